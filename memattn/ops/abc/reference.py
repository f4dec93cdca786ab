"""ABC, the ground truth: the paper's equations, one step at a time, memories in the open.

Peng et al. 2022, *ABC: Attention with Bounded-Memory Control*. At step t the memory holds

    K̃_t = Σ_{i≤t} φ_i ⊗ k_i          Ṽ_t = Σ_{i≤t} φ_i ⊗ v_i        [M, K], [M, V]

and the query reads it with a softmax over the M slots:

    o_t = softmax_M(scale · K̃_t q_t)ᵀ Ṽ_t

ABC_MLP writes with φ_i = α_i / Σ_{j≤t} α_j, α = exp(s): the weights of each slot over the
prefix are a softmax of s along time, which is how they are computed here (stable for any s).
Not causal, the sums run over the whole sequence and every query reads the same memory.

These loops rebuild every memory from scratch at each step: O(T²), for tests only.
"""

from __future__ import annotations

import torch

from memattn.ops.abc.common import ABCState, BoundedMemoryState, check_inputs
from memattn.ops.contract import compute_dtype, default_scale


def _read(q_t: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor,
          scale: float) -> torch.Tensor:
    """q_t [B, (Tq,) H, K], mem_k [B, H, M, K], mem_v [B, H, M, V] -> o_t [B, (Tq,) H, V]."""
    scores = scale * torch.einsum("bhmk,b...hk->b...hm", mem_k, q_t)
    p = torch.softmax(scores, dim=-1)  # over the M slots
    return torch.einsum("b...hm,bhmv->b...hv", p, mem_v)


def abc_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, *,
                  causal: bool = True, scale: float | None = None,
                  initial_state: ABCState | None = None,
                  output_final_state: bool = False) -> tuple[torch.Tensor, ABCState | None]:
    """ABC_MLP as written: q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], s [B, T, H, M].

    Returns o [B, Tq, H, V] (q's dtype) and, if asked, the ABCState after the last token.
    An initial_state (log_z [B, H, M], k [B, H, M, K], v [B, H, M, V]) enters as one more
    writer before the first token, with logit log_z and "key" / "value" its memories.
    """
    B, _, T, H, K, V, M = check_inputs(q, k, v, s, "s", causal, initial_state, ABCState)
    out_dtype = q.dtype
    dt = compute_dtype(q, k, v, s, *(initial_state or ()))
    q, k, v, s = q.to(dt), k.to(dt), v.to(dt), s.to(dt)
    scale = default_scale(scale, K)
    if initial_state is None:
        initial_state = ABCState.empty(B, H, M, K, V, device=q.device, dtype=dt)
    log_z0, k0, v0 = (t.to(dt) for t in initial_state)

    def memory(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The memory after tokens 0..n-1: (log_z [B, H, M], K̃ [B, H, M, K], Ṽ [B, H, M, V])."""
        logits = torch.cat([log_z0[:, None], s[:, :n]], dim=1)  # [B, 1 + n, H, M]
        phi = torch.softmax(logits, dim=1)  # α_i / Σ_j α_j, per slot
        mem_k = phi[:, 0, :, :, None] * k0 + torch.einsum("bihm,bihk->bhmk", phi[:, 1:], k[:, :n])
        mem_v = phi[:, 0, :, :, None] * v0 + torch.einsum("bihm,bihv->bhmv", phi[:, 1:], v[:, :n])
        return torch.logsumexp(logits, dim=1), mem_k, mem_v

    if causal:
        o = q.new_empty(B, T, H, V)
        for t in range(T):
            _, mem_k, mem_v = memory(t + 1)
            o[:, t] = _read(q[:, t], mem_k, mem_v, scale)
    else:
        _, mem_k, mem_v = memory(T)
        o = _read(q, mem_k, mem_v, scale)
    state = ABCState(*memory(T)) if output_final_state else None
    return o.to(out_dtype), state


def bounded_memory_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             phi: torch.Tensor, *, causal: bool = True,
                             scale: float | None = None,
                             initial_state: BoundedMemoryState | None = None,
                             output_final_state: bool = False
                             ) -> tuple[torch.Tensor, BoundedMemoryState | None]:
    """General ABC as written: q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], φ [B, T, H, M].

    Returns o [B, Tq, H, V] (q's dtype) and, if asked, the BoundedMemoryState
    (k [B, H, M, K], v [B, H, M, V]) after the last token. No normalisation of φ.
    """
    B, _, T, H, K, V, M = check_inputs(q, k, v, phi, "phi", causal, initial_state,
                                       BoundedMemoryState, nonnegative=True)
    out_dtype = q.dtype
    dt = compute_dtype(q, k, v, phi, *(initial_state or ()))
    q, k, v, phi = q.to(dt), k.to(dt), v.to(dt), phi.to(dt)
    scale = default_scale(scale, K)
    if initial_state is None:
        initial_state = BoundedMemoryState.empty(B, H, M, K, V, device=q.device, dtype=dt)
    k0, v0 = (t.to(dt) for t in initial_state)

    def memory(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K̃ [B, H, M, K], Ṽ [B, H, M, V]) after tokens 0..n-1."""
        mem_k = k0 + torch.einsum("bihm,bihk->bhmk", phi[:, :n], k[:, :n])
        mem_v = v0 + torch.einsum("bihm,bihv->bhmv", phi[:, :n], v[:, :n])
        return mem_k, mem_v

    if causal:
        o = q.new_empty(B, T, H, V)
        for t in range(T):
            o[:, t] = _read(q[:, t], *memory(t + 1), scale)
    else:
        o = _read(q, *memory(T), scale)
    state = BoundedMemoryState(*memory(T)) if output_final_state else None
    return o.to(out_dtype), state
