"""Persistent-memory attention, Sukhbaatar et al. 2019 ("all-attention"), as pure tensor functions.

The memory: N learned, input-independent key / value vectors per head (k_n, v_n),
read by every query together with the context keys / values of the sequence:

    s_tc = scale · q_tᵀ (k_c + u_(t-c))    context: learned relative position term u
    s_tn = pscale · pq_tᵀ k_n              persistent: no position term
    a_t  = softmax over [c ∈ context seen by t (soft span mask m_z on it), n ∈ 1..N]
    o_t  = Σ_c a_tc v_c + Σ_n a_tn v_n

`variant` picks the paper's variant at the op level: "joint" (all-attention, one softmax),
"split" (attn-split: one softmax over the context, one over the persistent vectors, the
two reads summed), "heads" (head-split: the first Hc heads read only the context, the last
Hp only the persistent vectors). N = 0 is plain softmax attention over the context.

Forms, one answer (tests hold the fast one to the reference):

    reference.py   explicit weights, loops over heads and queries: the ground truth
    sdpa.py        `scaled_dot_product_attention` over [persistent | context] keys
    flash.py       on the CPU, the context and the persistent vectors each through the
                   flash kernel, merged by their log-sum-exps (called by sdpa.py)

The decoding state is the context's keys and values (a KV cache, trimmed by the layer to
the window / learned span); the persistent vectors are parameters and never part of it.
`initial_state`, a KVState (k0 [B, Hc, T0, K], v0 [B, Hc, T0, V]), holds the context keys
and values before k, v (a cache or the previous segment's memory), and the final state is
the KVState of k0 ++ k, v0 ++ v.
"""

from __future__ import annotations

import torch

from memattn.ops.contract import public_op
from memattn.ops.persistent.common import (VARIANTS, DistanceTerms, distances, rel_index, span_mask,
                                           visible)
from memattn.ops.persistent.reference import (persistent_attention_reference,
                                              persistent_attention_weights)
from memattn.ops.persistent.sdpa import context_mask, persistent_attention_sdpa
from memattn.ops.softmax import KVState


@public_op("torch")
def persistent_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor,
                         pv: torch.Tensor, *, causal: bool = True, scale: float | None = None,
                         variant: str = "joint", pq: torch.Tensor | None = None,
                         pscale: float | None = None, distance: DistanceTerms | None = None,
                         attention_mask: torch.Tensor | None = None,
                         initial_state: KVState | None = None, output_final_state: bool = False,
                         backend: str = "auto") -> tuple[torch.Tensor, KVState | None]:
    """Attention over the context and N persistent key / value vectors per head.

    q [B, Tq, H, K]; k [B, Tk, Hc, K], v [B, Tk, Hc, V] the context; pk [Hp, N, Kp],
    pv [Hp, N, V] the persistent vectors (Hc = Hp = H, except in variant "heads" where
    Hc + Hp = H). Query i sits at position Tk - Tq + i of the keys (after initial_state).
    variant: "joint", "split" or "heads" (above).

    scale: of the context scores (default K^-0.5). pq [B, Tq, Hp, Kp]: the queries of the
    persistent scores (default: q, or its last Hp heads in variant "heads"), pscale their scale
    (default Kp^-0.5). distance: relative position embeddings, a soft span mask and a window
    on the context scores (`DistanceTerms`; default none). attention_mask: bool [B, Tk] (Tk
    counting initial_state), False for context keys never to be read. initial_state: a
    KVState (k [B, Hc, T0, K], v [B, Hc, T0, V]), the context before k, v.

    Returns o [B, Tq, H, V] in q's dtype and, if output_final_state, the KVState of the
    whole context (initial_state's tokens, then k, v), else None.
    backend: "auto" or "torch", both the SDPA form ("triton" is a ConfigError).
    """
    return persistent_attention_sdpa(q, k, v, pk, pv, causal=causal, scale=scale, variant=variant, pq=pq,
                                     pscale=pscale, distance=distance, attention_mask=attention_mask,
                                     initial_state=initial_state, output_final_state=output_final_state)


__all__ = [
    "VARIANTS", "DistanceTerms", "KVState", "context_mask", "distances", "persistent_attention",
    "persistent_attention_reference", "persistent_attention_sdpa", "persistent_attention_weights",
    "rel_index", "span_mask", "visible",
]
