"""Masked language modelling: a bidirectional `models.Encoder` trained to restore masked tokens
(task=mlm; ABC's warm-start setting fine-tunes such a model).

What `memattn train` and `memattn eval` need for task=mlm (`MaskedLMTask`: a batch of step
s, the loss, validation, a checkpoint's evaluation). A batch is batch_size windows of
seq_len tokens of the training split, drawn as the language model draws them; BERT's
masking chooses 15 % of the positions, of which 80 % read a mask token, 10 % a random token
and 10 % stay, and the loss is the cross-entropy at the chosen positions. The mask token
is one id past the corpus's vocabulary (model.vocab_size = vocabulary + 1). Validation reads
the first windows of the validation split with a masking fixed by the seed: loss and
accuracy at the chosen positions.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from memattn.config import RunConfig
from memattn.errors import ConfigError
from memattn.tasks import EvalOptions, StepLoss, Task, refuse_language_model_settings

MASK_RATE = 0.15


def mask_tokens(ids: torch.Tensor, mask_id: int, vocab: int, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of ids [B, L]: (inputs [B, L], chosen bool [B, L]: the positions to predict)."""
    chosen = torch.rand(ids.shape, generator=generator) < MASK_RATE
    action = torch.rand(ids.shape, generator=generator)
    random_ids = torch.randint(0, vocab, ids.shape, generator=generator)
    inputs = torch.where(chosen & (action < 0.8), mask_id, ids)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
    return inputs, chosen


def windows(ids: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` consecutive windows of seq_len tokens: [count', seq_len]."""
    n = min(count, len(ids) // seq_len)
    if n == 0:
        raise ConfigError(f"seq_len: the split holds {len(ids)} tokens, fewer than one window of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


class MaskedBatch(NamedTuple):
    """inputs [B, L] (masked), targets [B, L], chosen [B, L] bool."""

    inputs: torch.Tensor
    targets: torch.Tensor
    chosen: torch.Tensor

    def to(self, device) -> MaskedBatch:
        return MaskedBatch(*(t.to(device) for t in self))


def masked_loss(model, batch: MaskedBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(summed cross-entropy at the chosen positions, their logits [N, V], N)."""
    logits = model(batch.inputs, mlm=True)[batch.chosen]
    return F.cross_entropy(logits.float(), batch.targets[batch.chosen], reduction="sum"), logits, len(logits)


class MaskedLMTask(Task):
    """A corpus for the training loop's masked-LM task: batch of step s, loss, validation."""

    logged = ("loss", "accuracy")  # the validation figures the training log keeps
    selects = ("loss", "lower")  # train.patience stops on the validation loss
    extra_symbols = 1  # the mask token

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        refuse_language_model_settings(cfg)
        if cfg.data.corpus == "parallel":
            raise ConfigError(f"task={cfg.task}: translation reads parallel data (data.corpus=parallel) and only it "
                              "does; a masked LM reads a corpus")

    @classmethod
    def build_model(cls, cfg: RunConfig) -> torch.nn.Module:
        from memattn.models import Encoder

        return Encoder(cfg.model)

    @classmethod
    def prepare(cls, cfg: RunConfig, ddp, resume: bool, source) -> "MaskedLMTask":
        from memattn.train import load_task_corpus, with_vocab_size

        if source is not None and source.converted:
            raise ConfigError("train.init_from: a converted transformers model trains as a causal LM "
                              "(task=lm); a masked-LM run starts from a memattn masked-LM run")
        corpus = load_task_corpus(cfg, ddp, source)
        return cls(with_vocab_size(cfg, corpus.vocab.size + cls.extra_symbols), corpus, source)

    def __init__(self, cfg: RunConfig, corpus, source=None) -> None:
        from memattn.evaluate import as_tensor

        self.cfg, self.corpus, self.source = cfg, corpus, source
        self.vocab = corpus.vocab.size  # the mask token is the next id
        self.train_ids, self.val_ids = as_tensor(corpus.train), as_tensor(corpus.val)
        for name, ids in (("training", self.train_ids), ("validation", self.val_ids)):
            if len(ids) < cfg.train.seq_len + 2:
                raise ConfigError(f"train.seq_len: the {name} split holds {len(ids):,} tokens, fewer than "
                                  f"one window of {cfg.train.seq_len}")

    def batch(self, step: int, rank: int, world: int) -> MaskedBatch:
        """This rank's share of step `step`'s global batch, windows and masks drawn from
        (train.seed, step) alone."""
        from memattn.train import sample_batch, step_seed

        x, _ = sample_batch(self.train_ids, step, self.cfg.train)  # the global batch
        g = torch.Generator().manual_seed(step_seed(self.cfg.train.seed, step) + 1)
        inputs, chosen = mask_tokens(x, self.vocab, self.vocab, g)
        return MaskedBatch(*(t.chunk(world)[rank] for t in (inputs, x, chosen)))

    def tokens(self, batch: MaskedBatch) -> int:
        """Tokens a batch trains on (for tokens/s): every token it reads."""
        return batch.inputs.numel()

    def loss(self, model, batch: MaskedBatch) -> StepLoss:
        total, _, count = masked_loss(model, batch)
        return StepLoss(total, count)

    def evaluate(self, model, device, ids: torch.Tensor | None = None,
                 max_batches: int | None = None) -> dict[str, float]:
        """Loss (nats per masked token), perplexity and accuracy on the first windows of the
        validation split (or `ids`), masked with a generator seeded by train.seed."""
        tc = self.cfg.train
        batches = tc.eval_batches if max_batches is None else max_batches
        data = windows(self.val_ids if ids is None else ids, tc.seq_len,
                       batches * tc.batch_size if batches else 1 << 62)
        return evaluate_masked(model, data, self.vocab, tc.batch_size, tc.seed, device)

    @classmethod
    def evaluate_checkpoint(cls, model, cfg: RunConfig, vocab: dict[str, Any], options: EvalOptions
                            ) -> tuple[dict[str, Any], str]:
        """Loss, perplexity and accuracy at the masked positions of the split's windows (masks
        drawn from the run's seed)."""
        from memattn.evaluate import as_tensor

        o = options
        if o.stream or o.context:
            raise ConfigError("--stream / --context: for causal language models, not a masked-LM run")
        ids, _ = o.read_split(cfg, vocab)
        seq_len = o.seq_len or cfg.train.seq_len
        data = windows(as_tensor(ids), seq_len, o.batches * o.batch_size if o.batches else 1 << 62)
        result = evaluate_masked(model, data, cfg.model.vocab_size - cls.extra_symbols, o.batch_size,
                                 cfg.train.seed, o.device)
        result.update(split=o.split, seq_len=seq_len, checkpoint=str(o.checkpoint))
        return result, (f"{o.split}: loss {result['loss']:.4f} nats, perplexity {result['ppl']:.3f}, accuracy "
                        f"{100 * result['accuracy']:.2f} % over {result['tokens']:,} masked tokens "
                        f"(windows of {seq_len})")


@torch.no_grad()
def evaluate_masked(model, data: torch.Tensor, vocab: int, batch_size: int, seed: int,
                    device) -> dict[str, float]:
    """Masked-LM figures of windows data [N, L] (mask id = vocab), masks drawn from `seed`."""
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    total, right, count = 0.0, 0, 0
    for start in range(0, len(data), batch_size):
        x = data[start:start + batch_size]
        inputs, chosen = mask_tokens(x, vocab, vocab, g)
        batch = MaskedBatch(inputs, x, chosen).to(device)
        loss, logits, n = masked_loss(model, batch)
        total += loss.item()
        right += int((logits.argmax(-1) == batch.targets[batch.chosen]).sum())
        count += n
    model.train(was_training)
    loss = total / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "accuracy": right / max(count, 1),
            "tokens": count}
