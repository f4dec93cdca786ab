"""Translation: an encoder-decoder (`models.EncoderDecoder`) trained on parallel data.

What `memattn train` needs for task=translation (`TranslationTask`: the data, a batch of
step s, the label-smoothed loss, validation), and what `memattn eval` / `memattn translate`
add: decoding whole texts (`translate_texts`, greedy or beam search through each
mechanism's cache) and SacreBLEU / chrF (`score_translations`).

A pair is read as source ids [S] and target ids [T] of the joint BPE vocabulary
(`data.BPEVocab`), without specials; the decoder reads <s> y_1 .. y_T and is trained to
predict y_1 .. y_T </s>. Batches are right-padded with <pad>, which the source mask and the
loss leave out.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from memattn.config import RunConfig
from memattn.errors import ConfigError
from memattn.tasks import EvalOptions, StepLoss, Task, refuse_transfer


class PairBatch(NamedTuple):
    """src [B, S], src_mask [B, S] bool (True = real), tgt_in [B, T] (<s> y), tgt_out [B, T]
    (y </s>, <pad> after the end)."""

    src: torch.Tensor
    src_mask: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor

    def to(self, device) -> PairBatch:
        return PairBatch(*(t.to(device) for t in self))


def pad_rows(rows: list[np.ndarray], pad: int, before: list[int] = (), after: list[int] = ()) -> torch.Tensor:
    """Id arrays -> [B, L] int64, each row `before` + ids + `after`, right-padded with `pad`."""
    rows = [np.concatenate([np.asarray(before, np.int64), r.astype(np.int64), np.asarray(after, np.int64)])
            for r in rows]
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.from_numpy(r)
    return out


def pair_batch(split, rows, vocab) -> PairBatch:
    """The pairs `rows` (indices) of a ParallelSplit as a padded PairBatch."""
    src = pad_rows([split.source[i] for i in rows], vocab.pad_id)
    return PairBatch(src, src != vocab.pad_id,
                     pad_rows([split.target[i] for i in rows], vocab.pad_id, before=[vocab.bos_id]),
                     pad_rows([split.target[i] for i in rows], vocab.pad_id, after=[vocab.eos_id]))


def smoothed_loss(logits: torch.Tensor, target: torch.Tensor, pad: int,
                  smoothing: float) -> tuple[torch.Tensor, int]:
    """Summed label-smoothed cross-entropy over the real target tokens (target != pad), and
    their number: logits [B, T, V], target [B, T]. Each token's loss is
    (1 - ε) · (-log p(y)) + ε · mean over the vocabulary of -log p(v)."""
    real = target != pad
    loss = F.cross_entropy(logits.float()[real], target[real], label_smoothing=smoothing, reduction="sum")
    return loss, int(real.sum())


def load_parallel_corpus(cfg: RunConfig, vocab=None):
    """The ParallelCorpus of cfg.data (encoded with `vocab` when given: resuming, evaluating)."""
    from memattn.data import load_parallel

    d = cfg.data
    return load_parallel(source=d.source, target=d.target, path=d.path, name=d.name,
                         source_lang=d.source_lang, target_lang=d.target_lang, bpe_size=d.bpe_size,
                         cache_dir=d.cache_dir, vocab=vocab)


def check_lengths(corpus, max_len: int) -> None:
    """ConfigError naming the first pair of any split whose source, or target with its
    special token, is longer than the model's positions (model.max_len)."""
    for name in ("train", "val", "test"):
        split = corpus.split(name)
        for side, seqs, extra in (("source", split.source, 0), ("target", split.target, 1)):
            long = [i for i, s in enumerate(seqs) if len(s) + extra > max_len]
            if long:
                i = long[0]
                raise ConfigError(f"model.max_len: pair {i + 1} of the {name} split has a {side} of "
                                  f"{len(seqs[i]) + extra} tokens, more than model.max_len={max_len} "
                                  f"({len(long)} such pairs in that split); raise model.max_len or "
                                  "leave the long pairs out of the data")


class TranslationTask(Task):
    """Parallel data for the training loop: batch of step s, loss and validation."""

    logged = ("loss", "ppl")  # the validation figures the training log keeps
    selects = ("loss", "lower")  # train.patience stops on the validation loss
    translates = True

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        tc = cfg.train
        if cfg.data.corpus != "parallel":
            raise ConfigError(f"task=translation: translation reads parallel data (data.corpus=parallel) "
                              f"and only it does; got data.corpus={cfg.data.corpus!r}")
        if tc.segments or tc.init_from:
            raise ConfigError("task=translation: train.segments and train.init_from are for language models")
        refuse_transfer(cfg)
        if cfg.model.attention_layers:
            raise ConfigError("model.attention_layers: the layers of an encoder-decoder take model.attention "
                              "and model.encoder_attention")

    @classmethod
    def build_model(cls, cfg: RunConfig) -> torch.nn.Module:
        from memattn.models import EncoderDecoder

        return EncoderDecoder(cfg.model)

    @classmethod
    def prepare(cls, cfg: RunConfig, ddp, resume: bool, source) -> "TranslationTask":
        """Resumed, the corpus is read with the checkpoint's vocabulary."""
        from pathlib import Path

        from memattn.checkpoint import load_checkpoint
        from memattn.data import Vocab
        from memattn.train import main_rank_first, with_vocab_size

        vocab = None
        if resume:
            ckpt = load_checkpoint(Path(cfg.train.out_dir) / "checkpoint.safetensors")
            vocab = Vocab.from_json(ckpt.meta["vocab"])
        corpus = main_rank_first(lambda: load_parallel_corpus(cfg, vocab), ddp)
        return cls(with_vocab_size(cfg, corpus.vocab.size), corpus)

    def __init__(self, cfg: RunConfig, corpus) -> None:
        self.cfg = cfg
        self.corpus = corpus
        self.vocab = corpus.vocab
        self.train_split, self.val_split = corpus.split("train"), corpus.split("val")
        for name, split in (("training", self.train_split), ("validation", self.val_split)):
            if len(split) == 0:
                raise ConfigError(f"data: the {name} split of the parallel data holds no pair")
        check_lengths(corpus, cfg.model.max_len)

    def batch(self, step: int, rank: int, world: int) -> PairBatch:
        """This rank's share of step `step`'s global batch of batch_size pairs, drawn with a
        generator seeded by (train.seed, step): the same pairs whatever the number of ranks."""
        from memattn.train import step_seed

        g = torch.Generator().manual_seed(step_seed(self.cfg.train.seed, step))
        rows = torch.randint(len(self.train_split), (self.cfg.train.batch_size,), generator=g)
        return pair_batch(self.train_split, rows.chunk(world)[rank].tolist(), self.vocab)

    def tokens(self, batch: PairBatch) -> int:
        """Tokens a batch trains on (for tokens/s): its real target tokens."""
        return int((batch.tgt_out != self.vocab.pad_id).sum())

    def loss(self, model, batch: PairBatch) -> StepLoss:
        """The summed label-smoothed loss over a batch's real target tokens."""
        logits = model(batch.src, batch.tgt_in, src_mask=batch.src_mask)
        return StepLoss(*smoothed_loss(logits, batch.tgt_out, self.vocab.pad_id, self.cfg.train.label_smoothing))

    def evaluate(self, model, device, split=None, max_batches: int | None = None) -> dict[str, float]:
        """Cross-entropy (nats per target token, no smoothing) and perplexity on the validation
        split (or `split`), in order, batch_size pairs a batch, at most max_batches
        (train.eval_batches; 0: all)."""
        return evaluate_pairs(model, split or self.val_split, self.vocab, batch_size=self.cfg.train.batch_size,
                              max_batches=self.cfg.train.eval_batches if max_batches is None else max_batches,
                              device=device)

    @classmethod
    def evaluate_checkpoint(cls, model, cfg: RunConfig, vocab: dict[str, Any], options: EvalOptions
                            ) -> tuple[dict[str, Any], str]:
        """Loss and perplexity of the split's references, then its sources translated (beam)
        and scored with SacreBLEU and chrF."""
        from memattn.data import Vocab

        o = options
        if o.stream or o.context or o.seq_len:
            raise ConfigError("--stream / --context / --seq-len: for language models, not a translation run")
        vocab = Vocab.from_json(vocab)
        split = load_parallel_corpus(cfg, vocab).split(o.split)
        n = min(len(split), o.batches * o.batch_size) if o.batches else len(split)
        result = evaluate_pairs(model, split, vocab, batch_size=o.batch_size, max_batches=o.batches, device=o.device)
        start = time.perf_counter()
        hyps = translate_texts(model, vocab, split.source_text[:n], beam=o.beam, length_penalty=o.length_penalty,
                               batch_size=o.batch_size, device=o.device, where=f"the {o.split} split")
        seconds = time.perf_counter() - start
        result.update(score_translations(hyps, split.target_text[:n]), split=o.split, sentences=n, beam=o.beam,
                      length_penalty=o.length_penalty, translate_s=round(seconds, 2), checkpoint=str(o.checkpoint))
        return result, (f"{o.split}: loss {result['loss']:.4f} nats, perplexity {result['ppl']:.3f} over "
                        f"{result['tokens']:,} target tokens; BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f} "
                        f"over {n:,} sentences (beam {o.beam}, {seconds:.1f} s)")


@torch.no_grad()
def evaluate_pairs(model, split, vocab, *, batch_size: int, max_batches: int, device) -> dict[str, float]:
    """Mean cross-entropy per real target token (</s> included) and its perplexity."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    n = len(split)
    for b, start in enumerate(range(0, n, batch_size)):
        if max_batches and b >= max_batches:
            break
        batch = pair_batch(split, range(start, min(n, start + batch_size)), vocab).to(device)
        logits = model(batch.src, batch.tgt_in, src_mask=batch.src_mask)
        loss, tokens = smoothed_loss(logits, batch.tgt_out, vocab.pad_id, 0.0)
        total, count = total + loss.item(), count + tokens
    model.train(was_training)
    loss = total / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}


@torch.no_grad()
def translate_texts(model, vocab, texts: list[str], *, beam: int = 1, length_penalty: float = 0.6,
                    max_len: int | None = None, batch_size: int = 32, device="cpu",
                    where: str = "input") -> list[str]:
    """Each source text translated: greedy (beam=1) or beam search, in batches of batch_size
    sources sorted by length. A source longer than model.max_len is a ConfigError naming its
    line in `where`; outputs stop at </s> or at max_len tokens (default: twice the batch's
    longest source plus 10, at most model.max_len - 1)."""
    from memattn.decoding import beam_search, greedy

    if max_len is not None and max_len < 1:
        raise ConfigError(f"max_len: expected a longest output of at least 1 token (None: the default), got {max_len}")
    if batch_size < 1:
        raise ConfigError(f"batch_size: expected at least 1 sentence a batch, got {batch_size}")
    limit = model.cfg.max_len
    encoded = []
    for i, text in enumerate(texts):
        ids = vocab.encode(text)
        if len(ids) == 0:
            raise ConfigError(f"{where}: line {i + 1} is empty")
        if len(ids) > limit:
            raise ConfigError(f"{where}: line {i + 1} has {len(ids)} tokens, more than the model's "
                              f"model.max_len={limit}")
        encoded.append(ids)
    model.eval()
    out: list[str | None] = [None] * len(texts)
    order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        src = pad_rows([encoded[i] for i in rows], vocab.pad_id).to(device)
        longest = min(max_len if max_len is not None else 2 * src.shape[1] + 10, limit - 1)
        how = dict(src_mask=src != vocab.pad_id, bos=vocab.bos_id, eos=vocab.eos_id, max_len=longest)
        hyps = (greedy(model, src, **how) if beam == 1 else
                beam_search(model, src, beam=beam, length_penalty=length_penalty, **how))
        for i, ids in zip(rows, hyps):
            out[i] = vocab.decode(ids)
    return out


def score_translations(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus SacreBLEU (13a tokenisation) and chrF of detokenised hypotheses against one
    reference each, with sacrebleu's signatures."""
    try:
        import sacrebleu
    except ImportError:
        raise ConfigError("BLEU needs the sacrebleu package: pip install sacrebleu "
                          "(or the memattn[mt] extra)") from None
    if len(hypotheses) != len(references):
        raise ConfigError(f"hypotheses: {len(hypotheses)} for {len(references)} references")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {"bleu": b.score, "chrf": c.score, "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}
