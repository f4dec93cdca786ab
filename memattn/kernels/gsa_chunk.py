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
about 6e-8 · |ΔG|: 4e-7 for 64 gates of -0.1, 8e-5 for 64 gates at GATE_FLOOR). The cumulative
sums ΔG are taken per chunk ([chunks, BT] laid out, never a difference of long sums), and the
gradient of g comes back from that of s: dg_i = -ds_i α_i / (1 - α_i) - Σ_{j≥i in the chunk} ds_j.
"""

from __future__ import annotations

import functools

import torch

from memattn.errors import ConfigError, ShapeError
from memattn.kernels.abc_chunk import MAX_DIM, MIN_CHUNK, _backward, _forward, _plan, _precision
from memattn.kernels.abc_decode import check_kernel_inputs
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


@functools.lru_cache(maxsize=64)
def _chunk_slots(bounds: tuple[int, ...], chunk: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(where each packed token lies in the chunks laid end to end, [total] into
    [chunks · chunk]; the number of chunks): token j of sequence n at (n's first chunk) ·
    chunk + j, as the kernels split them. Kept for the next call with the same boundaries."""
    lens = torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])
    n_chunks = (lens + chunk - 1) // chunk
    first = (torch.cumsum(n_chunks, 0) - n_chunks) * chunk - torch.tensor(bounds[:-1])
    slots = torch.arange(bounds[-1]) + torch.repeat_interleave(first, lens)
    return slots.to(device), int(n_chunks.sum())


def _chunk_cumsum(x: torch.Tensor, slots: torch.Tensor, n_chunks: int, chunk: int,
                  reverse: bool = False) -> torch.Tensor:
    """x [total, H, M] -> the inclusive sums of x over each token's chunk, up to the token
    (reverse: from it to the chunk's end), each a plain sum of its own terms."""
    grid = x.new_zeros(n_chunks * chunk, *x.shape[1:]).index_copy_(0, slots, x)
    grid = grid.view(n_chunks, chunk, *x.shape[1:])
    grid = grid.flip(1).cumsum(1).flip(1) if reverse else grid.cumsum(1)
    return grid.view(n_chunks * chunk, *x.shape[1:])[slots]


def _gates(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g [total, H, M] -> (the clamped log gates, the write weights 1 - α ≥ WRITE_FLOOR, α)."""
    g = g.float().clamp_min(GATE_FLOOR)
    return g, (-torch.expm1(g)).clamp_min(WRITE_FLOOR), torch.exp(g)


class _GSAChunk(torch.autograd.Function):
    """Packed q [T, H, K], k [T, H, K], v [T, H, V], g [T, H, M] and the fp32 initial memories
    (or None) -> o [T, H, V] and the final memories K̃, Ṽ, all differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, g, k0, v0, plan, slots):
        ctx.set_materialize_grads(False)
        n_chunks, chunk = plan.n_chunks, plan.chunk
        g_c, w, _ = _gates(g)
        s = torch.log(w) - _chunk_cumsum(g_c, slots, n_chunks, chunk)  # [T, H, M] fp32
        o, final, saved = _forward(q, k, v, s, None, k0, v0, plan, reset=True)
        ctx.save_for_backward(q, k, v, g, s, *final, *saved)
        ctx.plan, ctx.slots, ctx.has_init = plan, slots, k0 is not None
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
        g_c, w, alpha = _gates(g)
        dg = -ds * alpha / w - _chunk_cumsum(ds, ctx.slots, plan.n_chunks, plan.chunk,
                                            reverse=True)
        dg = torch.where(g >= GATE_FLOOR, dg, 0.0).to(g.dtype)  # clamped gates: no gradient
        dinit = (dk0, dv0) if ctx.has_init else (None, None)
        return dq, dk, dv, dg, *dinit, None, None


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
    slots, _ = _chunk_slots(tuple(bounds), chunk_size, q.device)
    packed = [x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, v, g)]
    init = (None, None) if initial_state is None else \
        tuple(t.float().contiguous() for t in initial_state)
    o, kT, vT = _GSAChunk.apply(*packed, *init, plan, slots)
    state = GSAState(kT, vT) if output_final_state else None
    return o.view(B, T, H, V), state


__all__ = ["GATE_FLOOR", "gsa_chunk_triton"]
