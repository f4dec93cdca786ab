"""What the three ABC forms share: the decoding states and the checks of their inputs
(the rules every op shares are in memattn.ops.contract)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from memattn.errors import ShapeError, check_devices, check_float, check_tensor
from memattn.ops.contract import check_qkv, check_state_type


class ABCState(NamedTuple):
    """Fixed-size state of `abc_attention` after the tokens seen so far (positions ≤ t).

    log_z [B, H, M]     log Σ_{i≤t} exp(s_i), the log-normaliser of each slot
    k     [B, H, M, K]  the key memory K̃_t = Σ_{i≤t} exp(s_i - log_z) k_i
    v     [B, H, M, V]  the value memory Ṽ_t = Σ_{i≤t} exp(s_i - log_z) v_i

    k and v are the unnormalised sums rescaled by exp(-log_z), i.e. the normalised memory
    itself; every weight exp(s_i - log_z) is ≤ 1, so no entry overflows whatever the size
    of s. Held in float32 (float64 when the inputs are float64).
    """

    log_z: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, slots: int, k_dim: int, v_dim: int, *,
              device=None, dtype=torch.float32) -> ABCState:
        """The state before any token: log_z = -inf, empty memories."""
        return cls(torch.full((batch, heads, slots), -torch.inf, device=device, dtype=dtype),
                   torch.zeros(batch, heads, slots, k_dim, device=device, dtype=dtype),
                   torch.zeros(batch, heads, slots, v_dim, device=device, dtype=dtype))


class BoundedMemoryState(NamedTuple):
    """Fixed-size state of `bounded_memory_attention` after the tokens seen so far.

    k [B, H, M, K]  K̃_t = Σ_{i≤t} φ_i ⊗ k_i
    v [B, H, M, V]  Ṽ_t = Σ_{i≤t} φ_i ⊗ v_i

    Held in float32 (float64 when the inputs are float64).
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, slots: int, k_dim: int, v_dim: int, *,
              device=None, dtype=torch.float32) -> BoundedMemoryState:
        """The state before any token: empty memories."""
        return cls(torch.zeros(batch, heads, slots, k_dim, device=device, dtype=dtype),
                   torch.zeros(batch, heads, slots, v_dim, device=device, dtype=dtype))


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, w_name: str,
                 causal: bool, initial_state, state_type: type,
                 nonnegative: bool = False) -> tuple[int, int, int, int, int, int, int]:
    """Check q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], w [B, T, H, M] and the state.

    Returns (B, Tq, T, H, K, V, M). Raises ShapeError naming the argument at fault.
    """
    B, Tq, T, H, K, V = check_qkv(q, k, v)
    check_tensor(w_name, w, "[B, T, H, M]", B, T, H, None)
    check_float(w_name, w)
    M = w.shape[3]
    check_devices(q, **{w_name: w}, **{f"initial_state.{i}": t for i, t in enumerate(initial_state or ())})
    if M == 0:
        raise ShapeError(f"{w_name}: expected at least one memory slot (M >= 1) in [B, T, H, M], "
                         f"got shape {tuple(w.shape)}")
    if K == 0:
        raise ShapeError(f"q: expected a key dimension K >= 1 in [B, Tq, H, K], got shape {tuple(q.shape)}")
    if T == 0:
        raise ShapeError(f"k: expected at least one token (T >= 1) in [B, T, H, K], "
                         f"got shape {tuple(k.shape)}")
    if causal and Tq != T:
        raise ShapeError(f"q: expected as many queries as keys (Tq = T) for causal attention, "
                         f"got Tq={Tq} for T={T}")
    check_nonnegative(w, w_name, nonnegative)
    check_state(initial_state, state_type, B, H, M, K, V)
    return B, Tq, T, H, K, V, M


def check_step_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                      w_name: str, state, state_type: type,
                      nonnegative: bool = False) -> tuple[int, int, int, int, int]:
    """Check one decoding step: q [B, H, K], k [B, H, K], v [B, H, V], w [B, H, M].

    Returns (B, H, K, V, M).
    """
    check_tensor("q", q, "[B, H, K]", None, None, None)
    B, H, K = q.shape
    check_tensor("k", k, "[B, H, K]", B, H, K)
    check_tensor("v", v, "[B, H, V]", B, H, None)
    check_tensor(w_name, w, "[B, H, M]", B, H, None)
    V, M = v.shape[2], w.shape[2]
    if M == 0:
        raise ShapeError(f"{w_name}: expected at least one memory slot (M >= 1) in [B, H, M], "
                         f"got shape {tuple(w.shape)}")
    check_nonnegative(w, w_name, nonnegative)
    check_state(state, state_type, B, H, M, K, V, name="state")
    return B, H, K, V, M


def check_inplace_state(state: tuple | None, state_type: type, dtype: torch.dtype) -> None:
    """An in-place step overwrites the given state tensors: they must be contiguous and
    already in the dtype the step computes in (float32; float64 for float64 inputs)."""
    for field, t in zip(state_type._fields, state or ()):
        if t.dtype != dtype or not t.is_contiguous():
            raise ShapeError(f"state.{field}: inplace=True updates the state tensors in place "
                             f"and needs them contiguous {dtype}, got "
                             f"{'a non-contiguous ' if not t.is_contiguous() else ''}{t.dtype} "
                             f"tensor; pass inplace=False")


def check_nonnegative(w: torch.Tensor, name: str, wanted: bool) -> None:
    """ShapeError for negative write weights, checked where it is free: on the CPU. On a GPU
    the check would synchronise with the host at every call and decoding step, so it is left
    to the caller there (memattn's layers make φ non-negative by construction)."""
    if wanted and w.device.type == "cpu" and bool((w < 0).any()):
        raise ShapeError(f"{name}: expected non-negative write weights, got a minimum of {w.min().item():g}")


def check_state(state, state_type: type, B: int, H: int, M: int, K: int, V: int, *,
                name: str = "initial_state") -> None:
    if state is None:
        return
    check_state_type(state, state_type, name)
    fields = state_type._fields
    layouts = {"log_z": ("[B, H, M]", (B, H, M)), "k": ("[B, H, M, K]", (B, H, M, K)),
               "v": ("[B, H, M, V]", (B, H, M, V))}
    for field, t in zip(fields, state):
        layout, sizes = layouts[field]
        check_tensor(f"{name}.{field}", t, layout, *sizes)
