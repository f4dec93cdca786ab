"""A backward pass that never stores the T intermediate states C_t.

With S_t = α_t S_{t-1} + β_t k_t v_tᵀ (S = Cᵀ, [K, V]) and o_t = scale · S_tᵀ q_t, the
gradient G_t = ∂L/∂S_t runs backwards, G_t = α_{t+1} G_{t+1} + scale · q_t do_tᵀ, and

    dq_t = scale · S_t do_t        dk_t = β_t G_t v_t        dv_t = β_t G_tᵀ k_t
    dβ_t = k_tᵀ G_t v_t            dα_t = <G_t, S_{t-1}>     dS_0 = α_1 G_1

Everything is computed chunk by chunk with C×C matmuls (chunked.py); only the state at
each chunk start and G at each chunk end are needed, and they are rebuilt, not stored:

- basic and β-only forms (alpha None): S at the chunk starts comes from a forward prefix
  scan from S_0 and G from a backward suffix scan of scale · q doᵀ. Saved: q, k, v, β
  and S_0, O(T·(K+V) + K·V).
- α/β forms, "invert": S at each chunk start is rebuilt backwards from the final state by
  inverting the chunk's update, S_start = (S_end − Σ_i D[C-1, i] β_i k_i v_iᵀ) / Π_chunk α
  (the per-step inversion S_{t-1} = (S_t − β_t k_t v_tᵀ) / α_t composed over a chunk).
  Saved: q, k, v, α, β and S_T, O(T·(K+V) + K·V). Caveat: the rebuilt states carry the
  rounding error of S_T amplified by 1 / Π α over the steps inverted.
- α/β forms, "checkpoint": the forward keeps the state at every chunk start and the
  backward recomputes inside each chunk. Saved: O(T·(K+V) + (T/C)·K·V). Exact.
- "auto" (the default) inverts unless any α < ALPHA_MIN or some suffix of chunks has
  1 / Π α > MAX_AMPLIFICATION[dtype], where it checkpoints. Gates that decay much over the
  sequence (e.g. α ≈ 0.95 for hundreds of steps) therefore checkpoint.
- not causal: one memory S_T is read by all queries; saved q, k, v, α, β, S_0 and S_T, and
  dα comes from a scalar scan r_t = <G, S_{t-1}> = α_{t-1} r_{t-1} + β_{t-1} k_{t-1}ᵀ G v_{t-1}.

dα never divides by α (the terms of <G_t, S_{t-1}> are summed directly), so gates that are
exactly 0 get exact gradients.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from memattn.ops.linear.chunked import (DEFAULT_CHUNK_SIZE, check_chunk_size,
                                        chunked_forward_heads, final_state_heads)
from memattn.errors import ConfigError
from memattn.ops.contract import accumulation_dtype
from memattn.ops.linear.common import (LinearAttentionState, check_alpha_values, check_inputs,
                                       chunk_decays, from_chunks, heads_first, log_alpha,
                                       no_decays, resolve_scale, shift_down, suffix_decays, to_chunks)

ALPHA_MIN = 1e-3
# Largest 1 / Π α allowed through an inversion, by accumulation dtype: about eps · 1e2
# (fp32: ~1e-5) or eps · 1e6 (fp64: ~2e-10) of relative error in the rebuilt states.
MAX_AMPLIFICATION = {torch.float32: 1e2, torch.float64: 1e6}
STATE_MODES = ("auto", "invert", "checkpoint")


def choose_state_mode(alpha: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      dtype: torch.dtype | None = None) -> str:
    """Pick "invert" or "checkpoint" for gates alpha [B, T, H] >= 0 (one host sync).

    dtype: the accumulation dtype (default: that of alpha). Inverting from the end back to
    chunk c multiplies errors by exp(-Σ_{j ≥ start of c} log α_j); the largest such factor
    over all chunk starts, batches and heads must stay within MAX_AMPLIFICATION.
    """
    dt = accumulation_dtype(dtype or alpha.dtype)
    if bool((alpha < ALPHA_MIN).any()):
        return "checkpoint"
    x = log_alpha(heads_first(alpha, dt))  # [B, H, T]
    from_start = x.flip(-1).cumsum(-1).flip(-1)[..., ::chunk_size]  # [B, H, N]
    worst = (-from_start).max().item()
    return "invert" if worst <= math.log(MAX_AMPLIFICATION[dt]) else "checkpoint"


def causal_backward_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          x: torch.Tensor | None, beta: torch.Tensor | None,
                          do: torch.Tensor, dS: torch.Tensor, scale: float, chunk_size: int,
                          mode: str, saved_state: torch.Tensor | None, need_dalpha: bool):
    """Gradients of the causal form, heads first, in the accumulation dtype.

    q, k [B, H, T, K], v, do [B, H, T, V], x = log α [B, H, T] or None, beta [B, H, T] or
    None, dS = ∂L/∂S_T [B, H, K, V]. mode "prefix": saved_state is S_0 [B, H, K, V] or
    None; "invert": S_T [B, H, K, V]; "checkpoint": chunk-start states [B, H, N, K, V].
    Returns dq [B, H, T, K], dk [B, H, T, K], dv [B, H, T, V], dα [B, H, T] or None,
    dβ [B, H, T] or None (without β), dS_0 [B, H, K, V].
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    qc, kc, vc, doc = (to_chunks(t, chunk_size) for t in (q, k, v, do))  # [B, H, N, C, *]
    N = qc.shape[2]
    bc = to_chunks(q.new_ones(B, H, T) if beta is None else beta, chunk_size)  # [B, H, N, C]
    dec = (no_decays(q, B, H, N, chunk_size) if x is None  # ungated: no exponentials
           else chunk_decays(to_chunks(x, chunk_size)))
    write = dec.to_end * bc  # [B, H, N, C]: weight of k_i v_iᵀ in the chunk's end state

    # G at each chunk end, scanning back from dS: the reads of a chunk add scale · Σ g_t q_t do_tᵀ.
    sent_back = scale * (qc * dec.g[..., None]).mT @ doc  # [B, H, N, K, V]
    G_end = [None] * N
    G = dS
    for c in reversed(range(N)):
        G_end[c] = G
        G = sent_back[:, :, c] + dec.total[:, :, c, None, None] * G
    dS0 = G
    G_end = torch.stack(G_end, dim=2)  # [B, H, N, K, V]

    # S at each chunk start.
    if mode == "checkpoint":
        starts = saved_state
    else:
        increments = (kc * write[..., None]).mT @ vc  # [B, H, N, K, V]
        starts = [None] * N
        if mode == "prefix":
            S = q.new_zeros(B, H, K, V) if saved_state is None else saved_state
            for c in range(N):
                starts[c] = S
                S = dec.total[:, :, c, None, None] * S + increments[:, :, c]
        elif mode == "invert":
            S = saved_state
            for c in reversed(range(N)):
                S = (S - increments[:, :, c]) / dec.total[:, :, c, None, None]
                starts[c] = S
        else:
            raise ConfigError(f"mode: expected prefix, invert or checkpoint, got {mode!r}")
        starts = torch.stack(starts, dim=2)  # [B, H, N, K, V]

    qk = qc @ kc.mT  # [B, H, N, C, C]  q_t·k_i
    dov = doc @ vc.mT  # [B, H, N, C, C]  do_t·v_i
    by_key = bc[..., None, :]  # β_i along the key axis
    reads = scale * qk * dec.D  # [B, H, N, C, C]  without β
    P = scale * dov * dec.D * by_key  # [B, H, N, C, C]
    kG = kc @ G_end  # [B, H, N, C, V]  k_iᵀ G_end
    vG = vc @ G_end.mT  # [B, H, N, C, K]  G_end v_i
    dq = P @ kc + scale * dec.g[..., None] * (doc @ starts.mT)
    dk = P.mT @ qc + write[..., None] * vG
    dv = (reads * by_key).mT @ doc + write[..., None] * kG
    kGv = (kG * vc).sum(-1)  # [B, H, N, C]  k_iᵀ G_end v_i
    dbeta = None if beta is None else (reads * dov).sum(-2) + dec.to_end * kGv

    dalpha = None
    if need_dalpha:
        # dα_t = <G_t, S_{t-1}>, with G_t = scale Σ_{j≥t} D[j, t] q_j do_jᵀ + to_end_t G_end and
        # S_{t-1} = Σ_{i<t} D[t-1, i] β_i k_i v_iᵀ + g_before_t S_start: four products.
        pairs = scale * qk * dov * by_key  # [B, H, N, C(j), C(i)]  <q_j do_jᵀ, β_i k_i v_iᵀ>
        D_before = shift_down(dec.D)  # [t, i] = D[t-1, i]
        reads_reads = (dec.D * (pairs @ D_before.mT)).sum(-2)
        y = scale * ((qc @ starts) * doc).sum(-1)  # [B, H, N, C]  <q_j do_jᵀ, S_start>
        reads_start = dec.g_before * (dec.D.mT @ y[..., None]).squeeze(-1)
        end_writes = dec.to_end * (D_before @ (bc * kGv)[..., None]).squeeze(-1)
        end_start = dec.to_end * dec.g_before * (G_end * starts).sum((-2, -1))[..., None]
        dalpha = from_chunks(reads_reads + reads_start + end_writes + end_start, T)

    return (from_chunks(dq, T), from_chunks(dk, T), from_chunks(dv, T), dalpha,
            None if dbeta is None else from_chunks(dbeta, T), dS0)


def exclusive_decayed_scan(x: torch.Tensor, u: torch.Tensor, r0: torch.Tensor,
                           chunk_size: int) -> torch.Tensor:
    """r_t = Σ_{i<t} (Π_{i<l<t} α_l) u_i + (Π_{l<t} α_l) r0, chunked, without dividing by α.

    x = log α [B, H, T], u [B, H, T], r0 [B, H] -> r [B, H, T].
    """
    T = x.shape[-1]
    dec = chunk_decays(to_chunks(x, chunk_size))
    uc = to_chunks(u, chunk_size)  # [B, H, N, C]
    local = (shift_down(dec.D) @ uc[..., None]).squeeze(-1)
    sums = (dec.to_end * uc).sum(-1)  # [B, H, N]
    rho, r = [], r0
    for c in range(uc.shape[2]):
        rho.append(r)
        r = dec.total[:, :, c] * r + sums[:, :, c]
    rho = torch.stack(rho, dim=-1)  # [B, H, N]
    return from_chunks(local + dec.g_before * rho[..., None], T)


def final_backward_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         x: torch.Tensor | None, beta: torch.Tensor | None, do: torch.Tensor,
                         dS: torch.Tensor, scale: float, S0: torch.Tensor | None,
                         S_T: torch.Tensor, chunk_size: int, need_dalpha: bool):
    """Gradients of the non-causal form (all queries read S_T), heads first.

    q [B, H, Tq, K], do [B, H, Tq, V], k [B, H, T, K], v [B, H, T, V], x, beta [B, H, T]
    or None, dS, S0, S_T [B, H, K, V] -> same tuple as causal_backward_heads.
    """
    B, H = q.shape[:2]
    G = dS + scale * q.mT @ do  # [B, H, K, V]
    dq = scale * do @ S_T.mT
    w, total = (None, None) if x is None else suffix_decays(x)  # [B, H, T], [B, H]
    weight = w if beta is None else (beta if w is None else w * beta)
    kG = k @ G  # [B, H, T, V]
    vG = v @ G.mT  # [B, H, T, K]
    kGv = (kG * v).sum(-1)  # [B, H, T]
    dk = vG if weight is None else weight[..., None] * vG
    dv = kG if weight is None else weight[..., None] * kG
    dbeta = kGv if w is None else w * kGv
    dS0 = G if total is None else total[..., None, None] * G
    dalpha = None
    if need_dalpha:
        s0 = q.new_zeros(B, H) if S0 is None else (G * S0).sum((-2, -1))
        u = kGv if beta is None else beta * kGv
        dalpha = w * exclusive_decayed_scan(x, u, s0, chunk_size)
    return dq, dk, dv, dalpha, dbeta, dS0


def _as_input(grad: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor | None:
    """A heads-first gradient [B, H, T, ...] back to the layout and dtype of its input."""
    return None if like is None else grad.transpose(1, 2).to(like.dtype)


class LinearAttentionFunction(torch.autograd.Function):
    """(q, k, v, alpha, beta, initial_state, scale, causal, chunk_size, state_mode) -> (o, S_T).

    Layouts as in `linear_attention`; S_T [B, H, K, V] in the accumulation dtype. Everything
    kept for backward goes through save_for_backward (so saved-tensor hooks see all of it).
    """

    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, initial_state, scale, causal, chunk_size, state_mode):
        dt = accumulation_dtype(q.dtype)
        qh, kh, vh, b = (heads_first(t, dt) for t in (q, k, v, beta))
        x = None if alpha is None else log_alpha(heads_first(alpha, dt))  # [B, H, T]
        S0 = None if initial_state is None else initial_state.to(dt)
        if causal:
            if alpha is None:
                mode = "prefix"
            elif state_mode == "auto":
                mode = choose_state_mode(alpha, chunk_size, dt)
            else:
                mode = state_mode
            o, S, starts = chunked_forward_heads(qh, kh, vh, x, b, S0, scale, chunk_size,
                                                 keep_starts=mode == "checkpoint")
            kept = {"prefix": (initial_state, None), "invert": (S, None),
                    "checkpoint": (starts, None)}[mode]
        else:
            mode = "final"
            S = final_state_heads(kh, vh, x, b, S0)
            o = scale * (qh @ S)
            kept = (initial_state if alpha is not None else None, S)
        ctx.save_for_backward(q, k, v, alpha, beta, *kept)
        ctx.mode, ctx.scale, ctx.causal, ctx.chunk_size = mode, scale, causal, chunk_size
        ctx.state_dtype = None if initial_state is None else initial_state.dtype
        return o.transpose(1, 2).contiguous().to(q.dtype), S

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dS):
        q, k, v, alpha, beta, kept_a, kept_b = ctx.saved_tensors
        dt = accumulation_dtype(q.dtype)
        qh, kh, vh, b, doh = (heads_first(t, dt) for t in (q, k, v, beta, do))
        x = None if alpha is None else log_alpha(heads_first(alpha, dt))
        need_dalpha = ctx.needs_input_grad[3]
        if ctx.causal:
            saved_state = None if kept_a is None else kept_a.to(dt)
            grads = causal_backward_heads(qh, kh, vh, x, b, doh, dS.to(dt), ctx.scale,
                                          ctx.chunk_size, ctx.mode, saved_state, need_dalpha)
        else:
            S0 = None if kept_a is None else kept_a.to(dt)
            grads = final_backward_heads(qh, kh, vh, x, b, doh, dS.to(dt), ctx.scale, S0,
                                         kept_b, ctx.chunk_size, need_dalpha)
        dq, dk, dv, dalpha, dbeta, dS0 = grads
        return (_as_input(dq, q), _as_input(dk, k), _as_input(dv, v),
                None if dalpha is None else _as_input(dalpha, alpha), _as_input(dbeta, beta),
                None if ctx.state_dtype is None else dS0.to(ctx.state_dtype),
                None, None, None, None)


def linear_attention_autograd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                              causal: bool = True, alpha: torch.Tensor | None = None,
                              beta: torch.Tensor | None = None, scale: float | None = None,
                              initial_state: LinearAttentionState | None = None,
                              chunk_size: int = DEFAULT_CHUNK_SIZE, state_mode: str = "auto"
                              ) -> tuple[torch.Tensor, LinearAttentionState]:
    """Chunked forward with the memory-light backward above: the training path.

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], alpha / beta [B, T, H] (alpha >= 0),
    initial_state a LinearAttentionState -> (o [B, Tq, H, V] in the dtype of q, the
    LinearAttentionState after the last token, kv in fp32 / fp64). state_mode: "auto",
    "invert" or "checkpoint" (causal α forms only).
    """
    check_inputs(q, k, v, causal=causal, alpha=alpha, beta=beta, initial_state=initial_state)
    check_alpha_values(alpha)
    check_chunk_size(chunk_size)
    if state_mode not in STATE_MODES:
        raise ConfigError(f"state_mode: expected one of {', '.join(STATE_MODES)}, "
                          f"got {state_mode!r}")
    o, S = LinearAttentionFunction.apply(q, k, v, alpha, beta,
                                         None if initial_state is None else initial_state.kv,
                                         resolve_scale(scale), causal, chunk_size, state_mode)
    return o, LinearAttentionState(S)
