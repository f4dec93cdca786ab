"""Experiments that finish across sittings: each model is a run folder, trained and measured
in a worker process, N at a time.

A job is one model: its `key=value` settings and a name. Its run folder
`out_dir/runs/<slug of name>` holds the checkpoint, the log and, once the model is trained
and measured, `row.json`. Running the experiment again reuses every folder with a
`row.json` made from the same settings, resumes every folder with a checkpoint (exactly, as
`memattn train --resume` does) and starts the rest. A folder whose settings differ from the
job's is refused rather than mixed into the table.

While jobs run, a status line says which are done, which are running (step reached) and
how many are left, with an estimate of the time left.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import multiprocessing
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from memattn.errors import ConfigError, MemattnError
from memattn.fileio import atomic_write

ROW_FILE = "row.json"
CHECKPOINT_FILE = "checkpoint.safetensors"
SPEED_FILE = "speeds.json"  # timings of every model, taken side by side once all are trained
SPEED_ROUNDS = 3  # rounds of those timings, every model once in each
STAND_IN = "stand-in"  # a run folder's model trained one step, timed where the checkpoint is gone


@dataclass(frozen=True)
class Job:
    """One model of an experiment: `name` (its row) and the settings of its run."""

    name: str
    settings: tuple[str, ...]

    @property
    def slug(self) -> str:
        return self.name.replace(", ", "-").replace("=", "").replace(" ", "-").replace("/", "-").lower()


# measure(model, cfg, run_dir) -> figures of the trained model (test bpc, decoding, ...),
# called in the worker; it must be a module-level function (workers import it).
Measure = Callable[[Any, Any, Path], dict[str, Any]]


def run_dir_of(out_dir: Path, job: Job) -> Path:
    return Path(out_dir) / "runs" / job.slug


def finished_row(run_dir: Path, job: Job) -> dict[str, Any] | None:
    """The saved row of a finished job, None if it has none; ConfigError if the folder was made
    with other settings."""
    path = run_dir / ROW_FILE
    settings = run_dir / "settings.json"
    if settings.exists() and read_json(settings) != list(job.settings):
        raise ConfigError(f"{run_dir}: this run folder was made with other settings than the "
                          f"job {job.name!r} has now; move it away (or use another --out-dir) "
                          "to train it anew")
    if not path.exists():
        return None
    return read_json(path)


def read_json(path: Path) -> Any:
    """The JSON in `path`, or ConfigError naming it when it cannot be read as JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); it was cut short or edited: move the run folder "
                          "away (or use another --out-dir) to train it anew") from None


def train_and_measure(run_dir: Path, job: Job, measure: Measure) -> dict[str, Any]:
    """Train the job's model in run_dir (resuming a checkpoint there), measure it, write row.json."""
    import torch

    from memattn.config import load_config
    from memattn.train import model_from_checkpoint, train

    row = finished_row(run_dir, job)
    if row is not None:
        return row
    cfg = load_config(None, [*job.settings, f"train.out_dir={run_dir}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "settings.json", lambda tmp: tmp.write_text(json.dumps(list(job.settings))))
    resume = (run_dir / CHECKPOINT_FILE).exists()  # else nothing saved yet: start anew
    summary = train(cfg, resume=resume, overwrite=not resume, progress=False)
    model, cfg, _ = model_from_checkpoint(run_dir)  # under train.patience, its best evaluation's weights
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    speeds = sorted(r["tokens_per_s"] for r in log if "tokens_per_s" in r)
    row = {"model": job.name, "settings": list(job.settings), "params": summary["params"],
           "steps": summary["steps"],
           **{f"val_{k}": summary["val"][k] for k in ("bpc", "ppl", "accuracy") if k in summary["val"]},
           "train_s": round(summary["train_seconds"], 1),
           "train_tokens_per_s": speeds[len(speeds) // 2] if speeds else 0.0,
           **measure(model, cfg, run_dir)}
    text = json.dumps(row, indent=2) + "\n"
    atomic_write(run_dir / ROW_FILE, lambda tmp: tmp.write_text(text))
    return row


def _die_with_parent() -> None:
    """In a worker: end when the experiment process ends (Linux), so no orphan keeps training."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_jobs(out_dir: Path, jobs: list[Job], measure: Measure, *, workers: int = 1,
             label: str = "experiment", interval: float = 60.0, out=None,
             on_rows: Callable[[dict[str, dict[str, Any]]], None] | None = None,
             work: Callable[[Path, Job, Measure], dict[str, Any]] | None = None,
             steps_of: Callable[[Job], int] | None = None) -> list[dict[str, Any]]:
    """Rows of every job, in order: reused where finished, trained (resumed) where not,
    `workers` at a time. Failed jobs are reported together after the others are done.
    on_rows(rows by job name) runs whenever a job finishes (e.g. to write a partial table).
    work(run_dir, job, measure) trains and measures one job in a worker (default: a
    `memattn train` run, `train_and_measure`), steps_of(job) its most steps (default: its
    train.steps); both module-level functions. A job's run folder logs its steps to log.jsonl."""
    if workers < 1:
        raise ConfigError(f"--jobs: expected a positive number of models at once, got {workers}")
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{label}: two jobs share a name: {names}")
    out = out or sys.stdout
    out_dir = Path(out_dir)
    rows: dict[str, dict[str, Any]] = {}
    for job in jobs:
        row = finished_row(run_dir_of(out_dir, job), job)
        if row is not None:
            rows[job.name] = row
    todo = [job for job in jobs if job.name not in rows]
    progress = Progress(out_dir, jobs, label, workers, out, interval, steps_of)
    progress.report(rows, {}, force=True)
    errors: dict[str, str] = {}
    if todo:
        context = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=context,
                                         initializer=_die_with_parent) as pool:
            running = {pool.submit(work or train_and_measure, run_dir_of(out_dir, job), job, measure): job
                       for job in todo}
            pending = set(running)
            while pending:
                done, pending = futures.wait(pending, timeout=min(interval, 5.0),
                                             return_when=futures.FIRST_COMPLETED)
                for future in done:
                    job = running[future]
                    try:
                        rows[job.name] = future.result()
                    except Exception as e:  # noqa: BLE001 (reported with the others below)
                        errors[job.name] = f"{type(e).__name__}: {e}"
                progress.report(rows, errors, force=bool(done))
                if done and on_rows is not None and len(rows) < len(jobs):
                    try:
                        on_rows(dict(rows))
                    except Exception as e:  # noqa: BLE001 (the models go on; the final table raises it)
                        print(f"{label}: the partial table was not written ({type(e).__name__}: {e}); "
                              "the models go on training", file=sys.stderr, flush=True)
    if errors:
        raise MemattnError(f"{label}: {len(errors)} of {len(jobs)} models failed ("
                           + "; ".join(f"{name}: {why}" for name, why in errors.items())
                           + "); the others are saved, run the same command again to continue")
    return [rows[name] for name in names]


def source_run(out_dir: Path, job: Job, measure: Measure, *, needed: bool, label: str) -> Path:
    """The run folder of `job`, a model that other jobs start from (`train.init_from`), trained
    (or resumed) if unfinished. When `needed` (some job that starts from it is unfinished) and
    only its row is left (a fresh clone), it is trained again for its weights; figures that then
    differ from the saved row's are reported, and the jobs finished from the earlier weights kept."""
    run_dir = run_dir_of(out_dir, job)
    saved = finished_row(run_dir, job)
    again = saved is not None and needed and not (run_dir / CHECKPOINT_FILE).exists()
    if again:
        (run_dir / ROW_FILE).rename(run_dir / f"{ROW_FILE}.before")
    try:
        run_jobs(out_dir, [job], measure, workers=1, label=f"{label} (training again for its weights)"
                 if again else label)
    except BaseException:
        if again and not (run_dir / ROW_FILE).exists():
            (run_dir / f"{ROW_FILE}.before").rename(run_dir / ROW_FILE)
        raise
    if again:
        (run_dir / f"{ROW_FILE}.before").unlink()
        row = finished_row(run_dir, job)
        moved = {k: (v, row.get(k)) for k, v in saved.items()
                 if k.startswith(("val_", "test_")) and isinstance(v, float) and row.get(k) != v}
        if moved:
            print(f"{label}: {job.name} trained again differs from its saved row ("
                  + ", ".join(f"{k} {a:.4f} -> {b:.4f}" for k, (a, b) in moved.items())
                  + "); the models finished from the earlier weights are kept", file=sys.stderr)
    return run_dir


class Progress:
    """One status line per change (and every `interval` seconds): done, running, left, time left."""

    def __init__(self, out_dir: Path, jobs: list[Job], label: str, workers: int, out,
                 interval: float = 60.0, steps_of: Callable[[Job], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out_dir, self.jobs, self.label, self.workers, self.out = out_dir, jobs, label, workers, out
        self.steps = {job.name: (steps_of or train_steps_of)(job) for job in jobs}
        self.interval, self.last, self.clock = interval, 0.0, clock
        self.seen: dict[str, int] = {}  # name -> its step when first seen running
        # name -> (time, step) when its logged step first moved past that: the rate counts from
        # there, not from the first sight (a start-up, or a log line about to be written)
        self.since: dict[str, tuple[float, int]] = {}

    def step_of(self, job: Job) -> int:
        log = run_dir_of(self.out_dir, job) / "log.jsonl"
        if not log.exists():
            return 0
        step = 0
        for line in log.read_text().splitlines():
            try:
                step = max(step, int(json.loads(line).get("step", 0)))
            except (json.JSONDecodeError, AttributeError, ValueError):
                continue  # a line being written
        return step

    def report(self, rows: dict, errors: dict, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        running, left, rates = [], 0, []
        remaining_steps = 0
        for job in self.jobs:
            if job.name in rows or job.name in errors:
                continue
            step = self.step_of(job)
            total = self.steps[job.name]
            remaining_steps += total - step
            if step == 0 and job.name not in self.seen:
                left += 1
                continue
            if step > self.seen.setdefault(job.name, step):
                t0, s0 = self.since.setdefault(job.name, (now, step))
                if step > s0:
                    rates.append((now - t0) / (step - s0))
            running.append(f"{job.name} {step}/{total}")
        parts = [f"[{self.label}] done {len(rows)}/{len(self.jobs)}"]
        if errors:
            parts.append(f"failed {len(errors)}")
        if running:
            parts.append("running " + ", ".join(running))
        if left:
            parts.append(f"{left} not started")
        if rates and remaining_steps:
            # every worker busy while jobs are left (a job just handed out has logged no step yet)
            seconds = remaining_steps * (sum(rates) / len(rates)) / min(self.workers, len(running) + left)
            parts.append(f"about {format_duration(seconds)} left")
        print(" · ".join(parts), file=self.out, flush=True)


def train_steps_of(job: Job) -> int:
    """The train.steps of a `memattn train` job."""
    from memattn.config import load_config

    return load_config(None, list(job.settings)).train.steps


def format_duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{max(1, minutes)} min"


def measured_side_by_side(out_dir: Path, jobs: list[Job],
                          measure_one: Callable[[Job, Path], dict[str, Any]], *,
                          stand_ins: bool = False) -> dict[str, dict[str, Any]] | None:
    """measure_one(job, run folder) of every job (from the checkpoint there), by job name,
    taken in this process on one thread, so that rows compare (a worker's own timings depend on
    what ran beside it): SPEED_ROUNDS rounds, each measuring every job in turn, and each figure
    the median of its rounds, so that a change in the machine's load falls on every job alike.
    Kept in out_dir/SPEED_FILE with the jobs' settings and the machine, and taken again only
    when those change.

    A fresh clone keeps only the finished runs' rows, not their checkpoints. Where some job's
    checkpoint is not there: with `stand_ins` (the figures are costs that do not depend on the
    weights, e.g. time and memory, or only on what measure_one sets from the run's row, e.g.
    learned spans), the job's model trained one step in `run folder/STAND_IN` is measured
    instead (its figures say "stand_in": true); else nothing is measured and the result is
    None."""
    import os
    import platform

    import torch

    from research.experiments._common import torch_threads

    path = Path(out_dir) / SPEED_FILE
    how = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(), "threads": 1,
           "rounds": SPEED_ROUNDS, "settings": {job.name: list(job.settings) for job in jobs}}
    if path.exists():
        saved = json.loads(path.read_text())
        if {k: saved.get(k) for k in how} == how:
            return saved["speeds"]
    missing = [job.name for job in jobs if not (run_dir_of(out_dir, job) / CHECKPOINT_FILE).exists()]
    if missing and not stand_ins:
        print(f"not measured side by side: no checkpoint of {', '.join(missing)}", file=sys.stderr)
        return None
    folders = {job.name: stand_in(run_dir_of(out_dir, job), job) if job.name in missing
               else run_dir_of(out_dir, job) for job in jobs}
    with torch_threads(1):
        rounds = [{job.name: measure_one(job, folders[job.name]) for job in jobs} for _ in range(SPEED_ROUNDS)]
    figures = {job.name: {**median_figure([r[job.name] for r in rounds]), "stand_in": job.name in missing}
               for job in jobs}
    text = json.dumps({**how, "speeds": figures}, indent=2) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return figures


def median_figure(values: list[Any]) -> Any:
    """The median of the same figure taken in several rounds: numbers directly, mappings key by
    key and lists item by item (e.g. a profile over lengths); anything else as the first round
    took it."""
    first = values[0]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return statistics.median(values)
    if isinstance(first, dict):
        return {key: median_figure([v[key] for v in values]) for key in first}
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first) for v in values):
        return [median_figure(list(items)) for items in zip(*values)]
    return first


def stand_in(run_dir: Path, job: Job) -> Path:
    """run_dir/STAND_IN, holding the job's model trained one step (made unless there): the
    model, vocabulary and data of the job, for costs measured when its trained weights are gone."""
    from memattn.config import load_config
    from memattn.train import train

    folder = run_dir / STAND_IN
    if not (folder / CHECKPOINT_FILE).exists():
        cfg = load_config(None, [*job.settings, "train.steps=1", "train.eval_batches=1",
                                 f"train.out_dir={folder}"])
        train(cfg, overwrite=True, progress=False)
    return folder


def side_by_side_note(result: dict, figures: str, how: str) -> str:
    """Where a table's `figures` (e.g. "Tokens/s") come from: the side-by-side pass (`how` they
    were taken, and which models stood in for trained ones), or, until every run has finished,
    each run's own."""
    if result.get("side_by_side"):
        stood = [run for run in result["runs"] if run.get("stand_in")]
        return (f"{figures} were measured once every model was trained, in one process on one thread, "
                f"{SPEED_ROUNDS} rounds of every model in turn, the median of each (`{SPEED_FILE}`): {how}." + (
                    f" The trained weights of {len(stood)} of the {result['runs_planned']} runs were no "
                    "longer there (a fresh clone keeps the rows, not the checkpoints); each was measured "
                    "on its model trained one step (with the trained model's learned spans, where it has "
                    "them), the same cost: these mechanisms' time and memory depend on the weights only "
                    "through such spans." if stood else ""))
    later = ("the checkpoints they are measured from were not there when the last run finished"
             if result["finished"] == result["runs_planned"] else
             "they are measured side by side once every run has finished")
    return (f"{figures} are each run's own, taken beside whatever else ran then, so they do not compare "
            f"between rows; {later}.")


def run_experiment(out_dir: Path, name: str, pairs: list[tuple[str, Job]], shared: list[str], *,
                   quick: bool, overrides: list[str], jobs: int, measure: Measure,
                   summarise: Callable[[list[str], list[dict]], list[dict]],
                   markdown: Callable[[dict], str], curve: tuple[str, str],
                   plots: Callable[[Path, dict], None] | None = None,
                   extra: dict[str, Any] | None = None,
                   side_by_side: Callable[[Path, list[Job]], dict[str, dict]] | None = None) -> dict:
    """Train (or reuse, or resume) every (model, job) of `pairs`, `jobs` at a time, and write
    results.json, results.md (`markdown(result)`), logs/ and learning_curves.png (the
    validation figure curve = (log key, label) against steps, seed 0 of each model), anew as
    each job finishes (a partial table says how many runs it holds). Once every job has
    finished, side_by_side(out_dir, jobs) gives figures measured for all models in one pass
    (e.g. speeds, which depend on what ran beside a worker), by job name: they replace the
    rows' own, and the result says so (`side_by_side`: true); None where it cannot be measured."""
    from research.experiments._common import command_of, plot_curves, write_results

    out_dir = Path(out_dir)

    def report(rows: dict[str, dict], measured_side_by_side: bool = False) -> dict:
        done = [(model, job) for model, job in pairs if job.name in rows]
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        curves = {}
        for model, job in done:
            log = out_dir / "logs" / f"{job.slug}.jsonl"
            run_log = run_dir_of(out_dir, job) / "log.jsonl"
            if run_log.exists():  # a fresh clone keeps only the copy in logs/
                shutil.copyfile(run_log, log)
            elif not log.exists():  # e.g. a row copied from another experiment without its log
                print(f"{name}: no log of {job.name} ({run_log} or {log}): its learning curve is left out",
                      file=sys.stderr)
                continue
            if job.name == model:
                records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
                curves[model] = [[r["step"], r[curve[0]]] for r in records if curve[0] in r]
        result = {"experiment": name, "quick": quick, "command": command_of(out_dir, name, quick, overrides),
                  "config": shared, "finished": len(done), "runs_planned": len(pairs),
                  "models": summarise([model for model, _ in done], [rows[job.name] for _, job in done]),
                  "runs": [rows[job.name] for _, job in done], "side_by_side": measured_side_by_side,
                  **(extra or {})}
        write_results(out_dir, result, markdown(result))
        plot_curves(out_dir / "learning_curves.png", f"{name}: validation", curves, curve[1])
        if plots is not None:
            plots(out_dir, result)
        return result

    rows = run_jobs(out_dir, [job for _, job in pairs], measure, workers=jobs, label=name, on_rows=report)
    final = {job.name: row for (_, job), row in zip(pairs, rows)}
    figures = None if side_by_side is None else side_by_side(out_dir, [job for _, job in pairs])
    if figures is not None:
        final = {job_name: {**row, **figures[job_name]} for job_name, row in final.items()}
    return report(final, figures is not None)
