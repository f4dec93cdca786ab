"""An encoder-decoder: a bidirectional encoder writes a source memory that a causal decoder reads.

The encoder and the decoder are `Transformer` stacks: the decoder's self attention is
`model.attention`, the encoder's `model.encoder_attention` (default: the same); every
decoder block adds cross attention (`memattn.layers.cross`) of `model.cross_attention`
(default: the model's own mechanism, which must be able to serve as cross attention):
ABC_MLP cross attention has `attention.cross_slots` slots (its self attention keeps
`attention.num_slots`); softmax cross attention reads every source token. The source is encoded once:
`encode` returns one memory per decoder block, read by every decoding step, so with
`abc-mlp` the whole decoding state (self and cross) has a fixed size whatever the lengths.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from memattn.config import ModelConfig
from memattn.errors import ConfigError, ShapeError
from memattn.models.lm import ModelCache, Transformer


class EncoderDecoder(nn.Module):
    """Source ids [B, S] and target ids [B, T] -> next-target-token logits [B, T, vocab].

    One vocabulary for both sides; the output head is tied to the decoder's embeddings when
    model.tie_embeddings.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        encoder_cfg = cfg if cfg.encoder_attention is None else dataclasses.replace(
            cfg, attention=cfg.encoder_attention)
        self.encoder = Transformer(encoder_cfg, causal=False)
        self.decoder = Transformer(cfg, causal=True, cross=True)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.encoder.init_weights()
        self.decoder.init_weights()
        nn.init.normal_(self.head.weight, std=0.02)
        if cfg.tie_embeddings:
            self.head.weight = self.decoder.embed.weight

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def aux_loss(self) -> torch.Tensor | None:
        """The encoder's and the decoder's auxiliary losses together (Transformer.aux_loss)."""
        losses = [loss for loss in (self.encoder.aux_loss(), self.decoder.aux_loss()) if loss is not None]
        return torch.stack(losses).sum() if losses else None

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> list:
        """src [B, S], src_mask [B, S] bool (True = real) -> the memory of each decoder block."""
        h = self.encoder.hidden(src, attention_mask=src_mask)
        return [block.cross.memory(h, src_mask) for block in self.decoder.blocks]

    def decode(self, tgt: torch.Tensor, memories: list, *,
               cache: ModelCache | None = None) -> torch.Tensor:
        """tgt [B, T] -> logits [B, T, vocab]; with `cache`, continue after its position."""
        if len(memories) != len(self.decoder.blocks):
            raise ShapeError(f"memories: expected one per decoder block "
                             f"({len(self.decoder.blocks)}), got {len(memories)}")
        return self.head(self.decoder.hidden(tgt, cache=cache, memories=memories))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, *,
                src_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode(tgt, self.encode(src, src_mask))

    def init_cache(self, batch_size: int, device=None, dtype=None) -> ModelCache:
        """An empty decoding cache of the decoder's self attention."""
        return ModelCache([b.attn.init_state(batch_size, device=device, dtype=dtype)
                           for b in self.decoder.blocks], batch=batch_size)

    @torch.no_grad()
    def generate(self, src: torch.Tensor, bos: int, max_new_tokens: int, *,
                 src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy decoding: src [B, S] -> [B, max_new_tokens] target ids after `bos` (max_new_tokens
        >= 0; 0 gives [B, 0])."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens: expected a number of tokens >= 0, got {max_new_tokens!r}")
        if max_new_tokens == 0:
            return torch.zeros(src.shape[0], 0, dtype=torch.long, device=src.device)
        memories = self.encode(src, src_mask)
        cache = self.init_cache(src.shape[0], device=src.device)
        token = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)
        out = []
        for _ in range(max_new_tokens):
            token = self.decode(token, memories, cache=cache)[:, -1].argmax(-1, keepdim=True)
            out.append(token)
        return torch.cat(out, dim=1)


def memory_nbytes(memories: list) -> int:
    """Bytes held by the source memories (`EncoderDecoder.encode`)."""
    return sum(t.numel() * t.element_size() for m in memories for t in m if t is not None)
