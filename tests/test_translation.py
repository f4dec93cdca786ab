"""memattn.translation and task=translation: batches, the label-smoothed loss, training through
the shared loop (exact resume, two processes), `memattn eval` with BLEU and `memattn translate`."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import train_crashing_at

from memattn.cli import main
from memattn.config import load_config
from memattn.errors import ConfigError
from research.experiments.abc_mt import quick_pairs
from memattn.train import model_from_checkpoint, train
from memattn.translation import pair_batch, score_translations, smoothed_loss

pytest.importorskip("tokenizers")


def settings(data, out, *extra):
    return ["task=translation", "data.corpus=parallel", "data.level=bpe", "data.bpe_size=300",
            f"data.path={data}", f"data.cache_dir={out}/cache", "model.d_model=32", "model.n_layers=1",
            "model.n_heads=2", "model.ff_mult=2", "model.max_len=32", "model.init_std=0.1",
            "model.encoder_attention.name=softmax", "attention=abc-mlp", "attention.num_slots=2",
            "attention.cross_slots=4", "train.batch_size=8", "train.steps=6", "train.lr=0.003",
            "train.warmup=2", "train.label_smoothing=0.1", "train.eval_every=3", "train.eval_batches=2",
            "train.log_every=1", "train.save_every=2", "model.dropout=0.1", f"train.out_dir={out}/run",
            *extra]


@pytest.fixture()
def pairs(tmp_path):
    return quick_pairs(tmp_path / "pairs")


def read_log(run):
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


class Split:
    def __init__(self, source, target):
        self.source, self.target = source, target


class Specials:
    pad_id, bos_id, eos_id = 0, 1, 2


def test_a_batch_is_bos_then_target_in_and_target_then_eos_out_right_padded():
    split = Split([np.array([5, 6, 7]), np.array([8])], [np.array([9, 10]), np.array([11, 12, 13])])
    b = pair_batch(split, [0, 1], Specials)
    assert b.src.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b.src_mask.tolist() == [[True, True, True], [True, False, False]]
    assert b.tgt_in.tolist() == [[1, 9, 10, 0], [1, 11, 12, 13]]
    assert b.tgt_out.tolist() == [[9, 10, 2, 0], [11, 12, 13, 2]]


def test_smoothed_loss_is_the_mixture_of_the_reference_and_uniform_targets_over_real_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    target = torch.tensor([[3, 4, 0], [6, 0, 0]])  # 0 = pad
    eps = 0.2
    total, count = smoothed_loss(logits, target, 0, eps)
    by_hand = 0.0
    for b, t in [(0, 0), (0, 1), (1, 0)]:
        logp = torch.log_softmax(logits[b, t], -1)
        by_hand += (1 - eps) * -logp[target[b, t]] + eps * -logp.mean()
    assert count == 3
    assert total.item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_bleu_is_sacrebleus_corpus_score():
    refs = ["the cat sat on the mat", "a dog ran in the park today"]
    perfect = score_translations(refs, refs)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    hyps = ["the cat sat on a mat", "a dog ran in a park today"]
    import sacrebleu

    assert score_translations(hyps, refs)["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    with pytest.raises(ConfigError, match="hypotheses"):
        score_translations(hyps[:1], refs)


def test_training_learns_and_resumes_exactly(pairs, tmp_path):
    whole = load_config(None, settings(pairs, tmp_path / "whole"))
    summary = train(whole, progress=False)
    assert summary["val"]["ppl"] > 1 and "bpc" not in summary["val"]
    cut = load_config(None, settings(pairs, tmp_path / "cut"))
    train_crashing_at(cut, 3)
    train(cut, resume=True, progress=False)
    a, b = read_log(tmp_path / "whole" / "run"), read_log(tmp_path / "cut" / "run")
    assert [(r["step"], r.get("loss"), r.get("val_loss")) for r in a] == \
        [(r["step"], r.get("loss"), r.get("val_loss")) for r in b]
    model, cfg, vocab = model_from_checkpoint(tmp_path / "whole" / "run")
    assert cfg.task == "translation" and type(model).__name__ == "EncoderDecoder"
    assert vocab["kind"] == "bpe" and cfg.model.vocab_size == vocab["size"]
    assert type(model.encoder.blocks[0].attn).__name__ == "SoftmaxAttention"
    assert type(model.decoder.blocks[0].cross).__name__ == "ABCCrossAttention"


def test_a_longer_run_translates_by_reading_the_source(pairs, tmp_path, capsys):
    cfg = load_config(None, settings(pairs, tmp_path, "train.steps=150", "train.eval_every=150",
                                     "train.log_every=50", "train.save_every=150", "model.d_model=48",
                                     "train.batch_size=16", "model.dropout=0.0"))
    train(cfg, progress=False)
    assert main(["eval", str(tmp_path / "run"), "--beam", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 40 and result["beam"] == 3 and result["ppl"] < math.exp(3)

    test = [line.split("\t") for line in (pairs / "test.tsv").read_text().splitlines()]
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("".join(s + "\n" for s, _ in test))
    assert main(["translate", str(tmp_path / "run"), "--input", str(src), "--output", str(out),
                 "--beam", "3"]) == 0
    hyps, refs = out.read_text().splitlines(), [t for _, t in test]
    assert score_translations(hyps, refs)["bleu"] == pytest.approx(result["bleu"])  # the same search
    # against the references of other sentences the same outputs score far lower: they follow the source
    shifted = score_translations(hyps, refs[1:] + refs[:1])
    assert result["chrf"] > shifted["chrf"] + 15 and result["bleu"] > shifted["bleu"] + 5

    src.write_text("w1 w2\n\nw3\n")
    assert main(["translate", str(tmp_path / "run"), "--input", str(src)]) != 0
    assert "in.txt: line 2 is empty" in capsys.readouterr().err
    src.write_text("w1 " * 40 + "\n")
    assert main(["translate", str(tmp_path / "run"), "--input", str(src)]) != 0
    assert re.search(r"in\.txt: line 1 has \d+ tokens, more than .*max_len=32", capsys.readouterr().err)


def test_bad_settings_are_refused_naming_what_is_wrong(pairs, tmp_path):
    with pytest.raises(ConfigError, match="translation reads parallel data"):
        load_config(None, ["task=translation"])
    with pytest.raises(ConfigError, match="data.level: parallel data is read with a joint subword"):
        load_config(None, ["task=translation", "data.corpus=parallel", f"data.path={pairs}"])
    with pytest.raises(ConfigError, match="data.source, data.target: .* give both"):
        load_config(None, ["task=translation", "data.corpus=parallel", "data.level=bpe", "data.source=a.txt"])
    with pytest.raises(ConfigError, match="cannot serve as cross attention"):
        train(load_config(None, settings(pairs, tmp_path, "model.cross_attention.name=persistent")),
              progress=False)
    with pytest.raises(ConfigError, match=r"pair 1 of the train split has a source of \d+ tokens"):
        lines = (pairs / "train.tsv").read_text().splitlines()
        (pairs / "train.tsv").write_text("\n".join([" ".join(["w1"] * 40) + "\tt1", *lines[1:]]) + "\n")
        train(load_config(None, settings(pairs, tmp_path)), progress=False)


@pytest.mark.slow
def test_two_process_data_parallel_matches_one_process(pairs, tmp_path):
    extra = ("model.dropout=0.0",)
    train(load_config(None, settings(pairs, tmp_path / "one", *extra)), progress=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "memattn", "train", "--quiet", *settings(pairs, tmp_path / "two", *extra)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = read_log(tmp_path / "one" / "run"), read_log(tmp_path / "two" / "run")
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for r1, r2 in zip(one, two):  # the loss is the mean over the global batch's target tokens
        for key in ("loss", "val_loss"):
            if key in r1:
                assert r2[key] == pytest.approx(r1[key], rel=1e-4), (r1, r2)


def test_info_describes_translation_and_masked_runs(pairs, tmp_path, capsys):
    train(load_config(None, settings(pairs, tmp_path, "train.steps=2")), progress=False)
    assert main(["info", "--checkpoint", str(tmp_path / "run"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["task"] == "translation" and info["state_bytes_per_token"] is None and info["parameters"] > 0
    if importlib.util.find_spec("transformers"):  # export-hf takes causal LMs and encoders only
        assert main(["export-hf", str(tmp_path / "run"), "-o", str(tmp_path / "hf")]) == 2
        assert "is a translation run; causal LMs (task=lm) and masked-LM" in capsys.readouterr().err
