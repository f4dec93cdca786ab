"""memattn.train with train.segments: streams, carried memory, exact resume, evaluation with
the same cache; the auxiliary (span) loss in the objective; `memattn info` reporting spans."""

import json

import pytest
import torch
from conftest import tiny_overrides, train_crashing_at

from memattn.cli import main
from memattn.config import AttentionConfig, ModelConfig, load_config
from memattn.errors import ConfigError
from memattn.evaluate import evaluate, segment_window
from memattn.models import CausalLM
from memattn.train import model_from_checkpoint, train

PERSISTENT = ["attention=persistent", "attention.n_persistent=8", "attention.context=window",
              "attention.window=40", "attention.relative_positions=true", "attention.adaptive_span=true",
              "attention.span_max=24", "attention.span_ramp=4", "attention.span_init=0.5",
              "attention.span_loss=0.001", "model.positions=none", "train.segments=true"]


def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_segment_window_reads_contiguous_streams():
    ids = torch.arange(101)
    first, second = segment_window(ids, 4, 10, 0), segment_window(ids, 4, 10, 1)
    assert first.shape == (4, 11)
    assert first[:, 0].tolist() == [0, 25, 50, 75] and second[:, 0].tolist() == [10, 35, 60, 85]
    assert torch.equal(second[:, 0], first[:, -1])  # the next segment starts where the targets ended
    with pytest.raises(ValueError, match="hold only 2 segments"):
        segment_window(ids, 4, 10, 2)


def test_segment_evaluation_gives_every_token_the_window_of_the_whole_stream():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=2, ff_mult=0, positions="none",
                      attention=AttentionConfig("persistent", {"n_persistent": 3, "context": "window", "window": 7}))
    model = CausalLM(cfg).double().eval()
    ids = torch.randint(0, 23, (3 * 40 + 1,))
    result = evaluate(model, ids, seq_len=8, batch_size=3, segments=True)
    streams = ids[:-1].view(3, 40)  # 5 segments of 8 per stream
    targets = ids[1:].view(3, 40)
    logits = model(streams)  # one pass over each whole stream: the same window for every token
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert result["tokens"] == 120 and result["loss"] == pytest.approx(nll.item(), rel=1e-6)  # fp32 loss


def test_interrupted_and_resumed_segment_run_logs_the_same_losses(text_file, tmp_path):
    extra = (*PERSISTENT, "train.steps=8", "train.log_every=1", "train.save_every=3",
             "train.eval_every=4", "model.dropout=0.1")
    whole = load_config("tiny", tiny_overrides(text_file, tmp_path / "whole", *extra))
    train(whole, progress=False)
    cut = load_config("tiny", tiny_overrides(text_file, tmp_path / "cut", *extra))
    train_crashing_at(cut, 5)
    train(cut, resume=True, progress=False)  # from step 3, with the memory saved there

    a, b = read_log(tmp_path / "whole" / "run"), read_log(tmp_path / "cut" / "run")
    assert [(r["step"], r.get("loss"), r.get("aux_loss"), r.get("val_loss")) for r in a] == \
           [(r["step"], r.get("loss"), r.get("aux_loss"), r.get("val_loss")) for r in b]
    assert all("aux_loss" in r for r in a if "loss" in r)  # the span penalty joins the objective
    ma, _, _ = model_from_checkpoint(tmp_path / "whole" / "run")
    mb, _, _ = model_from_checkpoint(tmp_path / "cut" / "run")
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("overrides, message", [
    (["train.segments=true"], r"train\.segments: attention 'softmax' .* keeps no bounded memory"),
    (["train.segments=true", "attention=persistent"], r"train\.segments: attention 'persistent' .* keeps no bounded memory"),
    ([*PERSISTENT, "model.positions=learned"], r"train\.segments: a stream runs past any absolute position table"),
])
def test_segments_need_a_bounded_memory_and_relative_positions(text_file, tmp_path, overrides, message):
    cfg = load_config("tiny", tiny_overrides(text_file, tmp_path, *overrides))
    with pytest.raises(ConfigError, match=message):
        train(cfg, progress=False)


def test_info_reports_the_learned_spans(capsys):
    assert main(["info", "--config", "tiny", "--json", "attention=persistent", "attention.adaptive_span=true",
                 "attention.span_max=64", "attention.span_init=0.25"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spans"] == {"0": [16.0, 16.0], "1": [16.0, 16.0]}  # 2 layers x 2 heads
    assert info["state_bytes_per_token"] == 0  # the cache is cut at ⌈16 + 32⌉ tokens
    assert main(["info", "--config", "tiny", "attention=persistent", "attention.adaptive_span=true",
                 "attention.span_max=64"]) == 0
    assert "learned spans  layer 0: 0, 0 tokens" in capsys.readouterr().out
