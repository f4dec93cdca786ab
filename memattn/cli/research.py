"""`memattn demo` and `memattn experiment`: the main job, and the papers' experiments, small."""

from __future__ import annotations

import json
from pathlib import Path

from memattn.cli.common import OVERRIDES_HELP, int_at_least, research, with_config
from memattn.errors import ConfigError, MemattnError


def cmd_demo(args) -> int:
    from memattn.demo import run_demo

    run_demo(args.config, args.overrides, mechanisms=args.attention, out_dir=args.out_dir,
             warm_steps=args.warm_steps, contexts=tuple(sorted(set(args.contexts))), overwrite=args.overwrite,
             compile=not args.no_compile)
    return 0


def cmd_experiment(args) -> int:
    from memattn.fileio import output_lock

    research()
    from research.experiments import get_experiment
    from research.experiments._common import running

    module = get_experiment(args.name)
    out_dir = Path(args.out_dir or f"results/{args.name}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out-dir: {out_dir} is a file; give a folder for the results")
    if args.quick and holds_full_results(out_dir):
        raise ConfigError(f"--quick: {out_dir} holds the full results of experiment {args.name} (results.json); "
                          f"a quick run would write over them; give it a folder of its own with --out-dir "
                          f"(e.g. --out-dir runs/{args.name}-quick)")
    created = not out_dir.exists()
    with output_lock(out_dir, "--out-dir", ConfigError), running(args.command_line):
        try:
            module.run(out_dir, quick=args.quick, overrides=args.overrides, jobs=args.jobs)
        except MemattnError:  # refused before any result: no folder of its own left behind
            if created and out_dir.is_dir() and not any(out_dir.iterdir()):
                out_dir.rmdir()
            raise
    return 0


def holds_full_results(out_dir: Path) -> bool:
    """Whether `out_dir` holds an experiment's results from a full run (results.json without
    "quick": true, or one that cannot be read): what a --quick run must not write over."""
    path = out_dir / "results.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("quick") is not True
    except (OSError, ValueError, AttributeError):
        return True


def _experiment_list() -> str:
    try:
        research()
    except ConfigError:
        return "none in this installation (they run from a clone of the repository)"
    from research.experiments import experiments

    return "; ".join(f"{name}: {m.DESCRIPTION}" for name, m in experiments().items()) or "none yet"


def add_commands(sub) -> None:
    d = sub.add_parser("demo", help="the main job: prepare the corpus, train, evaluate, generate, compare",
                       description="Prepare the default corpus, train softmax attention, start each "
                       "other mechanism from it (train.init_from) and train it on, evaluate every "
                       "model on the test split, generate a sample, and compare quality, speed and "
                       "the decoding cost and state at growing contexts (a table and a plot).")
    with_config(d)
    d.add_argument("--attention", nargs="+", default=["softmax", "gsa"],
                   help="mechanisms to compare, the baseline first (default: %(default)s)")
    d.add_argument("--warm-steps", type=int_at_least(0, "a number of steps"), default=200,
                   help="steps each other mechanism trains after starting from the baseline; 0: "
                   "train it from scratch with the baseline's budget (default: %(default)s)")
    d.add_argument("--contexts", type=int_at_least(1, "a context length"), nargs="+",
                   default=[256, 1024, 4096, 16384],
                   help="context lengths at which decoding cost and state are measured (default: %(default)s)")
    d.add_argument("--out-dir", default="runs/demo", help="where runs and summary.json go (default: %(default)s)")
    d.add_argument("--no-compile", action="store_true",
                   help="time decoding eager only (by default also through torch.compile, as "
                        "memattn generate --compile decodes: tens of seconds to compile a model)")
    d.add_argument("--overwrite", action="store_true",
                   help="replace an earlier demo in --out-dir (without it, such a folder is refused)")
    d.set_defaults(fn=cmd_demo)

    x = sub.add_parser("experiment", help="reproduce a paper's experiment, small",
                       description="Run one of the papers' experiments and write its results "
                       "table under results/NAME/ (with the command that made it). "
                       "Experiments: " + _experiment_list())
    x.add_argument("name", help="which experiment")
    x.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    x.add_argument("--out-dir", help="where results go (default: results/NAME)")
    x.add_argument("--quick", action="store_true", help="a small smoke run, about a minute on a CPU")
    x.add_argument("--jobs", type=int_at_least(1, "a number of models at once"), default=1,
                   help="models trained at once, one thread each (experiments that train models "
                   "in run folders: abc-lm, persistent-lm); running the command again continues "
                   "unfinished models and reuses finished ones")
    x.set_defaults(fn=cmd_experiment)
