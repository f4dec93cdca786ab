"""The question-answering model of de Brébisson & Vincent 2016, small, for the reading task.

    document  ids [N, T] -> embedding -> bidirectional GRU -> states h_t [N, T, k]
    queries   ids [N, Q, Lq] -> embedding -> bidirectional GRU -> q [N, Q, k] (final states)
    read      r [N, Q, k], by `attention`:
                none          the document's final GRU states (no look-back)
                softmax       Σ_t softmax_t(h_t·q) h_t
                linear        C q with C = Σ_t h_t h_tᵀ
                gated-linear  C q with C = Σ_t f_t f_tᵀ, f_t = σ(W h_t + b) ⊙ h_t
    answer    logits [N, Q, n_answers] = MLP([LayerNorm(r), q])

k = 2·hidden. No read is scaled (softmax scores are plain dot products, as C q is), so the
variants differ only in how the document's states are combined. The linear forms never
need the document again once C is built: `represent` turns documents into
`memattn.representations.Representations` (k×k each) and `answer` answers queries from
them alone. The layer norm on r makes the answer layer blind to the scale of C q, which
grows with the document's length; it costs O(k) a query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from memattn.errors import ConfigError, ShapeError, check_tensor
from memattn.ops.linear import linear_attention
from memattn.ops.softmax import softmax_attention
from memattn.representations import Representations, encode, gated_write, lookup

ATTENTIONS = ("none", "softmax", "linear", "gated-linear")


@dataclass
class QAConfig:
    """vocab_size: word tokens (id 0 is padding); n_answers: answer classes;
    attention: how the query reads the document; embed: embedding width; hidden: GRU width
    per direction (document states and queries have k = 2·hidden)."""

    vocab_size: int
    n_answers: int
    attention: Literal["none", "softmax", "linear", "gated-linear"] = "linear"
    embed: int = 32
    hidden: int = 50

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention: expected one of {', '.join(ATTENTIONS)}, "
                              f"got {self.attention!r}")
        for name in ("vocab_size", "n_answers", "embed", "hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")

    @property
    def k(self) -> int:
        """Width of the document states, queries and memory: k = 2·hidden."""
        return 2 * self.hidden


def reverse_within(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] with each row's first lengths[b] steps reversed, the padding in place."""
    steps = torch.arange(x.shape[1], device=x.device)[None, :]  # [1, T]
    source = lengths.to(x.device)[:, None] - 1 - steps  # [B, T]
    source = torch.where(source >= 0, source, steps)
    return x.gather(1, source.view(*source.shape, *([1] * (x.dim() - 2))).expand_as(x))


class BiGRU(nn.Module):
    """A bidirectional GRU over right-padded batches: x [B, T, E], lengths [B] ->
    (states [B, T, 2·hidden], zero past each length; final [B, 2·hidden]).

    Each direction is a GRU over the padded batch, the backward one reading every row
    reversed within its length, so padding never reaches a real state. (On a CPU this is
    several times faster to train than a packed sequence.)
    """

    def __init__(self, embed: int, hidden: int) -> None:
        super().__init__()
        self.forward_rnn = nn.GRU(embed, hidden, batch_first=True)
        self.backward_rnn = nn.GRU(embed, hidden, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        fwd, _ = self.forward_rnn(x)  # [B, T, hidden]
        bwd_reversed, _ = self.backward_rnn(reverse_within(x, lengths))
        last = (lengths.to(x.device) - 1)[:, None, None].expand(-1, 1, fwd.shape[-1])
        final = torch.cat([fwd.gather(1, last)[:, 0], bwd_reversed.gather(1, last)[:, 0]], -1)
        mask = torch.arange(x.shape[1], device=x.device)[None, :] < lengths.to(x.device)[:, None]
        states = torch.cat([fwd, reverse_within(bwd_reversed, lengths)], -1)
        return states * mask[..., None].to(states.dtype), final


class ReadingQA(nn.Module):
    """Document encoder + query encoder + attention ∈ {none, softmax, linear, gated-linear}."""

    def __init__(self, cfg: QAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        k = cfg.k
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed, padding_idx=0)
        self.doc_rnn = BiGRU(cfg.embed, cfg.hidden)
        self.query_rnn = BiGRU(cfg.embed, cfg.hidden)
        self.gate = nn.Linear(k, k) if cfg.attention == "gated-linear" else None
        self.norm = nn.LayerNorm(k)
        self.head = nn.Sequential(nn.Linear(2 * k, k), nn.Tanh(), nn.Linear(k, cfg.n_answers))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def aux_loss(self) -> None:
        """No auxiliary loss: what the training loop adds to every model's objective."""
        return None

    def _rnn(self, rnn: BiGRU, ids: torch.Tensor, lengths: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T], lengths [B] -> (states [B, T, k], zero past each length; final [B, k])."""
        if bool((lengths < 1).any()) or bool((lengths > ids.shape[1]).any()):
            raise ShapeError(f"lengths: expected values in 1 … {ids.shape[1]}, got "
                             f"{lengths.min().item()} … {lengths.max().item()}")
        return rnn(self.embed(ids), lengths)

    def encode_documents(self, docs: torch.Tensor, lengths: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """docs [N, T], lengths [N] -> (h [N, T, k], mask [N, T] bool, final [N, k])."""
        check_tensor("docs", docs, "[N, T]", None, None)
        check_tensor("lengths", lengths, "[N]", docs.shape[0])
        h, final = self._rnn(self.doc_rnn, docs, lengths)
        mask = torch.arange(docs.shape[1], device=docs.device)[None, :] < lengths[:, None].to(docs.device)
        return h, mask, final

    def encode_queries(self, queries: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """queries [N, Q, Lq], lengths [N, Q] -> q [N, Q, k]."""
        check_tensor("queries", queries, "[N, Q, Lq]", None, None, None)
        N, Q, Lq = queries.shape
        check_tensor("query_lengths", lengths, "[N, Q]", N, Q)
        _, q = self._rnn(self.query_rnn, queries.reshape(N * Q, Lq), lengths.reshape(N * Q))
        return q.view(N, Q, -1)

    def written(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """What the linear forms write: f [N, T, k] (h, or σ(W h + b) ⊙ h), zero on padding."""
        f = h if self.gate is None else gated_write(h, self.gate)
        return f * mask[..., None].to(f.dtype)

    def read(self, h: torch.Tensor, mask: torch.Tensor, final: torch.Tensor,
             q: torch.Tensor) -> torch.Tensor:
        """h [N, T, k], mask [N, T], final [N, k], q [N, Q, k] -> r [N, Q, k] (before the norm)."""
        kind = self.cfg.attention
        if kind == "none":
            return final[:, None, :].expand(-1, q.shape[1], -1)
        if kind == "softmax":
            o, _ = softmax_attention(q[:, :, None], h[:, :, None], h[:, :, None], causal=False,
                                  scale=1.0, attention_mask=mask)
            return o[:, :, 0]
        f = self.written(h, mask)[:, :, None]  # [N, T, 1, k]: one head
        o, _ = linear_attention(q[:, :, None], f, f, causal=False)  # C q, C = Σ f fᵀ
        return o[:, :, 0]

    def classify(self, r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """r, q [N, Q, k] -> logits [N, Q, n_answers]."""
        return self.head(torch.cat([self.norm(r), q], dim=-1))

    def forward(self, docs: torch.Tensor, doc_lengths: torch.Tensor, queries: torch.Tensor,
                query_lengths: torch.Tensor) -> torch.Tensor:
        """docs [N, T], doc_lengths [N], queries [N, Q, Lq], query_lengths [N, Q]
        -> logits [N, Q, n_answers]."""
        h, mask, final = self.encode_documents(docs, doc_lengths)
        q = self.encode_queries(queries, query_lengths)
        return self.classify(self.read(h, mask, final, q), q)

    # The fixed-size path (linear forms): documents -> C once, then queries without them.

    def _check_linear(self, what: str) -> None:
        if self.cfg.attention not in ("linear", "gated-linear"):
            raise ConfigError(f"{what}: fixed-size representations need attention linear or "
                              f"gated-linear, this model reads with {self.cfg.attention!r}")

    def represent(self, docs: torch.Tensor, doc_lengths: torch.Tensor) -> Representations:
        """docs [N, T], doc_lengths [N] -> N memories C [N, 1, k, k] (the documents' only trace)."""
        self._check_linear("represent")
        h, mask, _ = self.encode_documents(docs, doc_lengths)
        meta = {"model": "ReadingQA", "attention": self.cfg.attention, "k": self.cfg.k}
        return encode(h, gate=self.gate, mask=mask, meta=meta)

    def answer(self, reps: Representations, queries: torch.Tensor,
               query_lengths: torch.Tensor) -> torch.Tensor:
        """reps of N documents, queries [N, Q, Lq], query_lengths [N, Q] -> logits
        [N, Q, n_answers], from the memories alone."""
        self._check_linear("answer")
        q = self.encode_queries(queries, query_lengths)
        return self.classify(lookup(reps, q.to(reps.dtype)).to(q.dtype), q)
