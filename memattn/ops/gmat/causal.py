"""Causal GMAT: a fresh memory block before every chunk, written only from the past.

Layout (common.py): blocks of S = M + C rows, block b = [m_b (M memory slots); chunk b
(C main tokens)]. What a row reads:

    memory slot of block b    block b - 1 whole (m_{b-1} and chunk b-1) and m_b
    main token of block b     m_b, and its pattern's past main keys:
                              chunked: chunk b up to itself; window: 0 <= i - j <= w (w <= C)

So m_b summarises the chunk before it and, through m_{b-1}, the chunks before that (one
chunk further back per layer): a memory that only ever saw the past, carried forward like
a recurrent state. Every row reads at most two blocks, so a call costs O(T·S) and a
decoder keeps only the last two blocks of keys and values: a fixed-size state.

Queries are the last Tq of the T positions of the keys, and the keys start at a block
boundary (a decoder passes its cached blocks followed by the new rows). One main-row query
(a decoding step) attends over the rows it can read and nothing else.
"""

from __future__ import annotations

import torch

from memattn.ops.gmat.common import attend, pad_to


def _previous(t: torch.Tensor) -> torch.Tensor:
    """[B, H, N, S, D] -> the same blocks shifted by one (block n holds block n-1, block 0 zeros)."""
    return torch.cat((torch.zeros_like(t[:, :, :1]), t[:, :, :-1]), dim=2)


def main_reads(r: torch.Tensor | int, c: torch.Tensor, *, num_memory: int, pattern: str, window: int,
               S: int) -> torch.Tensor:
    """Whether the main row at offset r (M <= r < S) of its block reads the key at offset c
    from its block's start (negative: the block before), broadcast: its block's memory
    slots, and its pattern's past main keys."""
    M = num_memory
    if pattern == "chunked":
        return (c >= 0) & ((c < M) | (c <= r))
    own_memory = (c >= 0) & (c < M)
    main_key = (c % S) >= M
    distance = (r - M) - torch.where(c >= 0, c - M, c)  # i - j in main positions
    return own_memory | (main_key & (distance >= 0) & (distance <= window))


def _one_main_row(q, k, v, *, num_memory, pattern, window, scale, valid, S, dtype):
    """A decoding step: q [B, 1, H, K] the main row at position T - 1 -> o [B, 1, H, V], reading
    only the rows its pattern can reach (its block, and the one before for window)."""
    T = k.shape[1]
    r = (T - 1) % S
    start = T - 1 - r  # its block's first row
    lo = start if pattern == "chunked" else max(0, start - S)
    c = torch.arange(lo - start, r + 1, device=q.device)
    seen = main_reads(r, c, num_memory=num_memory, pattern=pattern, window=window, S=S)[None]  # [1, J]
    if valid is not None:
        seen = seen & valid[:, lo:]
    o = attend(*(t.transpose(1, 2).to(dtype) for t in (q, k[:, lo:], v[:, lo:])),
               seen[:, None, None, :], scale)  # [B, H, 1, V]
    return o.transpose(1, 2)


def gmat_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_memory: int,
                chunk_size: int, pattern: str, window: int, scale: float,
                valid: torch.Tensor | None, memory_k: torch.Tensor | None,
                memory_v: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V] in the interleaved layout -> o [B, Tq, H, V]
    in `dtype`. valid bool [B, T] or None hides keys; inputs are checked by the caller."""
    M, C = num_memory, chunk_size
    S = M + C
    B, Tq, H, _ = q.shape
    T = k.shape[1]
    N = -(-T // S)
    device = q.device
    if Tq == 1 and (T - 1) % S >= M:  # one main row (a decoding step): the rows it reads alone
        return _one_main_row(q, k, v, num_memory=M, pattern=pattern, window=window, scale=scale,
                             valid=valid, S=S, dtype=dtype)

    def blocks(t):  # [B, T', H, D] -> [B, H, N, S, D], rows aligned with the keys
        t = t.transpose(1, 2).to(dtype)
        if t.shape[2] < T:  # queries: the last Tq positions
            t = torch.cat((t.new_zeros(B, H, T - t.shape[2], t.shape[-1]), t), dim=2)
        return pad_to(t, N * S, 2).view(B, H, N, S, t.shape[-1])

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    key_ok = torch.arange(N * S, device=device) < T
    key_ok = key_ok[None].expand(B, -1) if valid is None else pad_to(valid, N * S, 1) & key_ok
    key_ok = key_ok.view(B, 1, N, 1, S)

    if M:  # memory rows: [block b-1; memory of block b]
        mkb = kb if memory_k is None else blocks(memory_k)
        mvb = vb if memory_v is None else blocks(memory_v)
        keys = torch.cat((_previous(mkb), mkb[..., :M, :]), dim=3)  # [B, H, N, S + M, K]
        values = torch.cat((_previous(mvb), mvb[..., :M, :]), dim=3)
        visible = torch.cat((_previous(key_ok), key_ok[..., :M]), dim=-1)  # [B, 1, N, 1, S + M]
        o_memory = attend(qb[..., :M, :], keys, values, visible, scale)  # [B, H, N, M, V]

    # main rows: their own block (chunked) or the previous and own block (window)
    r = torch.arange(M, S, device=device)[:, None]  # main query offsets
    if pattern == "chunked":
        c = torch.arange(S, device=device)[None, :]
        local_k, local_v, ok = kb, vb, key_ok
    else:
        c = torch.arange(2 * S, device=device)[None, :] - S  # key offset from the block start
        local_k = torch.cat((_previous(kb), kb), dim=3)
        local_v = torch.cat((_previous(vb), vb), dim=3)
        ok = torch.cat((_previous(key_ok), key_ok), dim=-1)
    allowed = main_reads(r, c, num_memory=M, pattern=pattern, window=window, S=S)  # [C, S or 2S]
    o_main = attend(qb[..., M:, :], local_k, local_v, allowed & ok, scale)  # [B, H, N, C, V]

    o = torch.cat((o_memory, o_main), dim=3) if M else o_main  # [B, H, N, S, V]
    return o.flatten(2, 3)[:, :, T - Tq:T].transpose(1, 2)
