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
gradients of its own queries, keys and values. The models of `memattn experiment
persistent-lm` (4 layers, 4 heads of 32, rotary positions, 16 x 512 tokens), forward and
backward on one CPU thread against the concatenated call: all-attention (N = 513) 1.9 s
against 2.8 s, single-head (N = 513 of width 128) 3.7 s against 5.1 s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memattn.ops.abc.common import outside_autocast

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


class _JointRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pq, pk, pv, scale, pscale, causal):
        B, H = q.shape[:2]
        # the persistent call wants every head's queries, keys and values, batch by batch
        pqe, pke, pve = pq.expand(B, H, -1, -1), pk.expand(B, H, -1, -1), pv.expand(B, H, -1, -1)
        oc, lc = _flash(q, k, v, causal, scale)
        op, lp = _flash(pqe, pke, pve, False, pscale)
        lse = torch.logaddexp(lc, lp)  # [B, H, Tq], fp32 (fp64 for fp64 inputs)
        o = (torch.exp(lc - lse)[..., None] * oc + torch.exp(lp - lse)[..., None] * op).to(q.dtype)
        ctx.save_for_backward(q, k, v, pq, pk, pv, o, lse)
        ctx.scale, ctx.pscale, ctx.causal = scale, pscale, causal
        return o

    @staticmethod
    @outside_autocast
    def backward(ctx, do):
        q, k, v, pq, pk, pv, o, lse = ctx.saved_tensors
        B, H = q.shape[:2]
        do = do.contiguous()
        dq, dk, dv = _flash_backward(do, o, lse, q, k, v, ctx.causal, ctx.scale)
        dpq, dpk, dpv = _flash_backward(do, o, lse, pq.expand(B, H, -1, -1), pk.expand(B, H, -1, -1),
                                        pv.expand(B, H, -1, -1), False, ctx.pscale)
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
