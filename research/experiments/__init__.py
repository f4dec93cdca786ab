"""Reproductions of the papers' experiments, small: `memattn experiment NAME`.

Each module here is one experiment, named like the module with '-' for '_' (abc_lm.py ->
`abc-lm`). A module defines:

    DESCRIPTION: str                              one line for `--help`
    def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict

`run` trains and evaluates what the experiment compares, writes its results table (JSON +
markdown, plots where useful, and the command that made them) under `out_dir`, and returns
the table. `quick` shrinks it to a smoke test that finishes in about a minute on a CPU.
`jobs`: models trained at once. Every model of an experiment is a run folder
(`research.experiments._runner`): an experiment continues across sittings, reusing what is
finished and resuming what is not, exactly.

Models train through `memattn.train`'s one loop as registered tasks (`memattn.tasks`): lm, mlm
and translation; task=recall, registered by `recall.py` (its rows of MQAR and passkeys,
`task_options` for their settings); task=reading-qa, registered by `linear_qa.py` (its GRU
reader on the synthetic reading task, trained to convergence by the loop's early stopping,
train.patience on the validation accuracy, and tested with its best weights); task=majority,
registered by `gmat_majority.py` (MAJORITY(L, p) tagging; MAJORITY(8192, 1) starts from the
trained MAJORITY(512, 1) model through train.init_from, which grows its position table); and
task=compression, registered by `gmat_mlm.py` (a GMAT `Compressor` rebuilding masked text from
its M vectors, beside gmat-mlm's task=mlm encoders). A task's batch of step s is drawn from
(train.seed, s) alone, and the loop stops on its step budget: an experiment's time budget is a
number of steps.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

from memattn.errors import ConfigError


def experiments() -> dict[str, ModuleType]:
    """Every experiment module by its command name."""
    found = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"research.experiments.{info.name}")
        if hasattr(module, "run"):
            found[info.name.replace("_", "-")] = module
    return dict(sorted(found.items()))


def get_experiment(name: str) -> ModuleType:
    known = experiments()
    if name not in known:
        raise ConfigError(f"experiment: unknown experiment {name!r}; known: {', '.join(known) or 'none'}")
    return known[name]
