"""One fused Triton launch per ABC decoding step, for the whole batch and all heads.

A program owns one (batch, head) pair: it loads the state of its M slots, writes token t
into them, reads them with q_t and stores the new state and o_t. Grid (B·H,); the M×K
and M×V tiles are held whole (M, K, V padded to powers of two and masked).

    ABC_MLP (normalised):  log_z' = logaddexp(log_z, s_t)
                           K̃' = K̃ + w (k_t − K̃), w = exp(s_t − log_z') = sigmoid(s_t − log_z)
                           (Ṽ alike; the two weights exp(log_z − log_z') and w sum to 1)
    general ABC:           K̃' = K̃ + φ_t ⊗ k_t,  Ṽ' = Ṽ + φ_t ⊗ v_t
    gated slot (GSA):      K̃' = K̃ + (1 - α_t)(k_t − K̃), Ṽ alike, α_t = exp(g_t) from the
                           log gates g_t (1 - α_t to float32's precision also near g = 0)
    read:                  o_t = softmax_M(scale · K̃' q_t)ᵀ Ṽ'

Every program reads its whole tile before it writes, so the new state may overwrite the
old one (inplace=True). Decoding needs no gradient: these functions refuse inputs that
require one. Inputs fp32 / fp16 / bf16; states fp32; o in q's dtype.
"""

from __future__ import annotations

import torch

from memattn.errors import ConfigError, ShapeError
from memattn.kernels import KERNEL_DTYPES, kernels_supported
from memattn.ops.abc.common import (
    ABCState,
    BoundedMemoryState,
    check_inplace_state,
    check_step_inputs,
)
from memattn.ops.contract import default_scale
from memattn.ops.gsa.common import GSAState, check_gates

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch forms work without triton
    triton = None


def check_kernel_inputs(name: str, tensors: dict[str, torch.Tensor | None], *,
                        autograd: bool = False) -> None:
    """Raise ConfigError (backend) or ShapeError (a tensor), naming the argument, unless the
    Triton kernels of `name` can take the tensors (autograd=False: a kernel without backward
    also refuses tensors that require grad)."""
    if triton is None:
        raise ConfigError("backend: 'triton' needs the triton package "
                          "(pip install 'memattn[gpu]'); use backend='torch'")
    given = [t for t in tensors.values() if t is not None]
    for arg, t in tensors.items():
        if t is not None and not kernels_supported(t):
            raise ShapeError(f"{arg}: backend='triton' needs CUDA tensors (or CPU tensors with "
                             f"TRITON_INTERPRET=1), got one on {t.device}")
        if t is not None and t.dtype not in KERNEL_DTYPES:
            raise ShapeError(f"{arg}: backend='triton' takes float32, float16 or bfloat16, "
                             f"got {t.dtype}; use backend='torch'")
    if not autograd and torch.is_grad_enabled() and any(t.requires_grad for t in given):
        raise ConfigError(f"backend: the fused decoding step ({name}) has no backward; call it "
                          f"under torch.no_grad() or use backend='torch'")


if triton is not None:

    @triton.jit
    def write_weight(g):
        """1 - exp(g) for log gates g ≤ 0, to float32's precision also near 0, where 1 - exp(g)
        cancels: there the series -g (1 + g/2 + g²/6 + ... + g⁶/5040), whose next term is
        below 2e-8 of the sum for |g| < 0.35 (libdevice's expm1 does not run in the
        interpreter)."""
        series = 1.0 + g / 7.0
        for n in tl.static_range(6, 1, -1):
            series = 1.0 + g / n * series
        return tl.where(g > -0.35, -g * series, 1.0 - tl.exp(g))

    @triton.jit
    def _abc_step_kernel(q_ptr, k_ptr, v_ptr, w_ptr, lz_ptr, mk_ptr, mv_ptr,
                         o_ptr, lz_out, mk_out, mv_out,
                         H, M, K, V, scale,
                         sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sw_b, sw_h,
                         RULE: tl.constexpr,
                         BM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """One (batch, head) pair per program. q, k [B, H, K], v [B, H, V], w (φ, s or g for
        RULE "additive", "normalised" or "gated") [B, H, M] with the strides given (last dim
        contiguous); state and out tensors contiguous: log_z [B·H, M] (normalised only),
        K̃ [B·H, M, K], Ṽ [B·H, M, V]; o [B·H, V]."""
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        om = tl.arange(0, BM)
        ok = tl.arange(0, BK)
        ov = tl.arange(0, BV)
        m_m = om < M
        m_k = ok < K
        m_v = ov < V
        mk_mask = m_m[:, None] & m_k[None, :]
        mv_mask = m_m[:, None] & m_v[None, :]

        q = tl.load(q_ptr + b * sq_b + h * sq_h + ok, mask=m_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * sk_b + h * sk_h + ok, mask=m_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + ov, mask=m_v, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + b * sw_b + h * sw_h + om, mask=m_m, other=0.0).to(tl.float32)
        mk_off = bh * M * K + om[:, None] * K + ok[None, :]
        mv_off = bh * M * V + om[:, None] * V + ov[None, :]
        mem_k = tl.load(mk_ptr + mk_off, mask=mk_mask, other=0.0)  # [BM, BK]
        mem_v = tl.load(mv_ptr + mv_off, mask=mv_mask, other=0.0)  # [BM, BV]

        if RULE == "normalised":
            log_z = tl.load(lz_ptr + bh * M + om, mask=m_m, other=0.0)  # [BM]
            top = tl.maximum(log_z, w)
            top = tl.where(top == float("-inf"), 0.0, top)  # both -inf: keep exp finite
            new_log_z = top + tl.log(tl.exp(log_z - top) + tl.exp(w - top))
            # ≤ 1; the old memory keeps 1 - write. As a sigmoid of the old normaliser, not
            # exp(w - new_log_z): new_log_z is rounded at its own magnitude
            write = tl.sigmoid(w - log_z)
            mem_k = mem_k + write[:, None] * (k[None, :] - mem_k)
            mem_v = mem_v + write[:, None] * (v[None, :] - mem_v)
            tl.store(lz_out + bh * M + om, new_log_z, mask=m_m)
        elif RULE == "gated":
            write = write_weight(w)
            mem_k = mem_k + write[:, None] * (k[None, :] - mem_k)
            mem_v = mem_v + write[:, None] * (v[None, :] - mem_v)
        else:
            mem_k = mem_k + w[:, None] * k[None, :]
            mem_v = mem_v + w[:, None] * v[None, :]
        tl.store(mk_out + mk_off, mem_k, mask=mk_mask)
        tl.store(mv_out + mv_off, mem_v, mask=mv_mask)

        scores = scale * tl.sum(mem_k * q[None, :], axis=1)  # [BM]
        scores = tl.where(m_m, scores, float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=0))
        p = p / tl.sum(p, axis=0)
        o = tl.sum(p[:, None] * mem_v, axis=0)  # [BV]
        tl.store(o_ptr + bh * V + ov, o.to(o_ptr.dtype.element_ty), mask=m_v)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, v, w, state, rule: str, scale: float, inplace: bool):
    """Run the step kernel for a write `rule` (additive, normalised, gated); state is a full
    state tuple (float32). Returns (o, new state)."""
    B, H, K = q.shape
    V, M = v.shape[-1], w.shape[-1]
    q, k, v, w = (_last_dim_contiguous(t) for t in (q, k, v, w))
    if inplace:
        out = state
    else:
        state = type(state)(*(t.to(torch.float32).contiguous() for t in state))
        out = type(state)(*(torch.empty_like(t) for t in state))
    normalised = rule == "normalised"
    log_z, mem_k, mem_v = state if normalised else (None, *state)
    lz_out, mk_out, mv_out = out if normalised else (None, *out)
    o = torch.empty(B, H, V, device=q.device, dtype=q.dtype)
    BM, BK, BV = (triton.next_power_of_2(n) for n in (M, K, V))
    _abc_step_kernel[(B * H,)](
        q, k, v, w, mem_k if log_z is None else log_z, mem_k, mem_v,
        o, mk_out if lz_out is None else lz_out, mk_out, mv_out,
        H, M, K, V, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), w.stride(0), w.stride(1),
        RULE=rule, BM=BM, BK=BK, BV=BV,
        num_warps=min(16, max(4, BM * max(BK, BV) // 512)))  # two M×D tiles in registers
    return o, out


def _step(name: str, q, k, v, w, w_name: str, state, state_type: type, normalised: bool,
          scale: float | None, inplace: bool):
    """Check the inputs of one step, then run the kernel (shared by the two public steps)."""
    B, H, K, V, M = check_step_inputs(q, k, v, w, w_name, state, state_type,
                                      nonnegative=not normalised)
    fields = (f"state.{field}" for field in state_type._fields)
    check_kernel_inputs(name, {"q": q, "k": k, "v": v, w_name: w,
                               **dict(zip(fields, state or ()))})
    if inplace:
        check_inplace_state(state, state_type, torch.float32)
    if state is None:
        state = state_type.empty(B, H, M, K, V, device=q.device)
    return _launch(q, k, v, w, state, "normalised" if normalised else "additive",
                   default_scale(scale, K), inplace)


def abc_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
                    state: ABCState | None = None, *, scale: float | None = None,
                    inplace: bool = False) -> tuple[torch.Tensor, ABCState]:
    """`abc_attention_step` in one kernel launch.

    q [B, H, K], k [B, H, K], v [B, H, V], s [B, H, M] slot logits; state: ABCState
    (log_z [B, H, M], k [B, H, M, K], v [B, H, M, V]) or None before the first token.
    inplace: overwrite the given state tensors (contiguous float32) and return them.
    Returns o [B, H, V] in q's dtype and the new ABCState (float32).
    """
    return _step("abc_step_triton", q, k, v, s, "s", state, ABCState, True, scale, inplace)


def bounded_memory_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               phi: torch.Tensor, state: BoundedMemoryState | None = None, *,
                               scale: float | None = None, inplace: bool = False
                               ) -> tuple[torch.Tensor, BoundedMemoryState]:
    """`bounded_memory_attention_step` in one kernel launch: K̃ += φ ⊗ k, Ṽ += φ ⊗ v, read.

    q [B, H, K], k [B, H, K], v [B, H, V], φ [B, H, M] non-negative; state:
    BoundedMemoryState (k [B, H, M, K], v [B, H, M, V]) or None before the first token.
    inplace as in `abc_step_triton`. Returns o [B, H, V] in q's dtype and the new state.
    """
    return _step("bounded_memory_step_triton", q, k, v, phi, "phi", state, BoundedMemoryState,
                 False, scale, inplace)


def gsa_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    state: GSAState | None = None, *, scale: float | None = None,
                    inplace: bool = False) -> tuple[torch.Tensor, GSAState]:
    """`gated_slot_attention_step` in one kernel launch: K̃' = α K̃ + (1 - α) k_t, Ṽ alike,
    read.

    q [B, H, K], k [B, H, K], v [B, H, V], g [B, H, M] log forget gates (≤ 0); state:
    GSAState (k [B, H, M, K], v [B, H, M, V]) or None before the first token. inplace as in
    `abc_step_triton`. Returns o [B, H, V] in q's dtype and the new GSAState (float32).
    """
    B, H, K, V, M = check_step_inputs(q, k, v, g, "g", state, GSAState)
    check_gates(g)
    check_kernel_inputs("gsa_step_triton", {"q": q, "k": k, "v": v, "g": g,
                                            **{f"state.{f}": t for f, t in zip(GSAState._fields,
                                                                               state or ())}})
    if inplace:
        check_inplace_state(state, GSAState, torch.float32)
    if state is None:
        state = GSAState.empty(B, H, M, K, V, device=q.device)
    return _launch(q, k, v, g, state, "gated", default_scale(scale, K), inplace)


__all__ = ["abc_step_triton", "bounded_memory_step_triton", "check_kernel_inputs",
           "gsa_step_triton"]
