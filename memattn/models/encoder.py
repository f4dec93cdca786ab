"""A bidirectional encoder with a masked-LM head and an optional per-token tagging head."""

from __future__ import annotations

import torch
from torch import nn

from memattn.config import ModelConfig
from memattn.models.lm import Transformer


class Encoder(Transformer):
    """Token ids [B, T] -> hidden [B, T, d], every token seeing the whole sequence.

    `mlm_logits` [B, T, vocab] (tied to the embeddings when model.tie_embeddings) and, when
    `n_tags` > 0, `tag_logits` [B, T, n_tags]. `attention_mask` [B, T] bool marks real tokens.
    """

    def __init__(self, cfg: ModelConfig, n_tags: int = 0) -> None:
        super().__init__(cfg, causal=False)
        self.mlm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tag_head = nn.Linear(cfg.d_model, n_tags) if n_tags > 0 else None
        self.init_weights()
        if cfg.tie_embeddings:
            self.mlm_head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                mlm: bool = False, tags: bool = False) -> torch.Tensor:
        """Hidden states [B, T, d], or with `mlm` the masked-LM logits [B, T, vocab], with `tags`
        the tag logits [B, T, n_tags] (one call, so that a data-parallel wrapper sees the head's
        use in its forward)."""
        hidden = self.hidden(idx, attention_mask=attention_mask)
        if tags:
            return self.tag_logits(hidden)
        return self.mlm_logits(hidden) if mlm else hidden

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlm_head(hidden)

    def tag_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tag_head is None:
            raise ValueError("tag_logits: this encoder was built with n_tags=0")
        return self.tag_head(hidden)
