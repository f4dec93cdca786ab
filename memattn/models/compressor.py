"""Sequence compression with global memory (GMAT, Gupta & Berant 2020, §2.1).

An encoder whose n_layers are split in three:

    compress     token + position embeddings, M learned memory tokens before them
                 -> N_c blocks over memory and sequence -> keep the M memory rows
                 -> N_m blocks over the memory alone                     = M vectors [B, M, d]
    decompress   the M vectors before L position embeddings (the queries: no token is seen)
                 -> N_d blocks -> final norm -> token logits at every position [B, L, vocab]

so a sequence of L tokens is carried by M vectors alone. The attention mechanism comes from
the registry and must provide memory tokens (`gmat` with num_memory > 0). The decompression
queries are learned absolute position embeddings: the model's own table with
model.positions learned or split, else a split table of their own (rotary positions still
act inside every layer).

Compressed sequences are stored as one safetensors file ("memory" [N, M, d], "lengths"
[N]) with JSON metadata naming the model that made them, and read back with clear errors.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memattn.checkpoint import load_checkpoint, restore, save_checkpoint
from memattn.config import ModelConfig, from_dict, to_dict
from memattn.errors import CheckpointError, ConfigError, ShapeError
from memattn.fileio import atomic_write, read_tagged
from memattn.layers.base import LayerSpec, layers_aux_loss, memory_layout
from memattn.models.lm import Block, LearnedPositions, SplitPositions, init_weights, make_norm

COMPRESSED_FORMAT = "memattn-compressed/1"
KIND = "compressor"


class Compressor(nn.Module):
    """Tokens [B, L] -> M memory vectors [B, M, d] -> hidden [B, L, d] -> logits [B, L, vocab].

    n_compress (N_c >= 1) and n_decompress (N_d >= 1) of cfg.n_layers blocks read memory
    and sequence; the N_m = n_layers - N_c - N_d blocks between them read the memory alone.
    """

    def __init__(self, cfg: ModelConfig, *, n_compress: int, n_decompress: int) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ConfigError("model.vocab_size: must be set (> 0) before building the model")
        n_memory = cfg.n_layers - n_compress - n_decompress
        if n_compress < 1 or n_decompress < 1 or n_memory < 0:
            raise ConfigError(f"compressor: expected n_compress >= 1, n_decompress >= 1 and "
                              f"n_compress + n_decompress <= model.n_layers = {cfg.n_layers}, got "
                              f"n_compress={n_compress}, n_decompress={n_decompress}")
        layout = memory_layout(cfg.attention.name, cfg.attention.typed, causal=False)
        if layout is None:
            raise ConfigError(f"attention: the compressor keeps only memory rows, and {cfg.attention.name!r} "
                              f"with these options has none (use attention=gmat with num_memory > 0)")
        self.cfg, self.layout = cfg, layout
        self.n_compress, self.n_decompress = n_compress, n_decompress
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = {"split": SplitPositions(cfg.max_len, cfg.d_model),
                    "learned": LearnedPositions(cfg.max_len, cfg.d_model)}.get(cfg.positions)
        # decompression queries: the absolute table, or one of their own
        self.queries = self.pos if self.pos is not None else SplitPositions(cfg.max_len, cfg.d_model)
        self.memory = nn.Embedding(layout.tokens, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

        def blocks(first: int, count: int) -> nn.ModuleList:
            return nn.ModuleList(
                Block(cfg, LayerSpec(cfg.d_model, cfg.n_heads, causal=False, layer_idx=i,
                                     n_layers=cfg.n_layers, max_len=cfg.max_len,
                                     positions=cfg.positions, dropout=cfg.dropout))
                for i in range(first, first + count))

        self.compress_blocks = blocks(0, n_compress)
        self.memory_blocks = blocks(n_compress, n_memory)
        self.decompress_blocks = blocks(n_compress + n_memory, n_decompress)
        self.norm = make_norm(cfg.norm, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    @property
    def num_memory(self) -> int:
        return self.layout.tokens

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the attention layers' auxiliary losses (None if no mechanism gives one)."""
        return layers_aux_loss(self)

    def _positions(self, table: nn.Module | None, length: int, device) -> torch.Tensor | float:
        """Rows [L, d] of an absolute position table (0 without one)."""
        if length > self.cfg.max_len:
            raise ShapeError(f"length: positions up to {length} exceed model.max_len={self.cfg.max_len}")
        return 0.0 if table is None else table(torch.arange(length, device=device))

    def compress(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, L] (attention_mask bool [B, L], True for real tokens) -> memory [B, M, d]."""
        if idx.dim() != 2:
            raise ShapeError(f"idx: expected token ids [B, L], got shape {tuple(idx.shape)}")
        B, L = idx.shape
        M = self.num_memory
        x = self.dropout(self.embed(idx) + self._positions(self.pos, L, idx.device))
        x = torch.cat((self.memory.weight[None].expand(B, -1, -1), x), dim=1)
        mask = None if attention_mask is None else torch.cat(
            (attention_mask.new_ones(B, M), attention_mask), dim=1)
        for block in self.compress_blocks:
            x, _ = block(x, None, mask)
        memory = x[:, :M]
        for block in self.memory_blocks:
            memory, _ = block(memory, None, None)
        return memory

    def decompress(self, memory: torch.Tensor, length: int,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """memory [B, M, d] -> hidden [B, length, d], from the memory and positions alone.

        attention_mask bool [B, length]: False marks padding positions (as in `compress`).
        """
        M, d = self.num_memory, self.cfg.d_model
        if memory.dim() != 3 or memory.shape[1:] != (M, d):
            raise ShapeError(f"memory: expected [B, M={M}, d={d}], got shape {tuple(memory.shape)}")
        B = memory.shape[0]
        queries = self._positions(self.queries, length, memory.device)[None].expand(B, -1, -1).to(memory.dtype)
        x = torch.cat((memory, self.dropout(queries)), dim=1)
        mask = None if attention_mask is None else torch.cat(
            (attention_mask.new_ones(B, M), attention_mask), dim=1)
        for block in self.decompress_blocks:
            x, _ = block(x, None, mask)
        return self.norm(x[:, M:])

    def forward(self, idx: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, L] -> logits [B, L, vocab] rebuilt from the M compressed vectors."""
        memory = self.compress(idx, attention_mask)
        return self.head(self.decompress(memory, idx.shape[1], attention_mask))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


# ---------------------------------------------------------------------------------------
# Checkpoints of a compressor

def save_compressor(path: str | os.PathLike, model: Compressor, *, vocab: dict[str, Any], seq_len: int,
                    step: int = 0, metrics: dict[str, Any] | None = None) -> None:
    """Write the model, its vocabulary (Vocab.to_json) and training length as a checkpoint."""
    meta = {"kind": KIND, "config": {"model": to_dict(model.cfg)}, "vocab": vocab, "seq_len": seq_len,
            "compressor": {"n_compress": model.n_compress, "n_decompress": model.n_decompress},
            "metrics": metrics or {}}
    save_checkpoint(path, model, step=step, meta=meta)


def load_compressor(path: str | os.PathLike) -> tuple[Compressor, dict[str, Any]]:
    """(model in eval mode, checkpoint metadata) from a file saved by `save_compressor`."""
    ckpt = load_checkpoint(path)
    if ckpt.meta.get("kind") != KIND:
        raise CheckpointError(f"checkpoint {ckpt.path}: not a compressor checkpoint (made by "
                              f"`memattn experiment gmat-mlm` or save_compressor)")
    cfg = from_dict(ModelConfig, ckpt.meta["config"]["model"], "model")
    model = Compressor(cfg, **ckpt.meta["compressor"])
    restore(ckpt, model)
    return model.eval(), ckpt.meta


def fingerprint(model: nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers (names, dtypes, shapes, values)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# Compressed files

@dataclass
class Compressed:
    """Compressed sequences: memory [N, M, d] and the length of each sequence, [N]."""

    memory: torch.Tensor
    lengths: torch.Tensor
    meta: dict[str, Any]


def save_compressed(path: str | os.PathLike, memory: torch.Tensor, lengths: torch.Tensor, *,
                    model_fingerprint: str, **meta: Any) -> None:
    """Write memory [N, M, d] and lengths [N] atomically as safetensors with JSON metadata."""
    from safetensors.torch import save_file

    if memory.dim() != 3 or lengths.shape != (memory.shape[0],):
        raise ShapeError(f"memory, lengths: expected [N, M, d] and [N], got {tuple(memory.shape)} "
                         f"and {tuple(lengths.shape)}")
    info = dict(meta, format=COMPRESSED_FORMAT, model=model_fingerprint)
    tensors = {"memory": memory.detach().contiguous().cpu(),
               "lengths": lengths.to(torch.int64).contiguous().cpu()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"memattn": json.dumps(info)}))


def load_compressed(path: str | os.PathLike) -> Compressed:
    """Read a file written by `save_compressed`; anything else raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"compressed file {path}: no such file")
    meta, tensors = read_tagged(path, what="compressed file", error=CheckpointError)
    if meta.get("format") != COMPRESSED_FORMAT:
        raise CheckpointError(f"compressed file {path}: format {meta.get('format')!r}, expected "
                              f"{COMPRESSED_FORMAT!r}")
    memory, lengths = tensors.get("memory"), tensors.get("lengths")
    if memory is None or lengths is None or memory.dim() != 3 or lengths.shape != (memory.shape[0],):
        raise CheckpointError(f"compressed file {path}: expected tensors memory [N, M, d] and lengths [N]")
    return Compressed(memory, lengths, meta)


def check_compressed(compressed: Compressed, model: Compressor, path: str | os.PathLike) -> None:
    """CheckpointError unless every field of a compressed file fits `model`: memory
    [N, num_memory, d_model] of finite values, lengths in [1, seq_len] with seq_len within the
    model's max_len, and the stored token count equal to the lengths' sum."""
    memory, lengths, meta = compressed.memory, compressed.lengths, compressed.meta
    N, M, d = memory.shape
    if (M, d) != (model.num_memory, model.cfg.d_model):
        raise CheckpointError(f"compressed file {path}: memory vectors [N, {M}, {d}] do not fit the model's "
                              f"[N, {model.num_memory}, {model.cfg.d_model}]")
    if not memory.is_floating_point() or not bool(torch.isfinite(memory).all()):
        raise CheckpointError(f"compressed file {path}: the memory vectors are not all finite numbers")
    seq_len = meta.get("seq_len")
    if not isinstance(seq_len, int) or not 1 <= seq_len <= model.cfg.max_len:
        raise CheckpointError(f"compressed file {path}: seq_len {seq_len!r} is not a length the model "
                              f"reads (1 .. {model.cfg.max_len})")
    if N == 0 or lengths.dtype != torch.int64 or int(lengths.min()) < 1 or int(lengths.max()) > seq_len:
        raise CheckpointError(f"compressed file {path}: sequence lengths must lie in 1 .. {seq_len}, got "
                              + (f"{int(lengths.min())} .. {int(lengths.max())}" if N else "none"))
    if meta.get("tokens", int(lengths.sum())) != int(lengths.sum()):
        raise CheckpointError(f"compressed file {path}: it says {meta.get('tokens')!r} tokens, "
                              f"its lengths sum to {int(lengths.sum())}")


@torch.no_grad()
def compress_ids(model: Compressor, ids: np.ndarray, *, seq_len: int,
                 batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [n] cut into sequences of seq_len (the last may be shorter) -> (memory
    [N, M, d] fp32, lengths [N])."""
    if seq_len < 1 or seq_len > model.cfg.max_len:
        raise ConfigError(f"seq_len: expected 1 <= seq_len <= model.max_len = {model.cfg.max_len}, got {seq_len}")
    if batch_size < 1:
        raise ConfigError(f"batch_size: expected at least 1 sequence a batch, got {batch_size}")
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    n = len(ids)
    if n == 0:
        raise ShapeError("ids: nothing to compress (no tokens)")
    starts = list(range(0, n, seq_len))
    lengths = torch.tensor([min(seq_len, n - s) for s in starts])
    memories = []
    for b in range(0, len(starts), batch_size):
        chunk = starts[b:b + batch_size]
        width = int(lengths[b:b + batch_size].max())
        batch = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.bool)
        for row, s in enumerate(chunk):
            piece = ids[s:s + seq_len]
            batch[row, :len(piece)], mask[row, :len(piece)] = piece, True
        memories.append(model.compress(batch, None if bool(mask.all()) else mask).float())
    return torch.cat(memories), lengths


@torch.no_grad()
def decompress_ids(model: Compressor, memory: torch.Tensor, lengths: torch.Tensor, *,
                   n_symbols: int | None = None, batch_size: int = 16) -> np.ndarray:
    """memory [N, M, d], lengths [N] -> the argmax token ids of every position, concatenated.

    n_symbols: predict only ids below it (e.g. to leave out a mask token the model learned).
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size: expected at least 1 sequence a batch, got {batch_size}")
    out = []
    for b in range(0, memory.shape[0], batch_size):
        mem = memory[b:b + batch_size].to(next(model.parameters()).dtype)
        lens = lengths[b:b + batch_size]
        width = int(lens.max())
        mask = torch.arange(width)[None, :] < lens[:, None]
        logits = model.logits(model.decompress(mem, width, None if bool(mask.all()) else mask))
        if n_symbols is not None:
            logits = logits[..., :n_symbols]
        best = logits.argmax(-1)
        out.extend(best[row, :int(lens[row])].numpy() for row in range(len(lens)))
    return np.concatenate(out)
