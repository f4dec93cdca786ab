"""research.experiments.linear_qa: settings, and a quick run end to end."""

from __future__ import annotations

import json

import pytest

from memattn.errors import ConfigError
from research.experiments import get_experiment
from research.experiments.linear_qa import QUICK, Settings, parse_settings


def test_is_registered_as_an_experiment():
    assert get_experiment("linear-qa").DESCRIPTION


def test_settings_overrides_are_typed_and_checked():
    s = parse_settings(["steps=12", "lr=1e-3", "doc_len=[50,80]", "lookup_lengths=[250,500]"],
                       quick=False)
    assert (s.steps, s.lr, s.doc_len, s.lookup_lengths) == (12, 1e-3, (50, 80), (250, 500))
    assert parse_settings([], quick=True).steps == QUICK["steps"] < Settings().steps
    with pytest.raises(ConfigError, match=r"stepz: unknown key of linear-qa \(known: variants, seeds, steps"):
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
def test_quick_run_trains_to_convergence_resumably_and_writes_its_results(tmp_path):
    (tmp_path / "command.txt").write_text("memattn experiment linear-qa --quick steps=30\n")
    overrides = ["steps=30", "seeds=2", "test_docs=16", "lookup_lengths=[250,1000]"]
    results = get_experiment("linear-qa").run(tmp_path, quick=True, overrides=overrides, jobs=2)
    assert set(results["variants"]) == {"none", "softmax", "linear", "gated-linear"}
    assert len(results["runs"]) == 8
    for name, r in results["variants"].items():
        assert r["seeds"] == 2 and 0.0 <= r["accuracy"] <= 1.0
        assert ("accuracy_from_representations" in r) == (name in ("linear", "gated-linear"))
    for row in results["runs"]:
        log = [json.loads(line) for line in
               (tmp_path / "runs" / row["variant"].replace(" ", "-") if row["seed"] == 0 else
                tmp_path / "runs" / f"{row['variant']}-seed-{row['seed']}").joinpath("log.jsonl").read_text().splitlines()]
        # evaluated every 10 steps; stopped at the step budget or once 2 evaluations failed to improve
        assert row["steps"] >= 20, row  # at least the two evaluations that stopping needs
        log = [r for r in log if "val_accuracy" in r]
        assert [r["step"] for r in log] == list(range(10, row["steps"] + 1, 10))
        best = max(r["val_accuracy"] for r in log)
        assert row["val_accuracy"] == best and row["best_step"] == next(r["step"] for r in log if r["val_accuracy"] == best)
        assert row["converged"] == (row["steps"] < 30) or row["steps"] == 30
    rows = results["lookup"]
    assert [r["n"] for r in rows] == [250, 1000]
    assert all(r["linear_bytes"] == 100 * 100 * 4 and r["softmax_bytes"] == r["n"] * 100 * 4
               for r in rows)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    text = (tmp_path / "results.md").read_text()
    assert "memattn experiment linear-qa --quick steps=30" in text and "| gated-linear | 2 |" in text
    assert (tmp_path / "linear_qa.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # run again: every run folder is finished and reused as it is
    again = get_experiment("linear-qa").run(tmp_path, quick=True, overrides=overrides, jobs=1)
    assert again["runs"] == results["runs"]


def test_an_interrupted_run_resumes_to_the_same_figures(tmp_path, monkeypatch):
    import memattn.train
    from research.experiments._runner import train_and_measure
    from research.experiments.linear_qa import job_of, measure

    job = job_of(parse_settings(["steps=30", "patience=5", "test_docs=16"], quick=True), "linear", 0)
    whole = train_and_measure(tmp_path / "whole", job, measure)

    class Stop(Exception):
        pass

    save, saved = memattn.train.save_checkpoint, []

    def save_then_stop(path, *args, **kwargs):
        save(path, *args, **kwargs)
        saved.append(path.name)
        if saved.count("checkpoint.safetensors") == 2:  # stopped right after the step-20 checkpoint
            raise Stop

    monkeypatch.setattr(memattn.train, "save_checkpoint", save_then_stop)
    with pytest.raises(Stop):
        train_and_measure(tmp_path / "cut", job, measure)
    monkeypatch.setattr(memattn.train, "save_checkpoint", save)
    resumed = train_and_measure(tmp_path / "cut", job, measure)

    def figures(run):
        return [(r["step"], r.get("loss"), r.get("val_accuracy"))
                for r in map(json.loads, (tmp_path / run / "log.jsonl").read_text().splitlines())]
    assert figures("whole") == figures("cut")
    assert [step for step, _, accuracy in figures("whole") if accuracy is not None] == [10, 20, 30]
    keys = ("accuracy", "accuracy_long", "accuracy_from_representations", "val_accuracy", "best_step", "steps",
            "final_loss", "converged")
    assert {k: resumed[k] for k in keys} == {k: whole[k] for k in keys}


def test_findings_rank_the_variants_and_weigh_gaps_against_the_seeds_spread():
    from research.experiments.linear_qa import findings

    def variant(accuracy, spread, **extra):
        return {"accuracy": accuracy, "accuracy_spread": spread, "accuracy_long": accuracy / 2,
                "accuracy_long_spread": 0.0, "seeds": 2, **extra}

    results = {"variants": {"none": variant(0.20, 0.01), "softmax": variant(0.60, 0.02),
                            "linear": variant(0.50, 0.04), "gated-linear": variant(0.52, 0.02,
                                                                                   accuracy_from_representations=0.52)},
               "lookup": [{"n": 250, "linear_us_per_query": 1.0, "softmax_us_per_query": 2.0, "speedup": 2.0},
                          {"n": 8000, "linear_us_per_query": 1.1, "softmax_us_per_query": 55.0, "speedup": 50.0}]}
    text = "\n".join(findings(results))
    assert "We measured softmax (60.0 %) > gated-linear (52.0 %) > linear (50.0 %) > none (20.0 %)" in text
    assert "softmax is ahead of none by 40.0 points" in text
    assert "gated-linear and linear are within the seeds' spread (+2.0 points)" in text  # 2.0 <= 3.0
    assert "on the longer documents, gated-linear is ahead of linear by 1.0 points" in text
    assert "gated-linear 52.0 % against 52.0 % directly" in text and "linear 50.0 % against" not in text
    assert "(50× at n = 8,000)" in text
