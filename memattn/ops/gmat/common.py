"""What the forms of GMAT attention share: argument checks, the LSH hash and a masked softmax.

Two layouts of the rows (queries) and columns (keys) of one attention call:

- bidirectional: [memory (M rows); main sequence (L rows)], T = M + L; the M memory
  tokens sit before the sequence and carry no position.
- causal: blocks of S = M + C rows, [m_0, x_0 … x_{C-1}, m_1, x_C …]: a fresh copy of the
  M memory tokens precedes every chunk of C main tokens, so the memory a chunk reads was
  written before the chunk began (see causal.py). Position p of that sequence lies in
  block p // S; its offset r = p % S is a memory slot when r < M, else main token
  (p // S)·C + r - M.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memattn.errors import ConfigError, ShapeError, check_tensor
from memattn.ops import contract

PATTERNS = ("chunked", "window", "lsh", "full")
CAUSAL_PATTERNS = ("chunked", "window")


def _positive_int(name: str, value, *, zero_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not zero_ok):
        want = "a non-negative int" if zero_ok else "a positive int"
        raise ConfigError(f"{name}: expected {want}, got {value!r}")


def check_pattern(pattern: str, *, causal: bool, num_memory: int, chunk_size: int, window: int,
                  lsh_rotations: torch.Tensor | None, head_dim: int | None, heads: int | None) -> None:
    """Raise ConfigError (an option) or ShapeError (lsh_rotations) naming the argument unless
    the pattern and its sizes can be used."""
    _positive_int("num_memory", num_memory, zero_ok=True)
    if pattern not in PATTERNS:
        raise ConfigError(f"pattern: expected one of {', '.join(PATTERNS)}, got {pattern!r}")
    if causal and pattern not in CAUSAL_PATTERNS:
        why = ("hash buckets mix past and future tokens and decoding would need every past key"
               if pattern == "lsh" else "dense attention to the past is softmax attention: use attention=softmax")
        raise ConfigError(f"pattern: causal GMAT supports {', '.join(CAUSAL_PATTERNS)}, got {pattern!r} ({why})")
    _positive_int("chunk_size", chunk_size)
    _positive_int("window", window)
    if causal and pattern == "window" and window > chunk_size:
        raise ConfigError(f"window: a causal window must fit in one chunk (window <= chunk_size = "
                         f"{chunk_size}, the memory period), got window={window}")
    if pattern == "lsh":
        if lsh_rotations is None:
            raise ShapeError("lsh_rotations: the lsh pattern needs random rotations [H, K, n_buckets / 2]")
        check_tensor("lsh_rotations", lsh_rotations, "[H, K, n_buckets / 2]", heads, head_dim, None)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, memory_k: torch.Tensor | None,
              memory_v: torch.Tensor | None, attention_mask: torch.Tensor | None
              ) -> tuple[int, int, int, int, int, int]:
    """Shapes of one call: q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], memory_k / memory_v
    like k / v, attention_mask bool [B, T]. Returns (B, Tq, T, H, K, V)."""
    B, Tq, T, H, K, V = contract.check_qkv(q, k, v)
    if (memory_k is None) != (memory_v is None):
        raise ShapeError("memory_k, memory_v: give both (untied memory projections) or neither")
    if memory_k is not None:
        check_tensor("memory_k", memory_k, "[B, T, H, K]", B, T, H, K)
        check_tensor("memory_v", memory_v, "[B, T, H, V]", B, T, H, V)
    contract.check_mask(attention_mask, B, T)
    return B, Tq, T, H, K, V


def lsh_buckets(k: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Angular LSH of keys (Reformer): bucket = argmax([k R; -k R]).

    k [B, L, H, K], rotations [H, K, n_buckets / 2] -> buckets int64 [B, H, L] in [0, n_buckets).
    Buckets are a function of the keys only and carry no gradient.
    """
    with torch.no_grad():
        proj = torch.einsum("blhk,hkn->bhln", k.float(), rotations.float())  # [B, H, L, n/2]
        return torch.cat((proj, -proj), dim=-1).argmax(dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """softmax(scale · q kᵀ over the visible keys) v for every leading index, through the fused
    `scaled_dot_product_attention`.

    q [..., R, K], k [..., J, K], v [..., J, V], visible bool broadcastable to [..., R, J]
    (None: all) -> o [..., R, V]. A row with no visible key returns 0, never NaN: it is
    pointed at key 0 for the kernel and its output (and so its gradient) is zeroed.
    """
    lead, R, J = q.shape[:-2], q.shape[-2], k.shape[-2]
    q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k.expand(*lead, *k.shape[-2:]),
                                                            v.expand(*lead, *v.shape[-2:])))
    mask = empty = None
    if visible is not None:
        visible = visible.expand(*lead, R, J)
        empty = ~visible.any(dim=-1, keepdim=True)  # [..., R, 1]
        if visible.device.type != "cpu" or bool(empty.any()):  # a GPU would be waited for
            first = torch.arange(J, device=q.device) == 0
            visible = visible | (empty & first)
        else:
            empty = None
        mask = visible.reshape(-1, 1, R, J)
    o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    o = o.reshape(*lead, R, v.shape[-1])
    return o if empty is None else o.masked_fill(empty, 0.0)


def heads_first(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, T, D] in `dtype`."""
    return t.transpose(1, 2).to(dtype)


def pad_to(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad dim `dim` of t at its end up to `length`."""
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat((t, t.new_zeros(shape)), dim=dim)
