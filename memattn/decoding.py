"""Decoding an `EncoderDecoder`: greedy decoding and beam search over a batch of sources.

Both encode the sources once (`model.encode`: one memory per decoder block) and feed the
decoder one token per step through its cache (`model.init_cache`), never the prefix again:
with a bounded mechanism (abc-mlp) each hypothesis holds the same memory at every step.

Tokens: a hypothesis starts from `bos` and ends when it emits `eos`; the ids returned are
those after bos, eos left out (`pad_outputs` makes them a padded tensor). `max_len` bounds
the tokens emitted, eos included.

Beam search ranks a hypothesis Y by its log-probability divided by GNMT's length penalty
lp(Y) = ((5 + |Y|) / 6) ** length_penalty (Wu et al. 2016), |Y| counting the eos;
length_penalty = 0 ranks by the log-probability itself. Finished hypotheses are kept aside;
a source is done once it has `beam` of them that no live hypothesis can beat: a live one of
log-probability s ≤ 0 can reach at best s / lp(max_len). At max_len the live ones compete
too, ranked by lp(max_len). With beam = 1 and length_penalty = 0 it is greedy decoding.

Shapes: B sources, S source length, K beams per source, A sources still searched,
N rows decoded together (A·K in beam search), V vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, NamedTuple

import torch

from memattn.errors import ConfigError, ShapeError
from memattn.layers.base import check_mask


class Hypothesis(NamedTuple):
    """One finished (or, at max_len, unfinished) translation."""

    tokens: list[int]  # ids after bos, eos left out
    score: float  # log_prob / lp(Y)
    log_prob: float  # sum of its tokens' log-probabilities, eos included


def map_memory(memory: NamedTuple, fn: Callable[[torch.Tensor], torch.Tensor]) -> NamedTuple:
    """A memory (a NamedTuple of batch-first tensors, `EncoderDecoder.encode`) with `fn` applied
    to each tensor field; None fields stay None."""
    return type(memory)(*(fn(t) if isinstance(t, torch.Tensor) else t for t in memory))


def repeat_memory(memory: NamedTuple, repeats: int) -> NamedTuple:
    """Tensors [B, ...] -> [B·repeats, ...]: row b becomes rows b·r .. b·r + r - 1, as
    `ModelCache.repeat_interleave` does to the cache."""
    return map_memory(memory, lambda t: t.repeat_interleave(repeats, 0))


def select_memory(memory: NamedTuple, rows: torch.Tensor) -> NamedTuple:
    """Tensors [N, ...] -> [N', ...]: row i becomes row rows[i] (rows [N'] int64)."""
    return map_memory(memory, lambda t: t.index_select(0, rows.to(t.device)))


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """lp(Y) = ((5 + |Y|) / 6) ** alpha; 1 when alpha = 0."""
    return ((5 + length) / 6) ** alpha


@torch.no_grad()
def greedy(model, src: torch.Tensor, *, src_mask: torch.Tensor | None = None, bos: int, eos: int,
           max_len: int) -> list[list[int]]:
    """The likeliest token at every step: src [B, S] ids (src_mask [B, S] bool, True = real)
    -> B lists of at most max_len ids. A row that emitted eos leaves the batch."""
    _check_inputs(src, src_mask, max_len)
    B = src.shape[0]
    with _evaluating(model):
        memories = model.encode(src, src_mask)
        cache = model.init_cache(B, device=src.device)
        rows = torch.arange(B, device=src.device)  # [N] the source of each row still decoded
        token = torch.full((B,), bos, dtype=torch.long, device=src.device)  # [N]
        out: list[list[int]] = [[] for _ in range(B)]
        for _ in range(max_len):
            token = model.decode(token[:, None], memories, cache=cache)[:, -1].argmax(-1)  # [N]
            for b, t in zip(rows.tolist(), token.tolist()):
                if t != eos:
                    out[b].append(t)
            going = (token != eos).nonzero().squeeze(1)  # [N']
            if len(going) == 0:
                break
            if len(going) < len(token):
                rows, token = rows[going], token[going]
                cache.batch_select(going)
                memories = [select_memory(m, going) for m in memories]
    return out


@torch.no_grad()
def beam_search(model, src: torch.Tensor, *, src_mask: torch.Tensor | None = None, bos: int, eos: int,
                beam: int = 5, length_penalty: float = 0.6, max_len: int,
                n_best: bool = False) -> list[list[int]] | list[list[Hypothesis]]:
    """Beam search: src [B, S] ids (src_mask [B, S] bool, True = real) -> the best translation
    of each source, B lists of at most max_len ids; with `n_best`, each source's `beam` best
    Hypothesis, best first.

    The K = beam hypotheses of all sources still searched decode together as N = A·K rows:
    memories and cache are repeated K times, and after each step the cache rows follow their
    parents (`ModelCache.reorder`); a source that is done leaves the batch.
    """
    _check_inputs(src, src_mask, max_len)
    _check_count("beam", beam)
    if not isinstance(length_penalty, (int, float)) or not 0 <= length_penalty < float("inf"):
        raise ConfigError(f"length_penalty: expected a finite number >= 0, got {length_penalty!r}")
    B, K, device = src.shape[0], beam, src.device
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]  # each source's K best, best first

    def keep(b: int, tokens: list[int], log_prob: float, length: int) -> None:
        h = Hypothesis(tokens, log_prob / gnmt_length_penalty(length, length_penalty), log_prob)
        finished[b] = sorted(finished[b] + [h], key=lambda h: -h.score)[:K]

    with _evaluating(model):
        memories = [repeat_memory(m, K) for m in model.encode(src, src_mask)]  # [B·K, ...]
        cache = model.init_cache(B, device=device).repeat_interleave(K)
        sources = torch.arange(B, device=device)  # [A] the sources still searched
        scores = torch.zeros(B, K, device=device)  # [A, K] log-probability of each live hypothesis
        scores[:, 1:] = float("-inf")  # one live hypothesis per source at first: no duplicates
        history = torch.zeros(B, K, 0, dtype=torch.long, device=device)  # [A, K, t]
        token = torch.full((B * K,), bos, dtype=torch.long, device=device)  # [N]
        for t in range(max_len):
            logits = model.decode(token[:, None], memories, cache=cache)[:, -1]  # [N, V]
            logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
            A, V = scores.shape[0], logp.shape[-1]
            candidates = (scores.to(logp.dtype)[:, :, None] + logp.view(A, K, V)).view(A, K * V)
            top, index = candidates.topk(min(2 * K, K * V), dim=1)  # [A, 2K] best first
            parent, word = index // V, index % V  # at most K ends: K of the 2K go on
            ends = word == eos
            # an eos among the K best candidates ends a hypothesis of t + 1 tokens
            for a, r in (ends[:, :K] & top[:, :K].isfinite()).nonzero().tolist():
                keep(int(sources[a]), history[a, parent[a, r]].tolist(), top[a, r].item(), t + 1)
            live = ends.long().sort(dim=1, stable=True).indices[:, :K]  # [A, K] the best K going on
            scores, parent, word = top.gather(1, live), parent.gather(1, live), word.gather(1, live)
            history = torch.cat([history.gather(1, parent[..., None].expand(-1, -1, t)), word[..., None]], 2)
            if t + 1 == max_len:  # the live hypotheses compete too
                for a, b in enumerate(sources.tolist()):
                    for k in torch.isfinite(scores[a]).nonzero().flatten().tolist():
                        keep(b, history[a, k].tolist(), scores[a, k].item(), max_len)
                break
            best_reachable = scores[:, 0] / gnmt_length_penalty(max_len, length_penalty)  # [A]
            going = [a for a, b in enumerate(sources.tolist())
                     if len(finished[b]) < K or best_reachable[a].item() > finished[b][-1].score]
            if not going:
                break
            going_t = torch.tensor(going, dtype=torch.long, device=device)
            rows = (torch.arange(A, device=device)[:, None] * K + parent)[going_t].flatten()  # [N'] parents
            cache.reorder(rows)
            if len(going) < A:  # the rows of a source share one memory: its parents' rows are its rows
                memories = [select_memory(m, rows) for m in memories]
            sources, scores, history = sources[going_t], scores[going_t], history[going_t]
            token = word[going_t].flatten()
    if n_best:
        return finished
    return [hyps[0].tokens if hyps else [] for hyps in finished]


def pad_outputs(outputs: list[list[int]], *, pad: int, device=None) -> torch.Tensor:
    """B lists of ids -> ids [B, L] int64, L the longest, shorter rows filled with `pad` on the right."""
    out = torch.full((len(outputs), max(map(len, outputs), default=0)), pad, dtype=torch.long, device=device)
    for b, ids in enumerate(outputs):
        out[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}: expected an integer >= 1, got {value!r}")


def _check_inputs(src, src_mask, max_len) -> None:
    """ShapeError unless src is integer ids [B, S] (B, S >= 1) and src_mask None or bool [B, S];
    ConfigError unless max_len is an integer >= 1."""
    if (not isinstance(src, torch.Tensor) or src.dim() != 2 or src.is_floating_point()
            or src.is_complex() or src.dtype == torch.bool):
        got = (f"shape {tuple(src.shape)} of dtype {src.dtype}" if isinstance(src, torch.Tensor)
               else type(src).__name__)
        raise ShapeError(f"src: expected integer token ids [B, S], got {got}")
    if 0 in src.shape:
        raise ShapeError(f"src: expected at least one source of at least one token, "
                         f"got shape {tuple(src.shape)}")
    check_mask(src_mask, *src.shape, name="src_mask")
    _check_count("max_len", max_len)


@contextmanager
def _evaluating(model):
    """The model in eval mode (no dropout) inside, its own mode back after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
