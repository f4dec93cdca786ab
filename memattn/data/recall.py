"""Seeded synthetic recall tasks: multi-query associative recall (MQAR) and passkey retrieval.

Each generator returns (tokens [B, T] int64, answers [B, T] bool). A causal LM reads the
tokens and is scored only where `answers` is True: token t is predicted from the logits at
position t - 1 (`answer_loss`, `answer_hits`), so answers[:, 0] is always False. Both tasks
draw from one vocabulary (`RecallVocab`), so one model trains on both.

MQAR (multi-query associative recall, as in Arora et al. 2023, "Zoology"): N key-value pairs
with distinct keys, then Q = (T - 2N) / 2 queries, each a key seen earlier followed by the
value paired with it; the answers are those values::

    k_1 v_1 k_2 v_2 ... k_N v_N | q_1 a_1 ... q_Q a_Q       (q_j one of the k_i, a_j its v_i)

Query keys run through the N keys in a random order (then another order, when Q > N).
Values are uniform over the value vocabulary and may repeat between pairs.

Passkey: a marker and D digits, then `distance` filler tokens (uniform over the filler
vocabulary), then the query marker and the same D digits (the answers), then filler up to
the row's length when one is given::

    PASS d_1 .. d_D | f_1 .. f_distance | QUERY d_1 .. d_D | f ...

    vocab = RecallVocab()
    g = torch.Generator().manual_seed(0)
    tokens, answers = mqar_batch(8, length=64, pairs=16, vocab=vocab, generator=g)
    tokens, answers = passkey_batch(8, distance=1000, digits=5, vocab=vocab, generator=g)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memattn.errors import ConfigError, ShapeError, check_tensor


@dataclass(frozen=True)
class RecallVocab:
    """Token ids of both tasks, in blocks: PASS (0), QUERY (1), the digits, the filler
    tokens, the MQAR keys, the MQAR values."""

    digits: int = 10
    filler: int = 16
    keys: int = 64
    values: int = 64

    PASS = 0  # passkey marker
    QUERY = 1  # passkey query marker

    def __post_init__(self) -> None:
        for name in ("digits", "filler", "keys", "values"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected a positive number of tokens, got {getattr(self, name)}")

    @property
    def first_digit(self) -> int:
        return 2

    @property
    def first_filler(self) -> int:
        return self.first_digit + self.digits

    @property
    def first_key(self) -> int:
        return self.first_filler + self.filler

    @property
    def first_value(self) -> int:
        return self.first_key + self.keys

    @property
    def size(self) -> int:
        return self.first_value + self.values


def mqar_batch(batch: int, *, length: int, pairs: int, vocab: RecallVocab,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR rows: (tokens [batch, length] int64, answers [batch, length] bool).

    length = 2·pairs + 2·queries: `pairs` key-value pairs (distinct keys), then the queries.
    """
    queries, odd = divmod(length - 2 * pairs, 2)
    if pairs < 1 or pairs > vocab.keys:
        raise ConfigError(f"pairs: expected 1 .. {vocab.keys} (distinct keys of the key vocabulary), got {pairs}")
    if queries < 1 or odd:
        raise ConfigError(f"length: expected 2·pairs plus an even number >= 2 of query tokens "
                          f"(pairs = {pairs}), got {length}")
    keys = torch.rand(batch, vocab.keys, generator=generator).argsort(dim=1)[:, :pairs]  # [B, N] distinct
    values = torch.randint(0, vocab.values, (batch, pairs), generator=generator)  # [B, N]
    orders = torch.rand(batch, -(-queries // pairs), pairs, generator=generator).argsort(dim=2)
    asked = orders.flatten(1)[:, :queries]  # [B, Q] indices into the pairs
    tokens = torch.empty(batch, length, dtype=torch.long)
    tokens[:, 0:2 * pairs:2] = vocab.first_key + keys
    tokens[:, 1:2 * pairs:2] = vocab.first_value + values
    tokens[:, 2 * pairs::2] = vocab.first_key + keys.gather(1, asked)
    tokens[:, 2 * pairs + 1::2] = vocab.first_value + values.gather(1, asked)
    answers = torch.zeros(batch, length, dtype=torch.bool)
    answers[:, 2 * pairs + 1::2] = True
    return tokens, answers


def passkey_batch(batch: int, *, distance: int | torch.Tensor, digits: int, vocab: RecallVocab,
                  generator: torch.Generator, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Passkey rows: (tokens [batch, T] int64, answers [batch, T] bool).

    distance: filler tokens between the passkey and the query, one int or one per row
    (int64 [batch]). length: T, the rows' length (filler after the answer); None: the
    shortest that holds them, 2 + 2·digits + the longest distance.
    """
    distance = torch.as_tensor(distance, dtype=torch.long).expand(batch).clone()  # [B]
    if digits < 1 or digits > 10_000:
        raise ConfigError(f"digits: expected a passkey of 1 or more digits, got {digits}")
    if batch and int(distance.min()) < 0:
        raise ConfigError(f"distance: expected filler lengths >= 0, got {int(distance.min())}")
    need = 2 + 2 * digits + (int(distance.max()) if batch else 0)
    length = need if length is None else length
    if length < need:
        raise ConfigError(f"length: a passkey of {digits} digits at distance {need - 2 - 2 * digits} needs "
                          f"{need} tokens, got {length}")
    key = vocab.first_digit + torch.randint(0, vocab.digits, (batch, digits), generator=generator)  # [B, D]
    tokens = vocab.first_filler + torch.randint(0, vocab.filler, (batch, length), generator=generator)
    tokens[:, 0] = vocab.PASS
    tokens[:, 1:1 + digits] = key
    query = 1 + digits + distance  # [B] position of the query marker
    rows = torch.arange(batch)
    tokens[rows, query] = vocab.QUERY
    at = query[:, None] + 1 + torch.arange(digits)  # [B, D] the answer positions
    tokens[rows[:, None], at] = key
    answers = torch.zeros(batch, length, dtype=torch.bool)
    answers[rows[:, None], at] = True
    return tokens, answers


def _check(logits: torch.Tensor, tokens: torch.Tensor, answers: torch.Tensor) -> None:
    check_tensor("tokens", tokens, "[B, T]", None, None)
    check_tensor("logits", logits, "[B, T, V]", *tokens.shape, None)
    check_tensor("answers", answers, "[B, T]", *tokens.shape)
    if answers.dtype != torch.bool:
        raise ShapeError(f"answers: expected dtype torch.bool, got {answers.dtype}")
    if bool(answers[:, 0].any()):
        raise ShapeError("answers: the first token of a row has no logits before it to predict it")


def answer_loss(logits: torch.Tensor, tokens: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens: logits [B, T, V] at t - 1 predict tokens [B, T]
    at t where answers [B, T] is True."""
    _check(logits, tokens, answers)
    where = answers[:, 1:]
    return F.cross_entropy(logits[:, :-1][where].float(), tokens[:, 1:][where])


def answer_hits(logits: torch.Tensor, tokens: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: True at each answer position whose token is the argmax of the logits one
    position before it; False everywhere else (so hits.sum() / answers.sum() is the accuracy)."""
    _check(logits, tokens, answers)
    hits = torch.zeros_like(answers)
    hits[:, 1:] = answers[:, 1:] & (logits[:, :-1].argmax(-1) == tokens[:, 1:])
    return hits
