"""research.experiments._runner: experiments continue across sittings (killed, then run again),
reuse finished models, refuse folders made with other settings; through `memattn experiment`."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memattn.errors import ConfigError
from memattn.config import load_config
from research.experiments import _runner as runner
from research.experiments._runner import (CHECKPOINT_FILE, STAND_IN, Job, Progress, finished_row,
                                         measured_side_by_side, run_dir_of, run_jobs)
from memattn.train import model_from_checkpoint


def experiment_command(text_file, root, *extra):
    data = ["data.corpus=text", f"data.path={text_file}", f"data.cache_dir={root / 'cache'}"]
    return [sys.executable, "-m", "memattn", "experiment", "abc-lm", "--quick", "--out-dir",
            str(root / "out"), *data, *extra]


def wait_for(condition, timeout=240.0):
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError("timed out")
        time.sleep(0.05)


def logged_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_killed_experiment_continues_where_it_stopped(text_file, tmp_path):
    runs = tmp_path / "out" / "runs"
    # more steps than --quick's 12, a checkpoint every 6: the kill lands inside a model's training
    command = experiment_command(text_file, tmp_path, "train.steps=30", "train.eval_every=15")
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, text=True)
    try:
        # softmax (the first model) is finished and the second has saved a checkpoint mid-way
        wait_for(lambda: (runs / "softmax" / "row.json").exists()
                 and (runs / "abc-mlp-m4" / "checkpoint.safetensors").exists())
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    done_before = (runs / "softmax" / "row.json").read_text()
    stamp = (runs / "softmax" / "row.json").stat().st_mtime_ns
    steps_before = logged_steps(runs / "abc-mlp-m4")
    assert not (runs / "abc-mlp-m4" / "row.json").exists() and steps_before[-1] < 30
    partial = (tmp_path / "out" / "results.md").read_text()  # written as each model finished
    assert "In progress: 1 of 7 runs finished" in partial and "| softmax | 1 |" in partial

    second = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "[abc-lm] done 1/7" in second.stdout and "[abc-lm] done 7/7" in second.stdout
    # the finished model is reused as it was, the interrupted one resumed (each step logged once)
    assert (runs / "softmax" / "row.json").read_text() == done_before
    assert (runs / "softmax" / "row.json").stat().st_mtime_ns == stamp
    steps = logged_steps(runs / "abc-mlp-m4")
    assert steps == sorted(set(steps)) and steps[-1] == 30 and steps[:len(steps_before)] == steps_before
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [m["model"] for m in result["models"]][:2] == ["softmax", "abc-mlp, M=4"]
    assert result["models"][0]["seeds"] == 2 and result["models"][0]["steps"] == 30

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "done 7/7" in again.stdout.splitlines()[0]  # nothing to train

    # a fresh clone keeps only what .gitignore lets through: the rows, their settings, logs/
    logs = {p.name: p.read_text() for p in (tmp_path / "out" / "logs").iterdir()}
    for path in runs.glob("*/*"):
        if path.name not in ("row.json", "settings.json"):
            path.unlink()
    (tmp_path / "out" / "speeds.json").unlink()
    cloned = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert cloned.returncode == 0, cloned.stderr
    assert "done 7/7" in cloned.stdout.splitlines()[0]
    assert {p.name: p.read_text() for p in (tmp_path / "out" / "logs").iterdir()} == logs
    after = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [m["test_bpc"] for m in after["models"]] == [m["test_bpc"] for m in result["models"]]
    # abc-lm's costs do not depend on the weights: each model gone stands in, trained one step
    assert result["side_by_side"] and not any(run["stand_in"] for run in result["runs"])
    assert after["side_by_side"] and all(run["stand_in"] and run["train_tokens_per_s"] > 0 for run in after["runs"])
    _, cfg, _ = model_from_checkpoint(runs / "abc-mlp-m4" / STAND_IN)
    settings = json.loads((runs / "abc-mlp-m4" / "settings.json").read_text())
    assert cfg.train.steps == 1 and cfg.model.attention == load_config(None, settings).model.attention
    assert "7 of the 7 runs were no longer there" in (tmp_path / "out" / "results.md").read_text()


def test_side_by_side_figures_need_every_checkpoint_unless_stand_ins_may_serve(tmp_path, capsys, monkeypatch):
    jobs = [Job("a", ("attention=softmax",)), Job("b", ("attention=softmax", "train.seed=1"))]
    (run_dir_of(tmp_path, jobs[0]) / CHECKPOINT_FILE).parent.mkdir(parents=True)
    (run_dir_of(tmp_path, jobs[0]) / CHECKPOINT_FILE).write_bytes(b"")
    seen = []
    assert measured_side_by_side(tmp_path, jobs, lambda job, folder: seen.append(job)) is None
    assert not seen and "no checkpoint of b" in capsys.readouterr().err
    # with stand-ins, b's stands in and a's own checkpoint is measured
    monkeypatch.setattr(runner, "stand_in", lambda run_dir, job: run_dir / "stood-in")
    figures = measured_side_by_side(tmp_path, jobs, lambda job, folder: {"folder": folder.name}, stand_ins=True)
    assert figures == {"a": {"folder": "a", "stand_in": False}, "b": {"folder": "stood-in", "stand_in": True}}


def test_progress_times_steps_from_the_first_logged_step_it_saw_move(tmp_path):
    """A job resumed at step 40 whose first 10 steps take 100 s of start-up, then 1 s a step:
    the time left is its 930 steps and the unstarted job's 1,000 at 1 s a step, two at a time
    (the second worker takes the unstarted job: it has only not logged a step yet)."""
    jobs = [Job("resumed", ("a=1",)), Job("waiting", ("a=2",))]
    clock, out = [0.0], io.StringIO()
    progress = Progress(tmp_path, jobs, "x", workers=2, out=out, steps_of=lambda job: 1000,
                        clock=lambda: clock[0])
    run = run_dir_of(tmp_path, jobs[0])
    run.mkdir(parents=True)
    for now, step in ((0, 40), (100, 50), (110, 60), (120, 70)):
        clock[0] = now
        with open(run / "log.jsonl", "a") as f:
            f.write(json.dumps({"step": step}) + "\n")
        progress.report({}, {}, force=True)
    lines = out.getvalue().splitlines()
    assert "left" not in lines[1]  # one move seen: no rate yet
    assert lines[-1] == "[x] done 0/2 · running resumed 70/1000 · 1 not started · about 16 min left"


def finish_after_the_table(run_dir, job, measure):
    """A worker's job that trains nothing: its row is its name. Job b finishes only once the
    table of a has been tried (the file `tabled` beside runs/), so that a finishes alone."""
    if job.name == "b":
        wait_for(lambda: (run_dir.parent.parent / "tabled").exists(), timeout=60)
    return {"model": job.name}


def test_a_partial_table_that_fails_stops_no_model(tmp_path, capsys):
    """on_rows (the table written as models finish) raising is reported; the other models
    still run and every row comes back, instead of the error waiting for them all."""
    def failing_table(rows):
        (tmp_path / "tabled").touch()
        raise OSError("disk full")

    jobs = [Job("a", ("a=1",)), Job("b", ("a=2",))]
    rows = run_jobs(tmp_path, jobs, None, workers=1, label="x", on_rows=failing_table,
                    work=finish_after_the_table, steps_of=lambda job: 1, out=io.StringIO())
    assert rows == [{"model": "a"}, {"model": "b"}]
    assert "x: the partial table was not written (OSError: disk full)" in capsys.readouterr().err


def test_a_row_without_its_log_is_tabled_without_a_curve(tmp_path, capsys):
    """A finished row whose log is in neither its run folder nor logs/ (e.g. copied from
    another experiment) is tabled; its learning curve is left out, and said so."""
    from research.experiments._runner import run_experiment

    jobs = [Job("logged", ("train.seed=0",)), Job("copied", ("train.seed=1",))]
    for job in jobs:
        run = run_dir_of(tmp_path, job)
        run.mkdir(parents=True)
        (run / "settings.json").write_text(json.dumps(list(job.settings)))
        (run / "row.json").write_text(json.dumps({"model": job.name}))
    (run_dir_of(tmp_path, jobs[0]) / "log.jsonl").write_text(json.dumps({"step": 5, "val": 1.5}) + "\n")
    result = run_experiment(tmp_path, "x", [(job.name, job) for job in jobs], [], quick=True,
                            overrides=[], jobs=1, measure=None, summarise=lambda names, rows: rows,
                            markdown=lambda result: f"{len(result['models'])} rows", curve=("val", "v"))
    assert result["models"] == [{"model": "logged"}, {"model": "copied"}]
    assert (tmp_path / "results.md").read_text() == "2 rows"
    assert (tmp_path / "logs" / "logged.jsonl").exists() and not (tmp_path / "logs" / "copied.jsonl").exists()
    assert "x: no log of copied" in capsys.readouterr().err


def test_a_folder_made_with_other_settings_is_refused(tmp_path):
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "settings.json").write_text(json.dumps(["train.steps=5"]))
    with pytest.raises(ConfigError, match="other settings"):
        finished_row(run, Job("a", ("train.steps=6",)))
    assert finished_row(run, Job("a", ("train.steps=5",))) is None


def test_bad_job_lists_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--jobs"):
        run_jobs(tmp_path, [Job("a", ())], measure=None, workers=0)
    with pytest.raises(ConfigError, match="share a name"):
        run_jobs(tmp_path, [Job("a", ()), Job("a", ("train.seed=1",))], measure=None)


def test_the_setup_line_gives_each_key_once_with_the_value_that_holds():
    from research.experiments._common import setup_line

    line = setup_line(["model.d_model=128", "train.steps=1500", "attention=softmax", "train.steps=500"])
    assert line.endswith("`model.d_model=128 train.steps=500 attention=softmax`")


def test_side_by_side_figures_are_medians_of_rounds_taking_every_job_in_turn(tmp_path):
    """Each round measures every job once, in order; each figure is the median of the rounds:
    a spell of load that slows one round moves no model's figure."""
    jobs = [Job("a", ("attention=softmax",)), Job("b", ("attention=softmax", "train.seed=1"))]
    for job in jobs:
        (run_dir_of(tmp_path, job)).mkdir(parents=True)
        (run_dir_of(tmp_path, job) / CHECKPOINT_FILE).write_bytes(b"")
    order, slow = [], {("a", 1): 100.0, ("b", 2): 0.5}  # one spell of load in a's 2nd and b's 3rd round

    def measure(job, folder):
        order.append(job.name)
        turn = order.count(job.name) - 1
        return {"tokens_per_s": slow.get((job.name, turn), 10.0 if job.name == "a" else 20.0),
                "profile": [{"ms": turn}], "mode": f"round {turn}"}

    figures = measured_side_by_side(tmp_path, jobs, measure)
    assert order == ["a", "b"] * runner.SPEED_ROUNDS
    assert figures["a"]["tokens_per_s"] == 10.0 and figures["b"]["tokens_per_s"] == 20.0
    assert figures["a"]["profile"] == [{"ms": 1}] and figures["a"]["mode"] == "round 0"
