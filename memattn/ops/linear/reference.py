"""Cheap (gated) linear attention as written in de Brébisson & Vincent 2016: the ground truth.

An explicit loop over time with the memory as a named tensor, in fp32 (fp64 for fp64
inputs). The paper's memory is C = Σ v kᵀ ([V, K]); we keep its transpose
state = Cᵀ = Σ k vᵀ ([B, H, K, V]) and read o = stateᵀ q = C q.
"""

from __future__ import annotations

import torch

from memattn.ops.contract import accumulation_dtype
from memattn.ops.linear.common import LinearAttentionState, check_inputs, resolve_scale


def linear_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               causal: bool = True, alpha: torch.Tensor | None = None,
                               beta: torch.Tensor | None = None, scale: float | None = None,
                               initial_state: LinearAttentionState | None = None,
                               output_final_state: bool = False
                               ) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """C_t = α_t C_{t-1} + β_t v_t k_tᵀ, o_t = scale · C_t q_t, one step at a time.

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], alpha / beta [B, T, H] (default 1),
    initial_state a LinearAttentionState (kv [B, H, K, V]) -> o [B, Tq, H, V] (dtype of q),
    the LinearAttentionState after the last token (fp32, or fp64 for fp64 inputs; None
    unless output_final_state). Not causal: every query reads the final memory C_T, and Tq
    may differ from T.
    """
    B, _, T, H, K, V = check_inputs(q, k, v, causal=causal, alpha=alpha, beta=beta,
                                     initial_state=initial_state)
    out_dtype, dt = q.dtype, accumulation_dtype(q.dtype)
    scale = resolve_scale(scale)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    alpha = q.new_ones(B, T, H) if alpha is None else alpha.to(dt)
    beta = q.new_ones(B, T, H) if beta is None else beta.to(dt)
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.kv.to(dt)

    outputs = []
    for t in range(T):
        write = k[:, t, :, :, None] * v[:, t, :, None, :]  # [B, H, K, V] = (v_t k_tᵀ)ᵀ
        state = alpha[:, t, :, None, None] * state + beta[:, t, :, None, None] * write
        if causal:
            outputs.append(scale * (state.mT @ q[:, t, :, :, None]).squeeze(-1))  # [B, H, V]
    if causal:
        o = torch.stack(outputs, dim=1)  # [B, T, H, V]
    else:
        o = scale * torch.einsum("bqhk,bhkv->bqhv", q, state)
    return o.to(out_dtype), (LinearAttentionState(state) if output_final_state else None)
