"""Gated slot attention one token at a time with a fixed-size state: the decoding path.

A step costs O(H · M · (K + V)) whatever the number of tokens seen. With w = 1 - α_t
(computed as -expm1(g_t), exact for gates near 1) the update of each slot is one
interpolation between its old content and the token:

    K̃' = K̃ + w (k_t - K̃)   (`lerp`)          Ṽ' = Ṽ + w (v_t - Ṽ)

so every slot stays a convex mix of what was written: nothing grows over a long stream.
On CUDA, a step that needs no gradient takes the fused Triton kernel (memattn.kernels.
abc_decode.gsa_step_triton) unless backend="torch".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memattn.kernels import use_kernels
from memattn.ops.abc.common import check_inplace_state, check_step_inputs
from memattn.ops.contract import compute_dtype, default_scale
from memattn.ops.gsa.common import GSAState, check_gates, check_gsa_inputs


def _read(q: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, K], mem_k [B, H, M, K], mem_v [B, H, M, V] -> o [B, H, V]: softmax over the
    slots, in one fused call (a query of one token reading M keys and values)."""
    return F.scaled_dot_product_attention(q.unsqueeze(-2), mem_k, mem_v, scale=scale).squeeze(-2)


def _update(state: GSAState, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            inplace: bool = False) -> GSAState:
    """Write one token, k [B, H, K], v [B, H, V], g [B, H, M], into the state."""
    w = -torch.expm1(g)[..., None]  # [B, H, M, 1], 1 - α
    k, v = k[:, :, None, :].expand_as(state.k), v[:, :, None, :].expand_as(state.v)
    if inplace:
        state.k.lerp_(k, w)
        state.v.lerp_(v, w)
        return state
    return GSAState(torch.lerp(state.k, k, w), torch.lerp(state.v, v, w))


def gated_slot_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              state: GSAState | None = None, *, scale: float | None = None,
                              inplace: bool = False, backend: str = "auto"
                              ) -> tuple[torch.Tensor, GSAState]:
    """One causal step: write token t into the slots, then read them with its query.

    q [B, H, K], k [B, H, K], v [B, H, V], g [B, H, M] log forget gates (≤ 0); state: a
    GSAState (k [B, H, M, K], v [B, H, M, V]) or None before the first token.
    inplace: update the given state tensors in place (contiguous, float32, or float64 for
    float64 inputs) and return them; a None state starts a fresh one.
    backend: "auto" (the fused Triton kernel for CUDA inputs that need no gradient, else
    torch), "torch" or "triton" (memattn.kernels.abc_decode.gsa_step_triton).
    Returns o [B, H, V] in q's dtype and the new GSAState (float32, or float64).
    """
    if use_kernels(backend, (q, k, v, g, *(state or ())), differentiable=False):
        from memattn.kernels.abc_decode import gsa_step_triton
        return gsa_step_triton(q, k, v, g, state, scale=scale, inplace=inplace)
    B, H, K, V, M = check_step_inputs(q, k, v, g, "g", state, GSAState)
    check_gates(g)
    dt = compute_dtype(q, k, v, g, *(state or ()))
    if inplace:
        check_inplace_state(state, GSAState, dt)
    if state is None:
        state = GSAState.empty(B, H, M, K, V, device=q.device, dtype=dt)
    elif not inplace:
        state = GSAState(*(t.to(dt) for t in state))
    state = _update(state, k.to(dt), v.to(dt), g.to(dt), inplace)
    o = _read(q.to(dt), state.k, state.v, default_scale(scale, K))
    return o.to(q.dtype), state


def gsa_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: GSAState,
              scale: float | None = None) -> torch.Tensor:
    """`gated_slot_attention_step` with inplace=True and without its checks, for a caller that
    built the inputs itself (a layer decoding without autograd, where a step is a few small ops
    and the checks cost as much): q, k, v [B, H, *], g [B, H, M]; the state's tensors
    contiguous, in float32 (float64 for float64 inputs), written in place. On CUDA the fused
    kernel. Returns o [B, H, V] in q's dtype."""
    if use_kernels("auto", (q, k, v, g, *state), differentiable=False):
        from memattn.kernels.abc_decode import gsa_step_triton
        return gsa_step_triton(q, k, v, g, state, scale=scale, inplace=True)[0]
    dt = state.k.dtype
    _update(state, k.to(dt), v.to(dt), g.to(dt), inplace=True)
    return _read(q.to(dt), state.k, state.v, default_scale(scale, q.shape[-1])).to(q.dtype)


def gsa_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                  scale: float | None = None, initial_state: GSAState | None = None,
                  output_final_state: bool = False) -> tuple[torch.Tensor, GSAState | None]:
    """Causal gated slot attention, token after token; shapes as in `gated_slot_attention`.

    The step's update and read, with what does not depend on the state done once for the
    whole sequence (checks, casts, write weights 1 - α); keys and values are written side by
    side ([K̃ | Ṽ], one interpolation a token)."""
    B, _, T, H, K, V, M = check_gsa_inputs(q, k, v, g, True, initial_state)
    out_dtype = q.dtype
    dt = compute_dtype(q, k, v, g, *(initial_state or ()))

    def rows(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B·H, T, D]
        return x.to(dt).transpose(1, 2).reshape(B * H, T, -1)

    q = rows(q) * default_scale(scale, K)
    kv = torch.cat((rows(k), rows(v)), dim=-1)[:, :, None, :]  # [B·H, T, 1, K + V]
    w = -torch.expm1(rows(g))[..., None]  # [B·H, T, M, 1], 1 - α
    mem = (q.new_zeros(B * H, M, K + V) if initial_state is None
           else torch.cat([t.to(dt) for t in initial_state], dim=-1).reshape(B * H, M, K + V))
    outs = []
    for t in range(T):
        mem = torch.lerp(mem, kv[:, t].expand_as(mem), w[:, t])  # [K̃ | Ṽ]
        p = torch.softmax(torch.bmm(q[:, t:t + 1], mem[..., :K].transpose(1, 2)), dim=-1)
        outs.append(torch.bmm(p, mem[..., K:]))  # [B·H, 1, V]
    o = torch.cat(outs, dim=1).view(B, H, T, V).transpose(1, 2)
    mem = mem.view(B, H, M, K + V)
    state = GSAState(mem[..., :K], mem[..., K:]) if output_final_state else None
    return o.to(out_dtype), state
