"""task=mlm (memattn.masked): BERT masking, training an encoder through the shared loop (exact
resume, warm start into another mechanism), `memattn eval` and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_overrides, train_crashing_at

from memattn.cli import main
from memattn.config import load_config
from memattn.errors import ConfigError
from memattn.masked import MASK_RATE, mask_tokens
from memattn.train import model_from_checkpoint, train


def read_log(run):
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_masking_follows_bert_proportions():
    ids = torch.randint(0, 50, (400, 250))
    inputs, chosen = mask_tokens(ids, 50, 50, torch.Generator().manual_seed(0))
    assert abs(chosen.float().mean().item() - MASK_RATE) < 0.005
    masked = (inputs == 50) & chosen
    kept = (inputs == ids) & chosen
    assert abs(masked.sum() / chosen.sum() - 0.8) < 0.01
    assert abs(kept.sum() / chosen.sum() - (0.1 + 0.1 / 50)) < 0.01  # kept, or a random draw of itself
    assert torch.equal(inputs[~chosen], ids[~chosen]) and not (inputs[~chosen] == 50).any()


def test_an_encoder_learns_resumes_exactly_and_evaluates(text_file, tmp_path, capsys):
    extra = ("task=mlm", "train.steps=300", "train.batch_size=16", "train.lr=0.01", "train.log_every=5",
             "train.save_every=50", "train.eval_every=100", "train.eval_batches=0", "model.dropout=0.1")
    summary = train(load_config("tiny", tiny_overrides(text_file, tmp_path / "whole", *extra)), progress=False)
    log = read_log(tmp_path / "whole" / "run")
    model, cfg, vocab = model_from_checkpoint(tmp_path / "whole" / "run")
    from memattn.train import load_run_corpus

    val = torch.from_numpy(load_run_corpus(cfg).val.astype("int64"))
    unigram = val.bincount().max().item() / len(val)  # always guessing the commonest symbol
    assert summary["val"]["accuracy"] > unigram + 0.15
    assert type(model).__name__ == "Encoder" and cfg.model.vocab_size == len(vocab["symbols"]) + 1  # + mask

    cut = load_config("tiny", tiny_overrides(text_file, tmp_path / "cut", *extra))
    train_crashing_at(cut, 120)
    train(cut, resume=True, progress=False)
    assert [(r["step"], r.get("loss"), r.get("val_accuracy")) for r in read_log(tmp_path / "cut" / "run")] == \
        [(r["step"], r.get("loss"), r.get("val_accuracy")) for r in log]

    # the command line reads the split the same way the training loop validated on it
    assert main(["eval", str(tmp_path / "whole" / "run"), "--split", "val", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["accuracy"] == pytest.approx(log[-1]["val_accuracy"]) and result["loss"] == pytest.approx(log[-1]["val_loss"])
    assert main(["generate", str(tmp_path / "whole" / "run")]) != 0
    assert "a mlm run" in capsys.readouterr().err

    # warm start: the softmax encoder's trunk in an ABC_MLP encoder, only φ new
    warm = load_config("tiny", tiny_overrides(text_file, tmp_path / "warm", "task=mlm", "train.steps=2",
                                              "attention=abc-mlp", "attention.num_slots=4",
                                              f"train.init_from={tmp_path / 'whole' / 'run'}"))
    train(warm, progress=False)
    assert "2 new: blocks.0.attn.phi.weight, blocks.1.attn.phi.weight" in capsys.readouterr().err


def test_what_masked_lm_cannot_do_is_refused(text_file, tmp_path):
    with pytest.raises(ConfigError, match="task=mlm: train.segments and train.distill_weight"):
        load_config("tiny", tiny_overrides(text_file, tmp_path, "task=mlm", "train.segments=true"))


@pytest.mark.slow
def test_two_process_data_parallel_matches_one_process(text_file, tmp_path):
    import os
    import subprocess
    import sys

    extra = ("task=mlm", "train.steps=6", "train.log_every=1", "train.eval_every=6", "train.batch_size=8")
    train(load_config("tiny", tiny_overrides(text_file, tmp_path / "one", *extra)), progress=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "memattn",
           "train", "--config", "tiny", "--quiet", *tiny_overrides(text_file, tmp_path / "two", *extra)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "run" / "summary.json").read_text())
    assert summary["ranks_in_sync"] is True
    for r1, r2 in zip(read_log(tmp_path / "one" / "run"), read_log(tmp_path / "two" / "run")):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-4)


@pytest.mark.parametrize("task", ["lm", "mlm"])
def test_every_task_trains_with_the_adaptive_span_penalty(text_file, tmp_path, task):
    """The shared loop adds the model's auxiliary loss whatever the task: at the first step
    each of the 2 layers' spans are at span_init, so the penalty is
    2 · span_loss · span_max · span_init = 2 · 0.01 · 24 · 0.5."""
    extra = (f"task={task}", "attention=persistent", "attention.n_persistent=4", "attention.adaptive_span=true",
             "attention.span_max=24", "attention.span_init=0.5", "attention.span_loss=0.01",
             "train.steps=2", "train.log_every=1", "train.eval_every=2", "train.batch_size=4")
    train(load_config("tiny", tiny_overrides(text_file, tmp_path, *extra)), progress=False)
    first = read_log(tmp_path / "run")[0]
    assert first["step"] == 1 and first["aux_loss"] == pytest.approx(2 * 0.01 * 24 * 0.5, rel=1e-6)
