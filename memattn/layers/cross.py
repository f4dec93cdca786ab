"""Cross attention: queries from a target sequence read a memory written by a source sequence.

A cross layer has two halves, so that a decoder writes the source's memory once and reads
it at every step:

    memory(src [B, S, d], src_mask [B, S] | None) -> memory of the source
    forward(x [B, T, d], memory) -> y [B, T, d]

    softmax   the memory is the source's keys and values (and its mask): it grows with S.
    abc-mlp   ABC_MLP (Peng et al. 2022): `cross_slots` slots per head written by the
              source with φ = act(W_φ h) normalised over the source; fixed size
              ([B, H, M, D] twice), whatever S. A model's causal self attention keeps
              `num_slots`, so self and cross attention have separate memory sizes.

A mechanism says in the registry whether it can serve as cross attention and with which
layer (`register_cross` below); `build_cross_attention(name, options, spec)` builds it, and
a mechanism that cannot is refused with a ConfigError naming those that can: never a silent
softmax. A model picks its cross mechanism with `model.cross_attention` (default: its own).
No positions: the memory is a set, read the same by every target position.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from memattn.errors import ConfigError, ShapeError, check_tensor
from memattn.layers.abc import PAD_LOGIT, ABCMLPOptions, activation_logits
from memattn.layers.base import LayerSpec, check_mask, get_mechanism, mechanisms, parse_options, register_cross
from memattn.ops.abc import ABCState
from memattn.ops.abc.chunked import abc_memory, read_memory
from memattn.ops.abc.common import compute_dtype
from memattn.ops.softmax import softmax_attention


class SourceKV(NamedTuple):
    """Softmax cross attention's memory: the source's keys and values [B, S, H, D], mask [B, S]."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None


def _check_source(src: torch.Tensor, src_mask: torch.Tensor | None, d_model: int) -> None:
    check_tensor("src", src, "[B, S, d]", None, None, d_model)
    check_mask(src_mask, *src.shape[:2], name="src_mask")


class _Cross(nn.Module):
    """Query, key / value and output projections shared by the cross layers."""

    def __init__(self, spec: LayerSpec, bias: bool) -> None:
        super().__init__()
        self.spec = spec
        self.q = nn.Linear(spec.d_model, spec.d_model, bias=bias)
        self.kv = nn.Linear(spec.d_model, 2 * spec.d_model, bias=bias)
        self.out = nn.Linear(spec.d_model, spec.d_model, bias=bias)
        self.dropout = nn.Dropout(spec.dropout)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, H, D]."""
        return x.view(*x.shape[:2], self.spec.n_heads, self.spec.head_dim)

    def source_kv(self, src: torch.Tensor, src_mask: torch.Tensor | None):
        _check_source(src, src_mask, self.spec.d_model)
        return (self.heads(t) for t in self.kv(src).chunk(2, dim=-1))

    def query(self, x: torch.Tensor, memory_batch: int) -> torch.Tensor:
        """x [B, T, d] (B = the memory's batch) -> queries [B, T, H, D]."""
        check_tensor("x", x, "[B, T, d]", None, None, self.spec.d_model)
        if x.shape[0] != memory_batch:
            raise ShapeError(f"x: batch of {x.shape[0]} for a memory of batch {memory_batch}")
        return self.heads(self.q(x))

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.out(o.flatten(2)))


class SoftmaxCrossAttention(_Cross):
    """Softmax over every source token; the memory holds the source's keys and values."""

    def __init__(self, spec: LayerSpec, options: Any = None) -> None:
        super().__init__(spec, bias=getattr(options, "bias", False))

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> SourceKV:
        k, v = self.source_kv(src, src_mask)
        return SourceKV(k, v, src_mask)

    def forward(self, x: torch.Tensor, memory: SourceKV) -> torch.Tensor:
        q = self.query(x, memory.k.shape[0])
        o, _ = softmax_attention(q, memory.k, memory.v, causal=False,
                              attention_mask=memory.mask)
        return self.finish(o)


class ABCCrossAttention(_Cross):
    """ABC_MLP cross attention: `cross_slots` slots per head written by the source, fixed size."""

    def __init__(self, spec: LayerSpec, options: ABCMLPOptions) -> None:
        super().__init__(spec, bias=options.bias)
        self.options = options
        self.phi = nn.Linear(spec.d_model, spec.n_heads * options.cross_slots, bias=options.bias)

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> ABCState:
        """src [B, S, d] -> ABCState (log_z [B, H, M], k [B, H, M, D], v [B, H, M, D]).

        Padding (src_mask False) writes nothing; the memory is fp32 for fp16 / bf16 inputs.
        """
        k, v = self.source_kv(src, src_mask)
        B, S, _ = src.shape
        s = activation_logits(self.phi(src).view(B, S, self.spec.n_heads, -1),
                              self.options.activation)
        if src_mask is not None:
            s = s.masked_fill(~src_mask[:, :, None, None], PAD_LOGIT)
        dt = compute_dtype(src)
        return abc_memory(k.to(dt), v.to(dt), s.to(dt))

    def forward(self, x: torch.Tensor, memory: ABCState) -> torch.Tensor:
        q = self.query(x, memory.k.shape[0])
        o = read_memory(q.to(memory.k.dtype), memory.k, memory.v, self.spec.head_dim ** -0.5)
        return self.finish(o.to(x.dtype))


register_cross("softmax", SoftmaxCrossAttention)
register_cross("abc-mlp", ABCCrossAttention)


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
    return mech.cross(spec, parse_options(name, options))
