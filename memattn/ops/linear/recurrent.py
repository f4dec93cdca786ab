"""The recurrent form: a fixed-size state (kv [B, H, K, V]), O(K·V) per step, for decoding.

A decoder keeps only the state; it never re-reads the prefix. `linear_attention_read`
answers any number of queries from a state, the paper's fixed-size representation of a
document: encode once (causal=False, output_final_state=True), then read at O(K·V) a query.
"""

from __future__ import annotations

import torch

from memattn.errors import ShapeError, check_tensor
from memattn.ops.contract import accumulation_dtype
from memattn.ops.linear.common import (LinearAttentionState, cast, check_inputs, check_state,
                                       resolve_scale)


def _step(q_t: torch.Tensor | None, k_t: torch.Tensor, v_t: torch.Tensor,
          state: torch.Tensor | None, alpha_t: torch.Tensor | None,
          beta_t: torch.Tensor | None, scale: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Unchecked step in the accumulation dtype; q_t None writes without reading."""
    write = k_t[..., :, None] * v_t[..., None, :]  # [B, H, K, V]
    if beta_t is not None:
        write = beta_t[..., None, None] * write
    if state is None:
        state = write
    else:
        state = (state if alpha_t is None else alpha_t[..., None, None] * state) + write
    if q_t is None:
        return None, state
    return scale * (q_t[..., None, :] @ state).squeeze(-2), state  # [B, H, V]


def linear_attention_step(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                          state: LinearAttentionState | None = None,
                          alpha_t: torch.Tensor | None = None, beta_t: torch.Tensor | None = None,
                          *, scale: float | None = None
                          ) -> tuple[torch.Tensor, LinearAttentionState]:
    """One decoding step: S ← α_t · S + β_t k_t v_tᵀ, then o_t = scale · Sᵀ q_t.

    q_t [B, H, K], k_t [B, H, K], v_t [B, H, V], state a LinearAttentionState (kv
    [B, H, K, V]; None: empty), alpha_t / beta_t [B, H] (default 1) -> (o_t [B, H, V] in the
    dtype of q_t, the new LinearAttentionState in fp32, or fp64 for fp64 inputs).
    """
    check_tensor("q_t", q_t, "[B, H, K]", None, None, None)
    B, H, K = q_t.shape
    check_tensor("k_t", k_t, "[B, H, K]", B, H, K)
    check_tensor("v_t", v_t, "[B, H, V]", B, H, None)
    V = v_t.shape[-1]
    check_state(state, B, H, K, V, name="state")
    for name, t in (("alpha_t", alpha_t), ("beta_t", beta_t)):
        if t is not None:
            check_tensor(name, t, "[B, H]", B, H)
    dt = accumulation_dtype(q_t.dtype)
    o_t, kv = _step(*(cast(t, dt) for t in (q_t, k_t, v_t, None if state is None else state.kv,
                                             alpha_t, beta_t)), resolve_scale(scale))
    return o_t.to(q_t.dtype), LinearAttentionState(kv)


def linear_attention_read(q: torch.Tensor, state: LinearAttentionState, *,
                          scale: float | None = None) -> torch.Tensor:
    """Read a fixed memory: o = scale · Sᵀ q for every query.

    q [B, Tq, H, K], state a LinearAttentionState (kv [B, H, K, V]) -> o [B, Tq, H, V] in
    the dtype of q.
    """
    check_tensor("q", q, "[B, Tq, H, K]", None, None, None, None)
    B, _, H, K = q.shape
    if state is None:
        raise ShapeError("state: expected a LinearAttentionState (kv [B, H, K, V]), got None")
    check_state(state, B, H, K, None, name="state")
    dt = accumulation_dtype(q.dtype)
    o = resolve_scale(scale) * torch.einsum("bqhk,bhkv->bqhv", q.to(dt), state.kv.to(dt))
    return o.to(q.dtype)


def linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               causal: bool = True, alpha: torch.Tensor | None = None,
                               beta: torch.Tensor | None = None, scale: float | None = None,
                               initial_state: LinearAttentionState | None = None,
                               output_final_state: bool = False
                               ) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """The whole sequence through the decoding step, one token at a time.

    Same contract as `linear_attention`: q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V],
    alpha / beta [B, T, H], initial_state a LinearAttentionState -> (o [B, Tq, H, V],
    the LinearAttentionState after the last token or None).
    """
    check_inputs(q, k, v, causal=causal, alpha=alpha, beta=beta, initial_state=initial_state)
    dt = accumulation_dtype(q.dtype)
    scale = resolve_scale(scale)
    qs, ks, vs, alpha, beta, state = (cast(t, dt) for t in (
        q, k, v, alpha, beta, None if initial_state is None else initial_state.kv))
    outputs = []
    for t in range(ks.shape[1]):
        o_t, state = _step(qs[:, t] if causal else None, ks[:, t], vs[:, t], state,
                           None if alpha is None else alpha[:, t],
                           None if beta is None else beta[:, t], scale)
        outputs.append(o_t)
    if causal:
        o = torch.stack(outputs, dim=1)  # [B, T, H, V]
    else:
        o = scale * torch.einsum("bqhk,bhkv->bqhv", qs, state)
    return o.to(q.dtype), (LinearAttentionState(state) if output_final_state else None)
