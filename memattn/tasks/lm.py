"""Causal language modelling (task=lm): next-token cross-entropy on a corpus, from random
windows or, with train.segments, from contiguous streams whose memory is carried from step
to step; optionally distilled from the train.init_from model (train.distill_weight)."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from memattn.errors import ConfigError
from memattn.tasks import EvalOptions, StepLoss, Task, refuse_label_smoothing


class Windows(NamedTuple):
    """x, y [b, seq_len]: inputs and next tokens; `segment`: the stream segment the windows
    are (train.segments), else -1."""

    x: torch.Tensor
    y: torch.Tensor
    segment: int = -1

    def to(self, device) -> "Windows":
        return Windows(self.x.to(device), self.y.to(device), self.segment)


class LanguageModelTask(Task):
    logged = ("loss", "bpc")
    selects = ("loss", "lower")  # train.patience stops on the validation loss
    generates = True

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.data.corpus == "parallel":
            raise ConfigError("task=lm: translation reads parallel data (data.corpus=parallel) and only it "
                              "does; a language model reads a corpus")
        refuse_label_smoothing(cfg)

    @classmethod
    def build_model(cls, cfg) -> torch.nn.Module:
        """A CausalLM, or the converted transformers model that train.init_from names."""
        from memattn.warmstart import is_converted

        if cfg.train.init_from and is_converted(cfg.train.init_from):  # no weights to load here
            from memattn.integrations.convert import ConvertedLM, load_converted

            return ConvertedLM(load_converted(cfg.train.init_from)).train()
        from memattn.models import CausalLM

        return CausalLM(cfg.model)

    @classmethod
    def prepare(cls, cfg, ddp, resume: bool, source) -> "LanguageModelTask":
        from memattn.evaluate import as_tensor
        from memattn.train import converted_run, load_task_corpus, with_vocab_size

        tc = cfg.train
        if source is not None and source.converted:
            cfg = converted_run(cfg, source)
        corpus = load_task_corpus(cfg, ddp, source)
        cfg = with_vocab_size(cfg, corpus.vocab.size)
        train_ids, val_ids = as_tensor(corpus.train), as_tensor(corpus.val)
        for split, ids in (("training", train_ids), ("validation", val_ids)):
            if len(ids) < tc.seq_len + 2:
                raise ConfigError(f"train.seq_len: the {split} split of {cfg.data.corpus!r} holds {len(ids):,} "
                                  f"tokens, fewer than one window of seq_len + 1 = {tc.seq_len + 1} (and one "
                                  "to start from); use a larger corpus or a smaller train.seq_len")
        return cls(cfg, corpus, source, train_ids, val_ids)

    def __init__(self, cfg, corpus, source, train_ids: torch.Tensor, val_ids: torch.Tensor) -> None:
        self.cfg, self.corpus, self.source = cfg, corpus, source
        self.train_ids, self.val_ids = train_ids, val_ids
        self.teacher = None  # the frozen train.init_from model, when distilling
        self.carry = None  # train.segments: the memory carried from step to step
        self.n_segments = 0
        tc = cfg.train
        if tc.segments:
            self.n_segments = (len(train_ids) - 1) // tc.batch_size // tc.seq_len
            if self.n_segments == 0:
                raise ConfigError(f"train.segments: {tc.batch_size} streams of the training split "
                                  f"({len(train_ids):,} tokens) are shorter than train.seq_len={tc.seq_len}")

    def setup(self, model, device) -> None:
        """Segments need a model whose memory can be carried; distillation (train.distill_weight)
        reads the train.init_from model, frozen, on `device`."""
        if self.cfg.train.segments:
            from memattn.train import check_segments

            check_segments(model, self.cfg)
        if self.cfg.train.distill_weight > 0:
            from memattn.warmstart import teacher_model

            self.teacher = teacher_model(self.source).to(device)

    def batch(self, step: int, rank: int, world: int) -> Windows:
        from memattn.evaluate import segment_window
        from memattn.train import sample_batch

        tc = self.cfg.train
        if not tc.segments:
            return Windows(*sample_batch(self.train_ids, step, tc, rank, world))
        segment = step % self.n_segments
        window = segment_window(self.train_ids, tc.batch_size, tc.seq_len, segment).chunk(world)[rank]
        return Windows(window[:, :-1], window[:, 1:], segment)

    def tokens(self, batch: Windows) -> int:
        return batch.x.numel()

    def loss(self, model, batch: Windows) -> StepLoss:
        if batch.segment == 0:  # the streams (re)start: an empty memory
            self.carry = _unwrapped(model).init_cache(batch.x.shape[0], device=batch.x.device)
        logits = model(batch.x) if self.carry is None else model(batch.x, cache=self.carry)
        total = F.cross_entropy(logits.float().flatten(0, 1), batch.y.flatten(), reduction="sum")
        terms = {}
        if self.teacher is not None:
            from memattn.warmstart import distill_loss

            with torch.no_grad():
                teacher_logits = self.teacher(batch.x)
            terms["distill"] = (self.cfg.train.distill_weight, distill_loss(logits, teacher_logits))
        return StepLoss(total, batch.y.numel(), terms)

    def evaluate(self, model, device) -> dict[str, float]:
        from memattn.evaluate import evaluate

        tc = self.cfg.train
        return evaluate(model, self.val_ids, seq_len=tc.seq_len, batch_size=tc.batch_size,
                        max_batches=tc.eval_batches, device=device, segments=tc.segments,
                        chars_per_token=self.corpus.chars_per_token("val"))

    def meta(self) -> dict[str, Any]:
        from memattn.train import fingerprint

        return {**super().meta(),
                "data": {split: fingerprint(self.corpus.split(split)) for split in ("train", "val", "test")}}

    def resumed(self, ckpt, model, ddp, device) -> None:
        from memattn.train import changed_splits, restore_carried_memory

        if ddp.main:
            changed = changed_splits(ckpt.meta.get("data", {}), self.corpus)
            if changed:
                which = " and ".join([", ".join(changed[:-1]), changed[-1]] if len(changed) > 1 else changed)
                print(f"memattn train: note: --resume: the {which} split{'s' if len(changed) > 1 else ''} of "
                      f"{self.cfg.data.corpus!r} {'are' if len(changed) > 1 else 'is'} not the text the "
                      "checkpoint was trained with (it changed since); the run goes on with the text as it "
                      "is now", file=sys.stderr)
        if self.cfg.train.segments:
            self.carry = restore_carried_memory(ckpt, model, self.cfg.train.batch_size // ddp.world, ddp,
                                                device)

    def carried(self, ddp):
        from memattn.train import carried_memory

        return ({}, None) if self.carry is None else carried_memory(self.carry, ddp)

    @classmethod
    def evaluate_checkpoint(cls, model, cfg, vocab: dict[str, Any], options: EvalOptions
                            ) -> tuple[dict[str, Any], str]:
        """Loss, bits per character and perplexity of the split: windows of seq_len tokens
        scored after `context` unscored ones, or `batch_size` streams whose memory is carried
        from segment to segment (--stream, or a run trained with train.segments)."""
        from memattn.evaluate import as_tensor, check_streamable, evaluate

        o = options
        ids, chars_per_token = o.read_split(cfg, vocab)
        seq_len = o.seq_len or cfg.train.seq_len
        stream = o.stream or cfg.train.segments
        check_window(cfg, len(ids), seq_len, 0 if stream else o.context, o.split,
                     streams=o.batch_size if stream else 0)
        ids = as_tensor(ids)
        if stream and o.context:
            raise ConfigError("--context: a stream (--stream, or a run trained with train.segments) "
                              "already reads everything before each segment")
        if o.stream:
            check_streamable(model)
        windows = (len(ids) - 1 - o.context) // seq_len
        if o.batches:
            windows = min(windows, o.batches * o.batch_size)
        read, scored = windows * (o.context + seq_len), windows * seq_len
        if not stream and o.context and read > 1_000_000 and read > 8 * scored:
            print(f"memattn eval: note: each window re-reads --context {o.context:,} tokens before scoring "
                  f"{seq_len}: {read:,} tokens read to score {scored:,} (--batches N reads fewer)", file=sys.stderr)
        result = evaluate(model, ids, seq_len=seq_len, batch_size=o.batch_size, max_batches=o.batches,
                          device=o.device, segments=stream, context=o.context, chars_per_token=chars_per_token,
                          progress=o.progress)
        result.update(split=o.split, seq_len=seq_len, context=o.context, stream=stream, checkpoint=str(o.checkpoint))
        reading = ("one stream per row, state carried" if stream else
                   f"segments of {seq_len} after {o.context} unscored tokens")
        return result, (f"{o.split}: loss {result['loss']:.4f} nats, {result['bpc']:.4f} bits/char, "
                        f"perplexity {result['ppl']:.3f} over {result['tokens']:,} tokens ({reading})")

    @classmethod
    def evaluate_by_length(cls, model, cfg, vocab: dict[str, Any], options: EvalOptions, lengths: list[int], *,
                           streams: int, chunk: int, max_window: int) -> dict[str, Any]:
        """`memattn eval --lengths`: bits per character by position and over the first n tokens
        of `streams` documents of the split (`memattn.evaluate.evaluate_by_length`)."""
        from memattn.evaluate import as_tensor, evaluate_by_length

        ids, chars_per_token = options.read_split(cfg, vocab)
        result = evaluate_by_length(model, as_tensor(ids), lengths=lengths, train_len=cfg.train.seq_len,
                                    streams=streams, device=options.device, chars_per_token=chars_per_token,
                                    chunk=chunk, max_window=max_window, progress=options.progress)
        result.update(split=options.split, attention=cfg.model.attention.name, checkpoint=str(options.checkpoint))
        return result


def check_window(cfg, tokens: int, seq_len: int, context: int, split: str, streams: int = 0) -> None:
    """ConfigError unless a split of `tokens` tokens holds one window of context + seq_len
    tokens and its next one (or, streamed, `streams` streams of a segment each), and the
    model's learned positions, if any, reach that far: refused before anything is read."""
    names = "--seq-len" + (" / --context" if context else "")
    if streams and (tokens - 1) // streams < seq_len:
        raise ConfigError(f"--seq-len / --batch-size: the {split} split holds {tokens:,} tokens, too few for "
                          f"{streams} streams of a segment of {seq_len} tokens each; use a smaller --batch-size "
                          "or --seq-len")
    if not streams and tokens < context + seq_len + 1:
        raise ConfigError(f"{names}: the {split} split holds {tokens:,} tokens, fewer than one window of "
                          f"{context + seq_len:,} tokens and its next one ({context:,} of context + seq_len "
                          f"{seq_len:,} + 1); use a shorter {names.replace(' / ', ' or ')}")
    if cfg.model.positions in ("learned", "split") and context + seq_len > cfg.model.max_len:
        raise ConfigError(f"{names}: windows of {context + seq_len:,} tokens run past the model's learned "
                          f"positions (model.max_len={cfg.model.max_len:,}); use at most {cfg.model.max_len:,} "
                          "tokens in all")


def _unwrapped(model):
    """The model inside a DistributedDataParallel wrapper (or the model)."""
    return getattr(model, "module", model)
