"""memattn.train: learning, exact resume, data-parallel runs under torchrun."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_overrides, train_crashing_at

from memattn.config import TrainConfig, load_config
from memattn.errors import CheckpointError
from memattn.train import lr_at, model_from_checkpoint, sample_batch, train


def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def losses(log):
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in log]


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(100, cfg) == pytest.approx(0.1)


def test_batches_are_a_function_of_the_step_and_split_over_ranks():
    ids = torch.arange(1000)
    cfg = TrainConfig(batch_size=4, seq_len=8, seed=3)
    x, y = sample_batch(ids, 5, cfg)
    assert torch.equal(y, x + 1)  # targets are the next tokens
    assert torch.equal(sample_batch(ids, 5, cfg)[0], x)
    assert not torch.equal(sample_batch(ids, 6, cfg)[0], x)
    halves = [sample_batch(ids, 5, cfg, rank=r, world=2)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), x)


def test_training_lowers_the_loss(text_file, tmp_path):
    cfg = load_config("tiny", tiny_overrides(text_file, tmp_path, "train.steps=60", "train.eval_every=60"))
    summary = train(cfg, progress=False)
    log = read_log(tmp_path / "run")
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    assert summary["val"]["bpc"] < math.log2(summary_vocab(tmp_path))  # better than uniform
    assert (tmp_path / "run" / "checkpoint.safetensors").exists()


def summary_vocab(tmp_path):
    _, cfg, _ = model_from_checkpoint(tmp_path / "run")
    return cfg.model.vocab_size


def test_interrupted_and_resumed_run_logs_the_same_losses(text_file, tmp_path):
    extra = ("train.steps=9", "train.log_every=1", "train.save_every=3", "train.eval_every=4",
             "model.dropout=0.1")
    whole = load_config("tiny", tiny_overrides(text_file, tmp_path / "whole", *extra))
    train(whole, progress=False)
    cut = load_config("tiny", tiny_overrides(text_file, tmp_path / "cut", *extra))
    train_crashing_at(cut, 5)
    assert max(r["step"] for r in read_log(tmp_path / "cut" / "run")) == 5
    train(cut, resume=True, progress=False)

    a, b = read_log(tmp_path / "whole" / "run"), read_log(tmp_path / "cut" / "run")
    assert losses(a) == losses(b)  # bit-for-bit, including steps 4-5 logged before the crash
    ma, _, _ = model_from_checkpoint(tmp_path / "whole" / "run")
    mb, _, _ = model_from_checkpoint(tmp_path / "cut" / "run")
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), name


def test_resume_with_a_different_model_is_refused(text_file, tmp_path):
    train(load_config("tiny", tiny_overrides(text_file, tmp_path, "train.steps=2")), progress=False)
    other = load_config("tiny", tiny_overrides(text_file, tmp_path, "train.steps=4", "model.d_model=48"))
    with pytest.raises(CheckpointError, match=r"made with model\.d_model=32, this run has 48"):
        train(other, resume=True, progress=False)


def test_resume_without_checkpoint_is_a_clear_error(text_file, tmp_path):
    cfg = load_config("tiny", tiny_overrides(text_file, tmp_path))
    with pytest.raises(CheckpointError, match="no such file"):
        train(cfg, resume=True, progress=False)


@pytest.mark.slow
def test_two_process_data_parallel_matches_one_process(text_file, tmp_path):
    extra = ("train.steps=6", "train.log_every=1", "train.eval_every=6", "train.batch_size=8")
    single = load_config("tiny", tiny_overrides(text_file, tmp_path / "one", *extra))
    train(single, progress=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "memattn", "train", "--config", "tiny", "--quiet",
           *tiny_overrides(text_file, tmp_path / "two", *extra)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[:2000] + "\n...\n" + done.stderr[-2000:]
    summary = json.loads((tmp_path / "two" / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"] is True
    one, two = read_log(tmp_path / "one" / "run"), read_log(tmp_path / "two" / "run")
    for r1, r2 in zip(one, two):
        assert r1["step"] == r2["step"]
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-4)


@pytest.mark.slow
def test_killed_at_random_points_the_run_ends_as_an_uninterrupted_one(text_file, tmp_path):
    """SIGKILL at random moments (mid-step, mid-log-write, mid-checkpoint), resume each time:
    the log's losses and the final weights equal those of a run never stopped."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    extra = ("train.steps=60", "train.log_every=1", "train.save_every=4", "train.eval_every=10",
             "model.dropout=0.1")
    whole = load_config("tiny", tiny_overrides(text_file, tmp_path / "whole", *extra))
    train(whole, progress=False)
    command = [sys.executable, "-m", "memattn", "train", "--config", "tiny", "--quiet",
               *tiny_overrides(text_file, tmp_path / "cut", *extra)]
    log = tmp_path / "cut" / "run" / "log.jsonl"
    rng, kills = random.Random(7), 0
    while kills < 4:
        started = (tmp_path / "cut" / "run" / "checkpoint.safetensors").exists()
        proc = subprocess.Popen([*command, *(["--resume"] if started else ["--overwrite"])],
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        steps_before = len(log.read_text().splitlines()) if log.exists() else 0
        deadline = time.monotonic() + 120
        # wait until this sitting has trained a random few steps, then kill it at once: a random
        # step count, not a random delay, so that a fast machine cannot finish the run first
        target = steps_before + rng.randint(1, 8)
        while proc.poll() is None and time.monotonic() < deadline:
            if log.exists() and len(log.read_text().splitlines()) >= target:
                break
            time.sleep(0.002)
        if proc.poll() is not None:
            break  # finished before the kill
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
    finish = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=300)
    assert finish.returncode == 0, finish.stderr
    assert kills >= 2
    a, b = read_log(tmp_path / "whole" / "run"), read_log(tmp_path / "cut" / "run")
    assert losses(a) == losses(b) and [r["step"] for r in b if "loss" in r] == list(range(1, 61))
    ma, _, _ = model_from_checkpoint(tmp_path / "whole" / "run")
    mb, _, _ = model_from_checkpoint(tmp_path / "cut" / "run")
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), name


def torchrun(*args, timeout=300, wait=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "memattn", "train", "--config", "tiny", "--quiet", *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_fully_sharded_run_matches_one_process_and_resumes_from_its_shards(text_file, tmp_path):
    import signal
    import time

    extra = ("train.steps=8", "train.log_every=1", "train.eval_every=4", "train.batch_size=8",
             "train.save_every=2")  # no dropout: its masks are drawn per rank
    train(load_config("tiny", tiny_overrides(text_file, tmp_path / "one", *extra)), progress=False)
    torchrun(*tiny_overrides(text_file, tmp_path / "fsdp", *extra), "train.parallel=fsdp")
    one, fsdp = read_log(tmp_path / "one" / "run"), read_log(tmp_path / "fsdp" / "run")
    assert [r["step"] for r in one] == [r["step"] for r in fsdp]
    for r1, r2 in zip(one, fsdp):
        for key in ("loss", "val_loss"):
            if key in r1:
                assert r2[key] == pytest.approx(r1[key], rel=1e-5)
    run = tmp_path / "fsdp" / "run"
    assert [p.name for p in run.glob("checkpoint.dcp.*")] == ["checkpoint.dcp.8"]  # one sharded step kept
    ma, _, _ = model_from_checkpoint(tmp_path / "one" / "run")
    mb, _, _ = model_from_checkpoint(run)  # the full weights, read like any run's
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)

    # stopped after a sharded checkpoint, resumed: the same losses as the run never stopped
    cut = tiny_overrides(text_file, tmp_path / "cut", *extra, "train.parallel=fsdp")
    log = tmp_path / "cut" / "run" / "log.jsonl"
    proc = torchrun(*cut, wait=False)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= 3:  # 5 of 8 steps left to stop it in
            break
        time.sleep(0.002)
    assert proc.poll() is None, "the run ended before it could be stopped"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    torchrun(*cut, "--resume")
    again = read_log(tmp_path / "cut" / "run")
    assert losses(again) == losses(fsdp)
    with pytest.raises(CheckpointError, match="made with train.parallel='fsdp', this run has 'ddp'"):
        train(load_config("tiny", tiny_overrides(text_file, tmp_path / "cut", *extra)), resume=True,
              progress=False)
