"""Fixed-size document representations: encode documents once, answer queries later.

de Brébisson & Vincent 2016: with linear attention a document of any length n becomes one
K×V matrix, C = Σ_t v_t k_tᵀ (the paper's C = Σ h hᵀ over the document encoder's states h_t,
or Σ f fᵀ with the gated f = σ(W h + b) ⊙ h). A query q then reads r = C q in O(K·V),
whatever n, and without the document. This module builds those matrices, stores them in a
safetensors file and answers batches of queries against them.

    reps = encode(h, mask=mask)              # h [N, T, K] states of N documents -> N memories
    save("docs.safetensors", reps)           # atomic; JSON metadata names the format
    reps = load("docs.safetensors", key_dim=K)
    r = lookup(reps, q)                      # q [N, Q, K] -> r [N, Q, K]: r = C q per query

The memory is kept in the layout of the linear attention op: memory [N, H, K, V] holds
Cᵀ = Σ k vᵀ for each document and head (H = 1 for the paper's single memory), so
r = memoryᵀ q. Representations are stored in fp32 (fp64 for fp64 states). Bad input
raises `RepresentationError` (a file that is not ours, truncated or inconsistent) or
`memattn.errors.ShapeError` (queries or expectations of the wrong shape or dtype), both
ValueErrors that name the argument, what was expected and what came.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from memattn.errors import MemattnError, ShapeError, check_tensor
from memattn.fileio import atomic_write, read_tagged
from memattn.ops.contract import accumulation_dtype
from memattn.ops.linear import LinearAttentionState, linear_attention_read

FORMAT = "memattn-linear-representations"
VERSION = 1
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class RepresentationError(MemattnError, ValueError):
    """A representations file that is missing, not ours, truncated or inconsistent."""


@dataclass
class Representations:
    """N documents as fixed-size memories.

    memory [N, H, K, V]: Cᵀ = Σ_t k_t v_tᵀ per document and head, fp32 or fp64.
    lengths [N] int64: how many tokens each document wrote.
    meta: JSON-able notes stored with them (what encoder wrote them, the gate, ...).
    """

    memory: torch.Tensor
    lengths: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_tensor("memory", self.memory, "[N, H, K, V]", None, None, None, None)
        if self.memory.dtype not in _DTYPES.values():
            raise ShapeError(f"memory: expected dtype torch.float32 or torch.float64, "
                             f"got {self.memory.dtype}")
        check_tensor("lengths", self.lengths, "[N]", self.memory.shape[0])
        if self.lengths.dtype != torch.int64:
            raise ShapeError(f"lengths: expected dtype torch.int64, got {self.lengths.dtype}")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as e:
            raise ShapeError(f"meta: expected a JSON-able dict, got {self.meta!r} ({e})") from None

    @property
    def count(self) -> int:
        return self.memory.shape[0]

    @property
    def heads(self) -> int:
        return self.memory.shape[1]

    @property
    def key_dim(self) -> int:
        return self.memory.shape[2]

    @property
    def value_dim(self) -> int:
        return self.memory.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.memory.dtype

    def nbytes(self) -> int:
        """Bytes of the memories: N·H·K·V numbers, whatever the documents' lengths."""
        return self.memory.numel() * self.memory.element_size()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index) -> Representations:
        """A subset of the documents (an int, slice, list or index tensor)."""
        if isinstance(index, int):
            index = [index]
        return Representations(self.memory[index], self.lengths[index], dict(self.meta))


def gated_write(h: torch.Tensor, gate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The paper's gated vector f = σ(gate(h)) ⊙ h, written as C = Σ f fᵀ."""
    return torch.sigmoid(gate(h)) * h


def encode(keys: torch.Tensor, values: torch.Tensor | None = None, *,
           gate: Callable[[torch.Tensor], torch.Tensor] | None = None,
           mask: torch.Tensor | None = None, meta: dict[str, Any] | None = None
           ) -> Representations:
    """Write each document into its memory: Cᵀ = Σ_t k_t v_tᵀ over its real tokens.

    keys [N, T, K] (one memory per document) or [N, T, H, K] (one per head); values of the
    same layout [.., V], default the keys themselves: the paper's C = Σ h hᵀ.
    gate: the paper's gated form. A module or function mapping keys [.., K] to gate logits
    [.., K]; the written vector is f = σ(gate(h)) ⊙ h and C = Σ f fᵀ (needs values=None).
    mask [N, T] bool: True for real tokens; padding writes nothing. Gradients flow to the
    inputs (the memory is as differentiable as the states it is built from).
    """
    if keys.dim() == 3:
        keys = keys[:, :, None]  # [N, T, 1, K]
        values = None if values is None else _as_heads("values", values, keys)
    check_tensor("keys", keys, "[N, T, K] or [N, T, H, K]", None, None, None, None)
    if not keys.is_floating_point():
        raise ShapeError(f"keys: expected a floating point tensor, got dtype {keys.dtype}")
    N, T = keys.shape[:2]
    if gate is not None:
        if values is not None:
            raise ShapeError("values: the gated form writes f fᵀ with f = σ(gate(h)) ⊙ h, so "
                             "it takes keys only; got values as well")
        keys = gated_write(keys, gate)
    if values is None:
        values = keys
    else:
        check_tensor("values", values, "[N, T, H, V]", N, T, keys.shape[2], None)
        if values.dtype != keys.dtype:
            raise ShapeError(f"values: expected the dtype of keys ({keys.dtype}), "
                             f"got {values.dtype}")
    if mask is None:
        lengths = torch.full((N,), T, dtype=torch.int64)
    else:
        check_tensor("mask", mask, "[N, T]", N, T)
        if mask.dtype != torch.bool:
            raise ShapeError(f"mask: expected dtype torch.bool, got {mask.dtype}")
        lengths = mask.sum(1).cpu()
        keys = keys * mask[:, :, None, None].to(keys.dtype)
    dt = accumulation_dtype(keys.dtype)
    memory = torch.einsum("nthk,nthv->nhkv", keys.to(dt), values.to(dt))  # Σ_t k_t v_tᵀ
    return Representations(memory, lengths, dict(meta or {}))


def _as_heads(name: str, t: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    check_tensor(name, t, "[N, T, V] (like keys [N, T, K])", keys.shape[0], keys.shape[1], None)
    return t[:, :, None]


def lookup(reps: Representations, queries: torch.Tensor, *,
           scale: float | None = None) -> torch.Tensor:
    """Read every query from its document's memory: r = scale · C q, O(K·V) a query.

    queries [N, Q, H, K] (Q queries for each of the N documents), or [N, Q, K] when H = 1,
    in the representations' dtype -> r [N, Q, H, V] (or [N, Q, V]) in that dtype.
    scale: a float, None for 1 (the paper's read). To ask one document many queries, index
    the representations first (reps[[0, 0, 3]]).
    """
    if not isinstance(reps, Representations):
        raise ShapeError(f"reps: expected Representations, got {type(reps).__name__}")
    is_tensor = isinstance(queries, torch.Tensor)
    single = is_tensor and queries.dim() == 3 and reps.heads == 1
    q = queries[:, :, None] if single else queries
    shape = "[N, Q, K]" if single else "[N, Q, H, K]"
    if not is_tensor or q.dim() != 4:
        raise ShapeError(f"queries: expected {'[N, Q, K] or ' if reps.heads == 1 else ''}"
                         f"[N, Q, H, K] with H = {reps.heads}, got shape "
                         f"{tuple(getattr(queries, 'shape', ()))}")
    if q.shape[0] != reps.count:
        raise ShapeError(f"queries: expected {shape} with N = {reps.count} (one row of queries "
                         f"per representation), got shape {tuple(queries.shape)}")
    if q.shape[2] != reps.heads:
        raise ShapeError(f"queries: expected {shape} with H = {reps.heads}, got shape "
                         f"{tuple(queries.shape)}")
    if q.shape[3] != reps.key_dim:
        raise ShapeError(f"queries: expected {shape} with K = {reps.key_dim} (the key dim of the "
                         f"representations), got shape {tuple(queries.shape)}")
    if not q.is_floating_point() or q.dtype != reps.dtype:
        raise ShapeError(f"queries: expected dtype {reps.dtype} (that of the representations), "
                         f"got {q.dtype}")
    r = linear_attention_read(q, LinearAttentionState(reps.memory.to(q.device)), scale=scale)  # [N, Q, H, V]
    return r[:, :, 0] if single else r


def save(path: str | os.PathLike, reps: Representations) -> None:
    """Write `reps` to `path` (safetensors, atomically) with JSON metadata naming the format."""
    if not isinstance(reps, Representations):
        raise ShapeError(f"reps: expected Representations, got {type(reps).__name__}")
    header = {"format": FORMAT, "version": VERSION, "count": reps.count, "heads": reps.heads,
              "key_dim": reps.key_dim, "value_dim": reps.value_dim,
              "dtype": str(reps.dtype).removeprefix("torch."), "meta": reps.meta}
    tensors = {"memory": reps.memory.detach().contiguous().cpu(),
               "lengths": reps.lengths.detach().contiguous().cpu()}
    text = json.dumps(header)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"memattn": text}))


def load(path: str | os.PathLike, *, key_dim: int | None = None,
         dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
         ) -> Representations:
    """Read representations written by `save`, bit for bit.

    key_dim / dtype: what the caller expects (e.g. its query encoder's K and dtype); a file
    that holds something else raises ShapeError instead of failing later in `lookup`.
    """
    path = Path(path)
    if not path.exists():
        raise RepresentationError(f"path: no such file {str(path)!r}")
    if not path.is_file():
        raise RepresentationError(f"path: expected a representations file, got {str(path)!r}, "
                                  "which is not a file")
    info, tensors = read_tagged(path, what="representations file", error=RepresentationError)
    if info.get("format") != FORMAT:
        got = info.get("format")
        raise RepresentationError(f"path: {str(path)!r} holds format {got!r}, expected "
                                  f"{FORMAT!r} (document representations)")
    if info.get("version") != VERSION:
        raise RepresentationError(f"path: {str(path)!r} holds {FORMAT} version "
                                  f"{info.get('version')!r}; this memattn reads version {VERSION}")
    reps = _check_contents(path, info, tensors)
    if key_dim is not None and reps.key_dim != key_dim:
        raise ShapeError(f"key_dim: expected representations with K = {key_dim}, but "
                         f"{str(path)!r} holds K = {reps.key_dim}")
    if dtype is not None and reps.dtype != dtype:
        raise ShapeError(f"dtype: expected representations of dtype {dtype}, but "
                         f"{str(path)!r} holds {reps.dtype}")
    if str(device) != "cpu":
        reps = Representations(reps.memory.to(device), reps.lengths, reps.meta)
    return reps


def _check_contents(path: Path, info: dict[str, Any], tensors: dict[str, torch.Tensor]
                    ) -> Representations:
    """The tensors must be those the metadata describes; otherwise the file was altered."""
    where = f"path: {str(path)!r}"
    if set(tensors) != {"memory", "lengths"}:
        raise RepresentationError(f"{where}: expected tensors 'memory' and 'lengths', "
                                  f"got {sorted(tensors)}")
    memory, lengths = tensors["memory"], tensors["lengths"]
    want_dtype = _DTYPES.get(info.get("dtype"))
    if want_dtype is None or memory.dtype != want_dtype:
        raise RepresentationError(f"{where}: memory has dtype {memory.dtype}, metadata says "
                                  f"{info.get('dtype')!r} (expected float32 or float64)")
    want = tuple(info.get(k) for k in ("count", "heads", "key_dim", "value_dim"))
    if tuple(memory.shape) != want:
        raise RepresentationError(f"{where}: memory has shape {tuple(memory.shape)}, metadata "
                                  f"says [N, H, K, V] = {list(want)}")
    if lengths.dtype != torch.int64 or tuple(lengths.shape) != (want[0],):
        raise RepresentationError(f"{where}: lengths has shape {tuple(lengths.shape)} and dtype "
                                  f"{lengths.dtype}, expected [{want[0]}] int64")
    meta = info.get("meta", {})
    if not isinstance(meta, dict):
        raise RepresentationError(f"{where}: metadata 'meta' should be a mapping, got {meta!r}")
    return Representations(memory, lengths, meta)
