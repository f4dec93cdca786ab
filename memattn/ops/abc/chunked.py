"""ABC in parallel: chunked for causal training, closed form when not causal.

Both ABC passes are weighted sums over the prefix, with a weight w[t, i, m] per step t,
token i ≤ t and slot m:

    scores[t, m] = Σ_{i≤t} w[t, i, m] (q_t · k_i)        pass 1, keys -> slots
    o[t]         = Σ_{i≤t} (Σ_m p[t, m] w[t, i, m]) v_i   pass 2, slots -> values, p = softmax_M

so neither needs the memories K̃_t [M, K], Ṽ_t [M, V] of every step: earlier chunks are read
through the memory at the chunk boundary, the chunk itself through masked C×C products such
as q kᵀ. Only the boundary memories are stored, [T / C, M, K + V] per head.

General ABC (`bounded_memory_chunked`): w[t, i, m] = φ[i, m] does not depend on t, so a
chunk is two masked matmuls and the boundary memories are a cumulative sum.

ABC_MLP (`abc_chunked`): w[t, i, m] = exp(s[i, m] - log_z[t, m]), log_z = logcumsumexp(s).
Relative to r, midway between log_z at the chunk's first token and at its last,
write_i = exp(s_i - r) and z_t = exp(log_z_t - r) (a cumulative sum of write), so
w[t, i] = write_i / z_t: one masked matmul per pass, rows scaled by 1 / z_t. That is exact
while z_t and write_i stay far from overflow and 1 / z_t too, i.e. while log_z grows by less
than 80 over the chunk (each side of r within 40), the usual case (logits that drift, as
trained forget rates make them, grow it by up to 80 over a chunk of 64). A chunk where it
grows more (a logit jumping by 80 or more, as with s of ±1e4) is computed again by `_Exact`: each pair i < t is split through a boundary b with i ≤ b ≤ t,
w[t, i] = exp(s_i - log_z_b) · exp(log_z_b - log_z_t), both factors ≤ 1 however large |s|;
halving the chunk gives the boundaries, log2(C) levels of small matmuls, no [C, C, M] tensor.
The boundary memories are a cumulative sum relative to the final normaliser while log_z
grows by less than 40 over the sequence, else a loop over the chunks with factors ≤ 1.
Which way a call goes depends on the values of s (one host sync each); all ways are exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memattn.errors import ConfigError
from memattn.ops.abc.common import ABCState, BoundedMemoryState, check_inputs
from memattn.ops.contract import compute_dtype, default_scale

# Logit of the padding tokens after the end: exp(pad - log_z) = 0, logaddexp(log_z, pad) = log_z.
_PAD_LOGIT = -1e30
# Smallest exp(log_z_t - r) read by the fast path (r: midway along log_z over the chunk), and the
# inverse of the largest: e^±40 stay far from overflow, and a write weight exp(s_i - r) lost to
# underflow (< 1e-38 in float32) weighs < e^40 · 1e-38 in any w[t, i].
_MIN_Z = math.exp(-40.0)
_LOG_MAX_Z = -math.log(_MIN_Z)  # the same bound in log space: how far log_z may move from r
# Chunks are halved (not below _HALVE_DOWN_TO tokens) while more than 1 in _HALVE_AT would
# take the exact path: with abc-mlp's recency trained (rates up to 0.9 a token) a small LM's
# training step took 1.6x less time than with chunks of 64, all of whose first layer's were
# exact (benchmarks/abc_drift.py). 1 in 32 rather than 1 in 8: abc-mlp with forget rates,
# trained 6,000 steps of 512 characters (results/long-stream), sent 123 of the 1,024 chunks of
# 32 of its first layer to the exact path; halving them to 16 made its training step 6-9 %
# faster in two quiet runs (1.22 to 1.11 s, 1.34 to 1.27 s; halving wherever any chunk is exact
# was slower, 1.37-1.38 s). Both measured with r = log_z after the chunk's first half, which let
# log_z grow by 40 on each side of it rather than by 80 over the chunk.
_HALVE_AT = 32
_HALVE_DOWN_TO = 16


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ConfigError(f"chunk_size: expected a power of two, got {chunk_size!r}")


def _chunk_len(T: int, chunk_size: int) -> int:
    """The chunk length used: chunk_size, or the smallest power of two ≥ T if that is less."""
    return min(chunk_size, 1 << (T - 1).bit_length())


def _chunks(x: torch.Tensor, N: int, C: int, value: float = 0.0) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, N, C, D], padded after the end with `value`."""
    B, T, H, D = x.shape
    x = x.transpose(1, 2)  # [B, H, T, D]
    if N * C > T:
        x = F.pad(x, (0, 0, 0, N * C - T), value=value)
    return x.reshape(B, H, N, C, D)


def _unchunk(o: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, N, C, V] -> [B, T, H, V]."""
    B, H, N, C, V = o.shape
    return o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)


def _second_halves(x: torch.Tensor) -> torch.Tensor:
    """x [..., nb, h, D] (second halves) -> [..., 2·nb·h, D], zeros in the first halves."""
    *lead, nb, h, D = x.shape
    return torch.stack((torch.zeros_like(x), x), dim=-3).reshape(*lead, 2 * nb * h, D)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., n, j] @ b [..., j, d]; tiny inner sizes go through broadcasting, not bmm."""
    if a.shape[-1] <= 2:
        return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)
    return a @ b


# --------------------------------------------------------------------------------------
# ABC_MLP: α = exp(s), normalised over the prefix
# --------------------------------------------------------------------------------------

def abc_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, *,
                causal: bool = True, scale: float | None = None,
                initial_state: ABCState | None = None, output_final_state: bool = False,
                chunk_size: int = 64) -> tuple[torch.Tensor, ABCState | None]:
    """ABC_MLP in parallel: q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], s [B, T, H, M].

    Returns o [B, Tq, H, V] in q's dtype and, if asked, the ABCState after the last token.
    Causal inputs are processed in chunks of `chunk_size` (a power of two) tokens, memory
    O(T · (K + V + C + M)) per head; chunks whose normaliser grows by 80 or more (a logit
    jumping by that much) take the slower exact path, and where many would, the chunks are halved
    first (down to 16 tokens). Not causal, the closed form over the sequence.
    """
    _check_chunk_size(chunk_size)
    B, _, T, H, K, V, M = check_inputs(q, k, v, s, "s", causal, initial_state, ABCState)
    out_dtype = q.dtype
    dt = compute_dtype(q, k, v, s, *(initial_state or ()))
    scale = default_scale(scale, K)
    q, k, v, s = q.to(dt), k.to(dt), v.to(dt), s.to(dt)
    log_z0, k0, v0 = (None, None, None) if initial_state is None else \
        (t.to(dt) for t in initial_state)
    if not causal:
        return _abc_closed(q, k, v, s, scale, log_z0, k0, v0, output_final_state, out_dtype)

    # Where more than 1 in _HALVE_AT chunks would take the exact path (logits that drift
    # along the sequence, as abc-mlp's recency makes them), the chunks are halved first.
    C = _chunk_len(T, chunk_size)
    while True:
        N = -(-T // C)
        sc = _chunks(s, N, C, _PAD_LOGIT)  # [B, H, N, C, M]
        log_z_end, log_z_prev, log_z_mid, bad = _normalisers(sc, log_z0)
        if C <= _HALVE_DOWN_TO or bad[0].numel() * _HALVE_AT <= B * H * N:
            break
        C //= 2
    write, inv_z = _fast_weights(sc, log_z_prev, log_z_mid)
    qc = _chunks(q * scale, N, C)  # [B, H, N, C, K]
    kc, vc = _chunks(k, N, C), _chunks(v, N, C)  # [B, H, N, C, K], [B, H, N, C, V]

    # Memories before each chunk, keys and values side by side: [K̃ | Ṽ] [B, H, N, M, K + V],
    # mem: the memory after the last token. What a chunk adds is weighted relative to its end
    # (every weight ≤ 1, in every chunk, the exact path's included).
    write_end = torch.exp(sc - log_z_end[:, :, :, None, :]).transpose(-1, -2)  # [B, H, N, M, C]
    local = torch.cat((write_end @ kc, write_end @ vc), dim=-1)  # [B, H, N, M, K + V]
    mem0 = torch.cat((k0, v0), dim=-1) if k0 is not None else local.new_zeros(B, H, M, K + V)
    keep = torch.exp(log_z_prev - log_z_end)  # [B, H, N, M]
    mem_prev, mem = _boundary_memories(mem0, local, keep, log_z_prev, log_z_end)
    mem_kept = torch.exp(log_z_prev - log_z_mid)[..., None] * mem_prev  # relative to r
    causal_mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # i ≤ t

    # Pass 1, keys -> slots.
    qk = (qc @ kc.transpose(-1, -2)).masked_fill(~causal_mask, 0.0)  # [B, H, N, C, C]
    scores = inv_z * (qc @ mem_kept[..., :K].transpose(-1, -2) + qk @ write)  # [B, H, N, C, M]
    exact = None
    if bad[0].numel():
        # only the chunks at fault are gathered, and written over in place (no backward reads
        # `scores` or `o` as they were): no pass over the whole tensors
        exact = _Exact(*(x[bad] for x in (qc, kc, vc, sc, log_z_prev, mem_prev)), K)
        scores.index_put_(bad, exact.scores())
    p = torch.softmax(scores, dim=-1)  # [B, H, N, C, M]

    # Pass 2, slots -> values.
    pz = p * inv_z
    g = (pz @ write.transpose(-1, -2)).masked_fill(~causal_mask, 0.0)  # [B, H, N, C, C]
    o = pz @ mem_kept[..., K:] + g @ vc  # [B, H, N, C, V]
    if exact is not None:
        o.index_put_(bad, exact.out(p[bad]))

    state = None
    if output_final_state:
        state = ABCState(log_z_end[:, :, -1], mem[..., :K], mem[..., K:])
    return _unchunk(o, T).to(out_dtype), state


def _normalisers(sc: torch.Tensor, log_z0: torch.Tensor | None):
    """Chunked logits sc [B, H, N, C, M] (and the initial log-normaliser [B, H, M] or None) ->
    log_z after each chunk, before it and r, midway along it [B, H, N, M], and the indices
    (b, h, n) of the chunks that the fast path cannot take."""
    log_z_end = torch.logcumsumexp(torch.logsumexp(sc, dim=3), dim=2)
    if log_z0 is not None:
        log_z_end = torch.logaddexp(log_z0[:, :, None], log_z_end)
    start = log_z0 if log_z0 is not None else torch.full_like(log_z_end[:, :, 0], -torch.inf)
    log_z_prev = torch.cat((start[:, :, None], log_z_end[:, :, :-1]), dim=2)
    # The fast path reads z_t = exp(log_z_t - r) and w[t, i] = write_i / z_t, exact while
    # _MIN_Z ≤ z_t ≤ 1 / _MIN_Z; z grows along the chunk, so r midway between its first token's
    # log_z and its last's (log_z_end) allows the most growth, 2 · _LOG_MAX_Z. The chunks that
    # grow more (`bad`) are computed again by _Exact. Worked out in log space from [B, H, N, M]
    # tensors, so that a chunk length the caller then halves costs no pass over the chunk's weights.
    log_z_first = torch.logaddexp(log_z_prev, sc[:, :, :, 0])
    log_z_mid = 0.5 * (log_z_first + log_z_end)  # r
    bad = log_z_end - log_z_first > 2 * _LOG_MAX_Z
    return log_z_end, log_z_prev, log_z_mid, bad.any(-1).nonzero(as_tuple=True)


def _fast_weights(sc: torch.Tensor, log_z_prev: torch.Tensor, log_z_mid: torch.Tensor):
    """The fast path's write weights relative to r [B, H, N, C, M] and 1 / z [B, H, N, C, M]."""
    # Token i writes exp(s_i - r) ≤ exp(log_z_end - r); the memory before the chunk is kept
    # with exp(log_z_prev - r) ≤ 1. Capped at 1 / _MIN_Z so that no weight of a chunk the exact
    # path redoes overflows (nor its gradient): a chunk the fast path takes never reaches it.
    write = torch.exp((sc - log_z_mid[:, :, :, None, :]).clamp_max(_LOG_MAX_Z))
    z = torch.exp(log_z_prev - log_z_mid)[:, :, :, None, :] + torch.cumsum(write, dim=3)
    return write, 1.0 / z.clamp(_MIN_Z, 1.0 / _MIN_Z)


def _boundary_memories(mem0: torch.Tensor, local: torch.Tensor, keep: torch.Tensor,
                       log_z_prev: torch.Tensor, log_z_end: torch.Tensor):
    """Memories at the chunk boundaries: mem_n = keep_n · mem_{n-1} + local_n.

    mem0 [B, H, M, D] (before the first chunk), local [B, H, N, M, D], keep, log_z_prev,
    log_z_end [B, H, N, M]. Returns the memories before each chunk [B, H, N, M, D] and the
    memory after the last chunk [B, H, M, D].

    Relative to r = the final log_z, mem_n = exp(r - log_z_end_n) · U_n with U a cumulative
    sum of terms scaled by factors ≤ 1: a cumsum instead of a loop over the chunks, exact
    while exp(r - log_z_end_n) ≤ 1 / _MIN_Z. Otherwise the loop, stable for any logits.
    """
    r = log_z_end[:, :, -1:]  # [B, H, 1, M]
    up = torch.exp(r - log_z_end)  # [B, H, N, M], ≥ 1
    if bool((up[:, :, 0] <= 1.0 / _MIN_Z).all()):
        u0 = torch.exp(log_z_prev[:, :, :1] - r)[..., None] * mem0[:, :, None]  # [B, H, 1, M, D]
        u = u0 + torch.cumsum(torch.exp(log_z_end - r)[..., None] * local, dim=2)
        mem_prev = torch.cat((mem0[:, :, None], up[:, :, :-1, :, None] * u[:, :, :-1]), dim=2)
        return mem_prev, u[:, :, -1]
    mem, before = mem0, []
    for keep_n, local_n in zip(keep[..., None].unbind(2), local.unbind(2)):
        before.append(mem)
        mem = torch.addcmul(local_n, keep_n, mem)
    return torch.stack(before, dim=2), mem


class _Exact:
    """Both passes for chunks whose normaliser grows too much inside the chunk.

    Any pair i < t is split through a boundary b with i ≤ b ≤ t, the last token of the first
    half of the smallest halving block that holds both: w[t, i] = exp(s_i - log_z_b) ·
    exp(log_z_b - log_z_t), both factors ≤ 1. Inputs are the chunks at fault, flattened:
    q [n, C, K] (scaled), k [n, C, K], v [n, C, V], s [n, C, M], log_z_prev [n, M], mem_prev
    [n, M, K + V] (the memories K̃ | Ṽ before the chunk).
    """

    def __init__(self, q, k, v, s, log_z_prev, mem_prev, K):
        self.q, self.k, self.v, self.s = q, k, v, s
        self.log_z = torch.logaddexp(log_z_prev[:, None], torch.logcumsumexp(s, dim=1))
        self.from_prev = torch.exp(log_z_prev[:, None] - self.log_z)  # [n, C, M], ≤ 1
        self.own = torch.exp(s - self.log_z)  # [n, C, M], w[t, t]
        self.k_prev, self.v_prev = mem_prev[..., :K], mem_prev[..., K:]
        self.levels = []

    def _split(self, x: torch.Tensor, h: int, half: int) -> torch.Tensor:
        """x [n, C, D] -> the `half` (0 or 1) of every block of 2h tokens, [n, C / 2h, h, D]."""
        n, C, D = x.shape
        return x.view(n, C // (2 * h), 2, h, D)[:, :, half].contiguous()

    def scores(self) -> torch.Tensor:
        """Pass 1: scores [n, C, M] (before the softmax)."""
        q, k, s, log_z = self.q, self.k, self.s, self.log_z
        C = q.shape[1]
        scores = self.from_prev * (q @ self.k_prev.transpose(-1, -2)) \
            + (q * k).sum(-1, keepdim=True) * self.own
        h = C // 2
        while h >= 1:
            log_z_b = log_z.view(log_z.shape[0], C // (2 * h), 2, h, -1)[:, :, 0, -1:]
            a_l = torch.exp(self._split(s, h, 0) - log_z_b)  # [n, C / 2h, h, M], ≤ 1
            b_r = torch.exp(log_z_b - self._split(log_z, h, 1))  # [n, C / 2h, h, M], ≤ 1
            qk = self._split(q, h, 1) @ self._split(k, h, 0).transpose(-1, -2)  # [.., h, h]
            scores = scores + _second_halves(b_r * _matmul(qk, a_l))
            self.levels.append((h, a_l, b_r))
            h //= 2
        return scores

    def out(self, p: torch.Tensor) -> torch.Tensor:
        """Pass 2: p [n, C, M] (the softmax of the scores) -> o [n, C, V]."""
        o = (p * self.from_prev) @ self.v_prev + (p * self.own).sum(-1, keepdim=True) * self.v
        for h, a_l, b_r in self.levels:
            g = (self._split(p, h, 1) * b_r) @ a_l.transpose(-1, -2)  # [n, C / 2h, h, h]
            o = o + _second_halves(_matmul(g, self._split(self.v, h, 0)))
        return o


def _abc_closed(q, k, v, s, scale, log_z0, k0, v0, output_final_state, out_dtype):
    """Not causal: one memory from the whole sequence, read by every query."""
    initial = None if log_z0 is None else ABCState(log_z0, k0, v0)
    state = abc_memory(k, v, s, initial_state=initial)
    o = read_memory(q, state.k, state.v, scale)
    return o.to(out_dtype), (state if output_final_state else None)


def abc_memory(k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, *,
               initial_state: ABCState | None = None) -> ABCState:
    """The ABC_MLP memory of a whole sequence, without queries (e.g. a source for cross attention).

    k [B, T, H, K], v [B, T, H, V], s [B, T, H, M] slot logits, in the compute dtype.
    Returns ABCState: log_z = log Σ_i exp(s_i), K̃ = Σ_i exp(s_i - log_z) k_i, Ṽ likewise,
    continuing `initial_state` when given.
    """
    log_z = torch.logsumexp(s, dim=1)  # [B, H, M]
    if initial_state is not None:
        log_z = torch.logaddexp(initial_state.log_z, log_z)
    w = torch.exp(s - log_z[:, None])  # [B, T, H, M], α_i / Σ_j α_j
    mem_k = torch.einsum("bthm,bthk->bhmk", w, k)
    mem_v = torch.einsum("bthm,bthv->bhmv", w, v)
    if initial_state is not None:
        keep = torch.exp(initial_state.log_z - log_z)[..., None]  # [B, H, M, 1]
        mem_k, mem_v = mem_k + keep * initial_state.k, mem_v + keep * initial_state.v
    return ABCState(log_z, mem_k, mem_v)


def read_memory(q: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor,
                scale: float) -> torch.Tensor:
    """q [B, Tq, H, K], mem_k [B, H, M, K], mem_v [B, H, M, V] -> o [B, Tq, H, V]: softmax over slots."""
    p = torch.softmax(scale * torch.einsum("bqhk,bhmk->bqhm", q, mem_k), dim=-1)
    return torch.einsum("bqhm,bhmv->bqhv", p, mem_v)


# --------------------------------------------------------------------------------------
# General ABC: given non-negative write weights φ, no normalisation
# --------------------------------------------------------------------------------------

def bounded_memory_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi: torch.Tensor,
                           *, causal: bool = True, scale: float | None = None,
                           initial_state: BoundedMemoryState | None = None,
                           output_final_state: bool = False, chunk_size: int = 64
                           ) -> tuple[torch.Tensor, BoundedMemoryState | None]:
    """General ABC in parallel: q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], φ [B, T, H, M].

    Returns o [B, Tq, H, V] in q's dtype and, if asked, the BoundedMemoryState after the
    last token. Causal inputs are processed in chunks of `chunk_size` tokens.
    """
    _check_chunk_size(chunk_size)
    _, _, T, _, K, _, _ = check_inputs(q, k, v, phi, "phi", causal, initial_state,
                                       BoundedMemoryState, nonnegative=True)
    out_dtype = q.dtype
    dt = compute_dtype(q, k, v, phi, *(initial_state or ()))
    scale = default_scale(scale, K)
    q, k, v, phi = q.to(dt), k.to(dt), v.to(dt), phi.to(dt)
    k0, v0 = (None, None) if initial_state is None else (t.to(dt) for t in initial_state)
    if not causal:
        mem_k = torch.einsum("bthm,bthk->bhmk", phi, k)
        mem_v = torch.einsum("bthm,bthv->bhmv", phi, v)
        if k0 is not None:
            mem_k, mem_v = mem_k + k0, mem_v + v0
        o = read_memory(q, mem_k, mem_v, scale)
        state = BoundedMemoryState(mem_k, mem_v) if output_final_state else None
        return o.to(out_dtype), state

    C = _chunk_len(T, chunk_size)
    N = -(-T // C)
    qc = _chunks(q * scale, N, C)  # [B, H, N, C, K]
    kc, vc, fc = _chunks(k, N, C), _chunks(v, N, C), _chunks(phi, N, C)  # φ = 0 past the end
    kvc = torch.cat((kc, vc), dim=-1)  # [B, H, N, C, K + V]
    local = fc.transpose(-1, -2) @ kvc  # [B, H, N, M, K + V]
    total = torch.cumsum(local, dim=2)  # memory after each chunk, without the initial state
    mem_prev = torch.cat((torch.zeros_like(local[:, :, :1]), total[:, :, :-1]), dim=2)
    if k0 is not None:
        mem_prev = mem_prev + torch.cat((k0, v0), dim=-1)[:, :, None]
    k_prev, v_prev = mem_prev[..., :K], mem_prev[..., K:]  # [B, H, N, M, K], [B, H, N, M, V]

    causal_mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # i ≤ t
    qk = (qc @ kc.transpose(-1, -2)).masked_fill(~causal_mask, 0.0)  # [B, H, N, C, C]
    p = torch.softmax(qc @ k_prev.transpose(-1, -2) + qk @ fc, dim=-1)  # [B, H, N, C, M]
    g = (p @ fc.transpose(-1, -2)).masked_fill(~causal_mask, 0.0)  # [B, H, N, C, C]
    o = p @ v_prev + g @ vc  # [B, H, N, C, V]

    state = None
    if output_final_state:
        mem = total[:, :, -1]
        if k0 is not None:
            mem = mem + torch.cat((k0, v0), dim=-1)
        state = BoundedMemoryState(mem[..., :K], mem[..., K:])
    return _unchunk(o, T).to(out_dtype), state
