"""research.experiments.gmat_majority: task=majority on the training loop (its batches, loss,
exact resume, what it refuses), chaining a MAJORITY(512, 1) model to longer sequences, and
the curriculum settings."""

from __future__ import annotations

import json

import pytest
import torch

from memattn.config import load_config
from memattn.errors import ConfigError
from memattn.train import Distributed, train
from memattn.typed import parse_settings
from research.experiments._runner import run_dir_of
from research.experiments.gmat_majority import QUICK, TASK, Settings, job_of, plan, training_batch

from conftest import train_crashing_at


def quick_job(*overrides, length=512, parts=1, M=8, source=None):
    return job_of(parse_settings(Settings, list(overrides), QUICK, name="gmat-majority"), length, parts, M, source)


def config(tmp_path, job, *extra):
    return load_config(None, [*job.settings, f"train.out_dir={tmp_path}", *extra])


def test_chained_models_start_from_the_shorter_run_folder_of_the_same_memory(tmp_path):
    s = parse_settings(Settings, [], QUICK, name="gmat-majority")
    pairs = plan(s, tmp_path)
    chained = [(job, source) for job, source in pairs if source is not None]
    assert [job.name for job, _ in chained] == ["L=8192, p=1, M=0", "L=8192, p=1, M=8"]
    for job, source in chained:
        assert source.name == job.name.replace("8192", "512")
        assert f"train.init_from={run_dir_of(tmp_path, source)}" in job.settings
    scratch = plan(parse_settings(Settings, ["start=scratch"], QUICK, name="gmat-majority"), tmp_path)
    assert all(source is None and not any(s.startswith("train.init_from") for s in job.settings)
               for job, source in scratch)


def test_curriculum_shares_are_checked():
    s = parse_settings(Settings, ["wide_phase=0.25", "segment_steps=10"], name="gmat-majority")
    assert (s.wide_phase, s.segment_steps) == (0.25, 10)
    with pytest.raises(ConfigError, match=r"long_wide_phase: expected a share in \[0, 1\], got 1.5"):
        parse_settings(Settings, ["long_wide_phase=1.5"], name="gmat-majority")


def test_a_steps_batch_is_drawn_from_the_seed_and_step_alone_and_split_over_ranks(tmp_path):
    from memattn.tasks import task_class

    cfg = config(tmp_path, quick_job())
    o = cfg.task_settings
    assert (o.margins, o.wide_steps, cfg.train.seq_len) == ("curriculum", 20, 512)
    task = task_class(TASK).prepare(cfg, Distributed("cpu"), False, None)
    batch = task.batch(7, 0, 1)
    assert torch.equal(batch.bits, task.batch(7, 0, 1).bits) and not torch.equal(batch.bits, task.batch(8, 0, 1).bits)
    halves = [task.batch(7, r, 2) for r in (0, 1)]
    assert torch.equal(torch.cat([h.tags for h in halves]), batch.tags)
    # the curriculum: wide margins alone before wide_steps, then half fair coins after them
    wide = training_batch(o, 512, 8, 0, 3)
    fair = training_batch(o, 512, 8, 0, 25)
    def margin(bits):
        return (2 * bits.sum(1) - 512).abs().float().mean()

    assert margin(wide.bits) > 100 and margin(fair.bits[:4]) > 100 and margin(fair.bits[4:]) < 40


def test_an_interrupted_run_resumes_exactly(tmp_path):
    job = quick_job("steps=6", "warmup=2", M=4)
    whole = config(tmp_path / "whole", job, "train.log_every=1", "train.save_every=2")
    train(whole, progress=False)
    cut = config(tmp_path / "cut", job, "train.log_every=1", "train.save_every=2")
    train_crashing_at(cut, 3)  # after the checkpoint of step 2
    train(cut, resume=True, progress=False)
    logs = [[json.loads(line) for line in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("whole", "cut")]
    assert [(r["step"], r["loss"], r.get("val_exact_match")) for r in logs[0]] == \
        [(r["step"], r["loss"], r.get("val_exact_match")) for r in logs[1]]
    assert "val_token_accuracy" in logs[0][-1]


def test_a_chained_run_starts_from_the_shorter_model_with_its_position_table_grown(tmp_path):
    from memattn.train import model_from_checkpoint

    short = quick_job("steps=2", "warmup=1")
    train(config(tmp_path / "short", short), progress=False)
    long = quick_job("steps=1", length=1024, source=tmp_path / "short")
    cfg = config(tmp_path / "long", long, "train.lr=1e-12")  # one step that barely moves anything
    train(cfg, progress=False)
    a, _, _ = model_from_checkpoint(tmp_path / "short")
    b, _, _ = model_from_checkpoint(tmp_path / "long")
    high = b.pos.high.weight
    assert high.shape[0] == 2 and torch.allclose(high, a.pos.high.weight.expand(2, -1), atol=1e-6)
    assert torch.allclose(b.memory.weight, a.memory.weight, atol=1e-6)


@pytest.mark.parametrize("extra, message", [
    (["train.segments=true", "model.positions=rotary"], "train.segments and train.distill_weight are for causal language"),
    (["train.label_smoothing=0.1"], "train.label_smoothing"),
    (["task_options.parts=600"], "task_options.parts: expected at most train.seq_len = 512 segments"),
    (["model.max_len=256"], "model.max_len: sequences of train.seq_len = 512 run past"),
    (["task_options.margins=often"], "margins: expected wide, fair, curriculum, got 'often'"),
])
def test_the_task_refuses_what_it_cannot_train(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, quick_job(), *extra)
