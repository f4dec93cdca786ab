"""Chunked causal linear attention with α / β gates in Triton, forward and backward.

The math is that of memattn/ops/linear/chunked.py and backward.py, with S = Cᵀ [K, V]:
S_t = α_t S_{t-1} + β_t k_t v_tᵀ, o_t = scale · S_tᵀ q_t. Split T into N chunks of C
steps; inside a chunk (local t, i; S the state at its start)

    o_t   = scale · (Σ_{i≤t} D[t, i] β_i (q_t·k_i) v_i + g_t Sᵀ q_t)
    S_end = g_{C-1} S + Σ_i D[C-1, i] β_i k_i v_iᵀ

with D[t, i] = Π_{i<l≤t} α_l and g_t = Π_{l≤t} α_l.

Gates in log space, with resets. Within a chunk, x_l = log α_l (0 where α_l = 0),
b = cumsum(x) and z = cumsum(α = 0) counts the resets. Then D[t, i] = exp(b_t − b_i) where
i ≤ t and z_t = z_i (no zero gate in (i, t]) and exactly 0 otherwise; g_t = exp(b_t) if
z_t = 0. Nothing subtracts two infinite logs, so a zero gate is an exact reset, never NaN.

Kernels (fp32 accumulation; for fp16 / bf16 inputs on the GPU the matmuls that make o, S,
G, dq, dk, dv take their operands in the input dtype; those that feed dα, dβ stay fp32):

    _states_kernel       grid (⌈K/BK⌉, ⌈V/BV⌉, B·H)  scan over chunks: S at every chunk
                                                      start [B, H, N, K, V] and S_T
    _output_kernel       grid (⌈V/BV⌉, N, B·H)        o of one chunk from its start state
    _grad_states_kernel  grid (⌈K/BK⌉, ⌈V/BV⌉, B·H)  reverse scan: G = ∂L/∂S at every chunk
                                                      end (G_{t-1} = α_t G_t + scale q do ᵀ
                                                      at step t-1)
    _grads_kernel        grid (N, B·H)                dq, dk, dv, dα, dβ of one chunk

Saved for backward: q, k, v, α, β and S_0 only, O(T·(K+V) + K·V). The backward recomputes
the chunk-start states with _states_kernel (one more scan) rather than keeping the
N·K·V numbers of the forward; both [B, H, N, K, V] buffers live only inside one call.
dα_t = <G_t, S_{t-1}> is summed term by term from the chunk's matrices and never divides
by α, so gates that are exactly 0 get exact gradients. K and V are compile-time constants
(one compilation per head size); T is not.
"""

from __future__ import annotations

import torch

from memattn.errors import ConfigError
from memattn.kernels import scan_stages
from memattn.ops.linear.common import (LinearAttentionState, check_alpha_values, check_inputs,
                                       resolve_scale)

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch forms work without triton
    triton = None

DEFAULT_CHUNK_SIZE = 64


if triton is not None:

    @triton.jit
    def _chunk_gates(alpha_ptr, beta_ptr, b, h, n, T, H,
                     BT: tl.constexpr, HAS_ALPHA: tl.constexpr, HAS_BETA: tl.constexpr):
        """Gates of chunk n: (b = cumsum log α, z = resets so far, x = log α, reset, β),
        each [BT]; log α is 0 at a reset and at the padding past T (α = 1 there)."""
        ot = n * BT + tl.arange(0, BT)
        mt = ot < T
        off = b * T * H + ot * H + h
        if HAS_ALPHA:
            a = tl.load(alpha_ptr + off, mask=mt, other=1.0).to(tl.float32)
        else:
            a = tl.full([BT], 1.0, tl.float32)
        reset = a <= 0.0
        x = tl.where(reset, 0.0, tl.log(tl.where(reset, 1.0, a)))
        cum = tl.cumsum(x, axis=0)
        zeros = tl.cumsum(tl.where(reset, 1, 0), axis=0)
        if HAS_BETA:
            beta = tl.load(beta_ptr + off, mask=mt, other=0.0).to(tl.float32)
        else:
            beta = tl.where(mt, 1.0, 0.0)
        return cum, zeros, x, reset, beta

    @triton.jit
    def _chunk_ends(cum, zeros, BT: tl.constexpr):
        """(to_end [BT]: Π α from after i to the chunk end, total: Π α over the chunk)."""
        last = tl.arange(0, BT) == BT - 1
        cum_last = tl.sum(tl.where(last, cum, 0.0), axis=0)
        zeros_last = tl.sum(tl.where(last, zeros, 0), axis=0)
        to_end = tl.where(zeros == zeros_last, tl.exp(cum_last - cum), 0.0)
        total = tl.where(zeros_last == 0, tl.exp(cum_last), 0.0)
        return to_end, total

    @triton.jit
    def _decay_matrix(row_cum, row_zeros, cum, zeros, STRICT: tl.constexpr, BT: tl.constexpr):
        """[BT, BT] with [t, i] = exp(row_cum_t − cum_i) where i ≤ t (i < t if STRICT) and
        row_zeros_t = zeros_i, else 0."""
        o = tl.arange(0, BT)
        if STRICT:
            keep = (o[:, None] > o[None, :]) & (row_zeros[:, None] == zeros[None, :])
        else:
            keep = (o[:, None] >= o[None, :]) & (row_zeros[:, None] == zeros[None, :])
        return tl.where(keep, tl.exp(tl.where(keep, row_cum[:, None] - cum[None, :], 0.0)), 0.0)

    @triton.jit
    def _rows(ptr, row, mt, od, D: tl.constexpr, LOWP: tl.constexpr):
        """Rows `row` (valid where mt) of a [B, T, H, D] tensor at columns od -> [BT, BD],
        0 outside: in the input dtype if LOWP (a matmul operand on the GPU), else fp32."""
        x = tl.load(ptr + row[:, None] * D + od[None, :], mask=mt[:, None] & (od[None, :] < D),
                    other=0.0)
        if not LOWP:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _block(ptr, base, ok, ov, K: tl.constexpr, V: tl.constexpr):
        """The [BK, BV] block (ok, ov) of the fp32 [K, V] state at `base`, 0 outside."""
        return tl.load(ptr + base + ok[:, None] * V + ov[None, :],
                       mask=(ok[:, None] < K) & (ov[None, :] < V), other=0.0)

    @triton.jit
    def _put_block(ptr, base, x, ok, ov, K: tl.constexpr, V: tl.constexpr):
        tl.store(ptr + base + ok[:, None] * V + ov[None, :], x,
                 mask=(ok[:, None] < K) & (ov[None, :] < V))

    @triton.jit
    def _operand(x, like_ptr, LOWP: tl.constexpr):
        """An fp32 tile as a matmul operand: in the dtype of `like_ptr` if LOWP."""
        if LOWP:
            x = x.to(like_ptr.dtype.element_ty)
        return x

    @triton.jit
    def _chunk_rows(b, h, n, T, H, BT: tl.constexpr):
        """(row index into [B·T·H] of each step of chunk n, step < T) -> [BT] each."""
        ot = n * BT + tl.arange(0, BT)
        return (b * T + ot) * H + h, ot < T

    @triton.jit
    def _scan_program(H, BK: tl.constexpr, BV: tl.constexpr):
        """(bh, b, h, ok, ov) of a program of grid (⌈K/BK⌉, ⌈V/BV⌉, B·H)."""
        bh = tl.program_id(2).to(tl.int64)  # offsets past 2**31 at long T
        ok = tl.program_id(0) * BK + tl.arange(0, BK)
        ov = tl.program_id(1) * BV + tl.arange(0, BV)
        return bh, bh // H, bh % H, ok, ov

    @triton.jit
    def _states_chunk(S, n, k_ptr, v_ptr, alpha_ptr, beta_ptr, hs_ptr, bh, b, h, ok, ov,
                      T, H, K: tl.constexpr, V: tl.constexpr, N, BT: tl.constexpr,
                      HAS_ALPHA: tl.constexpr, HAS_BETA: tl.constexpr, LOWP: tl.constexpr):
        """Chunk n of `_states_kernel`: stores S at its start, returns S at its end."""
        _put_block(hs_ptr, (bh * N + n) * K * V, S, ok, ov, K, V)
        cum, zeros, _, _, beta = _chunk_gates(alpha_ptr, beta_ptr, b, h, n, T, H,
                                              BT, HAS_ALPHA, HAS_BETA)
        to_end, total = _chunk_ends(cum, zeros, BT)
        row, mt = _chunk_rows(b, h, n, T, H, BT)
        kw = _rows(k_ptr, row, mt, ok, K, False) * (to_end * beta)[:, None]  # [BT, BK]
        vc = _rows(v_ptr, row, mt, ov, V, LOWP)
        return total * S + tl.dot(tl.trans(_operand(kw, v_ptr, LOWP)), vc,
                                  input_precision="ieee")

    @triton.jit
    def _states_kernel(k_ptr, v_ptr, alpha_ptr, beta_ptr, h0_ptr, hs_ptr, ht_ptr,
                       T, H, K: tl.constexpr, V: tl.constexpr, N,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_ALPHA: tl.constexpr, HAS_BETA: tl.constexpr, HAS_H0: tl.constexpr,
                       LOWP: tl.constexpr, STAGES: tl.constexpr):
        """S at each chunk start -> hs [B, H, N, K, V]; S_T -> ht [B, H, K, V] (fp32).
        STAGES: see memattn.kernels.SCAN_STAGES."""
        bh, b, h, ok, ov = _scan_program(H, BK, BV)
        if HAS_H0:
            S = _block(h0_ptr, bh * K * V, ok, ov, K, V).to(tl.float32)
        else:
            S = tl.zeros([BK, BV], dtype=tl.float32)
        if STAGES > 0:
            for n in tl.range(0, N, num_stages=STAGES):
                S = _states_chunk(S, n, k_ptr, v_ptr, alpha_ptr, beta_ptr, hs_ptr, bh, b, h, ok,
                                  ov, T, H, K, V, N, BT, HAS_ALPHA, HAS_BETA, LOWP)
        else:
            n = 0
            while n < N:  # not range(N): the interpreter (numpy >= 2.4) cannot index by a runtime int
                S = _states_chunk(S, n, k_ptr, v_ptr, alpha_ptr, beta_ptr, hs_ptr, bh, b, h, ok,
                                  ov, T, H, K, V, N, BT, HAS_ALPHA, HAS_BETA, LOWP)
                n += 1
        _put_block(ht_ptr, bh * K * V, S, ok, ov, K, V)

    @triton.jit
    def _output_kernel(q_ptr, k_ptr, v_ptr, alpha_ptr, beta_ptr, hs_ptr, o_ptr, scale,
                       T, H, K: tl.constexpr, V: tl.constexpr, N,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_ALPHA: tl.constexpr, HAS_BETA: tl.constexpr, LOWP: tl.constexpr):
        """o of chunk n for one block of V columns -> o [B, T, H, V] (q's dtype)."""
        ov = tl.program_id(0) * BV + tl.arange(0, BV)
        n = tl.program_id(1)
        bh = tl.program_id(2).to(tl.int64)  # offsets past 2**31 at long T
        b = bh // H
        h = bh % H
        row, mt = _chunk_rows(b, h, n, T, H, BT)
        cum, zeros, _, _, beta = _chunk_gates(alpha_ptr, beta_ptr, b, h, n, T, H,
                                              BT, HAS_ALPHA, HAS_BETA)
        g = tl.where(zeros == 0, tl.exp(cum), 0.0)
        scores = tl.zeros([BT, BT], dtype=tl.float32)
        inter = tl.zeros([BT, BV], dtype=tl.float32)
        for ik in range(tl.cdiv(K, BK)):
            ok = ik * BK + tl.arange(0, BK)
            qc = _rows(q_ptr, row, mt, ok, K, LOWP)
            kc = _rows(k_ptr, row, mt, ok, K, LOWP)
            S = _operand(_block(hs_ptr, (bh * N + n) * K * V, ok, ov, K, V), q_ptr, LOWP)
            scores += tl.dot(qc, tl.trans(kc), input_precision="ieee")
            inter += tl.dot(qc, S, input_precision="ieee")
        scores = scores * _decay_matrix(cum, zeros, cum, zeros, False, BT) * beta[None, :]
        vc = _rows(v_ptr, row, mt, ov, V, LOWP)
        o = tl.dot(_operand(scores, v_ptr, LOWP), vc, input_precision="ieee")
        o = scale * (o + g[:, None] * inter)
        tl.store(o_ptr + row[:, None] * V + ov[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mt[:, None] & (ov[None, :] < V))

    @triton.jit
    def _grad_states_chunk(G, n, q_ptr, do_ptr, alpha_ptr, dhs_ptr, scale, bh, b, h, ok, ov,
                           T, H, K: tl.constexpr, V: tl.constexpr, N, BT: tl.constexpr,
                           HAS_ALPHA: tl.constexpr, LOWP: tl.constexpr):
        """Chunk n of `_grad_states_kernel`: stores G at its end, returns G before it."""
        _put_block(dhs_ptr, (bh * N + n) * K * V, G, ok, ov, K, V)
        cum, zeros, _, _, _ = _chunk_gates(alpha_ptr, alpha_ptr, b, h, n, T, H,
                                           BT, HAS_ALPHA, False)
        _, total = _chunk_ends(cum, zeros, BT)
        g = tl.where(zeros == 0, tl.exp(cum), 0.0)
        row, mt = _chunk_rows(b, h, n, T, H, BT)
        qg = _rows(q_ptr, row, mt, ok, K, False) * (scale * g)[:, None]
        doc = _rows(do_ptr, row, mt, ov, V, LOWP)
        return total * G + tl.dot(tl.trans(_operand(qg, do_ptr, LOWP)), doc,
                                  input_precision="ieee")

    @triton.jit
    def _grad_states_kernel(q_ptr, do_ptr, alpha_ptr, dht_ptr, dhs_ptr, dh0_ptr, scale,
                            T, H, K: tl.constexpr, V: tl.constexpr, N,
                            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            HAS_ALPHA: tl.constexpr, LOWP: tl.constexpr, STAGES: tl.constexpr):
        """G = ∂L/∂S at each chunk end -> dhs [B, H, N, K, V]; ∂L/∂S_0 -> dh0 (fp32).
        STAGES: see memattn.kernels.SCAN_STAGES."""
        bh, b, h, ok, ov = _scan_program(H, BK, BV)
        G = _block(dht_ptr, bh * K * V, ok, ov, K, V)
        if STAGES > 0:
            for i in tl.range(0, N, num_stages=STAGES):  # the chunks, last first
                G = _grad_states_chunk(G, N - 1 - i, q_ptr, do_ptr, alpha_ptr, dhs_ptr, scale, bh,
                                       b, h, ok, ov, T, H, K, V, N, BT, HAS_ALPHA, LOWP)
        else:
            n = N - 1
            while n >= 0:
                G = _grad_states_chunk(G, n, q_ptr, do_ptr, alpha_ptr, dhs_ptr, scale, bh, b, h,
                                       ok, ov, T, H, K, V, N, BT, HAS_ALPHA, LOWP)
                n -= 1
        _put_block(dh0_ptr, bh * K * V, G, ok, ov, K, V)

    @triton.jit
    def _grads_kernel(q_ptr, k_ptr, v_ptr, alpha_ptr, beta_ptr, do_ptr, hs_ptr, dhs_ptr,
                      dq_ptr, dk_ptr, dv_ptr, dalpha_ptr, dbeta_ptr, scale,
                      T, H, K: tl.constexpr, V: tl.constexpr, N,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_ALPHA: tl.constexpr, HAS_BETA: tl.constexpr,
                      NEED_DALPHA: tl.constexpr, LOWP: tl.constexpr):
        """dq, dk [B, T, H, K], dv [B, T, H, V] (input dtype), dα, dβ [B, T, H] (fp32) of
        chunk n, from its start state S (hs) and its end gradient G (dhs)."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        row, mt = _chunk_rows(b, h, n, T, H, BT)
        base = (bh * N + n) * K * V
        cum, zeros, x, reset, beta = _chunk_gates(alpha_ptr, beta_ptr, b, h, n, T, H,
                                                  BT, HAS_ALPHA, HAS_BETA)
        to_end, _ = _chunk_ends(cum, zeros, BT)
        g = tl.where(zeros == 0, tl.exp(cum), 0.0)
        D = _decay_matrix(cum, zeros, cum, zeros, False, BT)
        write = to_end * beta  # weight of k_i v_iᵀ in the chunk's end state

        # Pass 1 (fp32): the C×C products q·k, do·v and the contractions with S and G.
        qk = tl.zeros([BT, BT], dtype=tl.float32)
        for ik in range(tl.cdiv(K, BK)):
            ok = ik * BK + tl.arange(0, BK)
            qk += tl.dot(_rows(q_ptr, row, mt, ok, K, False),
                         tl.trans(_rows(k_ptr, row, mt, ok, K, False)), input_precision="ieee")
        dov = tl.zeros([BT, BT], dtype=tl.float32)
        qSdo = tl.zeros([BT], dtype=tl.float32)  # q_tᵀ S do_t
        kGv = tl.zeros([BT], dtype=tl.float32)  # k_iᵀ G v_i
        GS = 0.0  # <G, S>
        for iv in range(tl.cdiv(V, BV)):
            ov = iv * BV + tl.arange(0, BV)
            doc = _rows(do_ptr, row, mt, ov, V, False)
            vc = _rows(v_ptr, row, mt, ov, V, False)
            dov += tl.dot(doc, tl.trans(vc), input_precision="ieee")
            for ik in range(tl.cdiv(K, BK)):
                ok = ik * BK + tl.arange(0, BK)
                S = _block(hs_ptr, base, ok, ov, K, V)
                G = _block(dhs_ptr, base, ok, ov, K, V)
                qS = tl.dot(_rows(q_ptr, row, mt, ok, K, False), S, input_precision="ieee")
                kG = tl.dot(_rows(k_ptr, row, mt, ok, K, False), G, input_precision="ieee")
                qSdo += tl.sum(qS * doc, axis=1)
                kGv += tl.sum(kG * vc, axis=1)
                GS += tl.sum(G * S)

        reads = scale * qk * D  # [t, i] without β
        P = scale * dov * D * beta[None, :]  # [t, i]: dq_t = Σ_i P k_i, dk_i = Σ_t P q_t
        R = reads * beta[None, :]  # [t, i]: dv_i = Σ_t R do_t
        dbeta = tl.sum(reads * dov, axis=0) + to_end * kGv
        tl.store(dbeta_ptr + row, dbeta, mask=mt)
        if NEED_DALPHA:
            # dα_t = <G_t, S_{t-1}>, G_t = scale Σ_{j≥t} D[j, t] q_j do_jᵀ + to_end_t G and
            # S_{t-1} = Σ_{i<t} D[t-1, i] β_i k_i v_iᵀ + g_before_t S: four products.
            prev_zeros = zeros - tl.where(reset, 1, 0)
            prev_cum = cum - x
            g_before = tl.where(prev_zeros == 0, tl.exp(prev_cum), 0.0)
            D_before = _decay_matrix(prev_cum, prev_zeros, cum, zeros, True, BT)  # D[t-1, i]
            pairs = scale * qk * dov * beta[None, :]  # <q_j do_jᵀ, β_i k_i v_iᵀ>
            reads_reads = tl.sum(D * tl.dot(pairs, tl.trans(D_before), input_precision="ieee"),
                                 axis=0)
            reads_start = g_before * tl.sum(D * (scale * qSdo)[:, None], axis=0)
            end_writes = to_end * tl.sum(D_before * (beta * kGv)[None, :], axis=1)
            end_start = to_end * g_before * GS
            dalpha = reads_reads + reads_start + end_writes + end_start
            tl.store(dalpha_ptr + row, dalpha, mask=mt)

        # Pass 2: dq, dk by blocks of K.
        Pm = _operand(P, q_ptr, LOWP)
        for ik in range(tl.cdiv(K, BK)):
            ok = ik * BK + tl.arange(0, BK)
            dq = tl.dot(Pm, _rows(k_ptr, row, mt, ok, K, LOWP), input_precision="ieee")
            dk = tl.dot(tl.trans(Pm), _rows(q_ptr, row, mt, ok, K, LOWP), input_precision="ieee")
            for iv in range(tl.cdiv(V, BV)):
                ov = iv * BV + tl.arange(0, BV)
                S = _operand(_block(hs_ptr, base, ok, ov, K, V), do_ptr, LOWP)
                G = _operand(_block(dhs_ptr, base, ok, ov, K, V), do_ptr, LOWP)
                doc = _rows(do_ptr, row, mt, ov, V, LOWP)
                vc = _rows(v_ptr, row, mt, ov, V, LOWP)
                dq += (scale * g)[:, None] * tl.dot(doc, tl.trans(S), input_precision="ieee")
                dk += write[:, None] * tl.dot(vc, tl.trans(G), input_precision="ieee")
            tk_mask = mt[:, None] & (ok[None, :] < K)
            tl.store(dq_ptr + row[:, None] * K + ok[None, :], dq.to(dq_ptr.dtype.element_ty),
                     mask=tk_mask)
            tl.store(dk_ptr + row[:, None] * K + ok[None, :], dk.to(dk_ptr.dtype.element_ty),
                     mask=tk_mask)

        # Pass 3: dv by blocks of V.
        Rm = _operand(R, do_ptr, LOWP)
        for iv in range(tl.cdiv(V, BV)):
            ov = iv * BV + tl.arange(0, BV)
            dv = tl.dot(tl.trans(Rm), _rows(do_ptr, row, mt, ov, V, LOWP), input_precision="ieee")
            for ik in range(tl.cdiv(K, BK)):
                ok = ik * BK + tl.arange(0, BK)
                G = _operand(_block(dhs_ptr, base, ok, ov, K, V), k_ptr, LOWP)
                kG = tl.dot(_rows(k_ptr, row, mt, ok, K, LOWP), G, input_precision="ieee")
                dv += write[:, None] * kG
            tl.store(dv_ptr + row[:, None] * V + ov[None, :], dv.to(dv_ptr.dtype.element_ty),
                     mask=mt[:, None] & (ov[None, :] < V))


def _blocks(K: int, V: int, chunk_size: int, most: int = 64) -> dict:
    """Tile sizes: the chunk, and K / V blocks of at most `most` (at least 16, for tl.dot)."""
    return dict(BT=chunk_size, BK=min(most, max(16, triton.next_power_of_2(K))),
                BV=min(most, max(16, triton.next_power_of_2(V))))


def _lowp(q: torch.Tensor) -> bool:
    """Matmul operands in the input dtype: fp16 / bf16 on the GPU. The interpreter computes
    low-precision tl.dot wrongly, and fp32 inputs keep fp32 ("ieee") products."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _chunk_states(k, v, alpha, beta, initial_state, chunk_size):
    """(S at each chunk start [B, H, N, K, V], S_T [B, H, K, V]), both fp32."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    blocks = _blocks(K, V, chunk_size)
    N = triton.cdiv(T, chunk_size)
    hs = k.new_empty(B, H, N, K, V, dtype=torch.float32)
    ht = k.new_empty(B, H, K, V, dtype=torch.float32)
    grid = (triton.cdiv(K, blocks["BK"]), triton.cdiv(V, blocks["BV"]), B * H)
    _states_kernel[grid](k, v, alpha, beta, initial_state, hs, ht, T, H, K, V, N, **blocks,
                         HAS_ALPHA=alpha is not None, HAS_BETA=beta is not None,
                         HAS_H0=initial_state is not None, LOWP=_lowp(k), STAGES=scan_stages())
    return hs, ht


class LinearAttentionTriton(torch.autograd.Function):
    """(q, k, v, alpha, beta, initial_state, scale, chunk_size) -> (o, S_T), contiguous
    inputs in the layouts of `linear_attention`; S_T [B, H, K, V] in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, initial_state, scale, chunk_size):
        B, T, H, K = q.shape
        V = v.shape[-1]
        blocks = _blocks(K, V, chunk_size)
        hs, ht = _chunk_states(k, v, alpha, beta, initial_state, chunk_size)
        N = hs.shape[2]
        o = torch.empty_like(v, dtype=q.dtype)
        _output_kernel[(triton.cdiv(V, blocks["BV"]), N, B * H)](
            q, k, v, alpha, beta, hs, o, scale, T, H, K, V, N, **blocks,
            HAS_ALPHA=alpha is not None, HAS_BETA=beta is not None, LOWP=_lowp(q),
            num_warps=8)  # no register spills on sm_90 at C = 64, K = V = 128 (4 warps spill)
        ctx.save_for_backward(q, k, v, alpha, beta, initial_state)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, alpha, beta, initial_state = ctx.saved_tensors
        B, T, H, K = q.shape
        V = v.shape[-1]
        blocks = _blocks(K, V, ctx.chunk_size)
        do = do.to(q.dtype).contiguous()
        dht = dht.to(torch.float32).contiguous()
        hs, _ = _chunk_states(k, v, alpha, beta, initial_state, ctx.chunk_size)
        N = hs.shape[2]
        dhs = torch.empty_like(hs)
        dh0 = torch.empty_like(dht)
        _grad_states_kernel[(triton.cdiv(K, blocks["BK"]), triton.cdiv(V, blocks["BV"]), B * H)](
            q, do, alpha, dht, dhs, dh0, ctx.scale, T, H, K, V, N, **blocks,
            HAS_ALPHA=alpha is not None, LOWP=_lowp(q), STAGES=scan_stages())
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dalpha = q.new_empty(B, T, H, dtype=torch.float32)
        dbeta = q.new_empty(B, T, H, dtype=torch.float32)
        need_dalpha = alpha is not None and ctx.needs_input_grad[3]
        # Eight C×C fp32 matrices live at once: smaller K / V tiles and 8 warps keep the
        # register spills of sm_90 small (ptxas -v: 1.6 KB at C = 64, K = V = 128).
        _grads_kernel[(N, B * H)](
            q, k, v, alpha, beta, do, hs, dhs, dq, dk, dv, dalpha, dbeta, ctx.scale,
            T, H, K, V, N, **_blocks(K, V, ctx.chunk_size, most=32),
            HAS_ALPHA=alpha is not None, HAS_BETA=beta is not None, NEED_DALPHA=need_dalpha,
            LOWP=_lowp(q), num_warps=8)
        return (dq, dk, dv,
                dalpha.to(alpha.dtype) if need_dalpha else None,
                None if beta is None else dbeta.to(beta.dtype),
                None if initial_state is None else dh0.to(initial_state.dtype),
                None, None)


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16 \
            or chunk_size & (chunk_size - 1):
        raise ConfigError(f"chunk_size: expected a power of two >= 16 (tl.dot tiles), "
                          f"got {chunk_size!r}")


def linear_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                            alpha: torch.Tensor | None = None, beta: torch.Tensor | None = None,
                            scale: float | None = None,
                            initial_state: LinearAttentionState | None = None,
                            output_final_state: bool = False,
                            chunk_size: int = DEFAULT_CHUNK_SIZE
                            ) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Causal `linear_attention` in Triton: C_t = α_t C_{t-1} + β_t v_t k_tᵀ, o_t = scale·C_t q_t.

    q [B, T, H, K], k [B, T, H, K], v [B, T, H, V] (one of float32, float16, bfloat16);
    alpha, beta [B, T, H] (alpha >= 0, default 1); scale: None for 1; initial_state a
    LinearAttentionState (kv [B, H, K, V]). Returns o [B, T, H, V] in q's dtype and, if
    output_final_state, the LinearAttentionState after the last token (kv in float32), else
    None. Differentiable in every input and through the final state; the backward keeps
    only the inputs (see the module docstring).
    chunk_size: a power of two >= 16.
    """
    from memattn.kernels.abc_decode import check_kernel_inputs

    check_inputs(q, k, v, causal=True, alpha=alpha, beta=beta, initial_state=initial_state)
    kv0 = None if initial_state is None else initial_state.kv
    check_kernel_inputs("linear_attention_triton", {"q": q, "k": k, "v": v, "alpha": alpha,
                                                    "beta": beta, "initial_state.kv": kv0},
                        autograd=True)
    check_alpha_values(alpha)
    check_chunk_size(chunk_size)
    q, k, v, alpha, beta, kv0 = (None if t is None else t.contiguous()
                                 for t in (q, k, v, alpha, beta, kv0))
    o, kv = LinearAttentionTriton.apply(q, k, v, alpha, beta, kv0, resolve_scale(scale), chunk_size)
    return o, (LinearAttentionState(kv) if output_final_state else None)


__all__ = ["DEFAULT_CHUNK_SIZE", "LinearAttentionTriton", "linear_attention_triton"]
