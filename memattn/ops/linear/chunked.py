"""The chunked parallel form, for training: matmuls inside chunks, the state between them.

Split T into N chunks of C steps. Inside a chunk (local steps t, i; S the state at the
chunk start; D[t, i] = Π_{i<l≤t} α_l; g_t = Π_{l≤t} α_l):

    o_t   = scale · (Σ_{i≤t} D[t, i] β_i (q_t·k_i) v_i  +  g_t Sᵀ q_t)     masked C×C matmuls
    S_end = g_{C-1} S + Σ_i D[C-1, i] β_i k_i v_iᵀ                          carried to the next

Decays come from log-space sums of log α (see common.py): α = 0 gives exact zeros, no NaN.
Work is O(T·C·(K+V) + T·K·V); the only sequential part is the N-step scan of states.
"""

from __future__ import annotations

import torch

from memattn.errors import ConfigError
from memattn.ops.contract import accumulation_dtype
from memattn.ops.linear.common import (LinearAttentionState, check_alpha_values, check_inputs,
                                       chunk_decays, from_chunks, heads_first, log_alpha,
                                       no_decays, resolve_scale, suffix_decays, to_chunks)

DEFAULT_CHUNK_SIZE = 64


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"chunk_size: expected a positive int, got {chunk_size!r}")


def chunked_forward_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          x: torch.Tensor | None, beta: torch.Tensor | None,
                          state: torch.Tensor | None, scale: float, chunk_size: int,
                          keep_starts: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Causal chunked forward on heads-first tensors in the accumulation dtype.

    q [B, H, T, K], k [B, H, T, K], v [B, H, T, V], x = log α [B, H, T] or None,
    beta [B, H, T] or None, state [B, H, K, V] or None -> (o [B, H, T, V],
    final state [B, H, K, V], states at the chunk starts [B, H, N, K, V] if keep_starts).
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    qc, kc, vc = (to_chunks(t, chunk_size) for t in (q, k, v))  # [B, H, N, C, *]
    N = qc.shape[2]
    dec = (no_decays(q, B, H, N, chunk_size) if x is None  # ungated: no exponentials
           else chunk_decays(to_chunks(x, chunk_size)))
    write = dec.to_end if beta is None else dec.to_end * to_chunks(beta, chunk_size)  # [B, H, N, C]
    increments = (kc * write[..., None]).mT @ vc  # [B, H, N, K, V]: each chunk's own writes

    S = q.new_zeros(B, H, K, V) if state is None else state
    starts = []
    for c in range(N):
        starts.append(S)
        S = dec.total[:, :, c, None, None] * S + increments[:, :, c]
    starts = torch.stack(starts, dim=2)  # [B, H, N, K, V]

    scores = (qc @ kc.mT) * dec.D  # [B, H, N, C, C]
    if beta is not None:
        scores = scores * to_chunks(beta, chunk_size)[..., None, :]
    o = scores @ vc + dec.g[..., None] * (qc @ starts)  # [B, H, N, C, V]
    return scale * from_chunks(o, T), S, (starts if keep_starts else None)


def final_state_heads(k: torch.Tensor, v: torch.Tensor, x: torch.Tensor | None,
                      beta: torch.Tensor | None, state: torch.Tensor | None) -> torch.Tensor:
    """S_T = Π_j α_j · S_0 + Σ_i (Π_{j>i} α_j) β_i k_i v_iᵀ in one matmul.

    k [B, H, T, K], v [B, H, T, V], x = log α [B, H, T] or None, beta [B, H, T] or None,
    state [B, H, K, V] or None -> [B, H, K, V].
    """
    weight, total = (None, None) if x is None else suffix_decays(x)  # [B, H, T], [B, H]
    if beta is not None:
        weight = beta if weight is None else weight * beta
    S = (k if weight is None else k * weight[..., None]).mT @ v
    if state is not None:
        S = S + (state if total is None else total[..., None, None] * state)
    return S


def linear_attention_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             causal: bool = True, alpha: torch.Tensor | None = None,
                             beta: torch.Tensor | None = None, scale: float | None = None,
                             initial_state: LinearAttentionState | None = None,
                             output_final_state: bool = False,
                             chunk_size: int = DEFAULT_CHUNK_SIZE
                             ) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Chunked forward of `linear_attention` (plain autograd; the op's backward is backward.py).

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], alpha / beta [B, T, H] (alpha >= 0),
    initial_state a LinearAttentionState -> (o [B, Tq, H, V] in the dtype of q, the
    LinearAttentionState after the last token in fp32 / fp64, or None). Differentiating through this function stores per-chunk
    intermediates and gives 0 for the gradient of a gate that is exactly 0 (log space);
    `linear_attention` has neither limit.
    """
    check_inputs(q, k, v, causal=causal, alpha=alpha, beta=beta, initial_state=initial_state)
    check_alpha_values(alpha)
    check_chunk_size(chunk_size)
    dt = accumulation_dtype(q.dtype)
    qh, kh, vh, b = (heads_first(t, dt) for t in (q, k, v, beta))
    x = None if alpha is None else log_alpha(heads_first(alpha, dt))  # [B, H, T]
    S0 = None if initial_state is None else initial_state.kv.to(dt)
    scale = resolve_scale(scale)
    if causal:
        o, S, _ = chunked_forward_heads(qh, kh, vh, x, b, S0, scale, chunk_size)
    else:
        S = final_state_heads(kh, vh, x, b, S0)
        o = scale * (qh @ S)
    return o.transpose(1, 2).contiguous().to(q.dtype), (LinearAttentionState(S) if output_final_state else None)
