"""Cross attention: queries from a target sequence read a memory written by a source sequence.

A cross layer has two halves, so that a decoder writes the source's memory once and reads
it at every step:

    memory(src [B, S, d], src_mask [B, S] | None) -> memory of the source
    forward(x [B, T, d], memory) -> y [B, T, d]

A memory is a NamedTuple of tensors whose first dimension is the batch (beam search repeats
and reorders it field by field). Each mechanism writes it with its own rule, applied to
the whole source (a set: no position of the target enters it); its registration declares
the cross layer and that rule in words (`Cross`, `memattn info --mechanisms`), and its
layer file defines the cross layer beside its self-attention. The memories of slots are
read here (`SlotCrossAttention`), by a softmax over the slots, o = softmax_M(K̃ q / √D)ᵀ Ṽ;
their size is fixed whatever S, and the sizes come from the cross mechanism's own options
(`model.cross_attention`; abc-mlp's or gsa's `cross_slots` when the model's own mechanism
serves). Source positions count real tokens only, so a padded source writes what it would
alone; padding writes nothing.

`build_cross_attention(name, options, spec)` builds a mechanism's cross layer; a mechanism
that declares none is refused with a ConfigError naming those that can: never a silent
softmax.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from memattn.errors import ConfigError, ShapeError, check_tensor
from memattn.layers.base import LayerSpec, check_mask, get_mechanism, mechanisms, parse_options
from memattn.ops.abc import ABCState, BoundedMemoryState
from memattn.ops.abc.chunked import read_memory
from memattn.ops.contract import compute_dtype
from memattn.ops.gsa import GSAState


class SourceKV(NamedTuple):
    """A memory of source tokens: their keys and values [B, S, H, D], mask [B, S] | None."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None


def source_positions(src_mask: torch.Tensor | None, B: int, S: int, device) -> tuple[torch.Tensor, int]:
    """Positions of the source tokens counted over real ones ([1 or B, S] int64) and the largest."""
    if src_mask is None:
        return torch.arange(S, device=device)[None], S - 1
    pos = (src_mask.long().cumsum(1) - 1).clamp_min(0)
    return pos, int(pos.max())


class CrossLayer(nn.Module):
    """Query, key / value and output projections shared by the cross layers."""

    def __init__(self, spec: LayerSpec, options: Any) -> None:
        super().__init__()
        self.spec = spec
        self.options = options
        bias = getattr(options, "bias", False)
        self.q = nn.Linear(spec.d_model, spec.d_model, bias=bias)
        self.kv = nn.Linear(spec.d_model, 2 * spec.d_model, bias=bias)
        self.out = nn.Linear(spec.d_model, spec.d_model, bias=bias)
        self.dropout = nn.Dropout(spec.dropout)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, H, D]."""
        return x.view(*x.shape[:2], self.spec.n_heads, self.spec.head_dim)

    def source_kv(self, src: torch.Tensor, src_mask: torch.Tensor | None):
        check_tensor("src", src, "[B, S, d]", None, None, self.spec.d_model)
        check_mask(src_mask, *src.shape[:2], name="src_mask")
        return (self.heads(t) for t in self.kv(src).chunk(2, dim=-1))

    def query(self, x: torch.Tensor, memory_batch: int) -> torch.Tensor:
        """x [B, T, d] (B = the memory's batch) -> queries [B, T, H, D]."""
        check_tensor("x", x, "[B, T, d]", None, None, self.spec.d_model)
        if x.shape[0] != memory_batch:
            raise ShapeError(f"x: batch of {x.shape[0]} for a memory of batch {memory_batch}")
        return self.heads(self.q(x))

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.out(o.flatten(2)))


class SlotCrossAttention(CrossLayer):
    """A bounded memory of M slots per head written by the source, read by a softmax over
    the slots; subclasses write it (`memory`)."""

    def forward(self, x: torch.Tensor, memory: ABCState | BoundedMemoryState | GSAState) -> torch.Tensor:
        q = self.query(x, memory.k.shape[0])
        o = read_memory(q.to(memory.k.dtype), memory.k, memory.v, self.spec.head_dim ** -0.5)
        return self.finish(o.to(x.dtype))

    def given_phi(self, k: torch.Tensor, v: torch.Tensor, phi: torch.Tensor) -> BoundedMemoryState:
        """K̃ = Σ_s φ_s ⊗ k_s, Ṽ likewise: k, v [B, S, H, D], φ [B, S, H, M] -> [B, H, M, D] twice,
        in float32 at least."""
        dt = compute_dtype(k)
        phi = phi.to(dt)
        return BoundedMemoryState(torch.einsum("bshm,bshk->bhmk", phi, k.to(dt)),
                                  torch.einsum("bshm,bshv->bhmv", phi, v.to(dt)))


def cross_mechanisms() -> list[str]:
    """The registered mechanisms that can serve as cross attention."""
    return [name for name, m in mechanisms().items() if m.cross is not None]


def build_cross_attention(name: str, options: dict[str, Any] | Any, spec: LayerSpec) -> nn.Module:
    """The cross layer of mechanism `name` with its options; ConfigError if it has none."""
    mech = get_mechanism(name)
    if mech.cross is None:
        raise ConfigError(f"attention: {name!r} cannot serve as cross attention (it has no memory "
                          f"written by another sequence); mechanisms that can: "
                          f"{', '.join(cross_mechanisms())} (set model.cross_attention)")
    return mech.cross.layer(spec, parse_options(name, options))
