"""memattn.experiments.linear_qa: settings, and a quick run end to end."""

from __future__ import annotations

import json

import pytest

from memattn.errors import ConfigError
from memattn.experiments import get_experiment
from memattn.experiments.linear_qa import QUICK, Settings, parse_settings


def test_is_registered_as_an_experiment():
    assert get_experiment("linear-qa").DESCRIPTION


def test_settings_overrides_are_typed_and_checked():
    s = parse_settings(["steps=12", "lr=1e-3", "doc_len=[50,80]", "lookup_lengths=[250,500]"],
                       quick=False)
    assert (s.steps, s.lr, s.doc_len, s.lookup_lengths) == (12, 1e-3, (50, 80), (250, 500))
    assert parse_settings([], quick=True).steps == QUICK["steps"] < Settings().steps
    with pytest.raises(ConfigError, match=r"stepz: unknown key of linear-qa \(known: variants, steps"):
        parse_settings(["stepz=3"], quick=False)
    with pytest.raises(ConfigError, match=r"steps: expected an integer, got 'many'"):
        parse_settings(["steps=many"], quick=False)
    with pytest.raises(ConfigError, match=r"doc_len: expected \[shortest, longest\]"):
        parse_settings(["doc_len=[80,50]"], quick=False)
    with pytest.raises(ConfigError, match=r"lookup_lengths: expected a list of int"):
        parse_settings(["lookup_lengths=250"], quick=False)
    with pytest.raises(ConfigError, match=r"variants: expected distinct names among none, softmax"):
        parse_settings(["variants=[linear,abc]"], quick=False)
    assert parse_settings(["variants=[linear]"], quick=True).variants == ("linear",)
    with pytest.raises(ConfigError, match=r"hidden: expected positive values"):
        parse_settings(["hidden=0"], quick=False)


@pytest.mark.slow
def test_quick_run_writes_its_results(tmp_path):
    (tmp_path / "command.txt").write_text("memattn experiment linear-qa --quick steps=8\n")
    results = get_experiment("linear-qa").run(
        tmp_path, quick=True, overrides=["steps=8", "test_docs=16", "lookup_lengths=[250,1000]"])
    assert set(results["variants"]) == {"none", "softmax", "linear", "gated-linear"}
    for name, r in results["variants"].items():
        assert 0.0 <= r["accuracy"] <= 1.0 and r["train_seconds"] > 0
        assert ("accuracy_from_representations" in r) == (name in ("linear", "gated-linear"))
    rows = results["lookup"]
    assert [r["n"] for r in rows] == [250, 1000]
    assert all(r["linear_bytes"] == 100 * 100 * 4 and r["softmax_bytes"] == r["n"] * 100 * 4
               for r in rows)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    text = (tmp_path / "results.md").read_text()
    assert "memattn experiment linear-qa --quick steps=8" in text and "| gated-linear |" in text
    assert (tmp_path / "linear_qa.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
