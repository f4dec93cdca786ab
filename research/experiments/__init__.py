"""Reproductions of the papers' experiments, small: `memattn experiment NAME`.

Each module here is one experiment, named like the module with '-' for '_' (abc_lm.py ->
`abc-lm`). A module defines:

    DESCRIPTION: str                              one line for `--help`
    def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict

`run` trains and evaluates what the experiment compares, writes its results table (JSON +
markdown, plots where useful, and the command that made them) under `out_dir`, and returns
the table. `quick` shrinks it to a smoke test that finishes in about a minute on a CPU.
`jobs`: models trained at once. Experiments whose models are run folders
(`research.experiments._runner`) continue across sittings and take any `jobs`; the others
train in one process and refuse jobs > 1 (`single_process`).

Models train through `memattn.train`'s one loop as registered tasks (`memattn.tasks`): lm, mlm
and translation; task=recall, registered by `recall.py` (its rows of MQAR and passkeys,
`task_options` for their settings); and task=reading-qa, registered by `linear_qa.py` (its GRU
reader on the synthetic reading task, trained to convergence by the loop's early stopping,
train.patience on the validation accuracy, and tested with its best weights). Two experiments
still keep a loop of their own, each for what the one loop does not do yet:

- gmat-majority starts MAJORITY(8192, 1) from the trained MAJORITY(512, 1) model with a longer
  split position table whose new block rows copy the trained one (`start_from`); train.init_from
  copies only tensors of equal shapes. Its batches come from one generator advanced step by step
  (the same sequences for M = 0 and M > 0), and `budget_s` stops a model on time.
- gmat-mlm trains a `Compressor` to rebuild every character from its M vectors, an objective no
  registered task has, and its encoders on batches of one generator advanced step by step,
  where task=mlm draws each step's windows from (train.seed, step).

The two share `_common.train_steps`; moved onto the loop, they would write run folders
through `_runner` as the others do and that loop would go.
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


def single_process(name: str, jobs: int) -> None:
    """Raise ConfigError for --jobs > 1 in an experiment that trains in one process."""
    if jobs != 1:
        raise ConfigError(f"--jobs: experiment {name} trains its models one after another in one "
                          f"process; got --jobs {jobs}")
