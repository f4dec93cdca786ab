"""Causal language modelling (task=lm): next-token cross-entropy on a corpus, from random
windows or, with train.segments, from contiguous streams whose memory is carried from step
to step; optionally distilled from the train.init_from model (train.distill_weight)."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from memattn.errors import ConfigError
from memattn.tasks import StepLoss, Task


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

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.data.corpus == "parallel":
            raise ConfigError("task=lm: translation reads parallel data (data.corpus=parallel) and only it "
                              "does; a language model reads a corpus")
        if cfg.train.label_smoothing:
            raise ConfigError(f"train.label_smoothing: smooths the targets of translation runs "
                              f"(task=translation); a task=lm run trains on the plain cross-entropy, so "
                              f"leave it at 0 (got {cfg.train.label_smoothing})")

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
        from memattn.data import Vocab
        from memattn.evaluate import as_tensor
        from memattn.train import converted_run, load_run_corpus, read_with_vocab, with_vocab_size

        tc = cfg.train
        if source is not None and source.converted:
            cfg = converted_run(cfg, source)
        corpus = load_run_corpus(cfg, ddp)
        if source is not None and source.vocab is not None:
            corpus = read_with_vocab(corpus, Vocab.from_json(source.vocab), f"the vocabulary of "
                                     f"train.init_from {tc.init_from}", say=ddp.main)
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

    def check_model(self, model) -> None:
        if self.cfg.train.segments:
            from memattn.train import check_segments

            check_segments(model, self.cfg)

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


def _unwrapped(model):
    """The model inside a DistributedDataParallel wrapper (or the model)."""
    return getattr(model, "module", model)
