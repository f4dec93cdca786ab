"""memattn.transfer through `memattn train`: attention transfer (train.transfer_steps) from a
softmax run, its exact resume, its refusals, and LoRA adapters (train.lora_rank)."""

import json

import pytest
import torch
from conftest import crash_in_transfer_and_resume, tiny_overrides, train_crashing_at

from memattn.config import TrainConfig, load_config
from memattn.errors import ConfigError
from memattn.evaluate import as_tensor
from memattn.models import CausalLM
from memattn.train import load_run_corpus, model_from_checkpoint, train
from memattn.warmstart import read_source, warm_start

ABC = ("attention=abc-mlp", "attention.num_slots=4")


def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def records(log):
    return [(r["step"], r.get("transfer_step"), r.get("transfer_loss"), r.get("loss"), r.get("val_loss"))
            for r in log]


@pytest.fixture
def softmax_run(text_file, tmp_path):
    """A softmax model trained a little, whose attention outputs are not negligible."""
    cfg = load_config("tiny", tiny_overrides(text_file, tmp_path / "soft", "train.steps=30",
                                             "model.init_std=0.2", "train.eval_every=30"))
    train(cfg, progress=False)
    return tmp_path / "soft" / "run"


def student(text_file, tmp_path, source, name, *extra):
    return load_config("tiny", tiny_overrides(text_file, tmp_path / name, *ABC, "model.init_std=0.2",
                                              f"train.init_from={source}", *extra))


def layer_errors(teacher, model, x):
    """Per layer, the mean squared error of the model's attention output against the softmax
    layer's, both reading the softmax model's input of that layer (computed here by hand)."""
    inputs = []
    with torch.no_grad():
        teacher.hidden(x, layer_inputs=inputs)
        errors = []
        for block, mine, h in zip(teacher.blocks, model.blocks, inputs):
            u = block.norm_attn(h)
            errors.append(float(((mine.attn(u)[0] - block.attn(u)[0]) ** 2).mean()))
    return errors


def test_transfer_fits_each_layer_to_the_frozen_softmax_layer_and_moves_nothing_else(text_file, tmp_path,
                                                                                      softmax_run):
    cfg = student(text_file, tmp_path, softmax_run, "abc", "train.transfer_steps=40", "train.transfer_lr=0.01",
                  "train.steps=1", "train.log_every=10")
    train_crashing_at(cfg, 1)  # stopped at the first ordinary step: the checkpoint is the transfer's last
    after, _, _ = model_from_checkpoint(tmp_path / "abc" / "run")
    teacher, _, _ = model_from_checkpoint(softmax_run)
    torch.manual_seed(cfg.train.seed)  # the model as the run built it, before the transfer
    before = CausalLM(after.cfg)
    report = warm_start(before, read_source(softmax_run))
    assert report["new"] == ["blocks.0.attn.phi.weight", "blocks.1.attn.phi.weight"]

    x = as_tensor(load_run_corpus(cfg).val)[:8 * 32].view(8, 32)  # text the transfer never read
    was, now = layer_errors(teacher, before.eval(), x), layer_errors(teacher, after, x)
    assert all(b < 0.7 * a for a, b in zip(was, now)), (was, now)

    theirs, mine, start = teacher.state_dict(), after.state_dict(), before.state_dict()
    for k in mine:
        if k in report["new"]:
            assert not torch.equal(mine[k], start[k]), k  # the mechanism's own parameters moved
        else:
            assert torch.equal(mine[k], theirs[k]), k  # every copied one is bit for bit the source's

    log = read_log(tmp_path / "abc" / "run")
    transfer = [r for r in log if r.get("phase") == "transfer"]
    assert [r["transfer_step"] for r in transfer] == [10, 20, 30, 40] and all(r["step"] == 0 for r in transfer)
    assert set(transfer[0]["transfer_layers"]) == {"0", "1"} and "loss" not in transfer[0]
    assert transfer[-1]["transfer_loss"] < transfer[0]["transfer_loss"]
    assert transfer[-1]["transfer_loss"] == pytest.approx(sum(transfer[-1]["transfer_layers"].values()))
    assert log[-1]["step"] == 1 and "loss" in log[-1]  # then the ordinary steps


def test_a_run_killed_in_the_transfer_phase_resumes_as_an_uninterrupted_one(text_file, tmp_path, softmax_run):
    """Killed mid-transfer (after transfer step 5, checkpoint at 4) and at the first ordinary
    step (the checkpoint is the transfer's last): the logs and the final weights equal those of
    a run never stopped. A hybrid student (layer 1 kept softmax, so only layer 0 is
    transferred), dropout on, distillation in the ordinary steps."""
    extra = ("train.transfer_steps=6", "train.steps=4", "train.log_every=1", "train.save_every=2",
             "train.eval_every=2", "model.dropout=0.1", "model.attention_layers.1=softmax",
             "train.distill_weight=0.5")
    train(student(text_file, tmp_path, softmax_run, "whole", *extra), progress=False)
    whole = read_log(tmp_path / "whole" / "run")
    assert [r["transfer_layers"] for r in whole if r.get("transfer_step") == 1][0].keys() == {"0"}
    assert [r.get("transfer_step") for r in whole[:6]] == [1, 2, 3, 4, 5, 6]

    for name, crash_at in (("mid", 5), ("end", None)):  # None: at the first ordinary step
        cfg = student(text_file, tmp_path, softmax_run, name, *extra)
        crash_in_transfer_and_resume(cfg, crash_at)
        cut = read_log(tmp_path / name / "run")
        assert records(cut) == records(whole), name
        ma, _, _ = model_from_checkpoint(tmp_path / "whole" / "run")
        mb, _, _ = model_from_checkpoint(tmp_path / name / "run")
        for (k, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
            assert torch.equal(p, q), (name, k)


def test_transfer_is_refused_where_it_cannot_apply(text_file, tmp_path, softmax_run):
    with pytest.raises(ConfigError, match="train.transfer_steps: .* set train.init_from"):
        TrainConfig(transfer_steps=10)
    with pytest.raises(ConfigError, match="train.transfer_lr: .* set train.transfer_steps"):
        TrainConfig(transfer_lr=0.1, init_from="x")
    with pytest.raises(ConfigError, match="train.transfer_steps: not with train.segments"):
        TrainConfig(transfer_steps=10, init_from="x", segments=True)
    with pytest.raises(ConfigError, match="task=mlm: train.transfer_steps"):
        load_config("tiny", ["task=mlm", "train.init_from=x", "train.transfer_steps=3"])
    # a mechanism whose every parameter the warm start copies: nothing of its own to transfer
    window = load_config("tiny", tiny_overrides(text_file, tmp_path / "window", "attention=abc-window",
                                                "attention.window=4", f"train.init_from={softmax_run}",
                                                "train.transfer_steps=3", "train.steps=1"))
    with pytest.raises(ConfigError, match=r"train.transfer_steps: attention 'abc-window' has no parameters of its own"):
        train(window, progress=False)
    # a source that is not softmax attention
    abc = student(text_file, tmp_path, softmax_run, "abc", "train.steps=1")
    train(abc, progress=False)
    again = student(text_file, tmp_path, tmp_path / "abc" / "run", "again", "train.transfer_steps=3", "train.steps=1")
    with pytest.raises(ConfigError, match=r"train.transfer_steps: the train.init_from model .* has 'abc-mlp' "
                                          "attention, not softmax"):
        train(again, progress=False)


def test_lora_trains_adapters_on_a_frozen_trunk_and_resumes_exactly(text_file, tmp_path, softmax_run):
    extra = ("train.transfer_steps=3", "train.lora_rank=2", "train.steps=6", "train.log_every=1",
             "train.save_every=2", "train.eval_every=3")
    summary = train(student(text_file, tmp_path, softmax_run, "whole", *extra), progress=False)
    model, cfg, _ = model_from_checkpoint(tmp_path / "whole" / "run")
    source, mine = read_source(softmax_run).weights, model.state_dict()
    adapted = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.out", "ff.up", "ff.down")}
    for k, t in mine.items():
        if k in adapted:  # saved merged: W + B A
            assert not torch.equal(t, source[k]), k
        elif k in source:
            assert torch.equal(t, source[k]), k  # embeddings and norms frozen
    # the checkpoint (merged weights, no adapters) reads as the run read with its adapters
    from memattn.evaluate import evaluate

    corpus = load_run_corpus(cfg)
    val = evaluate(model, as_tensor(corpus.val), seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                   max_batches=cfg.train.eval_batches, chars_per_token=corpus.chars_per_token("val"))
    assert val["loss"] == pytest.approx(summary["val"]["loss"], rel=1e-5)

    cut = student(text_file, tmp_path, softmax_run, "cut", *extra)
    train_crashing_at(cut, 3)  # the checkpoint at ordinary step 2 holds the adapters
    train(cut, resume=True, progress=False)
    assert records(read_log(tmp_path / "cut" / "run")) == records(read_log(tmp_path / "whole" / "run"))
    other, _, _ = model_from_checkpoint(tmp_path / "cut" / "run")
    for (k, p), q in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(p, q), k


@pytest.mark.slow
def test_two_processes_transfer_and_adapt_as_one(text_file, tmp_path, softmax_run):
    """Under torchrun (two processes on gloo) the transfer steps and the LoRA adapters average
    their gradients over the ranks, which no DDP wrapper does for them: the losses of one
    process, and every rank ends with the same weights."""
    import os
    import subprocess
    import sys

    extra = ("train.transfer_steps=4", "train.transfer_lr=0.01", "train.lora_rank=2", "train.steps=3",
             "train.log_every=1", "train.eval_every=3", "train.batch_size=8")
    train(student(text_file, tmp_path, softmax_run, "one", *extra), progress=False)
    over = tiny_overrides(text_file, tmp_path / "two", *ABC, "model.init_std=0.2", f"train.init_from={softmax_run}",
                          *extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "memattn", "train", "--config", "tiny", "--quiet", *over]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_in_sync"] is True
    one, two = read_log(tmp_path / "one" / "run"), read_log(tmp_path / "two" / "run")
    assert len(one) == len(two) == 7
    for r1, r2 in zip(one, two):
        assert (r1["step"], r1.get("transfer_step")) == (r2["step"], r2.get("transfer_step"))
        key = "transfer_loss" if "transfer_step" in r1 else "loss"
        assert r2[key] == pytest.approx(r1[key], rel=1e-4)
