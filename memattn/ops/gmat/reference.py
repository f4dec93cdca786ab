"""GMAT attention as a dense masked softmax: the ground truth, for tests only.

It builds the whole T×T visibility mask (T = M + L, or the interleaved causal length)
from the definitions below and runs one dense softmax in fp32 (fp64 for fp64 inputs);
the fast forms (sparse.py, causal.py) never build it.

Bidirectional (Gupta & Berant 2020, Eq. 3), rows and columns [memory M; main L]:
    memory row    sees every memory and main key
    main row i    sees every memory key and the main keys j of its pattern:
        chunked   i // C == j // C                              (C×k blocks)
        window    |i - j| <= w                                  (sliding window)
        lsh       bucket(k_i) == bucket(k_j) and, sorting the tokens by (bucket, position)
                  into chunks of C, j's chunk is i's or the one before it (Reformer)
        full      every j                                       (dense, for comparison)

Causal, interleaved blocks of S = M + C (see common.py): block b holds memory slots
m_b then main tokens bC … bC + C - 1.
    memory row of block b   sees block b - 1 whole (its memory and its chunk) and the
                            memory slots of block b: the memory summarises only the past
    main row i of block b   sees the memory slots of block b and main keys j with
        chunked             j in chunk b and j <= i
        window              0 <= i - j <= w  (w <= C)

`attention_mask` hides keys (padding) in both layouts.
"""

from __future__ import annotations

import torch

from memattn.errors import ShapeError
from memattn.ops.contract import accumulation_dtype, default_scale
from memattn.ops.gmat.common import check_pattern, check_qkv, lsh_buckets


def masked_softmax(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim restricted to `visible` (bool, broadcastable to scores).

    A row with nothing visible gets all-zero weights (so its output is 0), never NaN, in the
    forward pass or the backward pass.
    """
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.detach().amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    return weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def bidirectional_mask(num_memory: int, length: int, pattern: str, *, chunk_size: int = 64,
                       window: int = 64, buckets: torch.Tensor | None = None) -> torch.Tensor:
    """The (M + L)×(M + L) visibility of the bidirectional layout, True = may attend.

    buckets int64 [B, H, L] (lsh only). Returns bool [M+L, M+L], or [B, H, M+L, M+L] for lsh.
    """
    M, L = num_memory, length
    i = torch.arange(L)[:, None]  # main query positions
    j = torch.arange(L)[None, :]  # main key positions
    if pattern == "chunked":
        main = i // chunk_size == j // chunk_size
    elif pattern == "window":
        main = (i - j).abs() <= window
    elif pattern == "full":
        main = torch.ones(L, L, dtype=torch.bool)
    else:  # lsh
        key = buckets * L + torch.arange(L)  # sort by bucket, then by position
        rank = key.argsort(dim=-1).argsort(dim=-1)  # [B, H, L]: place in the sorted order
        chunk = rank // chunk_size
        same_bucket = buckets[..., :, None] == buckets[..., None, :]
        back = chunk[..., :, None] - chunk[..., None, :]
        main = same_bucket & ((back == 0) | (back == 1))  # [B, H, L, L]
    lead = main.shape[:-2]
    mask = torch.ones(*lead, M + L, M + L, dtype=torch.bool)
    mask[..., M:, M:] = main  # memory rows and memory columns stay all True
    return mask


def causal_mask(num_memory: int, chunk_size: int, length: int, pattern: str, *,
                window: int = 64) -> torch.Tensor:
    """The T×T visibility of the interleaved causal layout (T = `length` rows from a block start).

    Returns bool [T, T], True = row may attend to column.
    """
    M, C = num_memory, chunk_size
    S = M + C
    mask = torch.zeros(length, length, dtype=torch.bool)
    for p in range(length):
        bp, rp = divmod(p, S)
        for c in range(length):
            bc, rc = divmod(c, S)
            if rp < M:  # a memory slot of block bp
                mask[p, c] = bc == bp - 1 or (bc == bp and rc < M)
            elif rc < M:  # a main token reads the memory of its own block
                mask[p, c] = bc == bp
            else:
                i, j = bp * C + rp - M, bc * C + rc - M  # main positions
                if pattern == "chunked":
                    mask[p, c] = bc == bp and j <= i
                else:
                    mask[p, c] = 0 <= i - j <= window
    return mask


def gmat_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             num_memory: int, causal: bool, pattern: str = "chunked",
                             chunk_size: int = 64, window: int = 64,
                             lsh_rotations: torch.Tensor | None = None, scale: float | None = None,
                             attention_mask: torch.Tensor | None = None,
                             memory_k: torch.Tensor | None = None,
                             memory_v: torch.Tensor | None = None) -> torch.Tensor:
    """Dense masked softmax with the explicit mask; arguments as in `gmat_attention`.

    q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V] -> o [B, Tq, H, V] (dtype of q).
    Memory rows read memory_k / memory_v when given (untied memory projections).
    """
    B, Tq, T, H, K, V = check_qkv(q, k, v, memory_k, memory_v, attention_mask)
    check_pattern(pattern, causal=causal, num_memory=num_memory, chunk_size=chunk_size,
                  window=window, lsh_rotations=lsh_rotations, head_dim=K, heads=H)
    M = num_memory
    if causal:
        mask = causal_mask(M, chunk_size, T, pattern, window=window)[T - Tq:]  # [Tq, T]
        S = M + chunk_size
        is_memory_row = torch.arange(T - Tq, T) % S < M
    else:
        if Tq != T or T < M:
            raise ShapeError(f"q: the bidirectional layout needs Tq = T >= num_memory, got Tq={Tq}, "
                             f"T={T}, num_memory={M}")
        buckets = lsh_buckets(k[:, M:], lsh_rotations) if pattern == "lsh" else None
        mask = bidirectional_mask(M, T - M, pattern, chunk_size=chunk_size, window=window,
                                  buckets=buckets)
        is_memory_row = torch.arange(T) < M
    mask = mask.to(q.device)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :]  # [B, H, Tq, T]
    dt = accumulation_dtype(q.dtype)
    scale = default_scale(scale, K)
    qh, kh, vh = (t.transpose(1, 2).to(dt) for t in (q, k, v))  # [B, H, *, D]
    o = masked_softmax(scale * qh @ kh.mT, mask) @ vh  # [B, H, Tq, V]
    if memory_k is not None:
        mk, mv = (t.transpose(1, 2).to(dt) for t in (memory_k, memory_v))
        o_memory = masked_softmax(scale * qh @ mk.mT, mask) @ mv
        o = torch.where(is_memory_row.to(q.device)[:, None], o_memory, o)
    return o.transpose(1, 2).to(q.dtype)
