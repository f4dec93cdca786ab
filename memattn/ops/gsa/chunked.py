"""Gated slot attention in chunks of C tokens (causal training), closed form when not causal.

Inside a chunk, with G the cumulative sum of the log gates g from the chunk's start, the
memory at step t is

    K̃_t = exp(G_t) ⊙ K̃_start + Σ_{i≤t} W[t, i] ⊗ k_i        (likewise Ṽ_t)
    W[t, i, m] = (1 - α_i,m) · exp(G_t,m - G_i,m)              [C, C, M] per chunk

Neither pass needs K̃_t or Ṽ_t at every step:

    scores[t, m] = exp(G_t,m) (q_t · K̃_start,m) + Σ_{i≤t} W[t, i, m] (q_t · k_i)       pass 1
    o_t          = Σ_m p_tm exp(G_t,m) Ṽ_start,m + Σ_{i≤t} (Σ_m p_tm W[t, i, m]) v_i    pass 2

with p = softmax_M(scale · scores). The differences G_t - G_i = Σ_{i<j≤t} g_j are summed
directly (one matmul of g with a 0 / 1 matrix), never as a difference of two long sums,
which would lose small gates next to a large one; they are ≤ 0, so exp never overflows.
The products W meets, q_t · k_i and Σ_m p_tm W[t, i, m], are masked to i ≤ t. The memory
is carried from chunk to chunk, K̃_end = K̃_start + ((exp(G_end) - 1) ⊙ K̃_start + Σ_i
W[end, i] ⊗ k_i), the change computed with expm1 so that gates near 1 do not drift over a
long stream. Chunks are computed in groups whose W holds at most GROUP_ELEMENTS numbers, so
a forward pass without autograd needs that much whatever the length; under autograd each
group's W is kept for the backward pass (autograd's, through these torch ops): O(T · C · M)
numbers per head.

That is the exact form, for any gates. On the CPU, a group whose chunks' gates sum to no less
than -FACTORED_RANGE in every slot (the common case: at init α ≈ 0.92, a sum of about -2.7
over 32 tokens) takes `_chunk_group_factored` instead: W factors into exp(G_t) and exp(-G_i), and
both passes become plain matmuls, about 2.5 times faster on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memattn.errors import ConfigError
from memattn.ops.abc.chunked import read_memory
from memattn.ops.contract import compute_dtype, default_scale
from memattn.ops.gsa.common import G_FLOOR, GSAState, check_gsa_inputs

DEFAULT_CHUNK_SIZE = 32
# A chunk whose log gates sum to no less than -FACTORED_RANGE in every slot factors its
# weights, exp(G_t - G_i) = exp(G_t) · exp(-G_i), each factor within e^±60 of 1: no float32
# overflow or underflow, the relative precision of either factor (`_chunk_group_factored`).
FACTORED_RANGE = 60.0
# Numbers of W [B, H, n, C, C, M] computed at once (16 MiB in float32): a group of n chunks.
GROUP_ELEMENTS = 1 << 22


def _chunks(x: torch.Tensor, N: int, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, N, C, D], zeros after the end (g = 0 there: α = 1, no write)."""
    B, T, H, D = x.shape
    x = x.transpose(1, 2)
    if N * C > T:
        x = F.pad(x, (0, 0, 0, N * C - T))
    return x.reshape(B, H, N, C, D).contiguous()  # a copy already unless H = 1


def gsa_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                causal: bool = True, scale: float | None = None,
                initial_state: GSAState | None = None, output_final_state: bool = False,
                chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, GSAState | None]:
    """Gated slot attention in parallel: q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V],
    g [B, T, H, M] log forget gates (≤ 0).

    Returns o [B, Tq, H, V] in q's dtype and, if asked, the GSAState after the last token.
    Causal inputs go in chunks of `chunk_size` tokens (any positive integer); not causal,
    the closed form (`gsa_memory`, then one read).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    B, _, T, H, K, V, M = check_gsa_inputs(q, k, v, g, causal, initial_state)
    out_dtype = q.dtype
    dt = compute_dtype(q, k, v, g, *(initial_state or ()))
    q, k, v, g = q.to(dt), k.to(dt), v.to(dt), g.to(dt).clamp_min(G_FLOOR)
    scale = default_scale(scale, K)
    initial = None if initial_state is None else GSAState(*(t.to(dt) for t in initial_state))
    if not causal:
        state = gsa_memory(k, v, g, initial_state=initial)
        o = read_memory(q, state.k, state.v, scale)
        return o.to(out_dtype), (state if output_final_state else None)

    C = min(chunk_size, T)
    N = -(-T // C)
    qc, gc = _chunks(q * scale, N, C), _chunks(g, N, C)  # [B, H, N, C, K], [B, H, N, C, M]
    kc, vc = _chunks(k, N, C), _chunks(v, N, C)  # [B, H, N, C, K], [B, H, N, C, V]
    if initial is None:
        initial = GSAState.empty(B, H, M, K, V, device=q.device, dtype=dt)
    mem_k, mem_v = initial  # before the first chunk
    per = max(1, GROUP_ELEMENTS // (B * H * C * C * M))  # chunks a group
    outs = []
    for n in range(0, N, per):
        group = [x[:, :, n:n + per] for x in (qc, kc, vc, gc)]
        # a group whose chunks' gates sum to at least -FACTORED_RANGE in every slot takes two
        # matmuls; deciding reads the gates, which only the CPU does without making the host wait
        factored = g.device.type == "cpu" and bool(-group[3].sum(dim=-2).min() <= FACTORED_RANGE)
        o, mem_k, mem_v = (_chunk_group_factored if factored else _chunk_group)(*group, mem_k, mem_v)
        outs.append(o)
    o = torch.cat(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    state = GSAState(mem_k, mem_v) if output_final_state else None
    return o.to(out_dtype), state


def _segment_sums(C: int, device, dtype) -> torch.Tensor:
    """S [C·C, C] of 0 / 1 with (S @ g)[t·C + i] = Σ_{i<j≤t} g_j for g [C, M]: the gates
    between token i and step t (0 for t ≤ i), each a plain sum of its own terms."""
    r = torch.arange(C, device=device)
    t, i, j = r.view(C, 1, 1), r.view(1, C, 1), r.view(1, 1, C)
    return ((i < j) & (j <= t)).to(dtype).view(C * C, C)


def _carry(G_end: torch.Tensor, local_k: torch.Tensor, local_v: torch.Tensor, mem_k: torch.Tensor,
           mem_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The memories before each of n chunks and after the last: a short scan. G_end
    [B, H, n, M] is each chunk's summed log gates, local_k / local_v [B, H, n, M, K / V] its
    writes at its end; a chunk changes the memory by expm1(G_end) ⊙ mem + its writes, added as
    one increment (with gates near 1 exp(G_end) rounds to 1 in a way that would bias a long
    stream, expm1 does not). Returns (before_k, before_v [B, H, n, M, K / V], mem_k, mem_v)."""
    before_k, before_v = [], []
    for forget, add_k, add_v in zip(torch.expm1(G_end[..., None]).unbind(2), local_k.unbind(2),
                                    local_v.unbind(2)):
        before_k.append(mem_k)
        before_v.append(mem_v)
        mem_k = mem_k + torch.addcmul(add_k, forget, mem_k)
        mem_v = mem_v + torch.addcmul(add_v, forget, mem_v)
    return torch.stack(before_k, dim=2), torch.stack(before_v, dim=2), mem_k, mem_v


def _chunk_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 mem_k: torch.Tensor, mem_v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n chunks: q [B, H, n, C, K] (scaled), k [B, H, n, C, K], v [B, H, n, C, V],
    g [B, H, n, C, M] and the memories before them, mem_k [B, H, M, K], mem_v [B, H, M, V]
    -> o [B, H, n, C, V] and the memories after them."""
    B, H, n, C, M = g.shape
    S = _segment_sums(C, g.device, g.dtype)
    w = -torch.expm1(g)  # [B, H, n, C, M], 1 - α
    # W[t, i, m] = (1 - α_i,m) exp(Σ_{i<j≤t} g_j,m): token i's weight in slot m at step t.
    # Above the diagonal (t < i) it is finite and unused: what it meets is masked there.
    W = torch.exp((S @ g).view(B, H, n, C, C, M)) * w[..., None, :, :]  # [.., C(t), C(i), M]
    last = torch.exp(S[-C:] @ g) * w  # [B, H, n, C(i), M], W at the chunk's last step
    G = g.cumsum(dim=-2)  # [B, H, n, C, M]: G_t - G_start, ≤ 0
    decay = torch.exp(G)

    last = last.transpose(-1, -2)  # [B, H, n, M, C]
    before_k, before_v, mem_k, mem_v = _carry(G[..., -1, :], last @ k, last @ v, mem_k, mem_v)

    seen = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [t, i]: t ≥ i
    qk = (q @ k.transpose(-1, -2)).masked_fill(~seen, 0.0)  # [B, H, n, C(t), C(i)]
    scores = decay * (q @ before_k.transpose(-1, -2)) \
        + (qk[..., None, :] @ W).squeeze(-2)  # [B, H, n, C, M]
    p = torch.softmax(scores, dim=-1)
    # Σ_m p_tm W[t, i, m]: how much of token i's value the read at step t takes
    mix = (W @ p[..., None]).squeeze(-1).masked_fill(~seen, 0.0)  # [B, H, n, C(t), C(i)]
    o = (p * decay) @ before_v + mix @ v  # [B, H, n, C, V]
    return o, mem_k, mem_v


def _chunk_group_factored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          mem_k: torch.Tensor, mem_v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_chunk_group` for chunks whose gates sum to at least -FACTORED_RANGE in every slot.

    W[t, i, m] = exp(G_t,m) · (1 - α_i,m) exp(-G_i,m) with G the chunk's inclusive cumulative
    sum of g, so both passes are matmuls over [C, C] and [C, M]:
    scores = exp(G) ⊙ (q K̃_startᵀ + (q kᵀ ⊙ causal) A), A = (1 - α) ⊙ exp(-G)     [C, M]
    o = (p ⊙ exp(G)) Ṽ_start + ((p ⊙ exp(G)) Aᵀ ⊙ causal) v                       [C, V]
    """
    C = g.shape[-2]
    w = -torch.expm1(g)  # [B, H, n, C, M], 1 - α
    G = g.cumsum(dim=-2)  # [B, H, n, C, M], ≥ -FACTORED_RANGE
    decay = torch.exp(G)
    A = w * torch.exp(-G)  # [B, H, n, C(i), M]
    # a chunk's writes at its end are exp(G_end) ⊙ Aᵀ k
    last = (A * decay[..., -1:, :]).transpose(-1, -2)  # [B, H, n, M, C]
    before_k, before_v, mem_k, mem_v = _carry(G[..., -1, :], last @ k, last @ v, mem_k, mem_v)

    seen = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [t, i]: t ≥ i
    qk = (q @ k.transpose(-1, -2)).masked_fill(~seen, 0.0)  # [B, H, n, C(t), C(i)]
    scores = decay * (q @ before_k.transpose(-1, -2) + qk @ A)  # [B, H, n, C, M]
    pd = torch.softmax(scores, dim=-1) * decay
    mix = (pd @ A.transpose(-1, -2)).masked_fill(~seen, 0.0)  # [B, H, n, C(t), C(i)]
    o = pd @ before_v + mix @ v  # [B, H, n, C, V]
    return o, mem_k, mem_v


def gsa_memory(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
               initial_state: GSAState | None = None) -> GSAState:
    """The gated slot memory after a whole sequence, without queries (the closed form, e.g.
    a source for cross attention).

    k [B, T, H, K], v [B, T, H, V], g [B, T, H, M] log forget gates (≤ 0), in the compute
    dtype (unchecked: the caller's). Token i's write decays by the gates after it:
    K̃ = exp(Σ_j g_j) ⊙ K̃_0 + Σ_i (1 - α_i) exp(Σ_{j>i} g_j) ⊗ k_i, Ṽ likewise.
    Returns a GSAState (k [B, H, M, K], v [B, H, M, V]) continuing `initial_state` if given.
    """
    g = g.clamp_min(G_FLOOR)
    after = F.pad(g[:, 1:], (0, 0, 0, 0, 0, 1))  # [B, T, H, M]: g_{i+1}, 0 past the end
    after = after.flip(1).cumsum(1).flip(1)  # Σ_{j>i} g_j, summed directly
    w = -torch.expm1(g) * torch.exp(after)  # [B, T, H, M]
    mem_k = torch.einsum("bthm,bthk->bhmk", w, k)
    mem_v = torch.einsum("bthm,bthv->bhmv", w, v)
    if initial_state is not None:
        keep = torch.exp(g.sum(1))[..., None]  # [B, H, M, 1]
        mem_k, mem_v = mem_k + keep * initial_state.k, mem_v + keep * initial_state.v
    return GSAState(mem_k, mem_v)
