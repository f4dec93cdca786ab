"""GMAT attention, Gupta & Berant 2020: global memory tokens over sparse attention.

Write rule  the M memory rows attend densely to every position (memory and sequence)
Read rule   each main row attends, in one softmax, to every memory slot and to its sparse
            pattern of main keys (chunked, sliding window, LSH buckets, or full)

Notation: B batch, M memory slots, L main sequence, T = M + L (bidirectional) rows,
H heads, K key / query dim, V value dim, C chunk length, w window. Activations
[B, T, H, D]; memory rows first.

Forms (all agree; tests hold each to the reference):
    reference.py   the (M+L)×(M+L) mask built explicitly, one dense softmax: tests only
    sparse.py      bidirectional: memory rows dense, main rows blocked, no L×L matrix
    causal.py      causal: a memory block before each chunk, written from the past only
"""

from __future__ import annotations

import torch

from memattn.errors import ShapeError
from memattn.ops.contract import accumulation_dtype, check_no_state, default_scale, public_op
from memattn.ops.gmat.causal import gmat_causal
from memattn.ops.gmat.common import CAUSAL_PATTERNS, PATTERNS, check_pattern, check_qkv, lsh_buckets
from memattn.ops.gmat.reference import (bidirectional_mask, causal_mask,
                                        gmat_attention_reference)
from memattn.ops.gmat.sparse import gmat_bidirectional


@public_op("torch")
def gmat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_memory: int,
                   causal: bool, pattern: str = "chunked", chunk_size: int = 64, window: int = 64,
                   lsh_rotations: torch.Tensor | None = None,
                   scale: float | None = None, attention_mask: torch.Tensor | None = None,
                   memory_k: torch.Tensor | None = None,
                   memory_v: torch.Tensor | None = None, initial_state: None = None,
                   output_final_state: bool = False, backend: str = "auto"
                   ) -> tuple[torch.Tensor, None]:
    """Attention of M global memory tokens and a sparsely attending sequence: (o, None).

    The op signature of memattn, with two deliberate differences: `causal` is a required
    keyword (GMAT's own setting is the encoder, every other op's default is causal, so no
    default would read right for both), and the op keeps no state — a causal decoder passes
    the rows of the last blocks as k and v (the `gmat` layer's GmatCache does), so
    initial_state or output_final_state is a ConfigError.

    Bidirectional (causal=False): q, k [B, M+L, H, K], v [B, M+L, H, V], the M memory
    rows first. Memory rows attend to all M + L keys; main rows to all memory keys and to
    the main keys of `pattern`:
        "chunked"  the C = chunk_size tokens of their own chunk (L is padded to a multiple of C)
        "window"   the tokens at distance <= window on either side
        "lsh"      tokens of the same hash bucket in their chunk of the bucket-sorted order and
                   the chunk before (Reformer); lsh_rotations [H, K, n_buckets / 2] are the
                   random projections of the hash, applied to the keys
        "full"     every token (dense; builds L×L scores, for comparison)
    Causal: rows are blocks of M + C, a memory block before each chunk (see causal.py);
    q holds the last Tq positions, k and v all T from a block boundary. "chunked" and
    "window" (window <= chunk_size) only.

    scale defaults to K^-0.5. attention_mask: bool [B, T], True for keys that may be read.
    memory_k / memory_v (like k / v): the keys and values memory rows read, for untied
    memory projections; default k / v. A row with no visible key returns 0.
    Returns o [B, Tq, H, V] in the dtype of q (fp16 / bf16 compute in fp32).
    Memory and work: O(M·(M+L) + L·(M+C)) scores (C, 2C or 3·window local keys a row).
    backend: "auto" or "torch", both the torch forms ("triton" is a ConfigError).
    """
    check_no_state("gmat_attention", initial_state, output_final_state,
                   "pass the rows of the last blocks as k and v, as the gmat layer's GmatCache does")
    B, Tq, T, H, K, V = check_qkv(q, k, v, memory_k, memory_v, attention_mask)
    check_pattern(pattern, causal=causal, num_memory=num_memory, chunk_size=chunk_size,
                  window=window, lsh_rotations=lsh_rotations, head_dim=K, heads=H)
    dt = accumulation_dtype(q.dtype)
    scale = default_scale(scale, K)
    if causal:
        if Tq > T:
            raise ShapeError(f"q: causal attention needs Tq <= T, got Tq={Tq}, T={T}")
        o = gmat_causal(q, k, v, num_memory=num_memory, chunk_size=chunk_size, pattern=pattern,
                        window=window, scale=scale, valid=attention_mask, memory_k=memory_k,
                        memory_v=memory_v, dtype=dt)
    else:
        if Tq != T:
            raise ShapeError(f"q: bidirectional GMAT has one query a position, expected Tq = T = {T}, "
                             f"got shape {tuple(q.shape)}")
        if T < num_memory:
            raise ShapeError(f"k: expected at least num_memory = {num_memory} positions (the memory "
                             f"rows come first), got shape {tuple(k.shape)}")
        o = gmat_bidirectional(q, k, v, num_memory=num_memory, pattern=pattern, chunk_size=chunk_size,
                               window=window, lsh_rotations=lsh_rotations, scale=scale,
                               valid=attention_mask, memory_k=memory_k, memory_v=memory_v, dtype=dt)
    return o.to(q.dtype), None


__all__ = [
    "CAUSAL_PATTERNS", "PATTERNS", "bidirectional_mask", "causal_mask", "gmat_attention",
    "gmat_attention_reference", "gmat_bidirectional", "gmat_causal", "lsh_buckets",
]
