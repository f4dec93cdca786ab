"""A decoder-only causal language model whose attention layer comes from the registry.

Pre-norm blocks: x = x + attn(norm(x)); x = x + ff(norm(x)). Embeddings tied to the
output head. Positions: rotary (inside each attention layer), learned (absolute, added to
the embeddings), split (absolute p = 512·q + r as the sum of two learned tables, for long
sequences), or none.

Hybrid models: `model.attention_layers` gives chosen layers a mechanism of their own (e.g.
softmax, or a window, in a few layers of a bounded-memory model); every other layer uses
`model.attention`.

Memory tokens: when the mechanism asks for them (`memattn.layers.base.MemoryLayout`), the
trunk inserts M learned embeddings (no position) into the sequence before the blocks,
as one prefix or a fresh block every C tokens, and drops them from the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memattn.config import SPLIT_BASE, ModelConfig
from memattn.errors import ConfigError, ShapeError
from memattn.layers.base import (
    AttentionState,
    LayerSpec,
    MemoryLayout,
    build_attention,
    build_feedforward,
    check_mask,
    get_mechanism,
    layers_aux_loss,
    memory_layout,
    real_positions,
)
from memattn.layers.cross import build_cross_attention


def make_norm(kind: str, d: int) -> nn.Module:
    return nn.RMSNorm(d) if kind == "rmsnorm" else nn.LayerNorm(d)


class FeedForward(nn.Module):
    """Position-wise MLP: d -> hidden -> d with GELU."""

    def __init__(self, d: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(nn.functional.gelu(self.up(x))))


class Block(nn.Module):
    """One pre-norm block: attention sublayer, then a feed-forward: the model's MLP, the mechanism's own
    sublayer (`Mechanism.feedforward`), or none when the mechanism replaces it.

    With `cross`, a cross-attention sublayer (`memattn.layers.cross`) sits between the two
    and reads the source memory passed to `forward`.
    """

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, cross: bool = False) -> None:
        super().__init__()
        own = cfg.layer_attention(spec.layer_idx)  # this layer's mechanism (hybrid models)
        self.norm_attn = make_norm(cfg.norm, cfg.d_model)
        self.attn = build_attention(own.name, own.typed, spec)
        mech = get_mechanism(own.name)
        self.reads_layer_outputs = mech.reads_layer_outputs  # e.g. abc-workspace
        self.norm_cross = make_norm(cfg.norm, cfg.d_model) if cross else None
        source = cfg.cross_attention or cfg.attention
        self.cross = build_cross_attention(source.name, source.typed, spec) if cross else None
        hidden = int(cfg.ff_mult * cfg.d_model)
        ff = build_feedforward(own.name, own.typed, spec)  # the mechanism's own, if any
        if ff is None and hidden > 0 and not mech.replaces_feedforward:
            ff = FeedForward(cfg.d_model, hidden, cfg.dropout)
        self.norm_ff = make_norm(cfg.norm, cfg.d_model) if ff is not None else None
        self.ff = ff

    def forward(self, x, state=None, attention_mask=None, memory=None, positions=None, layer_outputs=None):
        kwargs = {} if positions is None else {"positions": positions}
        if self.reads_layer_outputs:
            kwargs["layer_outputs"] = layer_outputs
        h, state = self.attn(self.norm_attn(x), memory_state=state, attention_mask=attention_mask, **kwargs)
        x = x + h
        if self.cross is not None:
            x = x + self.cross(self.norm_cross(x), memory)
        if self.ff is not None:
            x = x + self.ff(self.norm_ff(x))
        return x, state


class SplitPositions(nn.Module):
    """Absolute positions p = base·q + r embedded as E_r[r] + E_q[q] (GMAT): positions [T] -> [T, d].

    With base 512 and q < 64, two small tables cover 32,768 positions.
    """

    def __init__(self, max_len: int, d: int, base: int = SPLIT_BASE) -> None:
        super().__init__()
        self.base = base
        self.low = nn.Embedding(min(base, max_len), d)  # r = p mod base
        self.high = nn.Embedding(-(-max_len // base), d)  # q = p // base

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.low(positions % self.base) + self.high(positions // self.base)


class LearnedPositions(nn.Embedding):
    """Absolute positions p < max_len, a learned row each: positions [T] -> [T, d]."""


def position_tables(model: nn.Module) -> dict[str, bool]:
    """The weights of `model`'s absolute position tables by state-dict name, each with whether
    its rows are blocks (q of a split table's p = 512·q + r) rather than single positions."""
    tables = {}
    for name, m in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        if isinstance(m, SplitPositions):
            tables.update({f"{prefix}low.weight": False, f"{prefix}high.weight": True})
        elif isinstance(m, LearnedPositions):
            tables[f"{prefix}weight"] = False
    return tables


def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """GPT-2 style: linear and embedding weights N(0, cfg.init_std), biases 0, residual output
    projections N(0, cfg.init_std / √(2·n_layers)); then each module that has its own init
    for some parameters (`reset_own_parameters()`, e.g. a mechanism's option) applies it."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=cfg.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    for name, p in model.named_parameters():
        if name.endswith(("attn.out.weight", "cross.out.weight", "ff.down.weight")):
            nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
    for m in model.modules():
        if hasattr(m, "reset_own_parameters"):
            m.reset_own_parameters()


def insert_memory(x: torch.Tensor, memory: torch.Tensor, layout: MemoryLayout, offset: int,
                  attention_mask: torch.Tensor | None = None):
    """Insert memory blocks into x [B, T, d] whose first token sits at position `offset`.

    memory [M, d]. Returns (sequence [B, T + n·M, d], its attention mask or None, index [T]
    of the tokens in it); a block goes before each token at a multiple of `layout.every`
    (every = 0: before position 0 only).
    """
    B, T, d = x.shape
    M = layout.tokens
    if layout.every:
        first = (-offset) % layout.every
        starts = torch.arange(first, max(first, T), layout.every, device=x.device)
    else:
        starts = torch.arange(0 if offset == 0 else T, T, device=x.device)[:1]
    n = len(starts)
    blocks_before = torch.zeros(T, dtype=torch.long, device=x.device).index_fill(0, starts, 1).cumsum(0)
    index = torch.arange(T, device=x.device) + M * blocks_before  # [T]
    if n == 0:
        return x, attention_mask, index
    slots = (starts + M * torch.arange(n, device=x.device))[:, None] + torch.arange(M, device=x.device)
    out = x.new_zeros(B, T + n * M, d).index_copy(1, index, x)
    out = out.index_copy(1, slots.flatten(), memory.to(x.dtype).repeat(n, 1)[None].expand(B, -1, -1))
    if attention_mask is not None:
        attention_mask = attention_mask.new_ones(B, T + n * M).index_copy(1, index, attention_mask)
    return out, attention_mask, index


@dataclass
class ModelCache:
    """Decoding state of a whole model: one state per layer and the position reached.

    What decoding builds on: `reorder` (beam search: rows picked, repeated or dropped),
    `batch_select`, `to` (device, dtype), `crop` (forget the last tokens, where every layer
    keeps its tokens apart), `nbytes` and `fixed_size` (whether it stays the same size).

    `batch`: the rows its states hold (set by `init_cache`, followed by `reorder` and
    `repeat_interleave`; None: taken from the first input). Every step checks its input has
    that many rows, for every mechanism at once: a state of B rows fed fewer would broadcast
    silently in some of them.
    """

    states: list[AttentionState]
    position: int = 0
    real: torch.Tensor | None = None  # [B] real tokens read per row, once a mask was given
    batch: int | None = None

    def check_batch(self, B: int, name: str = "idx") -> None:
        """ShapeError unless an input `name` of B rows fits the cache's rows (taken from it when
        the cache does not know them yet)."""
        if self.batch is None:
            self.batch = B
        elif B != self.batch:
            raise ShapeError(f"{name}: the cache holds the state of {self.batch} row(s) (init_cache({self.batch}), "
                             f"or reorder / batch_select since), got a batch of {B} row(s); give it {self.batch} "
                             "rows, or select the rows of the cache first (batch_select)")

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.states)

    @property
    def fixed_size(self) -> bool:
        return all(s.fixed_size for s in self.states)

    def reorder(self, indices: torch.Tensor) -> ModelCache:
        """Row b of every state becomes row indices[b] of before (indices [B'] int64, values may
        repeat, B' may differ from B): beams follow their parents. In place; returns self.
        Row numbers must be integers in [0, B): checked on every device (on a GPU, one small read
        back per call, as beam search reads its scores anyway), and by a device-side assertion while
        a CUDA graph is being captured, where nothing can be read back."""
        indices = torch.as_tensor(indices)
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ShapeError(f"indices: expected integer row numbers, got dtype {indices.dtype}")
        indices = indices.long()
        if indices.dim() != 1:
            raise ShapeError(f"indices: expected row numbers [B'], got shape {tuple(indices.shape)}")
        if self.batch is not None and indices.numel():
            if indices.is_cuda and torch.cuda.is_current_stream_capturing():
                torch._assert_async(((indices >= 0) & (indices < self.batch)).all())
            elif (bounds := (int(indices.min()), int(indices.max())))[0] < 0 or bounds[1] >= self.batch:
                raise ShapeError(f"indices: row numbers must lie in [0, {self.batch}) (the rows the cache holds), "
                                 f"got {bounds[0]} to {bounds[1]}")
        if self.real is not None:
            self.real = self.real.index_select(0, indices.to(self.real.device))
        for state in self.states:
            state.map_tensors(lambda t, batched: t.index_select(0, indices.to(t.device)) if batched else t)
        self.batch = len(indices)
        return self

    def repeat_interleave(self, repeats: int) -> ModelCache:
        """Each row repeated `repeats` times in place (row b becomes rows b·r .. b·r + r - 1):
        the beams of one prompt start from its state. Returns self."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ConfigError(f"repeats: expected a whole number of copies >= 1, got {repeats!r}")
        if self.real is not None:
            self.real = self.real.repeat_interleave(repeats, 0)
        for state in self.states:
            state.map_tensors(lambda t, batched: t.repeat_interleave(repeats, 0) if batched else t)
        if self.batch is not None:
            self.batch *= repeats
        return self

    def batch_select(self, rows: torch.Tensor) -> ModelCache:
        """Keep only `rows` (e.g. the sequences still being decoded); in place, returns self."""
        return self.reorder(rows)

    def to(self, device=None, dtype: torch.dtype | None = None) -> ModelCache:
        """Move every state's tensors to `device` and its floating-point ones to `dtype`."""
        def move(t: torch.Tensor, batched: bool) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None)

        for state in self.states:
            state.map_tensors(move)
        if self.real is not None:
            self.real = self.real.to(device)
        return self

    def crop(self, length: int) -> ModelCache:
        """Forget every token after the first `length`; a state that cannot (a bounded memory)
        raises ConfigError before any state is changed."""
        if not 0 <= length <= self.position:
            raise ConfigError(f"crop: expected a length in 0 .. {self.position}, got {length}")
        refusing = [type(s).__name__ for s in self.states if not s.can_crop]
        if refusing:
            raise ConfigError(f"crop: the states {sorted(set(refusing))} hold summaries of their tokens "
                              "and cannot forget the last ones")
        if self.real is not None:
            raise ConfigError("crop: the cache holds padded rows, whose real lengths differ; crop "
                              "works on unpadded caches")
        for state in self.states:
            state.crop(length)
        self.position = length
        return self


class Transformer(nn.Module):
    """Embeddings, positions and a stack of blocks: token ids [B, T] -> hidden [B, T, d].

    `causal` says whether the attention layers are built for a decoder (causal) or an
    encoder (bidirectional); `cross` adds cross attention to every block (the decoder of
    an encoder-decoder); subclasses add the heads.
    """

    def __init__(self, cfg: ModelConfig, *, causal: bool, cross: bool = False) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size: must be set (> 0) before building the model")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = LearnedPositions(cfg.max_len, cfg.d_model) if cfg.positions == "learned" else None
        if cfg.positions == "split":
            self.pos = SplitPositions(cfg.max_len, cfg.d_model)
        self.memory_layout = memory_layout(cfg.attention.name, cfg.attention.typed, causal=causal)
        self.memory = (nn.Embedding(self.memory_layout.tokens, cfg.d_model)
                       if self.memory_layout is not None else None)
        self.dropout = nn.Dropout(cfg.dropout)
        shared: dict[str, nn.Module] = {}
        self.blocks = nn.ModuleList(
            Block(cfg, LayerSpec(cfg.d_model, cfg.n_heads, causal=causal, layer_idx=i,
                                 n_layers=cfg.n_layers, max_len=cfg.max_len,
                                 positions=cfg.positions, dropout=cfg.dropout, shared=shared),
                  cross)
            for i in range(cfg.n_layers)
        )
        self.norm = make_norm(cfg.norm, cfg.d_model)

    def init_weights(self) -> None:
        init_weights(self, self.cfg)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the attention layers' auxiliary losses (of the mechanisms that declare one,
        e.g. the adaptive-span penalty), to add to the training objective; None if none gives one."""
        return layers_aux_loss(self)

    def positions(self, B: int, T: int, offset: int, cache: ModelCache | None,
                  attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Each token's position [B, T] counted over its row's real tokens (a padded row is
        placed as if alone), and the cache's count of real tokens moved on; None when no row was
        ever padded (every token then sits at offset, offset + 1, ...)."""
        if self.memory is not None and self.memory_layout.every and attention_mask is not None \
                and not bool(attention_mask.all()):
            raise ConfigError("attention_mask: a causal gmat model places its memory blocks at the same "
                              "positions in every row of a batch, so it cannot read left-padded rows; "
                              "give it rows of one length (or one row at a time)")
        before = cache.real if cache is not None else None
        positions, real = real_positions(before, offset, attention_mask, B, T, self.embed.weight.device)
        if cache is not None and real is not None:
            cache.real = real
        return positions

    def hidden(self, idx: torch.Tensor, *, cache: ModelCache | None = None,
               attention_mask: torch.Tensor | None = None,
               memories: list | None = None, layer_inputs: list | None = None,
               run_block: Callable | None = None) -> torch.Tensor:
        """idx [B, T] -> final-norm hidden states [B, T, d]; with `cache`, continue and update it.

        memories: with cross attention, the source memory of each block.
        layer_inputs: a list to which each block's input [B, T, d] is appended (memory rows
        left out): the embeddings, then each block's output but the last.
        run_block: called as run_block(block, *args) in the place of block(*args), e.g. to
        recompute each block in the backward pass (activation checkpointing) from outside.
        """
        if idx.dim() != 2 or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise ShapeError(f"idx: expected integer token ids [B, T], got shape {tuple(idx.shape)} "
                             f"of dtype {idx.dtype}")
        B, T = idx.shape
        check_mask(attention_mask, B, T)
        if B == 0 or T == 0:
            raise ShapeError(f"idx: expected at least one sequence of at least one token, got shape {(B, T)}")
        if attention_mask is not None:  # a padded position's id is never read: any pad id will do
            idx = idx.masked_fill(~attention_mask, 0)
        if torch.compiler.is_compiling():  # a compiled decoding step reads nothing back
            torch._assert_async(((idx >= 0) & (idx < self.cfg.vocab_size)).all(),
                                f"idx: token ids must lie in [0, {self.cfg.vocab_size}) (model.vocab_size)")
        elif idx.device.type == "cpu":  # on a GPU the check would cost a synchronisation every call
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= self.cfg.vocab_size:
                raise ShapeError(f"idx: token ids must lie in [0, {self.cfg.vocab_size}) (model.vocab_size), "
                                 f"got ids from {low} to {high}")
        if cache is not None:
            cache.check_batch(B)
        offset = cache.position if cache is not None else 0
        positions = self.positions(B, T, offset, cache, attention_mask)
        x = self.embed(idx)
        if self.pos is not None:
            last = offset + T - 1 if positions is None else int(positions.max())
            if last >= self.cfg.max_len:
                raise ShapeError(f"idx: positions up to {last + 1} exceed model.max_len={self.cfg.max_len}"
                                 " of the learned position table")
            x = x + self.pos(torch.arange(offset, offset + T, device=idx.device) if positions is None
                             else positions)
        x = self.dropout(x)
        tokens = None
        if self.memory is not None:
            x, attention_mask, tokens = insert_memory(x, self.memory.weight, self.memory_layout, offset,
                                                      attention_mask)
        layer_outputs: dict = {}  # what a layer passes to later ones, in this pass only
        for i, block in enumerate(self.blocks):
            if layer_inputs is not None:
                layer_inputs.append(x if tokens is None or x.shape[1] == T else x[:, tokens])
            state = cache.states[i] if cache is not None else None
            args = (x, state, attention_mask, memories[i] if memories is not None else None, positions,
                    layer_outputs)
            x, state = block(*args) if run_block is None else run_block(block, *args)
            if cache is not None:
                cache.states[i] = state
        if cache is not None:
            cache.position += T
        if tokens is not None and x.shape[1] != T:
            x = x[:, tokens]  # drop the memory rows
        return self.norm(x)


class CausalLM(Transformer):
    """Token ids [B, T] -> next-token logits [B, T, vocab]; decodes with a per-layer cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, causal=True)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.init_weights()
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def init_cache(self, batch_size: int, device=None, dtype=None) -> ModelCache:
        """An empty decoding cache: each layer's own state object."""
        return ModelCache([b.attn.init_state(batch_size, device=device, dtype=dtype) for b in self.blocks],
                          batch=batch_size)

    def forward(self, idx: torch.Tensor, *, cache: ModelCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, T] -> logits [B, T, vocab]. With `cache`, continue after its position and update it."""
        return self.head(self.hidden(idx, cache=cache, attention_mask=attention_mask))
