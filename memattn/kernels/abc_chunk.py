"""Chunked causal ABC_MLP in Triton, forward and backward, with packed variable lengths.

The math is that of memattn/ops/abc/chunked.py. Per (sequence, head) and slot m, with
a_t = log_z_t = logaddexp(log_z_0, logcumsumexp(s)_t) and φ[t, i] = exp(s_i - a_t) (i ≤ t):

    S_t[m] = scale · q_t · K̃_t[m],  K̃_t = exp(a_0 - a_t) K̃_0 + Σ_{i≤t} φ[t, i] k_i
    p_t = softmax_M(S_t),            o_t = Σ_m p_t[m] Ṽ_t[m]   (Ṽ alike)

Every weight is written as a product of factors ≤ 1, so any finite s is safe. Tokens are
split into chunks of BT (the memory recurrence) and sub-blocks of BC rows (the matmuls).
For a token t of sub-block I and i of an earlier sub-block J of the same chunk, with r the
log-normaliser at the last token of J: φ[t, i] = exp(s_i - r) · exp(r - a_t), both ≤ 1,
so a pair of sub-blocks is two tl.dot; inside I, φ[t, i] = exp(s_i - r) · exp(r - a_t) with
r midway between a at I's first token and at its last, each factor within e^±40 while a grows
by less than 80 over I (`FACTOR_DIAG`: a masked tl.dot more), else φ is built per column (a
loop over the BC tokens) or, with `DIAG_3D`, whole as a [BC, BC, M] tile. Earlier chunks are
read through the memory at the chunk start.

Where a grows by less than 80 over a whole chunk (in trained models every chunk of ABC_MLP's,
plain or with recency, and of gated slot attention's, whose log-normaliser restarts at every
chunk; 2-73 % of ABC_MLP with forget's: benchmarks/results/cpu/whole_chunks.md), the chunk
needs no sub-blocks: each sub-block kernel of
`WHOLE_CHUNKS` runs one program a chunk (BC = BT) whose own block is the dots of its factors,
every product a tl.dot of BT rows and the chunk-start memory loaded once, and a second launch
over the sub-blocks that only the other chunks' sub-blocks compute (`_takes`: both read the
same test, `_growth`, from the chunk's first and last rows).

The memory recurrence over chunks is split in two: each chunk's own part, every chunk at
once, then a short scan per (sequence, head, tile) that only does elementwise work on loaded
tiles. For chunk g and slot m, with r_g = log Σ_{t∈g} exp(s_t) and u_g = Σ_{t∈g}
exp(s_t - r_g) x_t (x = k or v):

    z_end = logaddexp(z, r_g),  mem <- exp(z - z_end) mem + exp(r_g - z_end) u_g

(every weight ≤ 1), and a_t = logaddexp(z_prev_g, lc_t) with lc the log-cumsum-exp of s
inside the chunk. a is never stored: the sub-block kernels build it where they read it
(`_log_z`), from lc and z_prev, which moves 2·T·H·M·4 bytes less than a scan that writes a
(it would read lc and write a) and keeps per-token work off the sequential path.

Forward, three passes:

    _fwd_chunks   grid (chunks, tiles of [M, D], H), once for K̃ and once for Ṽ: r_g, u_g of
                  every chunk (one tl.dot each); the K̃ launch also stores r and lc.
    _fwd_scan     grid (⌈D/BD⌉, ⌈M/BM⌉, N·H), once for K̃ and once for Ṽ: the short scan over
                  the chunks of a sequence; stores the memory at every chunk start, the
                  normalisers before / after every chunk (K̃ launch) and the final state.
                  With RESET (gated slot attention, memattn.kernels.gsa_chunk) log_z
                  restarts at 0 at every chunk.
    _fwd_output   grid (chunks, H) then (sub-blocks, H): both ABC passes for BC tokens
                  fused, keys -> slots (scores, softmax over M), slots -> values; stores o,
                  the probabilities p and the scores' log-sum-exp lse.

Backward, four passes. With dp_t[m] = do_t · Ṽ_t[m], dS = p ⊙ (dp - Σ_m p dp), the
gradient reaching the memory at step t is G^K_t[m] = scale dS_t[m] q_t, G^V_t[m] =
p_t[m] do_t, and c_t[m] = K̃_t[m]·G^K_t[m] + Ṽ_t[m]·G^V_t[m] = dS_t[m] S_t[m] + p_t[m] dp_t[m]
needs no memory (S comes back as log p + lse). Then dk_i = Σ_m Σ_{t≥i} φ[t, i] G^K_t[m] (dv
alike) and ds_i[m] = Σ_{t≥i} φ[t, i][m] (k_i·G^K_t[m] + v_i·G^V_t[m] - c_t[m]); the final state's
gradients join the last token, its log_z gradient as -c.

    _bwd_dq       grid (chunks, H) then (sub-blocks, H): dp (the keys -> slots pass on do,
                  v), dS, c, then dq (the slots -> values pass on dS, k); stores dq, dS, c.
    _bwd_chunks   grid (chunks, tiles of [M, D], H), once for K̃ and once for Ṽ: each
                  chunk's own part of the gradient reaching the memory before it,
                  w_g = Σ_t (f_t ⊙ coef_t)ᵀ x_t with f_t = exp(z_prev_g - a_t) ≤ 1 (one tl.dot),
                  and in the K̃ launch the c term Σ_t f_t c_t.
    _bwd_scan     grid (⌈D/BD⌉, ⌈M/BM⌉, N·H), once for K̃ and once for Ṽ: the short reverse
                  scan dh_before(g) = keep_g dh_after(g) + w_g, keep_g = exp(z_prev_g -
                  z_end_g) ≤ 1 (dc alike); stores ∂L/∂(memory after each chunk) and the
                  gradient of the initial state.
    _bwd_dkv      grid (chunks, H) then (sub-blocks, H): dk, dv, ds from the later chunks
                  (through the stored gradients) and from the later tokens of the chunk;
                  each launch in two, the keys' side (dk) then the values' (dv), for the
                  whole chunks with `WHOLE_SPLIT_DKV`, for the sub-blocks with `SPLIT_DKV`.

A chunk's own part is stored where its scan then stores the state it feeds (u_g at the
memory after chunk g, w_g at the gradient before it): the scan reads it and overwrites it
with a value computed from it, so no buffer is added and every element is read before it is
written, pipelined loads included.

Saved for backward: q, k, v, s, lc [T, H, M], p [T, H, M], lse [T, H], the chunk-start
memories [chunks, H, M, K + V] and the normalisers, the initial and final states.

The per-token tensors the sub-block kernels hand each other, p (saved), dS and c [T, H, M],
are stored in the inputs' dtype when those are all bf16 or all fp16 and so are the dots'
operands (PREC "bf16" / "fp16", `_saved_dtype`), which halves their bytes; else fp32. lse,
lc, the normalisers, the memories and their gradients stay fp32, loads are upcast and all
arithmetic is fp32. p is stored rather than S: rounding S
to bf16 moves p = exp(S - lse) by up to |S| · 2^-8 relative, which grows with the scores,
where a rounded p is off by 2^-8 relative whatever its size (in fp16, p under 6e-5 loses
bits and under 3e-8 is 0: terms too small to count), and S, which c needs, comes back as
log p + lse, off by 2^-8 absolute; reading p also takes no exp. Measured against the float64
reference (max |error| / max |value| over o, the final state and every gradient; bf16
rounded to nearest as compiled code rounds; T = 128, K = V = 64, M = 32, several sub-blocks
and chunks): fp32 handed-on tensors 4.0e-3, p, dS, c in bf16 4.2e-3; with q × 4 (larger
scores) 4.8e-3 and 6.7e-3, where S in bf16 in place of p gave 5.0e-2 and S in fp32 with dS,
c in bf16 6.1e-3. fp16: 5.3e-4 and 6.0e-4; with q × 4 5.4e-4 and 1.2e-3 (S in fp16: 5.2e-3;
S in fp32: 9.3e-4). The tests' tolerances for half inputs (4e-2) did not move.

Tiles: BT = chunk_size (64 by default) tokens a chunk; BC rows a sub-block, 16 or 32, set
per sub-block kernel (`SUB_ROWS`; at most BT): each splits the chunk its own way, since they
hand each other only per-token tensors. K, V, M padded to powers of two ≥ 16 (at most 128)
and held whole in the sub-block kernels; the chunk kernels and the scans take blocks of at
most 64 along M and D, 4 warps when every tile side is ≤ 32, else 8; the sub-block kernels'
warps and diagonal-block forms are set per kernel (`SUB_WARPS`, `DIAG_3D`; a [BC, BC, BM]
tile only up to DIAG_3D_MAX numbers, so at BC = 32 and M = 32 the diagonal block is a loop
unless DIAG_3D_MAX is raised). Loads are upcast to fp32 and the elementwise work (exp,
log-sum-exp, decays) is fp32; every tl.dot accumulates in fp32. Its operands are fp32 for
fp32 inputs (IEEE precision) and, for inputs all in bf16 or all in fp16, rounded to that dtype
(`HALF_DOTS`; TF32 for mixed inputs or with HALF_DOTS off), as flash-linear-attention's
kernels and memattn/kernels/linear.py do, but for the dots that hold a block's factors: fp32
operands, TF32 products (`_factor_dot`). Sequential loops over chunks are `while` loops (their
count is read from cu_seqlens, which the interpreter cannot take as the bound of a `range`;
see memattn/kernels/__init__.py). The scans also have a `for` form that compiled Triton
software-pipelines (STAGES > 0, `STATE_STAGES`, 3); compiled for sm_90 it issues
asynchronous copies for the next chunks' loads, the `while` form none (on an H100 the
earlier scans, which did each chunk's whole work in order, took 1.2-1.9x less time with 3
stages; the short scans are not timed yet).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from memattn.errors import ConfigError, ShapeError
from memattn.kernels import KERNEL_DTYPES, interpreting, kernels_supported, scan_stages
from memattn.ops.abc.common import ABCState, check_inputs
from memattn.ops.contract import default_scale
from memattn.ops.abc.varlen import check_varlen

# The largest K, V and M the sub-block kernels hold whole: at 256 their tiles outgrow the
# shared memory of an H100.
MAX_DIM = 128
# The smallest chunk_size: a chunk holds at least one sub-block of the fewest rows (16, the
# smallest tl.dot).
MIN_CHUNK = 16
# Matmul operands of bf16 / fp16 inputs in that dtype (else fp32 operands, TF32 products).
HALF_DOTS = True
# Launch choices of the sub-block kernels and the scans: the fastest per kernel on an H100
# (bf16, T = 8,192, M = 32, D = 64 and 128; benchmarks/results/nvidia-h100/
# gpu_profile_variants.md), together 2.4-2.6x faster than 8 warps, diagonal loops and while
# scans (gpu_profile.md).
# Warps of each sub-block kernel when its widest tile side (K, V, M padded) is at most 64,
# and when it is 128.
SUB_WARPS = {"_fwd_output": (2, 1), "_bwd_dq": (4, 1), "_bwd_dkv": (4, 4)}
# Rows of a sub-block (BC) of each sub-block kernel, 16 or 32 (at most the chunk size). Each
# kernel has its own: they hand each other per-token tensors only (p, lse, dS, c). 16 in each
# until 32 is timed per kernel under today's launch choices (benchmarks/gpu_profile.py,
# "sub-blocks of 32 rows"): on an H100 at 8 warps with diagonal loops, 32 rows took 1.1-2.0x
# the time of 16 in every sub-block kernel (benchmarks/results/nvidia-h100/
# gpu_profile_variants.md); the bytes from HBM are the same (benchmarks/kernel_model.py), but at
# 32 the diagonal block's exps a token double (BC · M a pass) and, compiled for sm_90 at
# D = 64, M = 32 and 4 warps, `_fwd_output` and `_bwd_dq` take 216-230 registers a thread
# instead of 122-126, so an SM holds half the programs (benchmarks/results/sm_90/
# sub-rows-16-32).
SUB_ROWS = {"_fwd_output": 16, "_bwd_dq": 16, "_bwd_dkv": 16}
# The kernels that take a sub-block's own (diagonal) block in one step over [BC, BC, BM]
# tiles, where they hold at most DIAG_3D_MAX numbers (else a loop over its BC tokens).
DIAG_3D = ("_bwd_dkv",)
DIAG_3D_MAX = 16 * 16 * 64
# The kernels that take a sub-block's own block as masked dots of the factors u = exp(s - r),
# v = exp(r - a) where they are exact (`_diag_factors`), the one-step or loop form where not;
# of `_fwd_output` and `_bwd_dq`. Not `_bwd_dkv`: with both forms in it, compiled for sm_90 at
# 4 warps, its spills grew from 0-224 bytes a thread to 32-2,396 (D 64-128, M 32-64).
FACTOR_DIAG = ("_fwd_output", "_bwd_dq")
# The sub-block kernels that take whole chunks where the chunk's own weights are exact as dots
# of their factors (log_z grows by less than _FACTOR_SPAN over the chunk, `_growth`): one
# program a chunk of BT rows, every product a tl.dot of BT rows, the memory at the chunk start
# loaded once; a second launch takes the other chunks in sub-blocks of `SUB_ROWS`, as a kernel
# not named here takes every chunk.
WHOLE_CHUNKS = ("_fwd_output", "_bwd_dq", "_bwd_dkv")
# The dots' precisions (`_precision`) for which they do: bf16 and fp16 inputs. With fp32
# inputs (IEEE dots, no tensor cores) the whole-chunk kernels compiled for sm_90 at 8 warps
# spill 1-55 KB a thread where the sub-block ones spill at most 20 bytes at D = 64 and 1.1 KB
# at D = 128 (M = 32; benchmarks/results/sm_90/whole-chunks-fp32).
WHOLE_PRECISIONS = ("bf16", "fp16")
# Warps of each kernel's whole-chunk launch, when its widest tile side is at most 64 and 128:
# compiled for sm_90 (bf16, D 64-128, M 32-64; benchmarks/results/sm_90/whole-chunks), 8 warps
# take `_fwd_output` and `_bwd_dq` to 200-255 registers a thread, spilling nothing at M = 32
# and up to 36 bytes at M = 64 (4 warps: up to 596); at 16 a thread has at most 128 registers
# and all spill.
WHOLE_WARPS = {"_fwd_output": (8, 8), "_bwd_dq": (8, 8), "_bwd_dkv": (8, 8)}
# `_bwd_dkv`'s whole-chunk launch in two, the keys' side then the values' (`SPLIT_DKV` sets
# the sub-blocks' launch): in one it spills 160-1,160 bytes a thread at 8 warps, each side
# alone nothing up to D = 128, M = 32 (56 and 48 bytes at D = 128, M = 64).
WHOLE_SPLIT_DKV = True
# Software-pipelining stages of the short scans over chunks (0: the while form); 3 was the
# fastest for the earlier scans, which did each chunk's whole work in order.
STATE_STAGES = 3
# The backward's dk / dv / ds of the sub-blocks in two launches, the keys' side then the values'
# (fewer tiles live in one program), instead of one.
SPLIT_DKV = False
_INTERPRETED = tl.constexpr(interpreting())
_NEG = tl.constexpr(-1e30)  # logit of padding: exp(_NEG - x) = 0, logaddexp(x, _NEG) = x
_POS = tl.constexpr(1e30)  # log-normaliser of padding: exp(x - _POS) = 0
# A block's own weights are taken as dots of their factors while log_z grows by less than this
# over it (`_diag_factors`), else token by token. Each factor is then within e^±(span / 2),
# and the dots that hold factors take fp32 operands whatever the inputs (`_factor_dot`): e^40
# is far from float32's overflow, and the dots' entries above the diagonal, masked after the
# dot, reach e^80 (times M and the scores), still finite.
_FACTOR_SPAN = tl.constexpr(80.0)


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

@triton.jit
def _logaddexp(x, y):
    mx = tl.maximum(x, y)
    return mx + tl.log(1.0 + tl.exp(tl.minimum(x, y) - mx))


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b of fp32 tiles, accumulated in fp32. PREC "ieee" / "tf32": fp32 operands at that
    precision; "bf16" / "fp16": operands rounded to that dtype. The interpreter multiplies
    half operands wrongly, so there the rounded operands are multiplied in fp32: the same
    products (its bf16 rounding truncates where compiled code rounds to nearest, so its
    error is the larger)."""
    if PREC == "ieee" or PREC == "tf32":
        out = tl.dot(a, b, input_precision=PREC)
    else:
        if PREC == "bf16":
            a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
        else:
            a, b = a.to(tl.float16), b.to(tl.float16)
        if _INTERPRETED:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b)
    return out


@triton.jit
def _tile(ptr, rows, r_ok, i_h, H, D, o_d, other):
    """rows [R] (int64) of head i_h of a [total, H, D] tensor -> [R, BD] fp32, `other` where
    masked (set after the upcast: a load's `other` takes the tensor's dtype, and -1e30 is
    -inf in fp16)."""
    mask = r_ok[:, None] & (o_d < D)[None, :]
    x = tl.load(ptr + (rows[:, None] * H + i_h) * D + o_d[None, :], mask=mask, other=0.0)
    return tl.where(mask, x.to(tl.float32), other)


@triton.jit
def _row(ptr, row, ok, i_h, H, D, o_d, other):
    """One row of head i_h of a [total, H, D] tensor -> [BD] fp32."""
    mask = ok & (o_d < D)
    return tl.where(mask, tl.load(ptr + (row * H + i_h) * D + o_d, mask=mask,
                                  other=0.0).to(tl.float32), other)


@triton.jit
def _block(ptr, i_g, i_h, H, M, D, o_m, o_d):
    """The [M, D] matrix of head i_h at index i_g of a [G, H, M, D] tensor -> [BM, BD]."""
    mask = (o_m < M)[:, None] & (o_d < D)[None, :]
    return tl.load(ptr + ((i_g * H + i_h) * M + o_m[:, None]) * D + o_d[None, :], mask=mask,
                   other=0.0)


@triton.jit
def _put_block(ptr, x, i_g, i_h, H, M, D, o_m, o_d):
    mask = (o_m < M)[:, None] & (o_d < D)[None, :]
    tl.store(ptr + ((i_g * H + i_h) * M + o_m[:, None]) * D + o_d[None, :], x, mask=mask)


@triton.jit
def _col(x, o_c, j):
    """Column j of x [R, BC] -> [R]."""
    return tl.sum(tl.where(o_c[None, :] == j, x, 0.0), 1)


@triton.jit
def _locate(cu, boff, sub_idx, BT: tl.constexpr, BC: tl.constexpr):
    """This program's sub-block of the packed batch (program id 0) -> (its first token, its
    tokens [BC] and which of them lie in the sequence, the end and the start of its
    sequence, its index in the sequence, that of the first sub-block of its chunk, the
    global index of its chunk)."""
    i_x = tl.program_id(0)
    i_n = tl.load(sub_idx + 2 * i_x)
    i_s = tl.load(sub_idx + 2 * i_x + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    i_g = tl.load(boff + i_n).to(tl.int64) + (i_s * BC) // BT
    t0 = bos + i_s * BC
    rows = t0 + tl.arange(0, BC)
    return t0, rows, rows < eos, eos, bos, i_s, i_s - i_s % (BT // BC), i_g


@triton.jit
def _log_z(lc, b_zp, rows, r_ok, i_h, H, M, o_m):
    """a = log_z at the rows [R] of one chunk -> [R, BM]: logaddexp(z_prev, lc_t) of the
    log-normaliser before the chunk b_zp [BM] and the chunk's own log-cumsum-exp of s,
    lc [total, H, M] (`_fwd_chunks`); 1e30 where masked, so that exp(x - a) = 0 there."""
    return _logaddexp(b_zp[None, :], _tile(lc, rows, r_ok, i_h, H, M, o_m, _POS))


@triton.jit
def _log_z_row(lc, b_zp, row, ok, i_h, H, M, o_m):
    """a = log_z at one row of a chunk -> [BM] (see `_log_z`)."""
    return _logaddexp(b_zp, _row(lc, row, ok, i_h, H, M, o_m, _POS))


@triton.jit
def _zprev(zprev, i_g, i_h, H, M, o_m):
    """z_prev, the log-normaliser before chunk i_g [BM]."""
    return tl.load(zprev + (i_g * H + i_h) * M + o_m, mask=o_m < M, other=_NEG)


@triton.jit
def _chunk_decay(lc, b_zp, rows, r_ok, i_h, H, M, o_m):
    """(a of the rows of one chunk [R, BM], the weight exp(z_prev - a) ≤ 1 [R, BM] of the
    memory at the chunk's start), from its z_prev b_zp [BM] (`_zprev`)."""
    b_a = _log_z(lc, b_zp, rows, r_ok, i_h, H, M, o_m)
    return b_a, tl.exp(b_zp[None, :] - b_a)


@triton.jit
def _growth(lc, b_zp, first, R: tl.constexpr, eos, i_h, H, M, o_m):
    """How much a = log_z grows over the R rows from `first` of one chunk (those before eos),
    in the slot where it grows most. The weights among those rows are exact as dots of their
    factors (`_diag_factors`) while it is under _FACTOR_SPAN. a grows along the rows, so its
    first and last rows bound it."""
    last = tl.minimum(first + R, eos) - 1
    grow = (_log_z_row(lc, b_zp, last, True, i_h, H, M, o_m)
            - _log_z_row(lc, b_zp, first, True, i_h, H, M, o_m))  # 0 in padded slots
    return tl.max(grow, 0)


@triton.jit
def _factor_dot(a, b, PREC: tl.constexpr):
    """a @ b where a or b holds factors of a block's weights (`_diag_factors`, up to e^±40):
    fp32 operands, TF32 products for half inputs (`_dot`). Half operands would overflow
    (fp16) or round the weights they form to 8 bits (bf16: measured in the interpreter, which
    truncates and multiplies TF32 operands in full fp32: bf16 inputs, T = 192, K = V = 64,
    M = 32, relative L2 error against the float64 reference over 3 seeds, whole chunks with
    bf16 operands here o 1.2e-2, dq 2.6e-2, dk 2.8e-2, token by token 7.2e-3, 1.4e-2, 1.8e-2,
    with fp32 operands 6.9e-3, 1.7e-2, 1.8e-2)."""
    if PREC == "ieee":
        out = _dot(a, b, "ieee")
    else:
        out = _dot(a, b, "tf32")
    return out


@triton.jit
def _takes(lc, b_zp, t0, bos, eos, i_h, H, M, o_m, BT: tl.constexpr, UNITS: tl.constexpr):
    """Whether the program whose rows start at t0 computes them. UNITS "sub": every sub-block
    does; "whole" (one program a chunk): a chunk whose own weights are exact as dots of their
    factors (`_growth` over the chunk); "rest" (sub-blocks): those of the other chunks."""
    if UNITS == "sub":
        ok = t0 >= bos
    else:
        grow = _growth(lc, b_zp, bos + (t0 - bos) // BT * BT, BT, eos, i_h, H, M, o_m)
        if UNITS == "whole":
            ok = grow < _FACTOR_SPAN
        else:
            ok = grow >= _FACTOR_SPAN
    return ok


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------

@triton.jit
def _chunk_of(cu, chunk_idx, BT: tl.constexpr):
    """This program's chunk of the packed batch (program id 0) -> (its global index, its
    sequence, its index in the sequence, the sequence's number of chunks, its tokens [BT] and
    which of them lie in the sequence)."""
    i_g = tl.program_id(0).to(tl.int64)
    i_n = tl.load(chunk_idx + 2 * i_g)
    i_c = tl.load(chunk_idx + 2 * i_g + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    rows = bos + i_c * BT + tl.arange(0, BT)
    return i_g, i_n, i_c, (eos - bos + BT - 1) // BT, rows, rows < eos


@triton.jit
def _tile_of(M, D, BM: tl.constexpr, BD: tl.constexpr):
    """This program's slots o_m [BM] and features o_d [BD] (program id 1 over the tiles of
    [M, D], features fastest) and its feature block's index."""
    i_t = tl.program_id(1)
    n_d = tl.cdiv(D, BD)
    i_d = i_t % n_d
    return (i_t // n_d) * BM + tl.arange(0, BM), i_d * BD + tl.arange(0, BD), i_d


@triton.jit
def _fwd_chunks(x, s, lc, r, h, xT, cu, chunk_idx,
                H, M, D,
                STORE_LC: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                PREC: tl.constexpr):
    """Each chunk's own part of the memory, every chunk at once: grid (chunks, tiles of
    [M, D], H).

    x [total, H, D] (k or v), s [total, H, M]. For chunk g and slot m: r_g = log Σ_{t∈g}
    exp(s_t) (a running-max log-sum-exp) and u_g = Σ_t exp(s_t - r_g) x_t [M, D] (weights ≤ 1,
    one tl.dot). u_g is stored where `_fwd_scan` stores the memory after chunk g, h [chunks,
    H, M, D] at the next chunk or, after the last chunk of a sequence, xT [N, H, M, D]: the
    scan reads it there and overwrites it with a value computed from it, so each element is
    read before it is written, pipelined loads included. With STORE_LC (the K̃ launch, first
    feature block) also r [chunks, H, M] and the chunk's own log-cumsum-exp of s, lc [total,
    H, M] (a_t = logaddexp(z_prev, lc_t), built where it is read: `_log_z`).
    """
    i_h = tl.program_id(2)
    i_g, i_n, i_c, n_c, rows, r_ok = _chunk_of(cu, chunk_idx, BT)
    o_m, o_d, i_d = _tile_of(M, D, BM, BD)
    m_ok = o_m < M
    b_s = _tile(s, rows, r_ok, i_h, H, M, o_m, _NEG)  # [BT, BM]
    mx = tl.max(b_s, 0)
    b_r = mx + tl.log(tl.sum(tl.exp(b_s - mx[None, :]), 0))  # [BM]
    b_u = _dot(tl.trans(tl.exp(b_s - b_r[None, :])), _tile(x, rows, r_ok, i_h, H, D, o_d, 0.0),
               PREC)  # [BM, BD]
    if i_c + 1 < n_c:
        _put_block(h, b_u, i_g + 1, i_h, H, M, D, o_m, o_d)
    else:
        _put_block(xT, b_u, i_n, i_h, H, M, D, o_m, o_d)
    if STORE_LC and i_d == 0:
        tl.store(r + (i_g * H + i_h) * M + o_m, b_r, mask=m_ok)
        tl.store(lc + (rows[:, None] * H + i_h) * M + o_m[None, :],
                 tl.associative_scan(b_s, 0, _logaddexp), mask=r_ok[:, None] & m_ok[None, :])


@triton.jit
def _fwd_scan_chunk(i_g, last, final, b_mem, b_z, r, zprev, zend, h, i_h, i_d, H, M, D, o_m,
                    o_d, STORE_Z: tl.constexpr, RESET: tl.constexpr):
    """Chunk i_g of `_fwd_scan` (`last` the sequence's last chunk, `final` its final memory in
    xT): stores the memory before it, returns (the memory, log_z) after it (log_z 0 with
    RESET)."""
    m_ok = o_m < M
    at = (i_g * H + i_h) * M + o_m
    b_r = tl.load(r + at, mask=m_ok, other=0.0)
    after = tl.where(i_g < last, h + ((i_g + 1) * H + i_h) * M * D, final)  # u, `_fwd_chunks`
    b_u = tl.load(after + o_m[:, None] * D + o_d[None, :],
                  mask=m_ok[:, None] & (o_d < D)[None, :], other=0.0)
    _put_block(h, b_mem, i_g, i_h, H, M, D, o_m, o_d)
    b_end = _logaddexp(b_z, b_r)  # [BM]
    if STORE_Z and i_d == 0:
        tl.store(zprev + at, b_z, mask=m_ok)
        tl.store(zend + at, b_end, mask=m_ok)
    # both weights ≤ 1
    b_mem = b_mem * tl.exp(b_z - b_end)[:, None] + tl.exp(b_r - b_end)[:, None] * b_u
    if RESET:  # the next chunk's logits are relative to the memory after this one
        b_end = tl.zeros_like(b_end)
    return b_mem, b_end


@triton.jit
def _fwd_scan(lz0, x0, r, zprev, zend, h, lzT, xT, cu, boff,
              H, M, D,
              HAS_INIT: tl.constexpr, STORE_Z: tl.constexpr, BT: tl.constexpr,
              BM: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr, RESET: tl.constexpr):
    """Memories at the chunk starts of one (sequence, head), slots o_m, features o_d, from the
    chunks' own parts (`_fwd_chunks`): per chunk g, elementwise on loaded tiles,

        z_end = logaddexp(z, r_g),  mem <- exp(z - z_end) mem + exp(r_g - z_end) u_g

    lz0 [N, H, M], x0 [N, H, M, D] the initial state; r [chunks, H, M]. Stores h [chunks, H,
    M, D] (memory before each chunk), xT [N, H, M, D]; with STORE_Z (the K̃ launch, first
    feature block) also zprev / zend [chunks, H, M] (log_z before / after each chunk) and
    lzT [N, H, M].
    STAGES 0: a `while` loop over the chunks; else a `for` loop that compiled Triton
    software-pipelines with that many stages (the interpreter cannot run it).
    RESET: log_z is 0 at the start of every chunk, the first included (whatever lz0 holds):
    each chunk's logits are relative to the memory before it, which weighs exp(-a_t) at token
    t (gated slot attention, memattn.kernels.gsa_chunk).
    """
    i_d, i_m, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    g0 = tl.load(boff + i_n).to(tl.int64)
    last = g0 + (eos - bos + BT - 1) // BT - 1
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = i_d * BD + tl.arange(0, BD)
    m_ok = o_m < M
    if HAS_INIT:
        b_z = tl.maximum(tl.load(lz0 + i_nh * M + o_m, mask=m_ok, other=_NEG), _NEG)
        b_mem = _block(x0, i_n, i_h, H, M, D, o_m, o_d)
    else:
        b_z = tl.full([BM], _NEG, tl.float32)
        b_mem = tl.zeros([BM, BD], tl.float32)
    if RESET:
        b_z = tl.zeros([BM], tl.float32)
    final = xT + (i_nh * M).to(tl.int64) * D
    if STAGES > 0:
        for n in tl.range(0, last - g0 + 1, num_stages=STAGES):
            b_mem, b_z = _fwd_scan_chunk(g0 + n, last, final, b_mem, b_z, r, zprev, zend, h,
                                         i_h, i_d, H, M, D, o_m, o_d, STORE_Z, RESET)
    else:
        i_g = g0
        while i_g <= last:  # the chunks of the sequence, in order
            b_mem, b_z = _fwd_scan_chunk(i_g, last, final, b_mem, b_z, r, zprev, zend, h, i_h,
                                         i_d, H, M, D, o_m, o_d, STORE_Z, RESET)
            i_g += 1
    _put_block(xT, b_mem, i_n, i_h, H, M, D, o_m, o_d)
    if STORE_Z and i_d == 0:
        tl.store(lzT + i_nh * M + o_m, b_z, mask=m_ok)


@triton.jit
def _diag_phi(s, b_a, rows, eos, i_h, H, M, o_c, o_m):
    """φ[t, i][m] = exp(s_i[m] - a_t[m]) for the tokens t (axis 0, their a in b_a [BC, BM]) and
    i ≤ t (axis 1) of one sub-block, 0 for i > t -> [BC, BC, BM]: its diagonal block at once."""
    b_s = _tile(s, rows, rows < eos, i_h, H, M, o_m, _NEG)  # [BC, BM]
    seen = (o_c[:, None] >= o_c[None, :])[:, :, None]
    return tl.exp(tl.where(seen, b_s[None, :, :] - b_a[:, None, :], _NEG))


@triton.jit
def _diag_factors(b_s, b_a, r_ok):
    """A block's own weights φ[t, i][m] = exp(s_i[m] - a_t[m]) (i ≤ t) as u_i[m] v_t[m]:
    b_s [R, BM] its logits, b_a [R, BM] its a (_NEG and _POS where masked) -> (u = exp(s - r),
    v = exp(r - a)), r midway between a at its first row and at its last (a grows along the
    rows). Exact while log_z grows by less than _FACTOR_SPAN over its rows (`_growth`): then
    u ≤ e^(_FACTOR_SPAN / 2) (s_i ≤ a_i) and v within e^±(_FACTOR_SPAN / 2), and the block is
    a masked dot of the factors instead of a pass per token."""
    b_lo = tl.min(tl.where(r_ok[:, None], b_a, _POS), 0)  # [BM]
    b_hi = tl.max(tl.where(r_ok[:, None], b_a, _NEG), 0)
    b_r = tl.where(b_lo < b_hi, 0.5 * (b_lo + b_hi), b_lo)  # a padded slot: _POS throughout
    # the cap binds only where inexact
    b_u = tl.exp(tl.minimum(b_s - b_r[None, :], 0.5 * _FACTOR_SPAN))
    return b_u, tl.exp(b_r[None, :] - b_a)


@triton.jit
def _keys_to_slots(b_x, b_h, decay, y, s, lc, b_zp, b_a, t0, eos, bos, j0, i_s, i_h, H, D, M,
                   o_c, o_d, o_m, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                   DIAG3: tl.constexpr, OWN: tl.constexpr):
    """out[t, m] = decay[t, m] (x_t · h[m]) + Σ_{i≤t in the chunk} φ[t, i][m] (x_t · y_i) for
    the rows t of a sub-block -> [BC, BM]. b_x [BC, BD]; b_h [BM, BD] the memory before the
    chunk; y [total, H, D]; b_a [BC, BM] a of the rows, and that of other rows of the chunk from
    its z_prev b_zp and lc (`_log_z`). x = scale q, y = k, h = K̃: the scores; x = do, y = v,
    h = Ṽ: dp. OWN, how the sub-block's own block is taken: "factors", as dots of its factors
    (`_diag_factors`; exact where the program `_takes` its rows with UNITS "whole");
    "either", so where they are exact over it, else as "tokens", per token or with DIAG3 in one
    step (`_own_keys`)."""
    b_out = decay * _dot(b_x, tl.trans(b_h), PREC)
    if BC < BT:
        j = j0
        while j < i_s:  # earlier sub-blocks of the chunk, split at r = a at their last token
            rows_j = bos + j * BC + o_c
            b_yj = _tile(y, rows_j, rows_j < eos, i_h, H, D, o_d, 0.0)
            b_sj = _tile(s, rows_j, rows_j < eos, i_h, H, M, o_m, _NEG)
            b_r = _log_z_row(lc, b_zp, bos + j * BC + BC - 1, True, i_h, H, M, o_m)  # [BM]
            b_xy = _dot(b_x, tl.trans(b_yj), PREC)  # [BC, BC]
            b_out += tl.exp(b_r[None, :] - b_a) * _dot(b_xy, tl.exp(b_sj - b_r[None, :]), PREC)
            j += 1
    rows = t0 + o_c
    b_xy = _dot(b_x, tl.trans(_tile(y, rows, rows < eos, i_h, H, D, o_d, 0.0)), PREC)
    # each form named once per constant branch: compiled Triton drops a branch only on a
    # compile-time constant, so the runtime test sits inside the constant one. The factors are
    # rebuilt in each pass (`_slots_to_values` too) rather than held across the softmax.
    if OWN == "factors":
        b_out += _factor_keys(b_xy, s, b_a, rows, eos, i_h, H, M, o_c, o_m, PREC)
    elif OWN == "either":
        if _growth(lc, b_zp, t0, BC, eos, i_h, H, M, o_m) < _FACTOR_SPAN:
            b_out += _factor_keys(b_xy, s, b_a, rows, eos, i_h, H, M, o_c, o_m, PREC)
        else:
            b_out += _own_keys(b_xy, s, b_a, t0, eos, i_h, H, M, o_c, o_m, BC, DIAG3)
    else:
        b_out += _own_keys(b_xy, s, b_a, t0, eos, i_h, H, M, o_c, o_m, BC, DIAG3)
    return b_out


@triton.jit
def _factor_keys(b_xy, s, b_a, rows, eos, i_h, H, M, o_c, o_m, PREC: tl.constexpr):
    """The own block of `_keys_to_slots` as a masked dot of its factors (`_diag_factors`)."""
    b_u, b_v = _diag_factors(_tile(s, rows, rows < eos, i_h, H, M, o_m, _NEG), b_a, rows < eos)
    return b_v * _factor_dot(tl.where(o_c[:, None] >= o_c[None, :], b_xy, 0.0), b_u, PREC)


@triton.jit
def _own_keys(b_xy, s, b_a, t0, eos, i_h, H, M, o_c, o_m, BC: tl.constexpr,
              DIAG3: tl.constexpr):
    """The sub-block's own part of `_keys_to_slots`, Σ_{i≤t in it} φ[t, i][m] b_xy[t, i], with
    φ built per column, or whole with DIAG3 -> [BC, BM]."""
    rows = t0 + o_c
    if DIAG3:
        b_out = tl.sum(b_xy[:, :, None] * _diag_phi(s, b_a, rows, eos, i_h, H, M, o_c, o_m), 1)
    else:
        b_out = tl.zeros_like(b_a)
        for i in range(BC):  # token i of the sub-block, read by the tokens t ≥ i
            b_si = _row(s, t0 + i, t0 + i < eos, i_h, H, M, o_m, _NEG)
            b_phi = tl.exp(tl.where(o_c[:, None] >= i, b_si[None, :] - b_a, _NEG))  # [BC, BM]
            b_out += _col(b_xy, o_c, i)[:, None] * b_phi
    return b_out


@triton.jit
def _slots_to_values(b_w, b_h, decay, y, s, lc, b_zp, b_a, t0, eos, bos, j0, i_s, i_h, H, D, M,
                     o_c, o_d, o_m, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                     DIAG3: tl.constexpr, OWN: tl.constexpr):
    """out[t] = Σ_m w[t, m] (decay[t, m] h[m] + Σ_{i≤t in the chunk} φ[t, i][m] y_i) for the
    rows t of a sub-block -> [BC, BD]. b_w [BC, BM]; b_h [BM, BD] the memory before the chunk;
    y [total, H, D]; b_a, b_zp, lc, OWN as in `_keys_to_slots`. w = p, y = v, h = Ṽ: o;
    w = dS, y = k, h = K̃: dq / scale."""
    b_out = _dot(b_w * decay, b_h, PREC)
    if BC < BT:
        j = j0
        while j < i_s:
            rows_j = bos + j * BC + o_c
            b_yj = _tile(y, rows_j, rows_j < eos, i_h, H, D, o_d, 0.0)
            b_sj = _tile(s, rows_j, rows_j < eos, i_h, H, M, o_m, _NEG)
            b_r = _log_z_row(lc, b_zp, bos + j * BC + BC - 1, True, i_h, H, M, o_m)
            b_g = _dot(b_w * tl.exp(b_r[None, :] - b_a), tl.trans(tl.exp(b_sj - b_r[None, :])),
                       PREC)  # [BC, BC]
            b_out += _dot(b_g, b_yj, PREC)
            j += 1
    rows = t0 + o_c
    if OWN == "factors":
        b_out += _factor_values(b_w, y, s, b_a, rows, eos, i_h, H, D, M, o_c, o_d, o_m, PREC)
    elif OWN == "either":
        if _growth(lc, b_zp, t0, BC, eos, i_h, H, M, o_m) < _FACTOR_SPAN:
            b_out += _factor_values(b_w, y, s, b_a, rows, eos, i_h, H, D, M, o_c, o_d, o_m,
                                    PREC)
        else:
            b_out += _own_values(b_w, y, s, b_a, t0, eos, i_h, H, D, M, o_c, o_d, o_m, BC,
                                 PREC, DIAG3)
    else:
        b_out += _own_values(b_w, y, s, b_a, t0, eos, i_h, H, D, M, o_c, o_d, o_m, BC, PREC,
                             DIAG3)
    return b_out


@triton.jit
def _factor_values(b_w, y, s, b_a, rows, eos, i_h, H, D, M, o_c, o_d, o_m, PREC: tl.constexpr):
    """The own block of `_slots_to_values` as masked dots of its factors (`_diag_factors`)."""
    b_u, b_v = _diag_factors(_tile(s, rows, rows < eos, i_h, H, M, o_m, _NEG), b_a, rows < eos)
    b_g = _factor_dot(b_w * b_v, tl.trans(b_u), PREC)  # [BC (t), BC (i)]
    return _dot(tl.where(o_c[:, None] >= o_c[None, :], b_g, 0.0),
                _tile(y, rows, rows < eos, i_h, H, D, o_d, 0.0), PREC)


@triton.jit
def _own_values(b_w, y, s, b_a, t0, eos, i_h, H, D, M, o_c, o_d, o_m, BC: tl.constexpr,
                PREC: tl.constexpr, DIAG3: tl.constexpr):
    """The sub-block's own part of `_slots_to_values`, Σ_m w[t, m] Σ_{i≤t in it} φ[t, i][m]
    y_i, with φ built per column, or whole with DIAG3 -> [BC, BD]."""
    rows = t0 + o_c
    if DIAG3:
        b_g = tl.sum(b_w[:, None, :] * _diag_phi(s, b_a, rows, eos, i_h, H, M, o_c, o_m), 2)
        b_out = _dot(b_g, _tile(y, rows, rows < eos, i_h, H, D, o_d, 0.0), PREC)
    else:
        b_out = tl.zeros([BC, o_d.shape[0]], tl.float32)
        for i in range(BC):
            b_si = _row(s, t0 + i, t0 + i < eos, i_h, H, M, o_m, _NEG)
            b_phi = tl.exp(tl.where(o_c[:, None] >= i, b_si[None, :] - b_a, _NEG))
            b_yi = _row(y, t0 + i, t0 + i < eos, i_h, H, D, o_d, 0.0)
            b_out += tl.sum(b_w * b_phi, 1)[:, None] * b_yi[None, :]
    return b_out


@triton.jit
def _fwd_output(q, k, v, s, lc, zprev, hk, hv, o, p, lse, cu, boff, sub_idx, scale,
                H, K, V, M,
                BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                BM: tl.constexpr, PREC: tl.constexpr, DIAG3: tl.constexpr, OWN: tl.constexpr,
                UNITS: tl.constexpr):
    """o, the probabilities p = softmax_M(S) (in p's dtype: `_saved_dtype`) and the scores'
    log-sum-exp lse of one sub-block of BC tokens of one head (UNITS: `_takes`)."""
    i_h = tl.program_id(1)
    t0, rows, r_ok, eos, bos, i_s, j0, i_g = _locate(cu, boff, sub_idx, BT, BC)
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    o_m = tl.arange(0, BM)
    b_zp = _zprev(zprev, i_g, i_h, H, M, o_m)
    if _takes(lc, b_zp, t0, bos, eos, i_h, H, M, o_m, BT, UNITS):
        b_a, decay = _chunk_decay(lc, b_zp, rows, r_ok, i_h, H, M, o_m)
        b_q = _tile(q, rows, r_ok, i_h, H, K, o_k, 0.0) * scale  # [BC, BK]

        b_S = _keys_to_slots(b_q, _block(hk, i_g, i_h, H, M, K, o_m, o_k), decay, k, s, lc,
                             b_zp, b_a, t0, eos, bos, j0, i_s, i_h, H, K, M, o_c, o_k, o_m,
                             BT, BC, PREC, DIAG3, OWN)
        b_S = tl.where((o_m < M)[None, :], b_S, float("-inf"))
        mx = tl.max(b_S, 1)
        b_p = tl.exp(b_S - mx[:, None])
        den = tl.sum(b_p, 1)
        b_p = b_p / den[:, None]  # [BC, BM]
        tl.store(p + (rows[:, None] * H + i_h) * M + o_m[None, :], b_p.to(p.dtype.element_ty),
                 mask=r_ok[:, None] & (o_m < M)[None, :])
        tl.store(lse + rows * H + i_h, mx + tl.log(den), mask=r_ok)

        b_o = _slots_to_values(b_p, _block(hv, i_g, i_h, H, M, V, o_m, o_v), decay, v, s, lc,
                               b_zp, b_a, t0, eos, bos, j0, i_s, i_h, H, V, M, o_c, o_v, o_m,
                               BT, BC, PREC, DIAG3, OWN)
        tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=r_ok[:, None] & (o_v < V)[None, :])


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------

@triton.jit
def _bwd_dq(q, k, v, s, lc, zprev, hk, hv, p, lse, do, dq, dS, c, cu, boff, sub_idx, scale,
            H, K, V, M,
            BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            BM: tl.constexpr, PREC: tl.constexpr, DIAG3: tl.constexpr, OWN: tl.constexpr,
            UNITS: tl.constexpr):
    """dq, dS, c of one sub-block of one head (dS and c in their buffers' dtype; UNITS:
    `_takes`)."""
    i_h = tl.program_id(1)
    t0, rows, r_ok, eos, bos, i_s, j0, i_g = _locate(cu, boff, sub_idx, BT, BC)
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    o_m = tl.arange(0, BM)
    b_zp = _zprev(zprev, i_g, i_h, H, M, o_m)
    if _takes(lc, b_zp, t0, bos, eos, i_h, H, M, o_m, BT, UNITS):
        b_a, decay = _chunk_decay(lc, b_zp, rows, r_ok, i_h, H, M, o_m)
        b_do = _tile(do, rows, r_ok, i_h, H, V, o_v, 0.0)  # [BC, BV]

        # dp_t[m] = do_t · Ṽ_t[m]
        b_dp = _keys_to_slots(b_do, _block(hv, i_g, i_h, H, M, V, o_m, o_v), decay, v, s, lc,
                              b_zp, b_a, t0, eos, bos, j0, i_s, i_h, H, V, M, o_c, o_v, o_m,
                              BT, BC, PREC, DIAG3, OWN)
        b_p = _tile(p, rows, r_ok, i_h, H, M, o_m, 0.0)  # [BC, BM]
        # S = log p + lse; 0 where p = 0 (rounded to 0, or masked), where dS = 0 too
        seen = b_p > 0.0
        b_S = tl.where(seen, tl.log(tl.where(seen, b_p, 1.0))
                       + tl.load(lse + rows * H + i_h, mask=r_ok, other=0.0)[:, None], 0.0)
        ok = r_ok[:, None] & (o_m < M)[None, :]
        b_dS = b_p * (b_dp - tl.sum(b_p * b_dp, 1)[:, None])
        b_c = b_dS * b_S + b_p * b_dp  # K̃_t·G^K_t + Ṽ_t·G^V_t per slot
        tl.store(dS + (rows[:, None] * H + i_h) * M + o_m[None, :],
                 b_dS.to(dS.dtype.element_ty), mask=ok)
        tl.store(c + (rows[:, None] * H + i_h) * M + o_m[None, :],
                 b_c.to(c.dtype.element_ty), mask=ok)

        # dq_t = scale Σ_m dS_t[m] K̃_t[m]
        b_dq = _slots_to_values(b_dS, _block(hk, i_g, i_h, H, M, K, o_m, o_k), decay, k, s,
                                lc, b_zp, b_a, t0, eos, bos, j0, i_s, i_h, H, K, M, o_c, o_k,
                                o_m, BT, BC, PREC, DIAG3, OWN)
        tl.store(dq + (rows[:, None] * H + i_h) * K + o_k[None, :],
                 (b_dq * scale).to(dq.dtype.element_ty),
                 mask=r_ok[:, None] & (o_k < K)[None, :])


@triton.jit
def _bwd_chunks(x, coef, c, lc, zprev, dh, dhc, dx0, dc0, cu, chunk_idx, scale,
                H, M, D,
                IS_V: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                PREC: tl.constexpr):
    """Each chunk's own part of the gradient reaching the memory before it, every chunk at
    once: grid (chunks, tiles of [M, D], H).

    K̃ launch: x = q, coef = dS, G^K_t[m] = scale dS_t[m] q_t; Ṽ launch: x = do, coef = p,
    G^V_t[m] = p_t[m] do_t. With f_t = exp(z_prev - a_t) ≤ 1 (the weight of
    the memory before the chunk at token t), w_g = Σ_t (f_t ⊙ coef_t)ᵀ x_t (one tl.dot) and,
    in the K̃ launch's first feature block, wc_g = Σ_t f_t c_t. Stored where `_bwd_scan`
    stores the gradient before chunk g (that after the chunk before it, dh [chunks, H, M, D],
    dhc [chunks, H, M]; before a sequence's first chunk, dx0 [N, H, M, D], dc0 [N, H, M]):
    the scan reads them there and overwrites them with values computed from them.
    """
    i_h = tl.program_id(2)
    i_g, i_n, i_c, _nc, rows, r_ok = _chunk_of(cu, chunk_idx, BT)
    o_m, o_d, i_d = _tile_of(M, D, BM, BD)
    m_ok = o_m < M
    _a, b_f = _chunk_decay(lc, _zprev(zprev, i_g, i_h, H, M, o_m), rows, r_ok, i_h, H, M,
                           o_m)  # [BT, BM]
    b_coef = _tile(coef, rows, r_ok, i_h, H, M, o_m, 0.0)
    b_x = _tile(x, rows, r_ok, i_h, H, D, o_d, 0.0)
    if not IS_V:
        b_x = b_x * scale
    b_w = _dot(tl.trans(b_f * b_coef), b_x, PREC)  # [BM, BD]
    if i_c > 0:
        _put_block(dh, b_w, i_g - 1, i_h, H, M, D, o_m, o_d)
    else:
        _put_block(dx0, b_w, i_n, i_h, H, M, D, o_m, o_d)
    if (not IS_V) and i_d == 0:
        b_wc = tl.sum(b_f * _tile(c, rows, r_ok, i_h, H, M, o_m, 0.0), 0)  # [BM]
        at = tl.where(i_c > 0, dhc + ((i_g - 1) * H + i_h) * M, dc0 + (i_n * H + i_h) * M)
        tl.store(at + o_m, b_wc, mask=m_ok)


@triton.jit
def _bwd_scan_chunk(i_g, g0, first, first_c, b_dh, b_dc, zprev, zend, dh, dhc, i_h, i_d, H, M,
                    D, o_m, o_d, IS_V: tl.constexpr):
    """Chunk i_g of `_bwd_scan` (g0 the sequence's first chunk, `first` / `first_c` the
    gradients before it in dx0 / dc0): stores the gradient after it, returns (dh, dc) before
    it."""
    m_ok = o_m < M
    at = (i_g * H + i_h) * M + o_m
    before = tl.where(i_g > g0, dh + ((i_g - 1) * H + i_h) * M * D, first)  # w, `_bwd_chunks`
    b_w = tl.load(before + o_m[:, None] * D + o_d[None, :],
                  mask=m_ok[:, None] & (o_d < D)[None, :], other=0.0)
    _put_block(dh, b_dh, i_g, i_h, H, M, D, o_m, o_d)
    keep = tl.exp(tl.load(zprev + at, mask=m_ok, other=0.0)
                  - tl.load(zend + at, mask=m_ok, other=0.0))  # [BM], ≤ 1
    b_dh = b_dh * keep[:, None] + b_w
    if (not IS_V) and i_d == 0:
        b_wc = tl.load(tl.where(i_g > g0, dhc + ((i_g - 1) * H + i_h) * M, first_c) + o_m,
                       mask=m_ok, other=0.0)
        tl.store(dhc + at, b_dc, mask=m_ok)
        b_dc = b_dc * keep + b_wc
    return b_dh, b_dc


@triton.jit
def _bwd_scan(zprev, zend, dxT, dcT, dh, dhc, dx0, dc0, cu, boff,
              H, M, D,
              IS_V: tl.constexpr, HAS_DFINAL: tl.constexpr, BT: tl.constexpr,
              BM: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr):
    """∂L/∂(memory after each chunk) of one (sequence, head), slots o_m, features o_d, from the
    chunks' own parts (`_bwd_chunks`): per chunk g, last first, elementwise on loaded tiles,

        dh_before(g) = keep_g dh_after(g) + w_g,  keep_g = exp(z_prev_g - z_end_g) ≤ 1

    and dc alike in the K̃ launch's first feature block. dxT / dcT [N, H, M(, D)]: the
    gradient of the final memory and the c of the final state. Stores dh [chunks, H, M, D],
    dhc [chunks, H, M] (K̃ launch) and, before the first chunk, dx0 [N, H, M, D] (the initial
    memory's gradient) and dc0 [N, H, M].
    STAGES: as in `_fwd_scan`.
    """
    i_d, i_m, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    g0 = tl.load(boff + i_n).to(tl.int64)
    last = g0 + (eos - bos + BT - 1) // BT - 1
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = i_d * BD + tl.arange(0, BD)
    m_ok = o_m < M
    if HAS_DFINAL:
        b_dh = _block(dxT, i_n, i_h, H, M, D, o_m, o_d)
        b_dc = tl.load(dcT + i_nh * M + o_m, mask=m_ok, other=0.0)
    else:
        b_dh = tl.zeros([BM, BD], tl.float32)
        b_dc = tl.zeros([BM], tl.float32)
    first = dx0 + (i_nh * M).to(tl.int64) * D
    first_c = dc0 + (i_nh * M).to(tl.int64)
    if STAGES > 0:
        for n in tl.range(0, last - g0 + 1, num_stages=STAGES):  # the chunks, last first
            b_dh, b_dc = _bwd_scan_chunk(last - n, g0, first, first_c, b_dh, b_dc, zprev, zend,
                                         dh, dhc, i_h, i_d, H, M, D, o_m, o_d, IS_V)
    else:
        i_g = last
        while i_g >= g0:  # the chunks of the sequence, last first
            b_dh, b_dc = _bwd_scan_chunk(i_g, g0, first, first_c, b_dh, b_dc, zprev, zend, dh,
                                         dhc, i_h, i_d, H, M, D, o_m, o_d, IS_V)
            i_g -= 1
    _put_block(dx0, b_dh, i_n, i_h, H, M, D, o_m, o_d)
    if (not IS_V) and i_d == 0:
        tl.store(dc0 + i_nh * M + o_m, b_dc, mask=m_ok)


@triton.jit
def _bwd_dkv(q, k, v, s, lc, zprev, zend, p, do, dS, c, dhk, dhv, dhc, dk, dv, ds, ds_part,
             cu, boff, sub_idx, scale,
             H, K, V, M,
             BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             BM: tl.constexpr, PREC: tl.constexpr, DIAG3: tl.constexpr, SIDES: tl.constexpr,
             OWN: tl.constexpr, UNITS: tl.constexpr):
    """dk, dv, ds of one sub-block of one head. ds has a term from the keys' side (K̃: with
    k, q, dS and c) and one from the values' side (Ṽ: with v, do and p). SIDES 0: both, in one
    program; 1: the keys' side, dk and its ds term, stored to ds_part [total, H, M] fp32; 2:
    the values' side, dv, and ds with the term in ds_part added (fewer tiles live at once).
    OWN "factors": the sub-block's own block as masked dots of its factors (`_diag_factors`,
    where `_takes` gives this program exact factors: UNITS "whole"), "tokens": as a loop over
    its tokens or, with DIAG3, in one step."""
    i_h = tl.program_id(1)
    t0, rows, r_ok, eos, bos, i_s, j0, i_g = _locate(cu, boff, sub_idx, BT, BC)
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    o_m = tl.arange(0, BM)
    b_zp = _zprev(zprev, i_g, i_h, H, M, o_m)
    if _takes(lc, b_zp, t0, bos, eos, i_h, H, M, o_m, BT, UNITS):
        b_s = _tile(s, rows, r_ok, i_h, H, M, o_m, _NEG)  # [BC, BM]
        if SIDES != 2:
            b_k = _tile(k, rows, r_ok, i_h, H, K, o_k, 0.0)  # [BC, BK]
        if SIDES != 1:
            b_v = _tile(v, rows, r_ok, i_h, H, V, o_v, 0.0)  # [BC, BV]

        # Later chunks, through the gradient of the memory after this chunk.
        b_ze = tl.load(zend + (i_g * H + i_h) * M + o_m, mask=o_m < M, other=0.0)
        b_e = tl.exp(b_s - b_ze[None, :])  # [BC, BM], ≤ 1
        b_ds = tl.zeros([BC, BM], tl.float32)
        if SIDES != 2:
            b_hk = _block(dhk, i_g, i_h, H, M, K, o_m, o_k)
            b_hc = tl.load(dhc + (i_g * H + i_h) * M + o_m, mask=o_m < M, other=0.0)
            b_dk = _dot(b_e, b_hk, PREC)
            b_ds += b_e * (_dot(b_k, tl.trans(b_hk), PREC) - b_hc[None, :])
        if SIDES != 1:
            b_hv = _block(dhv, i_g, i_h, H, M, V, o_m, o_v)
            b_dv = _dot(b_e, b_hv, PREC)
            b_ds += b_e * _dot(b_v, tl.trans(b_hv), PREC)

        # Later sub-blocks of the chunk, through r = log_z at the last token of this one.
        if BC < BT:
            n_sub = (eos - bos + BC - 1) // BC
            j_end = tl.minimum(j0 + BT // BC, n_sub)
            b_r = _log_z_row(lc, b_zp, t0 + BC - 1, t0 + BC - 1 < eos, i_h, H, M, o_m)
            b_e = tl.exp(b_s - b_r[None, :])  # [BC, BM], ≤ 1
            j = i_s + 1
            while j < j_end:
                rows_j = bos + j * BC + o_c
                rj_ok = rows_j < eos
                b_f = tl.exp(b_r[None, :]
                             - _log_z(lc, b_zp, rows_j, rj_ok, i_h, H, M, o_m))  # ≤ 1
                if SIDES != 2:
                    b_qj = _tile(q, rows_j, rj_ok, i_h, H, K, o_k, 0.0) * scale
                    b_fdS = b_f * _tile(dS, rows_j, rj_ok, i_h, H, M, o_m, 0.0)
                    b_fc = tl.sum(b_f * _tile(c, rows_j, rj_ok, i_h, H, M, o_m, 0.0), 0)  # [BM]
                    b_dk += _dot(_dot(b_e, tl.trans(b_fdS), PREC), b_qj, PREC)
                    b_kq = _dot(b_k, tl.trans(b_qj), PREC)  # [BC, BC]
                    b_ds += b_e * (_dot(b_kq, b_fdS, PREC) - b_fc[None, :])
                if SIDES != 1:
                    b_doj = _tile(do, rows_j, rj_ok, i_h, H, V, o_v, 0.0)
                    b_pj = _tile(p, rows_j, rj_ok, i_h, H, M, o_m, 0.0)
                    b_fp = b_f * b_pj
                    b_dv += _dot(_dot(b_e, tl.trans(b_fp), PREC), b_doj, PREC)
                    b_ds += b_e * _dot(_dot(b_v, tl.trans(b_doj), PREC), b_fp, PREC)
                j += 1

        # This sub-block: token t reads tokens i ≤ t.
        if SIDES != 2:
            b_qs = _tile(q, rows, r_ok, i_h, H, K, o_k, 0.0) * scale  # [BC, BK]
            b_kq = _dot(b_k, tl.trans(b_qs), PREC)  # [BC (i), BC (t)]
        if SIDES != 1:
            b_do = _tile(do, rows, r_ok, i_h, H, V, o_v, 0.0)  # [BC, BV]
            b_vdo = _dot(b_v, tl.trans(b_do), PREC)
        if OWN == "factors":
            b_u, b_w = _diag_factors(b_s, _log_z(lc, b_zp, rows, r_ok, i_h, H, M, o_m), r_ok)
            later = o_c[None, :] >= o_c[:, None]  # [i, t]: token t reads token i
            if SIDES != 2:
                b_wdS = b_w * _tile(dS, rows, r_ok, i_h, H, M, o_m, 0.0)  # [BC (t), BM]
                b_wc = b_w * _tile(c, rows, r_ok, i_h, H, M, o_m, 0.0)
                b_dk += _dot(tl.where(later, _factor_dot(b_u, tl.trans(b_wdS), PREC), 0.0),
                             b_qs, PREC)
                b_ds += b_u * (_factor_dot(tl.where(later, b_kq, 0.0), b_wdS, PREC)
                               - _factor_dot(tl.where(later, 1.0, 0.0), b_wc, PREC))
            if SIDES != 1:
                b_wp = b_w * _tile(p, rows, r_ok, i_h, H, M, o_m, 0.0)
                b_dv += _dot(tl.where(later, _factor_dot(b_u, tl.trans(b_wp), PREC), 0.0),
                             b_do, PREC)
                b_ds += b_u * _factor_dot(tl.where(later, b_vdo, 0.0), b_wp, PREC)
        elif DIAG3:  # φ [t, i, m] with t the reading token (the rows of the tiles below)
            b_phi = _diag_phi(s, _log_z(lc, b_zp, rows, r_ok, i_h, H, M, o_m), rows, eos, i_h, H, M,
                              o_c, o_m)
            if SIDES != 2:
                b_dSt = _tile(dS, rows, r_ok, i_h, H, M, o_m, 0.0)  # [BC, BM]
                b_ct = _tile(c, rows, r_ok, i_h, H, M, o_m, 0.0)
                b_dk += _dot(tl.trans(tl.sum(b_phi * b_dSt[:, None, :], 2)), b_qs, PREC)
                b_ds += tl.sum(b_phi * (tl.trans(b_kq)[:, :, None] * b_dSt[:, None, :]
                                        - b_ct[:, None, :]), 0)
            if SIDES != 1:
                b_pt = _tile(p, rows, r_ok, i_h, H, M, o_m, 0.0)  # [BC, BM]
                b_dv += _dot(tl.trans(tl.sum(b_phi * b_pt[:, None, :], 2)), b_do, PREC)
                b_ds += tl.sum(b_phi * tl.trans(b_vdo)[:, :, None] * b_pt[:, None, :], 0)
        else:
            for i in range(BC):  # token t = t0 + i
                ok = t0 + i < eos
                b_at = _log_z_row(lc, b_zp, t0 + i, ok, i_h, H, M, o_m)
                b_phi = tl.exp(tl.where(o_c[:, None] <= i, b_s - b_at[None, :], _NEG))  # [BC, BM]
                if SIDES != 2:
                    b_dSt = _row(dS, t0 + i, ok, i_h, H, M, o_m, 0.0)
                    b_ct = _row(c, t0 + i, ok, i_h, H, M, o_m, 0.0)
                    b_qt = _row(q, t0 + i, ok, i_h, H, K, o_k, 0.0) * scale
                    b_dk += tl.sum(b_phi * b_dSt[None, :], 1)[:, None] * b_qt[None, :]
                    b_ds += b_phi * (_col(b_kq, o_c, i)[:, None] * b_dSt[None, :] - b_ct[None, :])
                if SIDES != 1:
                    b_pt = _row(p, t0 + i, ok, i_h, H, M, o_m, 0.0)
                    b_dot = _row(do, t0 + i, ok, i_h, H, V, o_v, 0.0)
                    b_dv += tl.sum(b_phi * b_pt[None, :], 1)[:, None] * b_dot[None, :]
                    b_ds += b_phi * _col(b_vdo, o_c, i)[:, None] * b_pt[None, :]

        m_ok = r_ok[:, None] & (o_m < M)[None, :]
        at_m = (rows[:, None] * H + i_h) * M + o_m[None, :]
        if SIDES != 2:
            tl.store(dk + (rows[:, None] * H + i_h) * K + o_k[None, :],
                     b_dk.to(dk.dtype.element_ty), mask=r_ok[:, None] & (o_k < K)[None, :])
        if SIDES != 1:
            tl.store(dv + (rows[:, None] * H + i_h) * V + o_v[None, :],
                     b_dv.to(dv.dtype.element_ty), mask=r_ok[:, None] & (o_v < V)[None, :])
        if SIDES == 1:
            tl.store(ds_part + at_m, b_ds, mask=m_ok)
        else:
            if SIDES == 2:
                b_ds += tl.load(ds_part + at_m, mask=m_ok, other=0.0)
            tl.store(ds + at_m, b_ds.to(ds.dtype.element_ty), mask=m_ok)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------

def _pad(n: int) -> int:
    """The smallest power of two ≥ max(n, 16)."""
    return max(16, triton.next_power_of_2(n))


class _Plan(NamedTuple):
    """Where the chunks of a packed batch lie (on the device); its sub-blocks of each size:
    `_sub_blocks`."""

    cu: torch.Tensor  # [N + 1] int32, sequence boundaries
    boff: torch.Tensor  # [N] int32, global index of each sequence's first chunk
    chunk_idx: torch.Tensor  # [chunks, 2] int32, (sequence, chunk in it)
    n_seq: int
    n_chunks: int
    bounds: tuple[int, ...]  # the sequence boundaries on the host
    chunk: int  # BT
    scale: float
    precision: str


def _plan(bounds: list[int], chunk: int, scale: float, precision: str,
          device: torch.device) -> _Plan:
    return _Plan(*_layout(tuple(bounds), chunk, device), tuple(bounds), chunk, scale, precision)


def _units(lens: torch.Tensor, size: int, device: torch.device) -> torch.Tensor:
    """[units, 2] int32: (sequence, index in it) of every unit of `size` tokens of sequences
    of lengths `lens`, sequence by sequence."""
    counts = (lens + size - 1) // size
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first = torch.cumsum(counts, 0) - counts
    return torch.stack((seq, torch.arange(int(counts.sum())) - first[seq]), dim=1).to(
        dtype=torch.int32, device=device).contiguous()


def _lengths(bounds: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])


# `_layout` and `_sub_blocks` are kept for the next call with the same boundaries: each copy to
# the GPU would wait for the work queued before it.
@functools.lru_cache(maxsize=64)
def _layout(bounds: tuple[int, ...], chunk: int, device: torch.device):
    """(cu, boff, chunk_idx, n_seq, n_chunks) of a packed batch in chunks of `chunk` tokens."""
    lens = _lengths(bounds)
    n_chunks = (lens + chunk - 1) // chunk
    as_int = {"dtype": torch.int32, "device": device}
    return (torch.tensor(bounds, **as_int), (torch.cumsum(n_chunks, 0) - n_chunks).to(**as_int),
            _units(lens, chunk, device), len(lens), int(n_chunks.sum()))


@functools.lru_cache(maxsize=64)
def _sub_blocks(bounds: tuple[int, ...], rows: int, device: torch.device) -> torch.Tensor:
    """[sub-blocks, 2] int32: (sequence, sub-block in it) of sub-blocks of `rows` tokens."""
    return _units(_lengths(bounds), rows, device)


def _precision(*inputs: torch.Tensor) -> str:
    """PREC of the kernels' tl.dot for these inputs (see `_dot` and `HALF_DOTS`)."""
    dtypes = {t.dtype for t in inputs}
    if dtypes == {torch.float32}:
        return "ieee"
    if HALF_DOTS and len(dtypes) == 1:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtypes.pop()]
    return "tf32"


def _saved_dtype(precision: str) -> torch.dtype:
    """dtype of the probabilities p, dS and c the kernels hand each other: that of the
    inputs when they are all bf16 or all fp16 (PREC "bf16" / "fp16"), else fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def _rows(kernel: str, chunk: int) -> int:
    """BC, the rows of a sub-block of sub-block kernel `kernel` (`SUB_ROWS`) in chunks of
    `chunk` tokens."""
    return min(SUB_ROWS[kernel], chunk)


def _diag3(kernel: str, M: int, rows: int) -> bool:
    """Whether sub-block kernel `kernel` takes its diagonal blocks of `rows` × `rows` tokens in
    one step (`DIAG_3D`)."""
    return kernel in DIAG_3D and rows * rows * _pad(M) <= DIAG_3D_MAX


def _state_blocks(M: int, D: int) -> tuple[int, int]:
    return min(64, _pad(M)), min(64, _pad(D))


def _warps(kernel: str, *blocks: int, whole: bool = False) -> int:
    """A sub-block kernel's `SUB_WARPS` (with whole, its `WHOLE_WARPS`) for its widest tile
    side; a chunk kernel's or a scan's 4 warps for small tiles, else 8 (with 4, the earlier
    scans' tiles of 64 × 64 took longer on an H100)."""
    table = WHOLE_WARPS if whole else SUB_WARPS
    if kernel in table:
        return table[kernel][max(blocks) > 64]
    return 4 if max(blocks) <= 32 else 8


def _sub_launches(kernel: str, plan: _Plan, K: int, V: int,
                  M: int) -> list[tuple[torch.Tensor, dict]]:
    """The launches of sub-block kernel `kernel`: each its units ([units, 2], `_units`: its
    grid's first axis and its sub_idx argument) and its tile sizes, precision and launch
    choices. A kernel of `WHOLE_CHUNKS` at a precision of `WHOLE_PRECISIONS`: the chunks exact
    as factors whole, then the others' sub-blocks (UNITS "whole", "rest": `_takes`); else
    every sub-block ("sub")."""
    rows = _rows(kernel, plan.chunk)
    blocks = {"BK": _pad(K), "BV": _pad(V), "BM": _pad(M), "BT": plan.chunk,
              "PREC": plan.precision}
    either = "either" if kernel in FACTOR_DIAG else "tokens"
    whole_too = kernel in WHOLE_CHUNKS and plan.precision in WHOLE_PRECISIONS
    sub = (_sub_blocks(plan.bounds, rows, plan.cu.device),
           {**blocks, "BC": rows, "DIAG3": _diag3(kernel, M, rows),
            "OWN": "tokens" if kernel == "_bwd_dkv" else either,
            "UNITS": "rest" if whole_too else "sub",
            "num_warps": _warps(kernel, _pad(K), _pad(V), _pad(M))})
    whole = (plan.chunk_idx, {**blocks, "BC": plan.chunk, "DIAG3": False, "OWN": "factors",
                              "UNITS": "whole",
                              "num_warps": _warps(kernel, _pad(K), _pad(V), _pad(M), whole=True)})
    if kernel == "_bwd_dkv":  # the SIDES of each launch (`_bwd_dkv`)
        sub[1]["SIDES"] = (1, 2) if SPLIT_DKV else (0,)
        whole[1]["SIDES"] = (1, 2) if WHOLE_SPLIT_DKV else (0,)
    return [whole, sub] if whole_too else [sub]


def _forward(q, k, v, s, lz0, k0, v0, plan: _Plan, reset: bool = False):
    """q [T, H, K], k [T, H, K], v [T, H, V], s [T, H, M] packed; initial state fp32 or None
    (lz0 None with reset: `_fwd_scan`'s RESET)."""
    T, H, K = q.shape
    V, M = v.shape[-1], s.shape[-1]
    N, NT, BT, prec = plan.n_seq, plan.n_chunks, plan.chunk, plan.precision
    f32 = {"dtype": torch.float32, "device": q.device}
    lc, r = torch.empty(T, H, M, **f32), torch.empty(NT, H, M, **f32)
    zprev, zend = torch.empty(NT, H, M, **f32), torch.empty(NT, H, M, **f32)
    hk, hv = torch.empty(NT, H, M, K, **f32), torch.empty(NT, H, M, V, **f32)
    lzT = torch.empty(N, H, M, **f32)
    kT, vT = torch.empty(N, H, M, K, **f32), torch.empty(N, H, M, V, **f32)
    has_init = k0 is not None
    for x, x0, h, xT, first in ((k, k0, hk, kT, True), (v, v0, hv, vT, False)):
        D = x.shape[-1]
        BM, BD = _state_blocks(M, D)
        tiles = triton.cdiv(D, BD) * triton.cdiv(M, BM)
        _fwd_chunks[(NT, tiles, H)](x, s, lc, r, h, xT, plan.cu, plan.chunk_idx, H, M, D,
                                    STORE_LC=first, BT=BT, BM=BM, BD=BD, PREC=prec,
                                    num_warps=_warps("_fwd_chunks", BT, BM, BD))
        grid = (triton.cdiv(D, BD), triton.cdiv(M, BM), N * H)
        _fwd_scan[grid](lzT if lz0 is None else lz0, x0 if has_init else xT, r, zprev, zend, h,
                        lzT, xT, plan.cu, plan.boff, H, M, D, HAS_INIT=has_init, STORE_Z=first,
                        BT=BT, BM=BM, BD=BD, STAGES=scan_stages(STATE_STAGES), RESET=reset,
                        num_warps=_warps("_fwd_scan", BM, BD))
    o = torch.empty(T, H, V, dtype=q.dtype, device=q.device)
    p = torch.empty(T, H, M, dtype=_saved_dtype(prec), device=q.device)
    lse = torch.empty(T, H, **f32)
    for units, launch in _sub_launches("_fwd_output", plan, K, V, M):
        _fwd_output[(units.shape[0], H)](q, k, v, s, lc, zprev, hk, hv, o, p, lse, plan.cu,
                                         plan.boff, units, plan.scale, H, K, V, M, **launch)
    return o, (lzT, kT, vT), (lc, zprev, zend, hk, hv, p, lse)


def _backward(q, k, v, s, do, saved, final, dfinal, plan: _Plan, reset: bool = False):
    """Gradients of q, k, v, s and of the initial memories; dfinal = (dlz, dK̃, dṼ) or None.
    reset: the forward ran with RESET (then dc0 is not a gradient: log_z_0 is not an input)."""
    lc, zprev, zend, hk, hv, p, lse = saved
    T, H, K = q.shape
    V, M = v.shape[-1], s.shape[-1]
    N, NT, BT, prec = plan.n_seq, plan.n_chunks, plan.chunk, plan.precision
    f32 = {"dtype": torch.float32, "device": q.device}
    dq = torch.empty_like(q)
    dS, c = (torch.empty(T, H, M, dtype=_saved_dtype(prec), device=q.device) for _ in range(2))
    for units, launch in _sub_launches("_bwd_dq", plan, K, V, M):
        _bwd_dq[(units.shape[0], H)](q, k, v, s, lc, zprev, hk, hv, p, lse, do, dq, dS, c,
                                     plan.cu, plan.boff, units, plan.scale, H, K, V, M, **launch)

    dcT = None
    if dfinal is not None:
        dlzT, dkT, dvT = dfinal
        _, kT, vT = final
        dcT = ((kT * dkT).sum(-1) + (vT * dvT).sum(-1) - dlzT).contiguous()
    dhk, dhv = torch.empty(NT, H, M, K, **f32), torch.empty(NT, H, M, V, **f32)
    dhc = torch.empty(NT, H, M, **f32)
    dk0, dv0, dc0 = (torch.empty(N, H, M, K, **f32), torch.empty(N, H, M, V, **f32),
                     torch.empty(N, H, M, **f32))
    dkT, dvT = (None, None) if dfinal is None else dfinal[1:]
    for x, coef, dxT, dh, dx0, is_v in ((q, dS, dkT, dhk, dk0, False),
                                        (do, p, dvT, dhv, dv0, True)):
        D = x.shape[-1]
        BM, BD = _state_blocks(M, D)
        tiles = triton.cdiv(D, BD) * triton.cdiv(M, BM)
        _bwd_chunks[(NT, tiles, H)](x, coef, c, lc, zprev, dh, dhc, dx0, dc0, plan.cu,
                                    plan.chunk_idx, plan.scale, H, M, D, IS_V=is_v, BT=BT, BM=BM,
                                    BD=BD, PREC=prec, num_warps=_warps("_bwd_chunks", BT, BM, BD))
        grid = (triton.cdiv(D, BD), triton.cdiv(M, BM), N * H)
        _bwd_scan[grid](zprev, zend, dx0 if dxT is None else dxT, dc0 if dcT is None else dcT,
                        dh, dhc, dx0, dc0, plan.cu, plan.boff, H, M, D, IS_V=is_v,
                        HAS_DFINAL=dfinal is not None, BT=BT, BM=BM, BD=BD,
                        STAGES=scan_stages(STATE_STAGES), num_warps=_warps("_bwd_scan", BM, BD))

    if reset:
        # The next chunk reads the memory after a chunk, not its log_z: log_z's gradient there
        # is 0, so c after the chunk is K̃·∂L/∂K̃ + Ṽ·∂L/∂Ṽ of that memory alone.
        after = _after_chunks(plan)
        dhc = ((torch.cat((hk, final[1]))[after] * dhk).sum(-1)
               + (torch.cat((hv, final[2]))[after] * dhv).sum(-1))
    dk, dv, ds = torch.empty_like(k), torch.empty_like(v), torch.empty_like(s)
    launches = _sub_launches("_bwd_dkv", plan, K, V, M)
    split = any(len(launch["SIDES"]) > 1 for _, launch in launches)
    ds_part = torch.empty(T, H, M, **f32) if split else ds
    for units, launch in launches:
        for sides in launch.pop("SIDES"):
            _bwd_dkv[(units.shape[0], H)](q, k, v, s, lc, zprev, zend, p, do, dS, c, dhk, dhv,
                                          dhc, dk, dv, ds, ds_part, plan.cu, plan.boff, units,
                                          plan.scale, H, K, V, M, SIDES=sides, **launch)
    return dq, dk, dv, ds, (dc0, dk0, dv0)


def _after_chunks(plan: _Plan) -> torch.Tensor:
    """[chunks] where the memory after each chunk lies in the chunk-start memories [chunks]
    followed by the final ones [N]: the next chunk's start, or its sequence's final memory."""
    NT, N = plan.n_chunks, plan.n_seq
    after = torch.arange(1, NT + 1, device=plan.boff.device)
    last = torch.cat((plan.boff[1:].long(), after[-1:])) - 1  # each sequence's last chunk
    after[last] = torch.arange(NT, NT + N, device=plan.boff.device)
    return after


class _ABCChunk(torch.autograd.Function):
    """Packed inputs [T, H, D] and fp32 initial state tensors (or None) -> o [T, H, V] and
    the final state (log_z, K̃, Ṽ), all differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, s, lz0, k0, v0, plan: _Plan):
        ctx.set_materialize_grads(False)
        o, final, saved = _forward(q, k, v, s, lz0, k0, v0, plan)
        ctx.save_for_backward(q, k, v, s, k0, v0, *final, *saved)
        ctx.plan, ctx.has_init = plan, lz0 is not None
        return (o, *final)

    @staticmethod
    def backward(ctx, do, dlzT, dkT, dvT):
        q, k, v, s, k0, v0, lzT, kT, vT, *saved = ctx.saved_tensors
        dfinal = None
        if any(g is not None for g in (dlzT, dkT, dvT)):
            dfinal = tuple(torch.zeros_like(x) if g is None else g.float().contiguous()
                           for g, x in ((dlzT, lzT), (dkT, kT), (dvT, vT)))
        if do is None:
            do = torch.zeros(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
        dq, dk, dv, ds, (dc0, dk0, dv0) = _backward(q, k, v, s, do.contiguous(), saved,
                                                    (lzT, kT, vT), dfinal, ctx.plan)
        dinit = (None, None, None)
        if ctx.has_init:
            # log_z_0 is the logit of the initial memory, read like a token's s.
            dlz0 = (k0 * dk0).sum(-1) + (v0 * dv0).sum(-1) - dc0
            dinit = (dlz0, dk0, dv0)
        return dq, dk, dv, ds, *dinit, None


def abc_chunk_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, *,
                     scale: float | None = None, initial_state: ABCState | None = None,
                     output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                     chunk_size: int = 64) -> tuple[torch.Tensor, ABCState | None]:
    """Causal ABC_MLP with the Triton kernels; the contract of `abc_chunked(causal=True)`.

    q [B, T, H, K], k [B, T, H, K], v [B, T, H, V], s [B, T, H, M] slot logits, in
    float32, float16 or bfloat16 (fp32 accumulation); K, V, M ≤ 128.
    initial_state: ABCState (log_z [B, H, M], k [B, H, M, K], v [B, H, M, V]) or None.
    cu_seqlens: [N + 1] integer boundaries of N sequences packed as B = 1; then the initial
    and final states have batch N and every sequence starts from its own.
    chunk_size: tokens per chunk of the memory recurrence, a power of two ≥ 16.
    Returns o [B, T, H, V] in q's dtype and, if output_final_state, the ABCState (float32)
    after the last token (of every sequence). Differentiable in q, k, v, s, the initial
    state and through the final state.
    """
    if cu_seqlens is None:
        B, _, T, H, K, V, M = check_inputs(q, k, v, s, "s", True, initial_state, ABCState)
        bounds = list(range(0, B * T + 1, T))
    else:
        bounds = check_varlen(q, k, v, s, cu_seqlens, initial_state)
        B, T, H, K = q.shape
        V, M = v.shape[-1], s.shape[-1]
    if not isinstance(chunk_size, int) or chunk_size < MIN_CHUNK or chunk_size & (chunk_size - 1):
        raise ConfigError(f"chunk_size: expected a power of two ≥ {MIN_CHUNK}, "
                          f"got {chunk_size!r}")
    named = {"q": q, "k": k, "v": v, "s": s,
             **{f"initial_state.{f}": t for f, t in zip(ABCState._fields, initial_state or ())}}
    for name, t in named.items():
        if not kernels_supported(t):
            raise ShapeError(f"{name}: the Triton kernels need CUDA tensors (or CPU tensors with "
                             f"TRITON_INTERPRET=1), got one on {t.device}")
        if t.dtype not in KERNEL_DTYPES:
            raise ShapeError(f"{name}: the Triton kernels take float32, float16 or bfloat16, "
                             f"got {t.dtype}")
    for name, size in (("K", K), ("V", V), ("M", M)):
        if size > MAX_DIM:
            raise ShapeError(f"q: the Triton kernels take {name} ≤ {MAX_DIM}, got {name}={size}")

    plan = _plan(bounds, chunk_size, default_scale(scale, K), _precision(q, k, v, s),
                 q.device)
    packed = [x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, v, s)]
    init = (None, None, None) if initial_state is None else \
        tuple(t.float().contiguous() for t in initial_state)
    o, lzT, kT, vT = _ABCChunk.apply(*packed, *init, plan)
    state = ABCState(lzT, kT, vT) if output_final_state else None
    return o.view(B, T, H, V), state


__all__ = ["abc_chunk_triton"]
