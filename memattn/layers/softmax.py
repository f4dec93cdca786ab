"""`softmax`: standard multi-head softmax attention, the baseline every mechanism is held to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memattn.layers.base import AttentionLayer, Cross, KVCache, LayerSpec, register
from memattn.layers.cross import CrossLayer, SourceKV
from memattn.ops.softmax import softmax_attention


@dataclass
class SoftmaxOptions:
    bias: bool = False  # biases on the q/k/v and output projections


class SoftmaxCrossAttention(CrossLayer):
    """Softmax over every source token; the memory holds the source's keys and values."""

    def memory(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> SourceKV:
        k, v = self.source_kv(src, src_mask)
        return SourceKV(k, v, src_mask)

    def forward(self, x: torch.Tensor, memory: SourceKV) -> torch.Tensor:
        q = self.query(x, memory.k.shape[0])
        o, _ = softmax_attention(q, memory.k, memory.v, causal=False, attention_mask=memory.mask)
        return self.finish(o)


@register("softmax", options=SoftmaxOptions, fixed_state=False,
          cross=Cross(SoftmaxCrossAttention, "the source's keys and values and its mask (SourceKV): "
                      "grows with the source"))
class SoftmaxAttention(AttentionLayer):
    """Softmax attention over every past token; decodes with a growing KV cache."""

    def __init__(self, spec: LayerSpec, options: SoftmaxOptions) -> None:
        super().__init__(spec, bias=options.bias)

    def init_state(self, batch_size: int, device=None, dtype=None) -> KVCache:
        return KVCache()

    def forward(self, x: torch.Tensor, *, memory_state: KVCache | None = None,
                attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """x [B, T, d], attention_mask [B, T] (True = real token), positions [B, T] ->
        (y [B, T, d], memory_state). The cache remembers which of its keys were padding."""
        _, q, k, v = self.project(x, memory_state, attention_mask, positions)
        if memory_state is not None:
            k, v, attention_mask = memory_state.update(k, v, attention_mask)
        o, _ = softmax_attention(q, k, v, causal=self.spec.causal, attention_mask=attention_mask)
        return self.finish(o), memory_state
