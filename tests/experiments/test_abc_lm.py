"""`memattn experiment abc-lm --quick`: every row trains, decodes and is written to the table."""

import pytest
from conftest import run_quick_lm_experiment

from memattn.experiments import get_experiment


@pytest.mark.slow
def test_quick_run_writes_the_table_curves_and_command(text_file, tmp_path):
    out, result = run_quick_lm_experiment("abc-lm", text_file, tmp_path)
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == ["softmax", "abc-mlp, M=32", "abc-mlp, M=64", "abc-linformer, M=64",
                          "abc-random, M=64", "abc-window, n=64"]
    for row in rows.values():
        assert 0 < row["test_bpc"] < 8 and row["train_s"] > 0 and row["decode_tokens_per_s"] > 0
        assert row["params"] > 0
    # the slot count shows in the parameters only where the control is learned
    assert rows["abc-mlp, M=64"]["params"] > rows["abc-mlp, M=32"]["params"]
    assert rows["abc-random, M=64"]["params"] == rows["softmax"]["params"]
    assert result["decode"]["new_tokens"] > 0
    assert result["command"].startswith("memattn experiment abc-lm data.corpus=text")
    table = (out / "results.md").read_text()
    assert result["command"] in table and "| abc-linformer, M=64 |" in table
    assert "Against the paper's finding" in table
    assert (out / "learning_curves.png").stat().st_size > 1000
    assert len(list((out / "logs").glob("*.jsonl"))) == 6


def test_is_listed_with_a_description():
    module = get_experiment("abc-lm")
    assert "bounded-memory" in module.DESCRIPTION
