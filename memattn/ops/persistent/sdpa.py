"""The fast form: `scaled_dot_product_attention` over [persistent | context] keys.

joint   on the CPU, a causal block over its own keys, or one that sees every key: the context
        and the persistent vectors each through the flash kernel, merged by their log-sum-exps
        (`flash.py`). Otherwise one SDPA call: the N persistent keys / values go in front of
        the context ones, the mask or bias gets N leading columns that are always seen with a
        zero bias (no position term, never span-masked). When the persistent scores use their
        own query pq (the unrotated query under rotary positions, the full-width one of the
        single-head variant) the features are concatenated instead:
            q' = [q, pq · pscale / scale],  k'_c = [k_c, 0],  k'_n = [0, k_n]
        so q'·k'_c = q·k_c and q'·k'_n = (pscale / scale) pq·k_n, one softmax over both.
        Cost: the score matmul grows from K to K + Kp features. When pq and the persistent
        keys are the same for every head (single-head: views broadcast over the heads) their
        scores are computed once and enter as the bias of N zero keys instead.
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

Banded reads: a causal block of many queries whose context is limited (a window, or a span
mask, zero at distances ≥ z + ramp) is read in blocks of BAND_BLOCK queries, each over only
the keys its queries can see: the block's own and the `reach` before it, per head when the
spans differ. Keys outside that band have weight exactly 0 (and no gradient), so the result
is the same; the work per query falls from N + Tk keys to N + BAND_BLOCK + reach, and the
float bias is built for the band alone. That is where an adaptive span saves compute in
training: all-attention over two 512-token segments, 4 heads with spans of 256 + 32 and 385
persistent vectors, trains at 3.3x the tokens/s of reading every key (904 -> 3,050 on one
CPU thread). The spans are read to the host once per call (a synchronisation on a GPU).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from memattn.ops.contract import accumulation_dtype, default_scale
from memattn.ops.persistent import flash
from memattn.ops.persistent.common import (NO_DISTANCE_TERMS, DistanceTerms, check_inputs, distances,
                                           rel_index, span_mask, visible)
from memattn.ops.softmax import KVState


def context_mask(q: torch.Tensor, Tk: int, *, causal: bool, scale: float, rel=None, span=None,
                 ramp=None, window=None, attention_mask=None):
    """Mask of the context scores for SDPA, and whether it is SDPA's own causal mask.

    q [B, Tq, Hc, K] (the queries of the context heads). Returns (mask, plain_causal): mask is
    None (every key seen), bool [B or 1, 1, Tq, Tk] (True = seen) or a float bias
    [B or 1, Hc or 1, Tq, Tk] added to scale · q kᵀ (−inf = not seen).
    """
    B, Tq, Hc, _ = q.shape
    dist = distances(Tq, Tk, q.device)  # [Tq, Tk]
    ends = torch.tensor([1 - Tq, Tk - 1])  # its least and largest entries, on the host
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
        lo, hi = rel_index(ends, rel.shape[0], causal=causal).tolist()  # rel_index is monotone
        qu = scale * torch.einsum("bthk,rk->bhtr", q, rel[lo:hi + 1].to(q.dtype))  # [B, Hc, Tq, R']
        term = qu.gather(-1, (idx - lo)[None, None].expand(B, Hc, Tq, Tk))
        bias = term if bias is None else bias + term
    if bias is not None:
        return bias.masked_fill(~seen, float("-inf")), False
    plain_causal = (causal and Tq == Tk and attention_mask is None
                    and (window is None or window >= Tk))
    # Every key seen: read from the distances' ends (visible is monotone in each direction
    # of |distance|) without a look at the GPU, or from the padding mask on the CPU only.
    if bool(visible(ends, causal=causal, window=window).all()) and (
            attention_mask is None or (not attention_mask.is_cuda and bool(seen.all()))):
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


# Queries per block of a banded read (above); fewer keys per query against more, smaller calls.
BAND_BLOCK = 64


def reaches(d: DistanceTerms, *, causal: bool, variant: str, Tq: int, Tk: int) -> list[int] | None:
    """The farthest distance each context head can see, when a banded read pays: causal
    queries, modes "joint" and "split", more than one block of queries, and a window or span
    that hides keys. One entry for all heads without a span (a window is the same for all),
    else one per head (the spans, read once from the device). None: read every key."""
    if not causal or variant == "heads" or Tq <= BAND_BLOCK or (d.window is None and d.span is None):
        return None
    limit = Tk - 1 if d.window is None else min(Tk - 1, d.window - 1)
    if d.span is None:
        return [limit] if limit + BAND_BLOCK < Tk else None
    # m_z(x) = 0 from x = z + ramp on: a head sees distances up to floor(z + ramp)
    spans = (d.span.detach().float() + float(d.ramp)).floor().tolist()
    return [max(0, min(limit, int(x))) for x in spans]


def _banded(q, k, v, pk, pv, reach, *, variant, pq, scale, pscale, d, attention_mask):
    """Causal attention read block by block over the band of keys each block can see;
    arguments as `persistent_attention_sdpa` (k, v with any initial state in front), reach
    from `reaches`. The whole blocks of a head (group) go as one batch of bands, the rest of
    the queries as one more call. Returns o [B, Tq, H, V]."""
    B, Tq, H, _ = q.shape
    Tk, C = k.shape[1], BAND_BLOCK
    n, rest = divmod(Tq, C)
    first = Tk - Tq  # position of the first query
    seen = (torch.ones(B, Tk, dtype=torch.bool, device=q.device) if attention_mask is None
            else attention_mask)
    groups = [slice(None)] if len(reach) == 1 else [slice(h, h + 1) for h in range(H)]
    heads = []
    for g, r in zip(groups, reach):
        span = None if d.span is None else d.span[g]

        def read(qs, ks, vs, pqs, mask):
            o, _ = persistent_attention_sdpa(qs, ks, vs, pk[g], pv[g], causal=True, scale=scale,
                                             variant=variant, pq=pqs, pscale=pscale, attention_mask=mask,
                                             distance=dataclasses.replace(d, span=span))
            return o

        def bands(x):  # [B, Tk, ...] -> [B * n, C + r, ...]: block b's keys, r before its first query
            x = torch.cat([x.new_zeros(B, r, *x.shape[2:]), x], 1)[:, first:first + n * C + r]
            return x.unfold(1, C + r, C).movedim(-1, 2).flatten(0, 1)

        def blocks(x):  # [B, Tq, H, D] -> [B * n, C, h, D]: the whole blocks of queries
            if x is None:
                return None
            x = x[:, :n * C, g]
            return x.reshape(B * n, C, *x.shape[2:])

        out = []
        if n:
            o = read(blocks(q), bands(k[:, :, g]), bands(v[:, :, g]), blocks(pq), bands(seen))
            out.append(o.reshape(B, n * C, *o.shape[2:]))
        if rest:
            c0 = max(0, first + n * C - r)
            out.append(read(q[:, n * C:, g], k[:, c0:, g], v[:, c0:, g],
                            None if pq is None else pq[:, n * C:, g], seen[:, c0:]))
        heads.append(torch.cat(out, 1))
    return torch.cat(heads, 2)


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
    dt = accumulation_dtype(qh.dtype)
    context = (qh @ kh.transpose(-1, -2)).to(dt) * scale
    if mask is not None:
        context = (context.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                   else context + mask)
    scores = torch.cat([(pqh @ pkb.transpose(-1, -2)).to(dt) * pscale, context], -1)
    p = torch.softmax(scores, -1).to(vh.dtype)
    return p[..., :N] @ pvb + p[..., N:] @ vh


def _same_for_every_head(x: torch.Tensor, dim: int) -> bool:
    """Whether x holds one tensor for every head along `dim`: one head, or a view broadcast
    over the heads (`expand`, stride 0)."""
    return x.shape[dim] == 1 or x.stride(dim) == 0


def _shared_persistent_read(qh, kh, vh, pq, pk, pvb, mask, scale, pscale):
    """The joint read when every head has the same persistent query and keys (single-head:
    the full-width query and N vectors of size d). Their scores pscale · pq pkᵀ are computed
    once, [B, 1, Tq, N], and enter SDPA as the bias of N zero keys, whose values are each
    head's own; the context keys keep their width K (concatenated features would be K + Kp
    wide and leave SDPA's fused kernels). qh [B, H, Tq, K], kh / vh [B, H, Tk, D], pq
    [B, Tq, H, Kp], pk [H, N, Kp], pvb [B, H, N, V], mask as `context_mask` -> [B, H, Tq, V]."""
    B, H, Tq, K = qh.shape
    Tk, N = kh.shape[2], pk.shape[1]
    persistent = pscale * (pq[:, :, :1].transpose(1, 2).to(qh.dtype) @ pk[:1].transpose(-1, -2))  # [B, 1, Tq, N]
    if mask is None:
        context = persistent.new_zeros(1, 1, Tq, Tk)
    elif mask.dtype == torch.bool:
        context = persistent.new_zeros(mask.shape).masked_fill(~mask, float("-inf"))
    else:
        context = mask.to(persistent.dtype)
    heads = context.shape[1]
    bias = torch.cat([persistent.expand(B, heads, Tq, N), context.expand(B, heads, Tq, Tk)], -1)
    keys = torch.cat([kh.new_zeros(B, H, N, K), kh], 2)
    return F.scaled_dot_product_attention(qh, keys, torch.cat([pvb, vh], 2), attn_mask=bias, scale=scale)


def persistent_attention_sdpa(q, k, v, pk, pv, *, causal=True, scale=None, variant="joint", pq=None,
                              pscale=None, distance=None, attention_mask=None, initial_state=None,
                              output_final_state=False):
    """Persistent-memory attention through `scaled_dot_product_attention`.

    Arguments and result as `memattn.ops.persistent_attention`.
    """
    d = distance or NO_DISTANCE_TERMS
    k, v = check_inputs(q, k, v, pk, pv, variant=variant, pq=pq, rel=d.rel, span=d.span, ramp=d.ramp,
                        window=d.window, attention_mask=attention_mask,
                        initial_state=initial_state, causal=causal)
    B, Tq, H, K = q.shape
    Tk, Hc = k.shape[1], k.shape[2]
    Hp, N, Kp = pk.shape
    scale, pscale = default_scale(scale, K), default_scale(pscale, Kp)
    pk, pv = pk.to(q.dtype), pv.to(q.dtype)
    final = KVState(k.transpose(1, 2), v.transpose(1, 2)) if output_final_state else None
    reach = reaches(d, causal=causal, variant=variant, Tq=Tq, Tk=Tk)
    if reach is not None:
        o = _banded(q, k, v, pk, pv, reach, variant=variant, pq=pq, scale=scale, pscale=pscale, d=d,
                    attention_mask=attention_mask)
        return o, final
    q_ctx = q[:, :, :Hc]
    mask, plain_causal = context_mask(q_ctx, Tk, causal=causal, scale=scale, rel=d.rel, span=d.span,
                                      ramp=d.ramp, window=d.window, attention_mask=attention_mask)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hc, Tk, D]
    pkb, pvb = pk[None].expand(B, -1, -1, -1), pv[None].expand(B, -1, -1, -1)  # [B, Hp, N, D]

    if variant == "joint" and N > 0:
        qh = q.transpose(1, 2)  # [B, H, Tq, K]
        if Tq * DECODE_RATIO <= Tk:
            pqh = qh if pq is None else pq.transpose(1, 2)
            o = _joint_read(qh, pqh, pkb, pvb, kh, vh, mask, scale, pscale)
            return o.transpose(1, 2), final
        if flash.AVAILABLE and q.device.type == "cpu" and (mask is None or plain_causal):
            pqh, pkh = (qh if pq is None else pq.transpose(1, 2)), pk
            if _same_for_every_head(pqh, 1) and _same_for_every_head(pkh, 0):
                pqh, pkh = pqh[:, :1], pkh[:1]  # the persistent scores once for every head
            o = flash.joint_read(qh, kh, vh, pqh, pkh, pv, scale=scale, pscale=pscale, causal=plain_causal)
            return o.transpose(1, 2), final
        if pq is not None and _same_for_every_head(pq, 2) and _same_for_every_head(pk, 0):
            o = _shared_persistent_read(qh, kh, vh, pq, pk, pvb, mask, scale, pscale)
            return o.transpose(1, 2), final
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
                pq = q[:, :, H - Hp:] if variant == "heads" else q
            o_p = F.scaled_dot_product_attention(pq.transpose(1, 2), pkb, pvb, scale=pscale)
            o = o + o_p if variant == "split" else torch.cat([o, o_p], 1)
    o = o.transpose(1, 2)  # [B, Tq, H, V]
    return o, final
