"""The joint read on the CPU: the context and the persistent vectors each through the fused
flash kernel, one softmax over both by their log-sum-exps.

SDPA over [persistent | context] keys needs a mask that sees every persistent column, so the
fused kernel reads all N + T keys for every query (the causal one skips the keys after the
query), and a persistent query of its own doubles the score features. Here the context goes
through the CPU flash kernel alone (causal, or every key seen) and the persistent vectors
through it again (every one seen, with their own query and scale); each call returns its
read o and its log-sum-exp ℓ per query, and

    L = logaddexp(ℓ_c, ℓ_p)                        the joint softmax's normaliser
    o = exp(ℓ_c - L) · o_c + exp(ℓ_p - L) · o_p

Backward: the kernel's backward, given the joint output o and L, recomputes its weights as
exp(s - L) and subtracts D = rowsum(dO ∘ o), so each call returns the joint softmax's
gradients of its own queries, keys and values. When the persistent scores are the same for
every head (single-head), the persistent call is one head whose values are every head's side
by side: head h's weights are c_h · softmax(s) with c_h = exp(ℓ_p - L_h).

The models of `memattn experiment persistent-lm` (4 layers, 4 heads of 32, rotary positions,
16 x 512 tokens), forward and backward on one CPU thread, side by side with the concatenated
call: all-attention (N = 513) 1.7x as fast, single-head (N = 513 of width 128) 3.3x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memattn.ops.contract import outside_autocast

_aten = torch.ops.aten
AVAILABLE = hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def _same_width(q, k, v):
    """Zero features up to one head size for all three (the kernel wants q, k, v equally wide;
    zero features change no score and zero value columns are cut off)."""
    width = max(q.shape[-1], v.shape[-1])
    return (F.pad(q, (0, width - q.shape[-1])), F.pad(k, (0, width - k.shape[-1])),
            F.pad(v, (0, width - v.shape[-1])))


def _flash(q, k, v, causal, scale):
    """The CPU flash kernel on q, k, v of any widths: o [.., V] and its log-sum-exp."""
    V = v.shape[-1]
    o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(*_same_width(q, k, v), 0.0, causal, scale=scale)
    return o[..., :V], lse


def _flash_backward(do, o, lse, q, k, v, causal, scale):
    """The kernel's gradients of q, k, v for the softmax whose output is o, normaliser lse."""
    K, V = q.shape[-1], v.shape[-1]
    qw, kw, vw = _same_width(q, k, v)
    pad = (0, qw.shape[-1] - V)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        F.pad(do, pad), qw, kw, vw, F.pad(o, pad), lse, 0.0, causal, scale=scale)
    return dq[..., :K], dk[..., :K], dv[..., :V]


def _heads_as_features(x):
    """[B, H, T, D] -> [B, 1, T, H·D]: the heads side by side in one head."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, 1, T, H * D)


def _persistent_inputs(q, pq, pk, pv):
    """Queries, keys and values of the persistent call, [B, h, .., ..] each. Scores the same
    for every head (pq and pk of one head, the single-head variant): one head whose values
    are every head's side by side (h = 1), as cheap as one head's scores; else h = H."""
    B, H = q.shape[:2]
    if pq.shape[1] == 1 and pk.shape[0] == 1 and H > 1:
        return pq, pk.expand(B, 1, -1, -1), _heads_as_features(pv[None]).expand(B, -1, -1, -1)
    return pq.expand(B, H, -1, -1), pk.expand(B, H, -1, -1), pv.expand(B, H, -1, -1)


def _per_head(o, lse, H):
    """The persistent call's read and log-sum-exp as [B, H, T, V] and [B, H, T]."""
    B, h, T, D = o.shape
    if h == H:
        return o, lse
    return o.view(B, T, H, D // H).transpose(1, 2), lse.expand(B, H, T)


class _JointRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pq, pk, pv, scale, pscale, causal):
        oc, lc = _flash(q, k, v, causal, scale)
        op, lp = _flash(*_persistent_inputs(q, pq, pk, pv), False, pscale)
        op, lp = _per_head(op, lp, q.shape[1])
        lse = torch.logaddexp(lc, lp)  # [B, H, Tq], fp32 (fp64 for fp64 inputs)
        o = (torch.exp(lc - lse)[..., None] * oc + torch.exp(lp - lse)[..., None] * op).to(q.dtype)
        ctx.save_for_backward(q, k, v, pq, pk, pv, o, lse, lp)
        ctx.scale, ctx.pscale, ctx.causal = scale, pscale, causal
        return o

    @staticmethod
    @outside_autocast
    def backward(ctx, do):
        q, k, v, pq, pk, pv, o, lse, lp = ctx.saved_tensors
        do = do.contiguous()
        dq, dk, dv = _flash_backward(do, o, lse, q, k, v, ctx.causal, ctx.scale)
        pqe, pke, pve = _persistent_inputs(q, pq, pk, pv)
        shared = pqe.shape[1] == 1 < q.shape[1]
        if shared:
            # one softmax for every head: head h's weights are c_h · softmax(s), c_h =
            # exp(ℓ_p - L_h), so the heads' c_h · dO_h against their joint outputs give
            # Σ_h c_h (dO_h v_nᵀ - D_h), the scores' gradient, and v_n's own c_h · dO_h parts
            do = (torch.exp(lp - lse)[..., None] * do).to(do.dtype)
            do, o, lse = _heads_as_features(do), _heads_as_features(o), lp[:, :1].contiguous()
        dpq, dpk, dpv = _flash_backward(do, o, lse, pqe, pke, pve, False, ctx.pscale)
        if shared:
            dpv = dpv.sum(0).view(pv.shape[1], pv.shape[0], -1).transpose(0, 1)  # [H, N, V]
        return (dq, dk, dv, dpq.sum_to_size(pq.shape), dpk.sum_to_size(pk.shape),
                dpv.sum_to_size(pv.shape), None, None, None)


@outside_autocast  # the fp32 parts stay fp32
def joint_read(q, k, v, pq, pk, pv, *, scale: float, pscale: float, causal: bool) -> torch.Tensor:
    """One softmax over the context and N persistent vectors, on the CPU.

    q [B, H, Tq, K], k [B, H, Tk, K], v [B, H, Tk, V] (causal: Tq = Tk, query i sees keys
    ≤ i; else every key), pq [B, H or 1, Tq, Kp], pk [H or 1, N, Kp], pv [H, N, V]
    -> o [B, H, Tq, V] in q's dtype.
    """
    pq, pk, pv = (t.to(q.dtype) for t in (pq, pk, pv))  # each kernel call wants one dtype
    return _JointRead.apply(q, k, v, pq, pk, pv, scale, pscale, causal)
