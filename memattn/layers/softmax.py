"""`softmax`: standard multi-head softmax attention, the baseline every mechanism is held to."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memattn.layers.base import KVCache, LayerSpec, check_mask, register
from memattn.layers.positions import Rotary
from memattn.ops.softmax import softmax_attention


@dataclass
class SoftmaxOptions:
    bias: bool = False  # biases on the q/k/v and output projections


@register("softmax", options=SoftmaxOptions)
class SoftmaxAttention(nn.Module):
    """Softmax attention over every past token; decodes with a growing KV cache."""

    def __init__(self, spec: LayerSpec, options: SoftmaxOptions) -> None:
        super().__init__()
        self.spec = spec
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=options.bias)
        self.out = nn.Linear(spec.d_model, spec.d_model, bias=options.bias)
        self.rotary = Rotary(spec.head_dim) if spec.positions == "rotary" else None
        self.dropout = nn.Dropout(spec.dropout)

    def init_state(self, batch_size: int, device=None, dtype=None) -> KVCache:
        return KVCache()

    def forward(self, x: torch.Tensor, *, memory_state: KVCache | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] (True = real token), positions [B, T] ->
        (y [B, T, d], memory_state). The cache remembers which of its keys were padding."""
        B, T, _ = x.shape
        check_mask(attention_mask, B, T)
        q, k, v = self.qkv(x).view(B, T, 3, self.spec.n_heads, self.spec.head_dim).unbind(2)
        if self.rotary is not None:
            at = positions if positions is not None else (memory_state.seen if memory_state is not None else 0)
            q, k = self.rotary(q, at), self.rotary(k, at)
        if memory_state is not None:
            k, v, attention_mask = memory_state.update(k, v, attention_mask)
        o, _ = softmax_attention(q, k, v, causal=self.spec.causal, attention_mask=attention_mask)
        return self.dropout(self.out(o.reshape(B, T, -1))), memory_state
