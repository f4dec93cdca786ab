"""`gmat`: global memory tokens over sparse attention (Gupta & Berant 2020, GMAT).

The model inserts M learned memory tokens into the sequence (see `gmat_memory_layout`); this
layer lets them attend densely to everything (the write: the memory summarises the
sequence) and lets every token attend to all of them besides its sparse pattern of
neighbours (the read). Work and memory O(M·(M+L) + L·(M+C)): never an L×L matrix.

Bidirectional (encoder): one block of M memory tokens before the sequence, reading all
M + L positions. Causal (decoder): a fresh memory block before every chunk of C tokens,
reading only the block before it (memory and chunk), so a token reads a memory written
from the past alone; decoding keeps the last two blocks: a fixed-size state. The lsh and
full patterns are bidirectional only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from memattn.errors import ConfigError, ShapeError, check_tensor
from memattn.layers.base import (AttentionLayer, AttentionState, LayerSpec, MemoryLayout, StateSize,
                                 check_mask, register)
from memattn.ops.gmat import CAUSAL_PATTERNS, PATTERNS, gmat_attention

LSH_SEED = 20_200_605  # rotations are drawn from this seed and the layer index: reproducible


@dataclass
class GmatOptions:
    num_memory: int = 8  # M memory tokens (0: the sparse pattern alone)
    pattern: Literal["chunked", "window", "lsh", "full"] = "chunked"
    chunk_size: int = 64  # C: chunked and lsh chunks; in causal models also the memory period
    window: int = 32  # sliding window: tokens read on each side (causal: before), <= C when causal
    n_buckets: int = 8  # lsh: hash buckets (even)
    untied_memory_projections: bool = False  # memory rows use their own q / k / v projections
    bias: bool = False  # biases on the projections

    def __post_init__(self) -> None:
        if self.num_memory < 0:
            raise ConfigError(f"num_memory: expected M >= 0 memory tokens, got {self.num_memory}")
        if self.pattern not in PATTERNS:
            raise ConfigError(f"pattern: expected one of {', '.join(PATTERNS)}, got {self.pattern!r}")
        for name in ("chunk_size", "window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected a positive int, got {getattr(self, name)}")
        if self.n_buckets < 2 or self.n_buckets % 2:
            raise ConfigError(f"n_buckets: expected an even number >= 2, got {self.n_buckets}")


class GmatCache(AttentionState):
    """Causal decoding state: keys and values of the last two blocks, [B, 2(M + C), H, D] each.

    `seen` counts the rows consumed, memory rows included; the buffers start at the block
    boundary `start` and hold `held` rows. Its size never changes with the context.
    """

    fixed_size = True

    def __init__(self, block: int) -> None:
        self.block = block  # S = M + C
        self.seen = 0
        self.start = 0
        self.held = 0
        self._buffers: dict[str, torch.Tensor] = {}

    def window(self, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The held rows followed by `new` ({name: [B, n, ...]}), for each name."""
        if not self._buffers:
            return new
        return {name: torch.cat((self._buffers[name][:, :self.held], t), dim=1) for name, t in new.items()}

    def keep(self, rows: dict[str, torch.Tensor]) -> None:
        """Store the tail of `rows` (the window after this step) from the last block boundary
        before the block of the next row."""
        n = next(iter(rows.values())).shape[1]
        end = self.start + n
        start = max(0, (end // self.block - 1) * self.block)
        if not self._buffers:
            self._buffers = {name: t.new_zeros((t.shape[0], 2 * self.block, *t.shape[2:]))
                             for name, t in rows.items()}
        for name, t in rows.items():
            self._buffers[name][:, :end - start] = t[:, start - self.start:]
        self.start, self.held, self.seen = start, end - start, end

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())

    def map_tensors(self, fn) -> None:
        self._buffers = {name: fn(t, True) for name, t in self._buffers.items()}


def gmat_memory_layout(options: GmatOptions, causal: bool) -> MemoryLayout | None:
    """M tokens before the sequence (encoder) or before every chunk of C (decoder)."""
    if options.num_memory == 0:
        return None
    return MemoryLayout(options.num_memory, options.chunk_size if causal else 0)


# a causal model places its memory blocks at the same positions in every row: no left padding
@register("gmat", options=GmatOptions, memory_layout=gmat_memory_layout, convertible=False,
          left_padding=False, state_size=StateSize("chunk_size", with_options={"num_memory": 2}),
          test_options={"num_memory": 2, "chunk_size": 4, "window": 4})
class GmatAttention(AttentionLayer):
    """Global memory tokens over sparse (chunked, window, lsh or full) attention; GMAT."""

    def __init__(self, spec: LayerSpec, options: GmatOptions) -> None:
        if spec.causal and options.pattern not in CAUSAL_PATTERNS:
            raise ConfigError(f"attention.pattern: a causal model supports gmat patterns "
                              f"{', '.join(CAUSAL_PATTERNS)}, got {options.pattern!r} (lsh buckets mix "
                              f"past and future; full is softmax attention)")
        if spec.causal and options.pattern == "window" and options.window > options.chunk_size:
            raise ConfigError(f"attention.window: a causal window must fit in one chunk "
                              f"(<= chunk_size = {options.chunk_size}), got {options.window}")
        super().__init__(spec, bias=options.bias)
        self.options = options
        d, H = spec.d_model, spec.n_heads
        self.memory_qkv = nn.Linear(d, 3 * d, bias=options.bias) if options.untied_memory_projections else None
        if options.pattern == "lsh":
            g = torch.Generator().manual_seed(LSH_SEED + spec.layer_idx)
            self.register_buffer("lsh_rotations", torch.randn(H, spec.head_dim, options.n_buckets // 2,
                                                              generator=g))
        else:
            self.lsh_rotations = None

    def init_state(self, batch_size: int, device=None, dtype=None) -> GmatCache:
        return GmatCache(self.options.num_memory + self.options.chunk_size)

    def _project(self, x: torch.Tensor, main: torch.Tensor, first_position: int):
        """x [B, T, d] -> q, k, v and (untied) memory q, k, v, each [B, T, H, D] or None, with the
        main rows (indices `main`, consecutive positions from `first_position`) rotated."""
        _, q, k, v = self.project(x, rotate=False)
        mq = mk = mv = None
        if self.memory_qkv is not None:
            mq, mk, mv = self.memory_qkv(x).view(*q.shape[:2], 3, *q.shape[2:]).unbind(2)
        if self.rotary is not None and len(main):
            def rotate(t):
                return t.index_copy(1, main, self.rotary(t.index_select(1, main), first_position))
            q, k = rotate(q), rotate(k)
            mk = rotate(mk) if mk is not None else None
        return q, k, v, mq, mk, mv

    def forward(self, x: torch.Tensor, *, memory_state: GmatCache | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d] with the memory rows in place -> (y [B, T, d], memory_state).

        attention_mask: bool [B, T], True for rows that may be attended (memory rows included).
        positions: not read; the rows' positions follow from the memory layout, which a causal
        model shares between the rows of a batch (so it refuses left padding, see CausalLM).
        """
        check_tensor("x", x, "[B, T, d]", None, None, self.spec.d_model)
        check_mask(attention_mask, *x.shape[:2])
        o = self._causal(x, memory_state, attention_mask) if self.spec.causal else \
            self._bidirectional(x, memory_state, attention_mask)
        return self.finish(o), memory_state

    def _kwargs(self) -> dict:
        opt = self.options
        return dict(num_memory=opt.num_memory, pattern=opt.pattern, chunk_size=opt.chunk_size,
                    window=opt.window, lsh_rotations=self.lsh_rotations)

    def _bidirectional(self, x, memory_state, attention_mask):
        M = self.options.num_memory
        T = x.shape[1]
        if memory_state is not None:
            raise ShapeError("memory_state: a bidirectional gmat layer reads the whole sequence at once "
                             "and keeps no decoding state")
        if T < M:
            raise ShapeError(f"x: expected the {M} memory rows before the sequence (T >= num_memory), "
                             f"got shape {tuple(x.shape)}")
        q, k, v, mq, mk, mv = self._project(x, torch.arange(M, T, device=x.device), 0)
        if mq is not None:
            q = torch.cat((mq[:, :M], q[:, M:]), dim=1)
        return gmat_attention(q, k, v, causal=False, attention_mask=attention_mask, memory_k=mk,
                              memory_v=mv, **self._kwargs())[0]

    def _causal(self, x, state, attention_mask):
        M, C = self.options.num_memory, self.options.chunk_size
        S = M + C
        B, n, _ = x.shape
        seen = state.seen if state is not None else 0
        offset = torch.arange(seen, seen + n, device=x.device) % S
        # The main rows (offset ≥ M), from the layout alone: the GPU is not waited for.
        def main_before(p):  # main rows among rows 0 .. p - 1 of the stream
            return (p // S) * C + max(0, p % S - M)
        count = main_before(seen + n) - main_before(seen)
        head = max(0, M - seen % S)  # the first main row, when there is one
        k_th = torch.arange(count, device=x.device)
        main = head + k_th + M * ((max(0, seen % S - M) + k_th) // C)
        first = main_before(seen + head)  # position of the first main row
        q, k, v, mq, mk, mv = self._project(x, main, first)
        if mq is not None:
            q = torch.where((offset < M)[None, :, None, None], mq, q)
        rows = {"k": k, "v": v}
        if mk is not None:
            rows.update(mk=mk, mv=mv)
        if attention_mask is not None or state is not None:  # a decoder keeps the mask of its keys
            rows["mask"] = (attention_mask if attention_mask is not None
                            else torch.ones(B, n, dtype=torch.bool, device=x.device))
        if state is not None:
            rows = state.window(rows)
        o, _ = gmat_attention(q, rows["k"], rows["v"], causal=True, attention_mask=rows.get("mask"),
                              memory_k=rows.get("mk"), memory_v=rows.get("mv"), **self._kwargs())
        if state is not None:
            state.keep(rows)
        return o
