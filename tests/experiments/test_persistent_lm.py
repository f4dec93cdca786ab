"""`memattn experiment persistent-lm --quick`: every row trains, parameters match, files are written."""

import pytest
from conftest import run_quick_lm_experiment

from memattn.experiments import get_experiment


@pytest.mark.slow
def test_quick_run_writes_the_table_curves_and_command(text_file, tmp_path):
    out, result = run_quick_lm_experiment("persistent-lm", text_file, tmp_path)
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == ["transformer", "all-attn", "attn-split", "head-split", "single-head",
                          "ff-attn", "all-attn, N=0"]
    target = rows["transformer"]["params"]
    for name, row in rows.items():
        assert 0 < row["test_bpc"] < 8 and row["train_s"] > 0
        if name != "all-attn, N=0":  # N is sized to the transformer's parameter count
            assert abs(row["params"] - target) <= row["params"] * 0.01, name
    assert rows["all-attn, N=0"]["params"] < target and rows["all-attn, N=0"]["options"]["n_persistent"] == 0
    assert result["command"].startswith("memattn experiment persistent-lm data.corpus=text")
    table = (out / "results.md").read_text()
    assert result["command"] in table and "| all-attn, N=0 | 0 |" in table
    assert (out / "learning_curves.png").stat().st_size > 1000
    assert len(list((out / "logs").glob("*.jsonl"))) == 7


def test_is_listed_with_a_description():
    module = get_experiment("persistent-lm")
    assert "persistent" in module.DESCRIPTION
