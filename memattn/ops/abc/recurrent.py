"""ABC one token at a time with a fixed-size state: the decoding path.

A step costs O(H · M · (K + V)) whatever the number of tokens seen, and never reads them.
The ABC_MLP update keeps a log-normaliser per slot, so every factor it applies is ≤ 1:

    log_z' = logaddexp(log_z, s_t)
    K̃'     = exp(log_z - log_z') K̃ + exp(s_t - log_z') k_t          (likewise Ṽ)
           = K̃ + w (k_t - K̃),  w = exp(s_t - log_z') = sigmoid(s_t - log_z)
                                                                   (the weights sum to 1)
"""

from __future__ import annotations

import torch

from memattn.kernels import use_kernels
from memattn.ops.abc.common import (
    ABCState,
    BoundedMemoryState,
    check_inplace_state,
    check_inputs,
    check_step_inputs,
)
from memattn.ops.contract import compute_dtype, default_scale


def _read(q: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, K], mem_k [B, H, M, K], mem_v [B, H, M, V] -> o [B, H, V].

    Both products are a row times a matrix, which CPU kernels run several times faster
    than a matrix times a column at these sizes; the scores are scaled in place (a step is
    a handful of small ops, so each allocation counts)."""
    scores = torch.matmul(q.unsqueeze(-2), mem_k.transpose(-1, -2)).mul_(scale)  # [B, H, 1, M]
    return torch.matmul(torch.softmax(scores, dim=-1), mem_v).squeeze(-2)


def _abc_update(state: ABCState, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
                inplace: bool = False) -> ABCState:
    """Write one token, k [B, H, K], v [B, H, V], s [B, H, M], into the state.

    The old memory keeps exp(log_z - log_z') and the token gets w = exp(s - log_z') =
    sigmoid(s - log_z), which sum to 1: the update is one interpolation K̃' = K̃ + w (k - K̃)
    (`lerp`). The sigmoid of the old normaliser is exact where s and log_z are large and
    close (exp(s - log_z') would carry log_z''s rounding at that magnitude)."""
    write = torch.sigmoid(s - state.log_z)[..., None]  # [B, H, M, 1], ≤ 1
    k, v = k[:, :, None, :].expand_as(state.k), v[:, :, None, :].expand_as(state.v)
    if inplace:
        torch.logaddexp(state.log_z, s, out=state.log_z)
        state.k.lerp_(k, write)
        state.v.lerp_(v, write)
        return state
    return ABCState(torch.logaddexp(state.log_z, s), torch.lerp(state.k, k, write),
                    torch.lerp(state.v, v, write))


def _torch_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, w_name: str,
                state: ABCState | BoundedMemoryState | None, state_type: type, update,
                scale: float | None, inplace: bool, nonnegative: bool = False
                ) -> tuple[torch.Tensor, ABCState | BoundedMemoryState]:
    """The checked PyTorch path of a step: w = s (ABCState, `_abc_update`) or φ
    (BoundedMemoryState, `_bounded_update`); the state computed in float32 (float64 for
    float64 inputs), the output in q's dtype."""
    B, H, K, V, M = check_step_inputs(q, k, v, w, w_name, state, state_type,
                                      nonnegative=nonnegative)
    dt = compute_dtype(q, k, v, w, *(state or ()))
    if inplace:
        check_inplace_state(state, state_type, dt)
    if state is None:
        state = state_type.empty(B, H, M, K, V, device=q.device, dtype=dt)
    elif not inplace:  # an in-place state is in dt already
        state = state_type(*(t.to(dt) for t in state))
    state = update(state, k.to(dt), v.to(dt), w.to(dt), inplace)
    o = _read(q.to(dt), state.k, state.v, default_scale(scale, K))
    return o.to(q.dtype), state


def abc_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
                       state: ABCState | None = None, *, scale: float | None = None,
                       inplace: bool = False, backend: str = "auto"
                       ) -> tuple[torch.Tensor, ABCState]:
    """One causal ABC_MLP step: write token t, then read the memory with its query.

    q [B, H, K], k [B, H, K], v [B, H, V], s [B, H, M]; state: ABCState (log_z [B, H, M],
    k [B, H, M, K], v [B, H, M, V]) or None before the first token.
    inplace: update the given state tensors in place (they must be contiguous, in float32 or
    float64 for float64 inputs) and return them; a None state starts a fresh one.
    backend: "auto" (the fused Triton kernel for CUDA inputs that need no gradient, else
    torch), "torch" or "triton" (memattn.kernels.abc_decode).
    Returns o [B, H, V] in q's dtype and the new ABCState (float32, or float64).
    """
    if use_kernels(backend, (q, k, v, s, *(state or ())), differentiable=False):
        from memattn.kernels.abc_decode import abc_step_triton
        return abc_step_triton(q, k, v, s, state, scale=scale, inplace=inplace)
    return _torch_step(q, k, v, s, "s", state, ABCState, _abc_update, scale, inplace)


def memory_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                 state: ABCState | BoundedMemoryState, scale: float | None = None) -> torch.Tensor:
    """`abc_attention_step` (state an ABCState, w = s the slot logits) or
    `bounded_memory_attention_step` (a BoundedMemoryState, w = φ) with inplace=True and
    without their checks, for a caller that built the inputs itself (a layer decoding
    without autograd, where a step is a few small ops and the checks cost as much): q, k, v
    [B, H, *], w [B, H, M]; the state's tensors contiguous, in float32 (float64 for float64
    inputs), written in place. On CUDA the fused kernel. Returns o [B, H, V] in q's dtype."""
    normalised = isinstance(state, ABCState)
    if use_kernels("auto", (q, k, v, w, *state), differentiable=False):
        from memattn.kernels.abc_decode import abc_step_triton, bounded_memory_step_triton
        step = abc_step_triton if normalised else bounded_memory_step_triton
        return step(q, k, v, w, state, scale=scale, inplace=True)[0]
    dt = state.k.dtype
    if normalised:
        _abc_update(state, k.to(dt), v.to(dt), w.to(dt), inplace=True)
    else:
        _bounded_update(state, k.to(dt), v.to(dt), w.to(dt), inplace=True)
    return _read(q.to(dt), state.k, state.v, default_scale(scale, q.shape[-1])).to(q.dtype)


def _bounded_update(state: BoundedMemoryState, k: torch.Tensor, v: torch.Tensor, phi: torch.Tensor,
                    inplace: bool = False) -> BoundedMemoryState:
    """Write one token, k [B, H, K], v [B, H, V], φ [B, H, M]: K̃ += φ ⊗ k, Ṽ += φ ⊗ v."""
    phi = phi[..., None]  # [B, H, M, 1]
    k_write, v_write = phi * k[:, :, None, :], phi * v[:, :, None, :]
    if inplace:
        state.k.add_(k_write)
        state.v.add_(v_write)
        return state
    return BoundedMemoryState(state.k + k_write, state.v + v_write)


def bounded_memory_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  phi: torch.Tensor, state: BoundedMemoryState | None = None, *,
                                  scale: float | None = None, inplace: bool = False,
                                  backend: str = "auto"
                                  ) -> tuple[torch.Tensor, BoundedMemoryState]:
    """One causal general-ABC step: K̃ += φ_t ⊗ k_t, Ṽ += φ_t ⊗ v_t, then read with q_t.

    q [B, H, K], k [B, H, K], v [B, H, V], φ [B, H, M] (non-negative); state:
    BoundedMemoryState (k [B, H, M, K], v [B, H, M, V]) or None before the first token.
    inplace and backend as in `abc_attention_step`.
    Returns o [B, H, V] in q's dtype and the new BoundedMemoryState.
    """
    if use_kernels(backend, (q, k, v, phi, *(state or ())), differentiable=False):
        from memattn.kernels.abc_decode import bounded_memory_step_triton
        return bounded_memory_step_triton(q, k, v, phi, state, scale=scale, inplace=inplace)
    return _torch_step(q, k, v, phi, "phi", state, BoundedMemoryState, _bounded_update, scale,
                       inplace, nonnegative=True)


def abc_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, *,
                  scale: float | None = None, initial_state: ABCState | None = None,
                  output_final_state: bool = False) -> tuple[torch.Tensor, ABCState | None]:
    """Causal ABC_MLP as a loop of `abc_attention_step`; shapes as in `abc_attention`."""
    T = check_inputs(q, k, v, s, "s", True, initial_state, ABCState)[2]
    state, outs = initial_state, []
    for t in range(T):
        o_t, state = abc_attention_step(q[:, t], k[:, t], v[:, t], s[:, t], state, scale=scale)
        outs.append(o_t)
    return torch.stack(outs, dim=1), (state if output_final_state else None)


def bounded_memory_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             phi: torch.Tensor, *, scale: float | None = None,
                             initial_state: BoundedMemoryState | None = None,
                             output_final_state: bool = False
                             ) -> tuple[torch.Tensor, BoundedMemoryState | None]:
    """Causal general ABC as a loop of `bounded_memory_attention_step`."""
    T = check_inputs(q, k, v, phi, "phi", True, initial_state, BoundedMemoryState,
                     nonnegative=True)[2]
    state, outs = initial_state, []
    for t in range(T):
        o_t, state = bounded_memory_attention_step(q[:, t], k[:, t], v[:, t], phi[:, t], state,
                                                   scale=scale)
        outs.append(o_t)
    return torch.stack(outs, dim=1), (state if output_final_state else None)
