"""What the forms of linear attention share: the state, input checks and chunk decays.

Decays are handled in log space: x_t = log α_t, with x_t = -inf where α_t = 0, so a
product of gates Π α is exp of a sum of logs and a zero gate gives an exact 0 (never NaN:
a sum of -inf and finite numbers stays -inf, and nothing subtracts two logs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from memattn.errors import ShapeError, check_float, check_tensor
from memattn.ops.contract import check_qkv, check_state_type


class LinearAttentionState(NamedTuple):
    """Fixed-size state of `linear_attention` after the tokens seen so far (positions ≤ t).

    kv [B, H, K, V]  S_t = C_tᵀ = α_t S_{t-1} + β_t k_t v_tᵀ, the transposed memory C_t

    Held in float32 (float64 when the inputs are float64).
    """

    kv: torch.Tensor


def resolve_scale(scale: float | None) -> float:
    """The read's scale: None means 1, the paper's o = C q. Deliberately not the K^-0.5 of
    the softmax reads (memattn.ops.contract.default_scale): a linear read has no softmax
    whose temperature the scale would set, only a size the caller may choose."""
    return 1.0 if scale is None else float(scale)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 alpha: torch.Tensor | None, beta: torch.Tensor | None,
                 initial_state: LinearAttentionState | None) -> tuple[int, int, int, int, int, int]:
    """Raise ShapeError naming the argument unless the shapes fit; return (B, Tq, T, H, K, V).

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], alpha / beta [B, T, H],
    initial_state a LinearAttentionState (kv [B, H, K, V]). Causal reading needs Tq = T (one
    query per step).
    """
    B, Tq, T, H, K, V = check_qkv(q, k, v)
    if T == 0:
        raise ShapeError(f"k: expected [B, T, H, K] with at least one step (T >= 1), "
                         f"got shape {tuple(k.shape)}")
    if causal and Tq != T:
        raise ShapeError(f"q: causal linear attention reads one query per step, so q needs "
                         f"Tq = T = {T}; got shape {tuple(q.shape)} (use causal=False for Tq != T)")
    for name, t in (("alpha", alpha), ("beta", beta)):
        if t is not None:
            check_tensor(name, t, "[B, T, H]", B, T, H)
            check_float(name, t)
    check_state(initial_state, B, H, K, V)
    return B, Tq, T, H, K, V


def check_state(state: LinearAttentionState | None, B: int, H: int, K: int, V: int | None, *,
                name: str = "initial_state") -> None:
    """ShapeError naming the argument unless state is None or a LinearAttentionState whose kv
    is a floating-point [B, H, K, V] (V None: any)."""
    if state is None:
        return
    check_state_type(state, LinearAttentionState, name)
    check_tensor(f"{name}.kv", state.kv, "[B, H, K, V]", B, H, K, V)
    check_float(f"{name}.kv", state.kv)


def check_alpha_values(alpha: torch.Tensor | None) -> None:
    """The chunked forms take log α: gates must be >= 0. Checked where it is free, on the
    CPU; on a GPU the check would synchronise with the host at every call, so it is left to
    the caller there (gated-linear's gates are sigmoids, in (0, 1) by construction)."""
    if alpha is not None and alpha.device.type == "cpu" and bool((alpha < 0).any()):
        raise ShapeError(f"alpha: expected gates >= 0 (decays are products computed in log "
                         f"space), got a minimum of {alpha.min().item():.4g}")


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """t in `dtype` (None passes through)."""
    return None if t is None else t.to(dtype)


def heads_first(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, T, H, ...] -> [B, H, T, ...] in `dtype` (None passes through)."""
    return None if t is None else t.transpose(1, 2).to(dtype)


def log_alpha(alpha: torch.Tensor) -> torch.Tensor:
    """log α elementwise with -inf where α = 0 and NaN where α is NaN (a gate that is not a
    number is never read as a reset). Autograd gives 0 (not NaN) at α = 0."""
    positive = alpha > 0
    safe = torch.where(positive, alpha, torch.ones_like(alpha))  # keeps log's gradient finite
    zero = torch.where(alpha == 0, float("-inf"), float("nan")).to(alpha.dtype)
    return torch.where(positive, safe.log(), zero)


def to_chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, H, T, ...] -> [B, H, N, C, ...], zero-padded at the end to N·C steps.

    Zero padding is neutral everywhere it is used: padded k, v, q, do are 0, padded
    β is 0 and padded log α is 0 (α = 1), so the state passes through unchanged.
    """
    T = t.shape[2]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 3) + (0, pad))
    return t.reshape(*t.shape[:2], n, chunk, *t.shape[3:])


def from_chunks(t: torch.Tensor, length: int) -> torch.Tensor:
    """[B, H, N, C, ...] -> [B, H, T, ...], dropping the padding."""
    return t.flatten(2, 3)[:, :, :length]


def segment_sums(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] -> [..., C, C] with out[t, i] = Σ_{i<j≤t} x_j for i ≤ t, -inf for i > t.

    Built by a cumulative sum down each column (never as a difference of two prefix sums,
    which would be -inf - -inf = NaN when a gate is 0).
    """
    C = x.shape[-1]
    below = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1)
    cols = x[..., :, None].expand(*x.shape, C).masked_fill(~below, 0.0)  # [..., C(t), C(i)] = x_t
    sums = cols.cumsum(-2)
    causal = torch.ones(C, C, dtype=torch.bool, device=x.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


class ChunkDecays(NamedTuple):
    """Products of gates inside each chunk, from log α chunked as [B, H, N, C]."""

    D: torch.Tensor  # [B, H, N, C, C]  D[t, i] = Π_{i<l≤t} α_l (0 above the diagonal)
    g: torch.Tensor  # [B, H, N, C]     Π_{l≤t} α_l, from the chunk start through t
    g_before: torch.Tensor  # [B, H, N, C]  Π_{l<t} α_l, from the chunk start to before t
    to_end: torch.Tensor  # [B, H, N, C]  Π_{i<l≤C-1} α_l, from after i to the chunk end
    total: torch.Tensor  # [B, H, N]     Π α over the whole chunk


def no_decays(like: torch.Tensor, B: int, H: int, N: int, C: int) -> ChunkDecays:
    """The decays of ungated chunks (every α = 1): D the causal 0/1 mask, every product 1;
    broadcast views, nothing exponentiated (what `chunk_decays` of zeros gives, cheaply)."""
    D = torch.ones(C, C, dtype=like.dtype, device=like.device).tril().expand(B, H, N, C, C)
    ones = like.new_ones(()).expand(B, H, N, C)
    return ChunkDecays(D, ones, ones, ones, ones[..., 0])


def chunk_decays(x: torch.Tensor) -> ChunkDecays:
    """Decay products of one chunked log-gate tensor x [B, H, N, C] (see ChunkDecays)."""
    cum = x.cumsum(-1)
    D = segment_sums(x).exp()
    g = cum.exp()
    g_before = F.pad(cum[..., :-1], (1, 0)).exp()
    return ChunkDecays(D, g, g_before, D[..., -1, :], g[..., -1])


def shift_down(D: torch.Tensor) -> torch.Tensor:
    """[..., C, C] -> same, out[t] = D[t-1] and out[0] = 0: decays that stop before step t."""
    return F.pad(D[..., :-1, :], (0, 0, 1, 0))


def suffix_decays(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, T] -> (w [B, H, T] with w_i = Π_{j>i} α_j, total [B, H] = Π_j α_j)."""
    suffix = x.flip(-1).cumsum(-1).flip(-1)  # Σ_{j≥i} x_j
    w = F.pad(suffix[..., 1:], (0, 1)).exp()
    return w, suffix[..., 0].exp()
