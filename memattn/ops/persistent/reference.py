"""Persistent-memory attention as written in Sukhbaatar et al. 2019: the ground truth.

An explicit loop over heads and queries, in fp32 (fp64 for fp64 inputs). For query t of
head h, with context keys k_c, relative position embeddings u and persistent vectors
(k_n, v_n):

    s_tc = scale · q_tᵀ (k_c + u_(t-c))            context scores (u = 0 without rel)
    s_tn = pscale · pq_tᵀ k_n                        persistent scores, no position term
    e_tc = m_z(|t - c|) · exp(s_tc)  for the keys the query sees (the past, the window)
    e_tn = exp(s_tn)                                 the span mask is padded with 1 here

joint  (all-attention):  a = [e_tc, e_tn] / (Σ_c e_tc + Σ_n e_tn)
split  (attn-split):     a = [e_tc / Σ_c e_tc, e_tn / Σ_n e_tn]   (the two reads are summed)
heads  (head-split):     context heads use e_tc only, persistent heads e_tn only

and o_t = Σ_c a_tc v_c + Σ_n a_tn v_n. The soft mask multiplies the exponentials and the
weights are renormalised, as in the adaptive-span paper.
"""

from __future__ import annotations

import torch

from memattn.errors import check_tensor
from memattn.ops.contract import default_scale
from memattn.ops.persistent.common import (NO_DISTANCE_TERMS, check_inputs, distances, rel_index,
                                           span_mask, visible)
from memattn.ops.softmax import KVState


def persistent_attention_weights(q, k, pk, *, causal=True, scale=None, variant="joint", pq=None,
                                 pscale=None, distance=None, attention_mask=None):
    """The attention weights of the reference, explicitly.

    q [B, Tq, H, K], k [B, Tk, Hc, K] (every context key, cached ones included), pk [Hp, N, Kp],
    pq [B, Tq, Hp, Kp] (default: q, or its last Hp heads in variant "heads"), distance a
    `DistanceTerms`, attention_mask bool [B, Tk]. Returns (persistent weights
    [B, H, Tq, N], context weights [B, H, Tq, Tk]), fp32 (fp64 for fp64 inputs), zero where a
    head does not read that part.
    """
    check_tensor("pk", pk, "[Hp, N, Kp]", None, None, None)
    values = pk.new_zeros(pk.shape[0], pk.shape[1], k.shape[-1])  # stand-in: only keys matter here
    d = distance or NO_DISTANCE_TERMS
    rel, span, ramp, window = d.rel, d.span, d.ramp, d.window
    check_inputs(q, k, k, pk, values, variant=variant, pq=pq, rel=rel, span=span, ramp=ramp, window=window,
                 attention_mask=attention_mask, initial_state=None, causal=causal)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Tq, H, K = q.shape
    Tk, Hc = k.shape[1], k.shape[2]
    Hp, N, Kp = pk.shape
    scale, pscale = default_scale(scale, K), default_scale(pscale, Kp)
    q, k, pk = q.to(dt), k.to(dt), pk.to(dt)
    if pq is None:
        pq = q[:, :, H - Hp:] if variant == "heads" else q
    pq = pq.to(dt)
    w_p = q.new_zeros(B, H, Tq, N)
    w_c = q.new_zeros(B, H, Tq, Tk)
    dist = distances(Tq, Tk, q.device)  # [Tq, Tk]
    seen = visible(dist, causal=causal, window=window)
    m = span_mask(span.to(dt), float(ramp), dist) if span is not None else None  # [Hc, Tq, Tk]
    u = rel.to(dt)[rel_index(dist, rel.shape[0], causal=causal)] if rel is not None else None  # [Tq, Tk, K]

    for h in range(H):
        reads_context = variant != "heads" or h < Hc
        reads_persistent = N > 0 and (variant != "heads" or h >= Hc)
        hp = h - Hc if variant == "heads" else h
        for t in range(Tq):
            scores, exps = [], []
            if reads_context:
                keys = k[:, :, h]  # [B, Tk, K]
                if u is not None:
                    keys = keys + u[t][None]
                s_c = scale * torch.einsum("bk,bck->bc", q[:, t, h], keys)  # [B, Tk]
                ok = seen[t][None, :].expand(B, Tk)
                if attention_mask is not None:
                    ok = ok & attention_mask
                scores.append(s_c.masked_fill(~ok, float("-inf")))
            if reads_persistent:
                scores.append(pscale * pq[:, t, hp] @ pk[hp].T)  # [B, N]
            top = torch.cat(scores, 1).max(1, keepdim=True).values  # [B, 1]
            if reads_context:
                e_c = torch.exp(scores[0] - top)
                if m is not None:
                    e_c = e_c * m[h, t][None]
                exps.append(e_c)
            if reads_persistent:
                exps.append(torch.exp(scores[-1] - top))  # mask padded with 1: never masked
            if variant == "split" or len(exps) == 1:
                exps = [e / e.sum(1, keepdim=True) for e in exps]
            else:
                total = sum(e.sum(1, keepdim=True) for e in exps)
                exps = [e / total for e in exps]
            if reads_context:
                w_c[:, h, t] = exps[0]
            if reads_persistent:
                w_p[:, h, t] = exps[-1]
    return w_p, w_c


def persistent_attention_reference(q, k, v, pk, pv, *, causal=True, scale=None, variant="joint",
                                   pq=None, pscale=None, distance=None, attention_mask=None,
                                   initial_state=None, output_final_state=False):
    """Persistent-memory attention from the explicit weights.

    q [B, Tq, H, K], k [B, Tk, Hc, K], v [B, Tk, Hc, V], pk [Hp, N, Kp], pv [Hp, N, V];
    the other arguments as in `persistent_attention`. Returns o [B, Tq, H, V] (q's dtype) and,
    if output_final_state, the context's KVState with initial_state's tokens first, else None.
    """
    d = distance or NO_DISTANCE_TERMS
    k_all, v_all = check_inputs(q, k, v, pk, pv, variant=variant, pq=pq, rel=d.rel, span=d.span, ramp=d.ramp,
                                window=d.window, attention_mask=attention_mask,
                                initial_state=initial_state, causal=causal)
    w_p, w_c = persistent_attention_weights(q, k_all, pk, causal=causal, scale=scale, variant=variant,
                                            pq=pq, pscale=pscale, distance=d, attention_mask=attention_mask)
    dt = w_p.dtype
    H, Hc, Hp = q.shape[2], k.shape[2], pk.shape[0]
    ctx_head = list(range(H)) if variant != "heads" else list(range(Hc)) + [0] * Hp
    per_head = list(range(H)) if variant != "heads" else [0] * Hc + list(range(Hp))
    o = (torch.einsum("bhtc,bchv->bthv", w_c, v_all.to(dt)[:, :, ctx_head])
         + torch.einsum("bhtn,hnv->bthv", w_p, pv.to(dt)[per_head]))
    return o.to(q.dtype), (KVState(k_all.transpose(1, 2), v_all.transpose(1, 2))
                           if output_final_state else None)
