"""The bidirectional fast forms: memory rows dense, main rows blocked; never an L×L matrix.

Rows and columns are [memory M; main L] (common.py). Each form computes

    memory rows   softmax(q_m [k_m; k_x]ᵀ) [v_m; v_x]              [M, M + L] scores
    main rows     one joint softmax over [memory keys ∪ the row's sparse main keys]

and differs only in how the main keys of a row are gathered:

    chunked   pad L to N chunks of C; chunk n reads itself           [N, C, M + C] scores
    window    pad L to N blocks of w; block n reads blocks n-1..n+1  [N, w, M + 3w] scores,
              masked to |i - j| <= w
    lsh       sort the tokens by (bucket, position), cut the sorted order into chunks of
              C; chunk n reads itself and chunk n-1, masked to the same bucket  [N, C, M + 2C]
    full      every main key (dense, L×L: for comparison only)

Memory: O(M·(M + L) + L·(M + J)) scores for J local keys a row (C, 3w or 2C).
"""

from __future__ import annotations

import torch

from memattn.ops.gmat.common import attend, lsh_buckets, pad_to


def memory_rows(q_memory: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Memory rows attend densely to every key: q_memory [B, H, M, K], k [B, H, T, K],
    v [B, H, T, V], valid bool [B, T] or None -> [B, H, M, V]."""
    return attend(q_memory, k, v, None if valid is None else valid[:, None, None, :], scale)


def _local_with_memory(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, local_visible: torch.Tensor,
                       k_memory: torch.Tensor, v_memory: torch.Tensor, memory_visible: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """One joint softmax over a block's local keys and the memory keys.

    qb [B, H, N, R, K], kb [B, H, N, J, K], vb [B, H, N, J, V], local_visible bool
    broadcastable to [B, H, N, R, J], k_memory [B, H, M, K], v_memory [B, H, M, V],
    memory_visible bool [B, M]; None: all visible -> o [B, H, N, R, V].
    """
    B, H, N, R, _ = qb.shape
    M, J = k_memory.shape[2], kb.shape[3]
    if M:  # the memory keys join every block's keys
        kb = torch.cat((k_memory[:, :, None].expand(B, H, N, M, -1), kb), dim=3)  # [B, H, N, M + J, K]
        vb = torch.cat((v_memory[:, :, None].expand(B, H, N, M, -1), vb), dim=3)
        if local_visible is not None or memory_visible is not None:
            everything = torch.ones((), dtype=torch.bool, device=qb.device)
            mem_vis = everything if memory_visible is None else memory_visible[:, None, None, None, :]
            loc_vis = everything if local_visible is None else local_visible
            local_visible = torch.cat((mem_vis.expand(B, H, N, R, M), loc_vis.expand(B, H, N, R, J)), dim=-1)
    return attend(qb, kb, vb, local_visible, scale)


def _blocks(t: torch.Tensor, size: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H, N, size, D], zero-padding L up to N·size."""
    B, H, L, D = t.shape
    n = -(-L // size)
    return pad_to(t, n * size, 2).view(B, H, n, size, D)


def _key_valid(valid: torch.Tensor | None, B: int, L: int, length: int, device) -> torch.Tensor:
    """bool [B, length]: main key j < L and not hidden by the attention mask."""
    inside = torch.arange(length, device=device) < L
    if valid is None:
        return inside[None, :].expand(B, length)
    return pad_to(valid, length, 1) & inside


def chunked_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_memory: torch.Tensor,
                 v_memory: torch.Tensor, valid: torch.Tensor | None, memory_valid: torch.Tensor | None,
                 scale: float, chunk_size: int) -> torch.Tensor:
    """Main rows, chunked: q, k [B, H, L, K], v [B, H, L, V] -> [B, H, L, V]."""
    B, H, L, _ = q.shape
    qb, kb, vb = (_blocks(t, chunk_size) for t in (q, k, v))  # [B, H, N, C, *]
    N = qb.shape[2]
    key_ok = None
    if valid is not None or L % chunk_size:  # padding or masked keys
        key_ok = _key_valid(valid, B, L, N * chunk_size, q.device).view(B, 1, N, 1, chunk_size)
    o = _local_with_memory(qb, kb, vb, key_ok, k_memory, v_memory, memory_valid, scale)
    return o.flatten(2, 3)[:, :, :L]


def window_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_memory: torch.Tensor,
                v_memory: torch.Tensor, valid: torch.Tensor | None, memory_valid: torch.Tensor | None,
                scale: float, window: int) -> torch.Tensor:
    """Main rows, sliding window |i - j| <= w: q, k [B, H, L, K], v [B, H, L, V] -> [B, H, L, V]."""
    B, H, L, _ = q.shape
    W = window
    qb = _blocks(q, W)  # [B, H, N, W, K]
    N = qb.shape[2]

    def neighbours(t):  # [B, H, L, D] -> [B, H, N, 3W, D]: blocks n-1, n, n+1
        padded = pad_to(torch.cat((t.new_zeros(B, H, W, t.shape[-1]), t), dim=2), (N + 2) * W, 2)
        return padded.unfold(2, 3 * W, W).transpose(-1, -2)

    kb, vb = neighbours(k), neighbours(v)
    key_ok = torch.cat((torch.zeros(B, W, dtype=torch.bool, device=q.device),
                        _key_valid(valid, B, L, (N + 1) * W, q.device)), dim=1)
    key_ok = key_ok.unfold(1, 3 * W, W)[:, None, :, None, :]  # [B, 1, N, 1, 3W]
    r = torch.arange(W, device=q.device)[:, None]  # query offset in its block
    c = torch.arange(3 * W, device=q.device)[None, :] - W  # key offset from the block start
    near = ((r - c).abs() <= W)[None, None, None]  # [1, 1, 1, W, 3W]
    o = _local_with_memory(qb, kb, vb, near & key_ok, k_memory, v_memory, memory_valid, scale)
    return o.flatten(2, 3)[:, :, :L]


def lsh_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_memory: torch.Tensor,
             v_memory: torch.Tensor, valid: torch.Tensor | None, memory_valid: torch.Tensor | None,
             scale: float, chunk_size: int, buckets: torch.Tensor) -> torch.Tensor:
    """Main rows, LSH buckets: q, k [B, H, L, K], v [B, H, L, V], buckets int64 [B, H, L]
    -> [B, H, L, V]."""
    B, H, L, _ = q.shape
    C = chunk_size
    order = (buckets * L + torch.arange(L, device=q.device)).argsort(dim=-1)  # [B, H, L]

    def sort(t):
        return t.gather(2, order[..., None].expand(-1, -1, -1, t.shape[-1]))

    qb, kb_own, vb_own = (_blocks(sort(t), C) for t in (q, k, v))  # [B, H, N, C, *]
    N = qb.shape[2]

    def with_previous(t):  # [B, H, N, C, D] -> [B, H, N, 2C, D]: chunk n-1, then chunk n
        previous = torch.cat((torch.zeros_like(t[:, :, :1]), t[:, :, :-1]), dim=2)
        return torch.cat((previous, t), dim=3)

    kb, vb = with_previous(kb_own), with_previous(vb_own)
    key_ok = _key_valid(valid, B, L, L, q.device)[:, None].expand(B, H, L).gather(2, order)
    key_ok = pad_to(key_ok, N * C, 2).view(B, H, N, C)
    bucket = pad_to(buckets.gather(2, order) + 1, N * C, 2).view(B, H, N, C)  # 0 marks padding
    key_ok = with_previous(key_ok[..., None])[..., 0]  # [B, H, N, 2C]
    key_bucket = with_previous(bucket[..., None])[..., 0]
    visible = key_ok[:, :, :, None, :] & (bucket[..., :, None] == key_bucket[:, :, :, None, :])
    o_sorted = _local_with_memory(qb, kb, vb, visible, k_memory, v_memory, memory_valid, scale)
    o_sorted = o_sorted.flatten(2, 3)[:, :, :L]  # [B, H, L, V] in sorted order
    return o_sorted.gather(2, order.argsort(dim=-1)[..., None].expand(-1, -1, -1, o_sorted.shape[-1]))


def full_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Main rows, dense over memory and sequence: q [B, H, L, K], k [B, H, M+L, K],
    v [B, H, M+L, V] -> [B, H, L, V]. Builds L×(M+L) scores: the comparison point."""
    return memory_rows(q, k, v, valid, scale)


def gmat_bidirectional(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_memory: int,
                       pattern: str, chunk_size: int, window: int, lsh_rotations: torch.Tensor | None,
                       scale: float, valid: torch.Tensor | None, memory_k: torch.Tensor | None,
                       memory_v: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """q, k [B, T, H, K], v [B, T, H, V] with T = M + L, rows [memory; main] -> o [B, T, H, V]
    in `dtype` (the accumulation dtype). Arguments as in `gmat_attention`; inputs checked."""
    M = num_memory
    qh, kh, vh = (t.transpose(1, 2).to(dtype) for t in (q, k, v))  # [B, H, T, D]
    mk = kh if memory_k is None else memory_k.transpose(1, 2).to(dtype)
    mv = vh if memory_v is None else memory_v.transpose(1, 2).to(dtype)
    out = [memory_rows(qh[:, :, :M], mk, mv, valid, scale)] if M else []
    L = qh.shape[2] - M
    if L > 0:
        q_x, k_x, v_x = qh[:, :, M:], kh[:, :, M:], vh[:, :, M:]
        k_m, v_m = kh[:, :, :M], vh[:, :, :M]
        valid_x = None if valid is None else valid[:, M:]
        valid_m = None if valid is None else valid[:, :M]
        if pattern == "chunked":
            o_x = chunked_rows(q_x, k_x, v_x, k_m, v_m, valid_x, valid_m, scale, chunk_size)
        elif pattern == "window":
            o_x = window_rows(q_x, k_x, v_x, k_m, v_m, valid_x, valid_m, scale, window)
        elif pattern == "lsh":
            buckets = lsh_buckets(k[:, M:], lsh_rotations)
            o_x = lsh_rows(q_x, k_x, v_x, k_m, v_m, valid_x, valid_m, scale, chunk_size, buckets)
        else:
            o_x = full_rows(q_x, kh, vh, valid, scale)
        out.append(o_x)
    return torch.cat(out, dim=2).transpose(1, 2)
