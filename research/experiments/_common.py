"""What the experiments share: writing results (JSON, markdown, the command, figures), each
atomically, and summaries over seeds."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from memattn.fileio import atomic_write, atomic_write_text


def training_tokens_per_s(model: torch.nn.Module, loss_of: Callable[[], tuple[torch.Tensor, int]],
                          steps: int = 4) -> float:
    """Tokens per second of training steps on one batch: loss_of() -> (loss, tokens it
    trains on), backward and an AdamW step at lr 0, `steps` times after one untimed step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    model.train()
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()
        loss, tokens = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return steps * tokens / (time.perf_counter() - start)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Within: torch uses `n` threads; the number it had before is restored on the way out."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# The `memattn experiment` command line running now (set by the CLI), recorded with the results.
_RUNNING: ContextVar[str | None] = ContextVar("memattn_experiment_command", default=None)


@contextlib.contextmanager
def running(command_line: str) -> Iterator[None]:
    """Within: the results written (`write_results`) name `command_line` as the command that
    made them, in the results and in command.txt beside them. A run refused before it writes
    results leaves command.txt as it was."""
    token = _RUNNING.set(command_line)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def command_of(out_dir: Path, name: str, quick: bool, overrides) -> str:
    """The command that makes out_dir's results: the command line running now (`running`),
    else the one recorded beside them (command.txt), else its equivalent."""
    line = _RUNNING.get()
    if line is not None:
        return line
    written = out_dir / "command.txt"
    if written.exists():
        return written.read_text().strip()
    return " ".join([f"memattn experiment {name}", *(["--quick"] if quick else []), *overrides])


def held_settings(settings: list[str]) -> list[str]:
    """`key=value` settings with each key once, holding the value given last, where it was
    first given: `[a=1, b=2, a=3]` -> `[a=3, b=2]`."""
    held: dict[str, str] = {}
    for setting in settings:
        held[setting.split("=", 1)[0]] = setting
    return list(held.values())


def setup_line(settings: list[str]) -> str:
    """A results table's line of the shared `key=value` settings (`held_settings`)."""
    return "Setup (shared `key=value` settings): `" + " ".join(held_settings(settings)) + "`"


def write_results(out_dir: Path, results: dict[str, Any], markdown: str) -> None:
    """results.json and results.md under out_dir, and command.txt when a command line is
    running (`running`), each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2) + "\n"
    atomic_write(out_dir / "results.json", lambda tmp: tmp.write_text(text))
    atomic_write(out_dir / "results.md", lambda tmp: tmp.write_text(markdown))
    if _RUNNING.get() is not None:
        atomic_write_text(out_dir / "command.txt", _RUNNING.get() + "\n")


def by_model(names: list[str], rows: list[dict]) -> dict[str, list[dict]]:
    """The rows (one a seed) of each model, models in order of first appearance."""
    runs: dict[str, list[dict]] = {}
    for name, row in zip(names, rows):
        runs.setdefault(name, []).append(row)
    return runs


def seed_figures(runs: list[dict], keys) -> dict[str, float]:
    """For each of `keys` the runs have: the mean of the runs' figures and, as `key`_spread,
    their spread (max − min)."""
    out = {}
    for key in keys:
        if key in runs[0]:
            values = [r[key] for r in runs]
            out[key] = statistics.fmean(values)
            out[f"{key}_spread"] = max(values) - min(values)
    return out


def plot_curves(path: Path, title: str, curves: dict[str, list[list[float]]], ylabel: str) -> None:
    """Training curves {label: [[step, value], ...]} as one PNG (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in curves.items():
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Write a matplotlib figure as PNG atomically, then close it."""
    import matplotlib.pyplot as plt

    def write(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=dpi)

    atomic_write(path, write)
    plt.close(fig)


def compare(a: dict, b: dict, key: str = "test_bpc", *, higher_is_better: bool = False, scale: float = 1.0,
            digits: int = 3, unit: str = "") -> str:
    """'a is ahead of b by x' in words, 'within the seeds' spread' when both have seeds and the
    gap is at most the mean of their spreads (`key`_spread, half the spread of the seeds).
    a and b are rows with 'model', 'seeds' and `key`; the gap is scaled by `scale` (100: points)."""
    diff = scale * (a[key] - b[key])
    spread = scale * (a.get(f"{key}_spread", 0.0) + b.get(f"{key}_spread", 0.0)) / 2
    figure = f"{abs(diff):.{digits}f}{unit}"
    if a["seeds"] > 1 and b["seeds"] > 1 and abs(diff) <= spread:
        return f"{a['model']} and {b['model']} are within the seeds' spread ({diff:+.{digits}f}{unit})"
    ahead = diff > 0 if higher_is_better else diff < 0
    return f"{a['model']} is {'ahead of' if ahead else 'behind'} {b['model']} by {figure}"
