"""Chunked causal gated slot attention in Triton: the ABC kernels of memattn.kernels.abc_chunk
run with RESET, forward and backward, with packed variable lengths.

GSA's memory inside a chunk, with ΔG_t = Σ g_j over the chunk's tokens j ≤ t (log gates,
g = log α), is

    K̃_t = exp(ΔG_t) K̃_start + Σ_{i≤t} (1 - α_i) exp(ΔG_t - ΔG_i) k_i      (Ṽ alike)

and that is ABC's normalised memory for the logits s_i = log(1 - α_i) - ΔG_i with a
log-normaliser 0 at the chunk's start: the normaliser after token t is
log(1 + Σ_{i≤t} (1 - α_i) exp(-ΔG_i)) = -ΔG_t, since the sum telescopes
((1 - α_i) exp(-ΔG_i) = exp(-ΔG_i) - exp(-ΔG_{i-1})), so ABC's weights exp(s_i - a_t) and
exp(0 - a_t) are GSA's, exactly. The kernels' RESET flag restarts the log-normaliser at 0 at
every chunk, so the logits never hold more than one chunk's gates (float32 resolves them to
about 6e-8 · |ΔG|: 4e-7 for 64 gates of -0.1, 8e-5 for 64 gates at GATE_FLOOR). One kernel
turns the gates into s, chunk by chunk (`_gate_logits`: ΔG a cumulative sum inside the chunk,
never a difference of long sums), and one turns the gradient of s into that of g
(`_gate_grads`: dg_i = -ds_i α_i / (1 - α_i) - Σ_{j≥i in the chunk} ds_j), each reading and
writing every element once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memattn.errors import ConfigError, ShapeError
from memattn.kernels.abc_chunk import (MAX_DIM, MIN_CHUNK, _backward, _chunk_of, _forward, _plan,
                                       _precision, _tile)
from memattn.kernels.abc_decode import check_kernel_inputs, write_weight
from memattn.ops.abc.varlen import check_varlen
from memattn.ops.contract import default_scale
from memattn.ops.gsa.common import GSAState, check_gates, check_gsa_inputs

# Log gates are clamped to at least this: a slot then keeps at most e^-20 ≈ 2e-9 of what it
# held, where float32 output cannot tell it from 0, and the logits of a chunk of BT tokens stay
# within BT · 20 (their rounding, relative to the weights, within 1e-4 for BT = 64).
GATE_FLOOR = -20.0
# Write weights 1 - α are at least this (α = 1 exactly writes nothing: log 0 would be -inf
# and a chunk of padding NaN); its gradient divides by the same floor, so it stays exact.
WRITE_FLOOR = 1e-30
_GATE_FLOOR = tl.constexpr(GATE_FLOOR)
_WRITE_FLOOR = tl.constexpr(WRITE_FLOOR)


@triton.jit
def _gate_tile(g, rows, r_ok, i_h, H, M, o_m):
    """(the log gates as given, clamped to GATE_FLOOR (NaN stays NaN), the write weights
    1 - α ≥ WRITE_FLOOR) of a chunk's rows, [BT, BM] fp32."""
    b_g = _tile(g, rows, r_ok, i_h, H, M, o_m, 0.0)
    b_c = tl.where(b_g < _GATE_FLOOR, _GATE_FLOOR, b_g)
    b_w = write_weight(b_c)
    return b_g, b_c, tl.where(b_w < _WRITE_FLOOR, _WRITE_FLOOR, b_w)


@triton.jit
def _gate_logits(g, logits, cu, chunk_idx, H, M, BT: tl.constexpr, BM: tl.constexpr):
    """Grid (chunks, slot blocks, H): g [total, H, M] -> the logits s = log(1 - α) - ΔG
    [total, H, M] fp32, ΔG the sums of the clamped log gates from the chunk's start."""
    i_h = tl.program_id(2)
    _, _, _, _, rows, r_ok = _chunk_of(cu, chunk_idx, BT)
    o_m = tl.program_id(1) * BM + tl.arange(0, BM)
    _, b_c, b_w = _gate_tile(g, rows, r_ok, i_h, H, M, o_m)
    tl.store(logits + (rows[:, None] * H + i_h) * M + o_m[None, :], tl.log(b_w) - tl.cumsum(b_c, 0),
             mask=r_ok[:, None] & (o_m < M)[None, :])


@triton.jit
def _gate_grads(g, d_logits, dg, cu, chunk_idx, H, M, BT: tl.constexpr, BM: tl.constexpr):
    """Grid (chunks, slot blocks, H): the gradient of s -> that of g, dg_i = -ds_i α_i /
    (1 - α_i) - Σ_{j≥i in the chunk} ds_j; 0 for gates below GATE_FLOOR (clamped), NaN for NaN."""
    i_h = tl.program_id(2)
    _, _, _, _, rows, r_ok = _chunk_of(cu, chunk_idx, BT)
    o_m = tl.program_id(1) * BM + tl.arange(0, BM)
    b_g, b_c, b_w = _gate_tile(g, rows, r_ok, i_h, H, M, o_m)
    b_ds = _tile(d_logits, rows, r_ok, i_h, H, M, o_m, 0.0)
    b_dg = -b_ds * tl.exp(b_c) / b_w - tl.cumsum(b_ds, 0, reverse=True)
    tl.store(dg + (rows[:, None] * H + i_h) * M + o_m[None, :],
             tl.where(b_g < _GATE_FLOOR, 0.0, b_dg), mask=r_ok[:, None] & (o_m < M)[None, :])


def _gate_block(M: int) -> int:
    """Slots a program of the gate kernels takes."""
    return min(32, max(16, triton.next_power_of_2(M)))


def _gate_launch(plan, H: int, M: int) -> tuple[tuple[int, int, int], dict]:
    BM = _gate_block(M)
    return (plan.n_chunks, triton.cdiv(M, BM), H), {"BT": plan.chunk, "BM": BM}


def gate_logits(g: torch.Tensor, plan) -> torch.Tensor:
    """Packed log gates g [total, H, M] -> the logits s [total, H, M] (fp32) of ABC's kernels
    with RESET."""
    total, H, M = g.shape
    s = torch.empty(total, H, M, dtype=torch.float32, device=g.device)
    grid, sizes = _gate_launch(plan, H, M)
    _gate_logits[grid](g, s, plan.cu, plan.chunk_idx, H, M, **sizes)
    return s


def gate_grads(g: torch.Tensor, ds: torch.Tensor, plan) -> torch.Tensor:
    """The gradient of `gate_logits`'s s, ds [total, H, M] -> that of g, in g's dtype."""
    total, H, M = g.shape
    dg = torch.empty_like(g)
    grid, sizes = _gate_launch(plan, H, M)
    _gate_grads[grid](g, ds.contiguous(), dg, plan.cu, plan.chunk_idx, H, M, **sizes)
    return dg


class _GSAChunk(torch.autograd.Function):
    """Packed q [T, H, K], k [T, H, K], v [T, H, V], g [T, H, M] and the fp32 initial memories
    (or None) -> o [T, H, V] and the final memories K̃, Ṽ, all differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, g, k0, v0, plan):
        ctx.set_materialize_grads(False)
        s = gate_logits(g, plan)
        o, final, saved = _forward(q, k, v, s, None, k0, v0, plan, reset=True)
        ctx.save_for_backward(q, k, v, g, s, *final, *saved)
        ctx.plan, ctx.has_init = plan, k0 is not None
        return o, final[1], final[2]

    @staticmethod
    def backward(ctx, do, dkT, dvT):
        q, k, v, g, s, lzT, kT, vT, *saved = ctx.saved_tensors
        plan = ctx.plan
        dfinal = None
        if dkT is not None or dvT is not None:
            dfinal = (torch.zeros_like(lzT),
                      *(torch.zeros_like(x) if d is None else d.float().contiguous()
                        for d, x in ((dkT, kT), (dvT, vT))))
        if do is None:
            do = torch.zeros(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
        dq, dk, dv, ds, (_, dk0, dv0) = _backward(q, k, v, s, do.contiguous(), saved,
                                                  (lzT, kT, vT), dfinal, plan, reset=True)
        dinit = (dk0, dv0) if ctx.has_init else (None, None)
        return dq, dk, dv, gate_grads(g, ds, plan), *dinit, None


def gsa_chunk_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                     scale: float | None = None, initial_state: GSAState | None = None,
                     output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                     chunk_size: int = 64) -> tuple[torch.Tensor, GSAState | None]:
    """Causal gated slot attention with the Triton kernels; the contract of
    `gsa_chunked(causal=True)`.

    q [B, T, H, K], k [B, T, H, K], v [B, T, H, V], g [B, T, H, M] log forget gates (≤ 0), in
    float32, float16 or bfloat16 (fp32 accumulation); K, V, M ≤ 128. Gates below GATE_FLOOR
    count as GATE_FLOOR.
    initial_state: GSAState (k [B, H, M, K], v [B, H, M, V]) or None (empty memories).
    cu_seqlens: [N + 1] integer boundaries of N sequences packed as B = 1; then the initial
    and final states have batch N and every sequence starts from its own.
    chunk_size: tokens per chunk of the memory recurrence, a power of two ≥ 16.
    Returns o [B, T, H, V] in q's dtype and, if output_final_state, the GSAState (float32)
    after the last token (of every sequence). Differentiable in q, k, v, g, the initial state
    and through the final state.
    """
    if cu_seqlens is None:
        B, _, T, H, K, V, M = check_gsa_inputs(q, k, v, g, True, initial_state)
        bounds = list(range(0, B * T + 1, T))
    else:
        bounds = check_varlen(q, k, v, g, cu_seqlens, initial_state, w_name="g",
                              state_type=GSAState)
        check_gates(g)
        B, T, H, K = q.shape
        V, M = v.shape[-1], g.shape[-1]
    if not isinstance(chunk_size, int) or chunk_size < MIN_CHUNK or chunk_size & (chunk_size - 1):
        raise ConfigError(f"chunk_size: expected a power of two ≥ {MIN_CHUNK}, "
                          f"got {chunk_size!r}")
    check_kernel_inputs("gsa_chunk_triton", {
        "q": q, "k": k, "v": v, "g": g,
        **{f"initial_state.{f}": t for f, t in zip(GSAState._fields, initial_state or ())}},
        autograd=True)
    for name, size in (("K", K), ("V", V), ("M", M)):
        if size > MAX_DIM:
            raise ShapeError(f"q: the Triton kernels take {name} ≤ {MAX_DIM}, got {name}={size}")

    plan = _plan(bounds, chunk_size, default_scale(scale, K), _precision(q, k, v), q.device)
    packed = [x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, v, g)]
    init = (None, None) if initial_state is None else \
        tuple(t.float().contiguous() for t in initial_state)
    o, kT, vT = _GSAChunk.apply(*packed, *init, plan)
    state = GSAState(kT, vT) if output_final_state else None
    return o.view(B, T, H, V), state


__all__ = ["GATE_FLOOR", "gsa_chunk_triton"]
