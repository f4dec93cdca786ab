"""The fast form: `scaled_dot_product_attention` over [persistent | context] keys.

joint   one SDPA call. The N persistent keys / values go in front of the context ones, the
        mask or bias gets N leading columns that are always seen with a zero bias (no
        position term, never span-masked). When the persistent scores use their own query
        pq (the unrotated query under rotary positions, the full-width one of the
        single-head variant) the features are concatenated instead:
            q' = [q, pq · pscale / scale],  k'_c = [k_c, 0],  k'_n = [0, k_n]
        so q'·k'_c = q·k_c and q'·k'_n = (pscale / scale) pq·k_n, one softmax over both.
        Cost: the score matmul grows from K to K + Kp features.
split   one SDPA call over the context, one over the persistent vectors, outputs summed.
heads   context heads over the context, persistent heads over the persistent vectors.

Context masking: causal / window / padding as a bool mask, or, when there is a position
bias or a span mask, a float bias added to the scores:

    relative positions   scale · q_t·u_(t-c): qu = q Uᵀ [B, Hc, Tq, R'] (R' ≤ min(R, Tk + Tq)
                         rows are read) then gathered to [B, Hc, Tq, Tk]. Time O(B·Hc·Tq·R'·K)
                         + O(B·Hc·Tq·Tk); memory B·Hc·Tq·(R' + Tk) numbers, the size of the
                         score matrix, kept for the backward pass.
    soft span mask       log m_z(|t - c|) [Hc, Tq, Tk] (−inf where m = 0): softmax(s + log m)
                         equals the paper's m·exp(s) renormalised; its gradient reaches z.

A float bias makes SDPA read a materialised [B, H, Tq, N + Tk] bias; a pure causal mask
over the context alone (no persistent keys in the call) uses SDPA's own causal path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memattn.ops.persistent.common import (NO_DISTANCE_TERMS, check_inputs, distances, rel_index,
                                           resolve_scale, span_mask, visible)


def context_mask(q: torch.Tensor, Tk: int, *, causal: bool, scale: float, rel=None, span=None,
                 ramp=None, window=None, attention_mask=None):
    """Mask of the context scores for SDPA, and whether it is SDPA's own causal mask.

    q [B, Tq, Hc, K] (the queries of the context heads). Returns (mask, plain_causal): mask is
    None (every key seen), bool [B or 1, 1, Tq, Tk] (True = seen) or a float bias
    [B or 1, Hc or 1, Tq, Tk] added to scale · q kᵀ (−inf = not seen).
    """
    B, Tq, Hc, _ = q.shape
    dist = distances(Tq, Tk, q.device)  # [Tq, Tk]
    seen = visible(dist, causal=causal, window=window)[None, None]  # [1, 1, Tq, Tk]
    if attention_mask is not None:
        seen = seen & attention_mask[:, None, None, :]
    bias = None
    if span is not None:
        m = span_mask(span.to(q.dtype), float(ramp), dist)  # [Hc, Tq, Tk]
        tiny = torch.finfo(m.dtype).tiny
        bias = torch.where(m > 0, m.clamp_min(tiny).log(), float("-inf"))[None]
    if rel is not None:
        idx = rel_index(dist, rel.shape[0], causal=causal)
        lo, hi = int(idx.min()), int(idx.max())
        qu = scale * torch.einsum("bthk,rk->bhtr", q, rel[lo:hi + 1].to(q.dtype))  # [B, Hc, Tq, R']
        term = qu.gather(-1, (idx - lo)[None, None].expand(B, Hc, Tq, Tk))
        bias = term if bias is None else bias + term
    if bias is not None:
        return bias.masked_fill(~seen, float("-inf")), False
    plain_causal = (causal and Tq == Tk and attention_mask is None
                    and (window is None or window >= Tk))
    if bool(seen.all()):
        return None, False
    return seen, plain_causal


def _sdpa(q, k, v, mask, plain_causal, scale):
    """q [B, H, Tq, K], k [B, H, Tk, K], v [B, H, Tk, V] -> [B, H, Tq, V]."""
    if plain_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _with_persistent_columns(mask: torch.Tensor | None, N: int) -> torch.Tensor | None:
    """Prepend N always-seen, zero-bias columns to a context mask [b, h, Tq, Tk]."""
    if mask is None:
        return None
    lead = (mask.new_ones if mask.dtype == torch.bool else mask.new_zeros)(*mask.shape[:-1], N)
    return torch.cat([lead, mask], -1)


# Few queries on a long context (decoding): read the context keys and values where they lie
# rather than copy them next to the persistent ones for one fused call.
DECODE_RATIO = 8


def _joint_read(qh, pqh, pkb, pvb, kh, vh, mask, scale, pscale):
    """One softmax over N persistent and Tk context keys, without concatenating the keys.

    qh [B, H, Tq, K] (context scores), pqh [B, H, Tq, Kp] (persistent scores), pkb / pvb
    [B, H, N, D], kh / vh [B, H, Tk, D], mask [.., Tq, Tk] (bool: seen, or an additive
    bias) or None -> [B, H, Tq, V]; scores in fp32 at least.
    """
    N = pkb.shape[2]
    dt = torch.promote_types(qh.dtype, torch.float32)
    context = (qh @ kh.transpose(-1, -2)).to(dt) * scale
    if mask is not None:
        context = (context.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                   else context + mask)
    scores = torch.cat([(pqh @ pkb.transpose(-1, -2)).to(dt) * pscale, context], -1)
    p = torch.softmax(scores, -1).to(vh.dtype)
    return p[..., :N] @ pvb + p[..., N:] @ vh


def persistent_attention_sdpa(q, k, v, pk, pv, *, causal=True, scale=None, mode="joint", pq=None,
                              pscale=None, distance=None, attention_mask=None, initial_state=None,
                              output_final_state=False):
    """Persistent-memory attention through `scaled_dot_product_attention`.

    Arguments and result as `memattn.ops.persistent_attention`.
    """
    d = distance or NO_DISTANCE_TERMS
    k, v = check_inputs(q, k, v, pk, pv, mode=mode, pq=pq, rel=d.rel, span=d.span, ramp=d.ramp,
                        window=d.window, attention_mask=attention_mask,
                        initial_state=initial_state, causal=causal)
    B, Tq, H, K = q.shape
    Tk, Hc = k.shape[1], k.shape[2]
    Hp, N, Kp = pk.shape
    scale, pscale = resolve_scale(scale, K), resolve_scale(pscale, Kp)
    pk, pv = pk.to(q.dtype), pv.to(q.dtype)
    q_ctx = q[:, :, :Hc]
    mask, plain_causal = context_mask(q_ctx, Tk, causal=causal, scale=scale, rel=d.rel, span=d.span,
                                      ramp=d.ramp, window=d.window, attention_mask=attention_mask)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hc, Tk, D]
    pkb, pvb = pk[None].expand(B, -1, -1, -1), pv[None].expand(B, -1, -1, -1)  # [B, Hp, N, D]

    if mode == "joint" and N > 0:
        qh = q.transpose(1, 2)  # [B, H, Tq, K]
        if Tq * DECODE_RATIO <= Tk:
            pqh = qh if pq is None else pq.transpose(1, 2)
            o = _joint_read(qh, pqh, pkb, pvb, kh, vh, mask, scale, pscale)
            return o.transpose(1, 2), ((k, v) if output_final_state else None)
        if pq is None and pscale == scale:  # one query for both parts: concatenate the keys
            queries, keys = qh, torch.cat([pkb, kh], 2)
        else:  # the persistent scores have their own query: concatenate the features
            pqh = (q if pq is None else pq).transpose(1, 2) * (pscale / scale)
            queries = torch.cat([qh, pqh], -1)  # [B, H, Tq, K + Kp]
            keys = torch.cat([torch.cat([kh.new_zeros(B, H, N, K), pkb], -1),
                              torch.cat([kh, kh.new_zeros(B, H, Tk, Kp)], -1)], 2)
        values, V = torch.cat([pvb, vh], 2), vh.shape[-1]
        if V < queries.shape[-1] <= 2 * V:  # the fused kernels (CPU flash too) want values as
            # wide as the queries: zero columns up to twice their width cost less than the
            # unfused path (all-attn with rotary positions: 1.4x its training tokens/s)
            values = F.pad(values, (0, queries.shape[-1] - V))
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=_with_persistent_columns(mask, N),
                                           scale=scale)[..., :V]
    else:
        o = _sdpa(q_ctx.transpose(1, 2), kh, vh, mask, plain_causal, scale)  # [B, Hc, Tq, V]
        if N > 0:
            if pq is None:
                pq = q[:, :, H - Hp:] if mode == "heads" else q
            o_p = F.scaled_dot_product_attention(pq.transpose(1, 2), pkb, pvb, scale=pscale)
            o = o + o_p if mode == "split" else torch.cat([o, o_p], 1)
    o = o.transpose(1, 2)  # [B, Tq, H, V]
    return o, ((k, v) if output_final_state else None)
