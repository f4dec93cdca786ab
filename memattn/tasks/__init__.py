"""Tasks: what a run trains its model to do, registered by name as mechanisms are.

`cfg.task` names one. A task is a class with

    Options                      None, or the dataclass of its own settings: cfg.task_options
                                 (`task_options.KEY=VALUE`) read as it, cfg.task_settings
    check_config(cfg)            classmethod: ConfigError for settings the task cannot take
    build_model(cfg)             classmethod: the model as initialised
    extra_symbols                ids beyond the data's vocabulary (the masked LM's mask token)
    prepare(cfg, ddp, resume, source)
                                 classmethod: the task on its data, its cfg with
                                 model.vocab_size set (`source`: the train.init_from model)
and, on an instance,
    cfg, corpus, source          its settings, data and train.init_from model (or None)
    logged                       the validation figures the training log keeps
    selects                      None, or (figure, "higher" | "lower"): the figure of evaluate()
                                 that train.patience stops on and whose best weights it keeps
    model_name                   what the model is called in progress bars and summaries (the
                                 attention's name, by default)
    batch(step, rank, world)     this rank's share of step `step`'s global batch, a function
                                 of (train.seed, step) alone; has .to(device)
    tokens(batch)                tokens the batch trains on (for tokens/s)
    loss(model, batch)           StepLoss: the summed loss, the positions it scores, and any
                                 further weighted terms of the objective
    evaluate(model, device)      the validation figures
    setup(model, device)         once the model is built: ConfigError if it cannot serve the
                                 task's settings; what the task holds beside it, on `device`
                                 (the language model's distillation teacher)
    meta()                       what a checkpoint records of the data (its vocabulary, by
                                 default, which `memattn eval` and `generate` read with)
    resumed(ckpt, model, ddp, device), carried(ddp)
                                 what a checkpoint keeps of the task's own state between
                                 steps (the language model's carried memory) and its return

What the command line does with a trained run, asked of its task, never of its name:
    evaluate_checkpoint(model, cfg, vocab, options)
                                 classmethod: `memattn eval` (EvalOptions): the figures and
                                 the line that says them
    generates                    its model continues a text token by token (`memattn generate`,
                                 `eval --lengths`, the decoding state `memattn info` measures)
    evaluate_by_length(model, cfg, vocab, options, lengths, streams=, chunk=, max_window=)
                                 classmethod of a task that generates: `eval --lengths`
    translates                   its model translates sentences (`memattn translate`)

The training loop (memattn.train) is the same for every task: it adds the model's auxiliary
losses (`aux_loss()`, e.g. adaptive-span penalties) to every task's objective.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from memattn.errors import ConfigError


class StepLoss(NamedTuple):
    """A batch's loss: `total` summed over the `scored` positions (the loop divides by their
    mean over the ranks), and `terms`, name -> (weight, value) added to the mean as
    weight · value and logged by name."""

    total: torch.Tensor
    scored: int
    terms: dict[str, tuple[float, torch.Tensor]] = {}


@dataclass(frozen=True)
class EvalOptions:
    """What `memattn eval` asks of a trained run; a task's errors name these options as the
    command line spells them (--seq-len, --context, ...)."""

    checkpoint: str  # the checkpoint file or run folder
    split: str = "test"
    seq_len: int | None = None  # None: the training seq_len
    batch_size: int = 16
    batches: int = 0  # 0: all
    context: int = 0
    stream: bool = False
    beam: int = 5
    length_penalty: float = 0.6
    device: str = "cpu"
    progress: Callable[[int, int], None] | None = None  # (done, total)

    def read_split(self, cfg, vocab: dict[str, Any]):
        """(ids, characters per token) of the split of the run's corpus, read with the run's
        vocabulary (`memattn.train.checkpoint_split`); a note on stderr when its text changed
        since training."""
        from memattn.train import checkpoint_split

        ids, chars_per_token, note = checkpoint_split(self.checkpoint, cfg, vocab, self.split)
        if note:
            print(f"memattn eval: note: {note}", file=sys.stderr)
        return ids, chars_per_token


class Task:
    """Defaults of the optional parts of a task (see the module docstring)."""

    Options: type | None = None
    extra_symbols = 0
    source = None
    selects: tuple[str, str] | None = None
    generates = False
    translates = False

    @classmethod
    def check_config(cls, cfg) -> None:
        return None

    @classmethod
    def evaluate_checkpoint(cls, model, cfg, vocab: dict[str, Any], options: EvalOptions
                            ) -> tuple[dict[str, Any], str]:
        raise ConfigError(f"{options.checkpoint}: a {cfg.task} run; its task has no evaluation of a "
                          "checkpoint for memattn eval")

    @classmethod
    def evaluate_by_length(cls, model, cfg, vocab: dict[str, Any], options: EvalOptions, lengths: list[int], *,
                           streams: int, chunk: int, max_window: int) -> dict[str, Any]:
        raise ConfigError(f"--lengths: {options.checkpoint}: a {cfg.task} run; its task has no evaluation by "
                          "length")

    @property
    def model_name(self) -> str:
        return self.cfg.model.attention.name

    def setup(self, model, device) -> None:
        return None

    def meta(self) -> dict[str, Any]:
        return {"vocab": self.corpus.vocab.to_json(), "corpus": self.corpus.name}

    def resumed(self, ckpt, model, ddp, device) -> None:
        return None

    def carried(self, ddp) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        return {}, None


def read_task_options(name: str, options: dict[str, Any]) -> Any:
    """`options` (cfg.task_options) as task `name`'s Options dataclass, every key and type
    checked (ConfigError naming `task_options.KEY`); None for a task without options."""
    from memattn.typed import from_dict

    cls = task_class(name)
    if cls.Options is None:
        if options:
            raise ConfigError(f"task_options: task={name} has no options of its own, got "
                              f"{', '.join(sorted(options))}")
        return None
    return from_dict(cls.Options, options, "task_options")


def refuse_label_smoothing(cfg) -> None:
    """ConfigError for train.label_smoothing in a task that trains on the plain cross-entropy."""
    if cfg.train.label_smoothing:
        raise ConfigError(f"train.label_smoothing: smooths the targets of translation runs "
                          f"(task=translation); a task={cfg.task} run trains on the plain cross-entropy, "
                          f"so leave it at 0 (got {cfg.train.label_smoothing})")


def refuse_transfer(cfg) -> None:
    """ConfigError for the attention transfer and LoRA settings outside causal language models."""
    if cfg.train.transfer_steps or cfg.train.lora_rank:
        raise ConfigError(f"task={cfg.task}: train.transfer_steps and train.lora_rank are for causal "
                          "language models (task=lm)")


def refuse_language_model_settings(cfg) -> None:
    """ConfigError for what only language models train with (train.segments, train.distill_weight,
    attention transfer and LoRA) and for train.label_smoothing, in a task that is neither."""
    if cfg.train.segments or cfg.train.distill_weight:
        raise ConfigError(f"task={cfg.task}: train.segments and train.distill_weight are for causal language "
                          "models")
    refuse_label_smoothing(cfg)
    refuse_transfer(cfg)


@dataclass(frozen=True)
class TaskEntry:
    name: str
    summary: str
    where: str  # "module:Class", imported when the task is used


TASKS: dict[str, TaskEntry] = {}


def register_task(name: str, summary: str, where: str) -> None:
    if name in TASKS:
        raise ValueError(f"task {name!r} is already registered")
    TASKS[name] = TaskEntry(name, summary, where)


def task_class(name: str) -> type[Task]:
    """The class of task `name` (ConfigError naming `task` if none is registered)."""
    if name not in TASKS:
        raise ConfigError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    module, _, cls = TASKS[name].where.partition(":")
    return getattr(importlib.import_module(module), cls)


register_task("lm", "a causal language model on a corpus", "memattn.tasks.lm:LanguageModelTask")
register_task("mlm", "a bidirectional encoder restoring masked tokens", "memattn.masked:MaskedLMTask")
register_task("translation", "an encoder-decoder on parallel data", "memattn.translation:TranslationTask")
