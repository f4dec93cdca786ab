"""research.experiments.gmat_majority and gmat_mlm: the task generator, settings, and a
quick run of each end to end."""

from __future__ import annotations

import json

import pytest
import torch

from memattn.errors import ConfigError
from research.experiments import get_experiment
from memattn.typed import parse_settings
from research.experiments.gmat_majority import Settings, majority_batch


def test_both_are_registered_experiments():
    assert get_experiment("gmat-majority").DESCRIPTION and get_experiment("gmat-mlm").DESCRIPTION


@pytest.mark.parametrize("margins", ["fair", "uniform", "runs"])
@pytest.mark.parametrize("length, parts", [(512, 1), (512, 3), (101, 4), (3, 3)])
def test_majority_tags_are_the_majority_bit_of_each_segment(length, parts, margins):
    bits, tags = majority_batch(length, parts, 64, torch.Generator().manual_seed(0), margins=margins)
    assert bits.shape == tags.shape == (64, length) and set(bits.unique().tolist()) <= {0, 1}
    bounds = [s * length // parts for s in range(parts + 1)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        ones = bits[:, lo:hi].sum(1)
        majority = (2 * ones > hi - lo).long()
        assert (2 * ones != hi - lo).all()  # never a tie
        assert (tags[:, lo:hi] == majority[:, None]).all()
    again = majority_batch(length, parts, 64, torch.Generator().manual_seed(0), margins=margins)
    assert torch.equal(again[0], bits)  # seeded


def test_majority_bits_are_fair_coins_with_ties_broken():
    bits, tags = majority_batch(512, 1, 4000, torch.Generator().manual_seed(1))
    assert abs(bits.float().mean().item() - 0.5) < 0.005
    margin = (2 * bits.sum(1) - 512).abs().float()
    assert margin.min() >= 2 and abs(margin.mean().item() - 18.05) < 1.0  # E|N(0, √512)| ≈ 18.05
    assert 0.45 < tags[:, 0].float().mean() < 0.55


def test_runs_segments_mislead_a_chunk_but_have_wide_margins():
    bits, tags = majority_batch(512, 1, 4000, torch.Generator().manual_seed(2), margins="runs")
    # the first and the last bit lie in different runs: they differ unless one of them was flipped
    assert abs((bits[:, 0] != bits[:, -1]).float().mean().item() - (0.9 ** 2 + 0.1 ** 2)) < 0.02
    # the majority of the first chunk of 64 is that of the segment about half of the time only
    first_chunk = (2 * bits[:, :64].sum(1) > 64).long()
    assert 0.4 < (first_chunk != tags[:, 0]).float().mean().item() < 0.55
    # |2·ones - n| ≈ 0.8·|2k - n| for a prefix of k uniform in 1 … n-1: mean ≈ 0.8 · n / 2
    margin = (2 * bits.sum(1) - 512).abs().float().mean().item()
    assert abs(margin - 0.8 * 256) < 8


def test_settings_are_typed_and_checked():
    s = parse_settings(Settings, ["steps=12", "lr=1e-3"], name="gmat-majority")
    assert (s.steps, s.lr) == (12, 1e-3)
    with pytest.raises(ConfigError, match=r"stepz: unknown key of gmat-majority \(known: d_model"):
        parse_settings(Settings, ["stepz=3"], name="gmat-majority")
    with pytest.raises(ConfigError, match=r"steps: expected an integer, got 'many'"):
        parse_settings(Settings, ["steps=many"], name="gmat-majority")
    with pytest.raises(ConfigError, match=r"num_memory: expected a positive value, got 0"):
        parse_settings(Settings, ["num_memory=0"], name="gmat-majority")
    with pytest.raises(ConfigError, match=r"wide: expected runs or uniform, got 'often'"):
        parse_settings(Settings, ["wide=often"], name="gmat-majority")
    with pytest.raises(ConfigError, match=r"margins: expected fair, runs or uniform, got 'x'"):
        majority_batch(8, 1, 2, torch.Generator(), margins="x")


@pytest.mark.slow
def test_quick_majority_run_writes_its_table(tmp_path):
    (tmp_path / "command.txt").write_text("memattn experiment gmat-majority --quick\n")
    results = get_experiment("gmat-majority").run(tmp_path, quick=True, overrides=["steps=6"])
    rows = results["rows"]
    assert [(r["L"], r["p"], r["M"]) for r in rows] == [(512, 1, 0), (512, 1, 8), (512, 3, 0), (512, 3, 8),
                                                       (8192, 1, 0), (8192, 1, 8)]
    assert all(0 <= r["exact_match"] <= 1 and 0 <= r["token_accuracy"] <= 1 for r in rows)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    text = (tmp_path / "results.md").read_text()
    assert "memattn experiment gmat-majority --quick" in text and "| MAJORITY(8192, 1) | 8 |" in text
    assert "6 of 6 models trained" in text and "†" not in text
    assert (tmp_path / "gmat_majority.png").stat().st_size > 0
    assert [r["init"] for r in rows] == ["scratch"] * 4 + ["MAJORITY(512, 1)"] * 2
    # run again: every run folder is finished and reused as it is, the chained ones without their source
    rows_before = {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/row.json")}
    assert len(rows_before) == 6
    for source in tmp_path.glob("runs/l512-p1-*/checkpoint.safetensors"):
        source.unlink()
    again = get_experiment("gmat-majority").run(tmp_path, quick=True, overrides=["steps=6"], jobs=2)
    assert again["rows"] == rows and {p: p.stat().st_mtime_ns for p in rows_before} == rows_before


@pytest.mark.slow
def test_quick_mlm_run_writes_its_table_and_a_compressor(tmp_path, text_file):
    (tmp_path / "command.txt").write_text("memattn experiment gmat-mlm --quick\n")
    out = tmp_path / "compressor.safetensors"
    results = get_experiment("gmat-mlm").run(
        tmp_path, quick=True, overrides=["corpus=text", f"path={text_file}", f"cache_dir={tmp_path / 'cache'}",
                                         "steps=5", f"compressor_out={out}"])
    names = [r["model"] for r in results["rows"]]
    assert names == ["chunked, M=0", "chunked, M=16", "compressed, M=16"]
    assert [r["layers"] for r in results["rows"]] == ["2", "2", "1+1+1"]
    for r in results["rows"]:
        for split in ("val", "test"):
            assert 0 <= r[split]["error_rate"] <= 1 and r[split]["perplexity"] > 1
    assert "unmasked_error_rate" in results["rows"][2]["test"] and out.exists()
    text = (tmp_path / "results.md").read_text()
    assert "memattn experiment gmat-mlm --quick" in text and "| compressed, M=16 | 1+1+1 |" in text
    assert json.loads((tmp_path / "results.json").read_text()) == results
    from memattn.models.compressor import load_compressor

    model, meta = load_compressor(out)
    assert meta["seq_len"] == 128 and results["rows"][2]["checkpoint"] == str(out)
