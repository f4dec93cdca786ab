"""memattn.decoding: greedy and beam search over a batch of sources with an EncoderDecoder."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch
from torch import nn

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError, ShapeError
from memattn.models import EncoderDecoder
from memattn.models.lm import ModelCache
from memattn.models.seq2seq import memory_nbytes
from memattn.decoding import beam_search, gnmt_length_penalty, greedy, pad_outputs

BOS = 0
MECHANISMS = {"softmax": {}, "abc-mlp": {"num_slots": 5, "cross_slots": 3}}
MODEL_EOS = {"softmax": 10, "abc-mlp": 4}  # with these, `model`'s rows end at different steps


def model(name):
    """A random encoder-decoder; init_std 0.5 makes its next-token distributions peaked, so
    that greedy rows end (or not) at different steps and beams part."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=12, d_model=32, n_layers=2, n_heads=4, max_len=64, init_std=0.5,
                      attention=AttentionConfig(name, MECHANISMS[name]))
    return EncoderDecoder(cfg).double()


def padded(rows, side):
    """Sources of different lengths -> ids [B, S] padded with 0 on `side`, mask [B, S]."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        cols = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[b, cols], mask[b, cols] = r, True
    return ids, mask


def sources(n=5):
    lengths = (9, 4, 7, 6, 2, 5)[:n]
    return [torch.randint(1, 12, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MECHANISMS))
def test_beam_search_of_one_beam_is_greedy(name, side):
    m = model(name)
    src, mask = padded(sources(), side)
    eos = MODEL_EOS[name]
    out = greedy(m, src, src_mask=mask, bos=BOS, eos=eos, max_len=10)
    assert {len(o) for o in out} & set(range(10)) and len({len(o) for o in out}) > 1  # rows end apart
    assert beam_search(m, src, src_mask=mask, bos=BOS, eos=eos, beam=1, length_penalty=0.0,
                       max_len=10) == out
    assert m.generate(src, BOS, 10, src_mask=mask)[0, :len(out[0])].tolist() == out[0]


class Table(NamedTuple):
    """The stub's memory: each row's next-token log-probabilities [N, V, V] (row: previous
    token), and a field left None."""

    logp: torch.Tensor
    unused: torch.Tensor | None


class Bigram(nn.Module):
    """Stands in for an EncoderDecoder: the next token depends only on the previous one, through
    the table tables[src[b, 0]] [V, V] of source b. Counts its decoding steps."""

    def __init__(self, tables: torch.Tensor) -> None:
        super().__init__()
        self.tables = tables
        self.steps = 0

    def encode(self, src, src_mask=None):
        return [Table(self.tables[src[:, 0]], None)]

    def init_cache(self, batch_size, device=None, dtype=None):
        return ModelCache([])

    def decode(self, tgt, memories, *, cache):
        assert tgt.shape[1] == 1, "one token per step, never the prefix"
        self.steps += 1
        logp = memories[0].logp
        return logp[torch.arange(len(tgt)), tgt[:, 0]][:, None]  # [N, 1, V]


EOS = 1
# token 0 is bos (and a word), 1 eos; rows: the previous token; row 1 (after eos) is never read
TABLES = torch.tensor([
    # greedy goes 2, 0, 2, 0 ...; the best is 3 then eos
    [[0.05, 0.10, 0.45, 0.40], [0.25] * 4, [0.32, 0.25, 0.15, 0.28], [0.02, 0.90, 0.04, 0.04]],
    # eos at once is the likeliest; with a length penalty of 1, 2 2 2 2 (unfinished) wins
    [[0.05, 0.40, 0.35, 0.20], [0.25] * 4, [0.02, 0.03, 0.93, 0.02], [0.30, 0.30, 0.20, 0.20]],
    # eos is almost certain after every token
    [[0.005, 0.985, 0.005, 0.005]] * 4,
], dtype=torch.float64).log()


def brute_force(table, max_len, alpha):
    """Every hypothesis of at most max_len tokens, (score, ids) best first: the ones ended by eos
    and, at max_len, the unfinished ones."""
    words = [w for w in range(table.shape[0]) if w != EOS]
    out = []
    for n in range(max_len + 1):
        for ids in itertools.product(words, repeat=n):
            ends = n < max_len
            seq = [BOS, *ids] + ([EOS] if ends else [])
            log_prob = sum(table[a, b].item() for a, b in zip(seq, seq[1:]))
            out.append((log_prob / gnmt_length_penalty(n + ends, alpha), list(ids)))
    return sorted(out, key=lambda h: -h[0])


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_beam_search_finds_the_best_sequence_of_a_hand_made_model(alpha):
    stub, src, max_len = Bigram(TABLES[:2]), torch.tensor([[0], [1]]), 4
    found = beam_search(stub, src, bos=BOS, eos=EOS, beam=128, length_penalty=alpha, max_len=max_len,
                        n_best=True)  # 128 beams hold every hypothesis: the search is exhaustive
    for b in range(2):
        truth = brute_force(TABLES[b], max_len, alpha)
        assert found[b][0].tokens == truth[0][1]
        assert found[b][0].score == pytest.approx(truth[0][0], rel=1e-12)
        assert [h.score for h in found[b]] == pytest.approx([s for s, _ in truth], rel=1e-12)
    assert beam_search(stub, src, bos=BOS, eos=EOS, beam=128, length_penalty=alpha,
                       max_len=max_len) == [h[0].tokens for h in found]
    assert greedy(stub, src, bos=BOS, eos=EOS, max_len=max_len)[0] != found[0][0].tokens
    assert (found[1][0].tokens == [2, 2, 2, 2]) == (alpha == 1.0)


def test_beam_search_stops_once_no_live_hypothesis_can_win():
    stub = Bigram(TABLES[2:])
    assert beam_search(stub, torch.tensor([[0]]), bos=BOS, eos=EOS, beam=2, max_len=20) == [[]]
    assert stub.steps == 3  # two finished after 2 steps; the live ones fall behind them at step 3


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MECHANISMS))
def test_a_batch_of_sources_is_translated_as_each_source_alone(name, side):
    m = model(name).eval()
    rows = sources()
    src, mask = padded(rows, side)
    eos = MODEL_EOS[name]
    options = dict(bos=BOS, eos=eos, beam=3, max_len=8, n_best=True)
    batched = beam_search(m, src, src_mask=mask, **options)
    assert len({len(hyps[0].tokens) for hyps in batched}) > 1  # sources end at different steps
    for row, hyps in zip(rows, batched):
        alone = beam_search(m, row[None], **options)[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], rel=1e-9)
        for h in hyps:  # the cache followed each beam's parents: a full pass gives its log-probability
            ended = len(h.tokens) < options["max_len"]
            tgt = torch.tensor([BOS, *h.tokens] + ([eos] if ended else []))
            logp = m(row[None], tgt[None, :-1]).log_softmax(-1)[0]
            assert h.log_prob == pytest.approx(logp.gather(1, tgt[1:, None]).sum().item(), rel=1e-9)
            assert h.score == pytest.approx(h.log_prob / gnmt_length_penalty(len(tgt) - 1, 0.6), rel=1e-12)


class Recorder(nn.Module):
    """An EncoderDecoder that records, at each decoding step, the tokens fed and the bytes per
    row of its cache and of the source memories."""

    def __init__(self, model: EncoderDecoder) -> None:
        super().__init__()
        self.model = model
        self.steps: list[tuple[tuple[int, ...], float, float]] = []

    def encode(self, src, src_mask=None):
        return self.model.encode(src, src_mask)

    def init_cache(self, batch_size, device=None, dtype=None):
        return self.model.init_cache(batch_size, device=device, dtype=dtype)

    def decode(self, tgt, memories, *, cache):
        rows = tgt.shape[0]
        self.steps.append((tuple(tgt.shape), cache.nbytes() / rows, memory_nbytes(memories) / rows))
        return self.model.decode(tgt, memories, cache=cache)


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_beam_search_holds_a_fixed_memory_per_hypothesis_with_a_bounded_mechanism(name):
    m = Recorder(model(name))
    src, mask = padded(sources(3), "left")
    beam_search(m, src, src_mask=mask, bos=BOS, eos=m.model.cfg.vocab_size, beam=4, max_len=12)
    shapes, cache_bytes, memory_bytes = zip(*m.steps)
    assert len(m.steps) == 12 and set(shapes) == {(12, 1)}  # one token per hypothesis per step
    assert len(set(memory_bytes)) == 1
    if name == "abc-mlp":
        assert m.model.init_cache(1).fixed_size
        assert len(set(cache_bytes)) == 1
    else:  # the softmax cache grows: the recorder sees it
        assert all(a < b for a, b in zip(cache_bytes, cache_bytes[1:]))


def test_pad_outputs():
    assert pad_outputs([[3, 4], [], [5]], pad=9).tolist() == [[3, 4], [9, 9], [5, 9]]


@pytest.mark.parametrize("kwargs,error,match", [
    ({"beam": 0}, ConfigError, "beam"),
    ({"beam": 2.0}, ConfigError, "beam"),
    ({"max_len": 0}, ConfigError, "max_len"),
    ({"length_penalty": -0.5}, ConfigError, "length_penalty"),
    ({"src": torch.randint(0, 12, (5,))}, ShapeError, "src"),
    ({"src": torch.rand(2, 5)}, ShapeError, "src"),
    ({"src": torch.zeros(2, 0, dtype=torch.long)}, ShapeError, "src"),
    ({"src_mask": torch.ones(2, 4, dtype=torch.bool)}, ShapeError, "src_mask"),
    ({"src_mask": torch.ones(2, 5)}, ShapeError, "src_mask"),
])
def test_bad_input_is_a_clear_error(kwargs, error, match):
    m = model("softmax")
    args = dict(src=torch.randint(0, 12, (2, 5)), bos=BOS, eos=1, max_len=4) | kwargs
    with pytest.raises(error, match=match):
        beam_search(m, **args)
    if not {"beam", "length_penalty"} & set(kwargs):
        with pytest.raises(error, match=match):
            greedy(m, **args)
