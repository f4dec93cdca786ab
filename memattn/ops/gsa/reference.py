"""Gated slot attention, the ground truth: the paper's recurrence, one token at a time.

Zhang et al. 2024, *Gated Slot Attention for Efficient Linear-Time Sequence Modeling*. Each
of the M slots forgets at its own rate α_t ∈ (0, 1] and takes the rest from the new token:

    K̃_t = α_t ⊙ K̃_{t-1} + (1 - α_t) ⊗ k_t          [M, K]
    Ṽ_t = α_t ⊙ Ṽ_{t-1} + (1 - α_t) ⊗ v_t          [M, V]
    o_t = softmax_M(scale · K̃_t q_t)ᵀ Ṽ_t

Not causal, every query reads the memory after the whole sequence.
"""

from __future__ import annotations

import torch

from memattn.ops.abc.chunked import read_memory
from memattn.ops.contract import compute_dtype, default_scale
from memattn.ops.gsa.common import GSAState, check_gsa_inputs


def gsa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                  causal: bool = True, scale: float | None = None,
                  initial_state: GSAState | None = None,
                  output_final_state: bool = False) -> tuple[torch.Tensor, GSAState | None]:
    """Gated slot attention as written: q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V],
    g [B, T, H, M] log forget gates (α = exp(g)).

    Returns o [B, Tq, H, V] (q's dtype) and, if asked, the GSAState (k [B, H, M, K],
    v [B, H, M, V]) after the last token; computed in float32 (float64 for float64 inputs).
    """
    B, _, T, H, K, V, M = check_gsa_inputs(q, k, v, g, causal, initial_state)
    out_dtype = q.dtype
    dt = compute_dtype(q, k, v, g, *(initial_state or ()))
    q, k, v, g = q.to(dt), k.to(dt), v.to(dt), g.to(dt)
    scale = default_scale(scale, K)
    if initial_state is None:
        initial_state = GSAState.empty(B, H, M, K, V, device=q.device, dtype=dt)
    mem_k, mem_v = (t.to(dt) for t in initial_state)  # [B, H, M, K], [B, H, M, V]
    alpha = torch.exp(g)  # [B, T, H, M]

    o = q.new_empty(B, T, H, V) if causal else None
    for t in range(T):
        a = alpha[:, t, :, :, None]  # [B, H, M, 1]
        mem_k = a * mem_k + (1 - a) * k[:, t, :, None, :]
        mem_v = a * mem_v + (1 - a) * v[:, t, :, None, :]
        if causal:
            o[:, t] = read_memory(q[:, t:t + 1], mem_k, mem_v, scale)[:, 0]
    if not causal:
        o = read_memory(q, mem_k, mem_v, scale)
    state = GSAState(mem_k, mem_v) if output_final_state else None
    return o.to(out_dtype), state
