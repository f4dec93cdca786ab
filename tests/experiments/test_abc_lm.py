"""`memattn experiment abc-lm --quick`: every model trains, is measured and lands in the table."""

import dataclasses
import json
import math

import pytest
import torch
from conftest import run_quick_lm_experiment

from research.experiments import get_experiment
from research.experiments._lm_common import (by_position_buckets, by_position_lines, jobs_of,
                                             summarise)
from research.experiments._runner import SPEED_FILE, SPEED_ROUNDS, Job
from research.experiments.abc_lm import (FULL, MEASURE, MODELS, QUICK, QUICK_MODELS, findings,
                                        markdown)
from memattn.train import load_run_corpus, model_from_checkpoint


@pytest.mark.slow
def test_quick_run_writes_the_table_sweep_and_slot_usage(text_file, tmp_path):
    out, result = run_quick_lm_experiment("abc-lm", text_file, tmp_path)
    models = {m["model"]: m for m in result["models"]}
    assert list(models) == ["softmax", "abc-mlp, M=4", "abc-mlp, M=8", "abc-random, M=8",
                            "abc-mlp, M=4, W_phi init", "abc-mlp, M=4, recency"]
    assert models["softmax"]["seeds"] == 2 and len(result["runs"]) == 7
    model, cfg, _ = model_from_checkpoint(out / "runs" / "abc-mlp-m8")
    uniform = math.log2(cfg.model.vocab_size)
    for m in models.values():
        assert m["test_bpc"] < uniform and m["test_bpc_context"] < uniform  # learned something
    # the table's test figure: the checkpoint's mean -log2 p of each next character over the
    # first windows of the test split (seq_len + 1 characters, seq_len apart), counted here
    row, L = models["abc-mlp, M=8"], cfg.train.seq_len
    assert row["test_tokens"] >= MEASURE[True]["test_tokens"] and row["test_tokens"] % L == 0
    test = torch.as_tensor(load_run_corpus(cfg).test, dtype=torch.long)
    windows = test[torch.arange(row["test_tokens"] // L)[:, None] * L + torch.arange(L + 1)]
    with torch.no_grad():
        logp = model(windows[:, :-1]).double().log_softmax(-1)
    bits = -logp.gather(-1, windows[:, 1:, None])[..., 0].mean(0) / math.log(2)  # [L] by position
    assert row["test_bpc"] == pytest.approx(bits.mean().item(), rel=1e-5)
    # and by position: each bucket of positions a-b holds their mean, the buckets cover the window
    buckets = [(int(b.split("-")[0]), int(b.split("-")[1])) for b in row["test_bpc_by_position"]]
    assert [a for a, _ in buckets] == [0] + [b + 1 for _, b in buckets[:-1]] and buckets[-1][1] == L - 1
    for (a, b), value in zip(buckets, row["test_bpc_by_position"].values()):
        assert value == pytest.approx(bits[a:b + 1].mean().item(), rel=1e-5)
    # slot statistics for ABC_MLP only; the larger W_φ init parts the slots' writes
    assert "slots_trained" not in models["softmax"] and "slots_trained" not in models["abc-random, M=8"]
    plain, parted = models["abc-mlp, M=4"]["slots_init"], models["abc-mlp, M=4, W_phi init"]["slots_init"]
    assert parted["write_spread"] < plain["write_spread"] and parted["key_cosine"] < plain["key_cosine"]
    table = (out / "results.md").read_text()
    assert result["command"] in table and "| abc-random, M=8 | 1 |" in table and "In progress" not in table
    assert "## Where in the segment the loss falls (context 0)" in table
    age = models["abc-mlp, M=8"]["slots_trained"]["write_age"]
    assert 0 <= age <= 2 and f"→ {age:.2f} |" in table
    assert (out / "memory_sweep.png").stat().st_size > 1000
    assert (out / "learning_curves.png").stat().st_size > 1000
    # tokens/s of every run come from one pass once all were trained, kept in speeds.json
    speeds = json.loads((out / SPEED_FILE).read_text())["speeds"]
    assert result["side_by_side"] and "3 rounds of every model in turn" in table
    assert sorted(speeds) == sorted(run["model"] for run in result["runs"])
    for run in result["runs"]:
        assert run["train_tokens_per_s"] == speeds[run["model"]]["train_tokens_per_s"] > 0
        assert run["decode_tokens_per_s"] == speeds[run["model"]]["decode_tokens_per_s"] > 0


def test_the_table_holds_each_models_figures_against_softmax():
    """results.md of a hand-made result of two models: the rows written out by hand."""
    shared = {"context": 16, "test_tokens": 1024, "context_tokens": 512, "train_s": 126.0}
    result = {"command": "memattn experiment abc-lm", "finished": 3, "runs_planned": 3, "runs": [],
              "side_by_side": True, "config": ["train.steps=2000", "train.batch_size=8", "train.seq_len=64"],
              "models": [
                  dict(shared, model="softmax", attention="softmax", options={}, seeds=2, params=12345,
                       test_bpc=2.0, test_bpc_spread=0.1, test_bpc_context=1.8, test_bpc_context_spread=0.04,
                       val_bpc=2.05, train_tokens_per_s=1500.4, decode_tokens_per_s=250.4),
                  dict(shared, model="abc-mlp, M=4", attention="abc-mlp", options={"num_slots": 4}, seeds=1,
                       params=12000, test_bpc=2.25, test_bpc_context=2.1, val_bpc=2.3,
                       train_tokens_per_s=1250.0, decode_tokens_per_s=900.0)]}
    text = markdown(result)
    lines = text.splitlines()
    assert ("| model | seeds | parameters | test bpc, context 0 | vs softmax | test bpc, context 16 | vs softmax "
            "| val bpc | train tokens/s | decode tokens/s |") in lines
    assert "| softmax | 2 | 12,345 | 2.000 ± 0.050 | +0.000 | 1.800 ± 0.020 | +0.000 | 2.050 | 1,500 | 250 |" in lines
    assert "| abc-mlp, M=4 | 1 | 12,000 | 2.250 | +0.250 | 2.100 | +0.300 | 2.300 | 1,250 | 900 |" in lines
    assert ("Budget: 2,000 steps of 8 x 64 characters (1.0 M training characters) per model; softmax has "
            "12,345 parameters and trained in 2 min on one CPU thread.") in text
    assert "over the first 1,024 characters" in text and "512 characters at context 16" in text
    assert "Command: `memattn experiment abc-lm`" in lines and "In progress" not in text


def test_speeds_are_measured_again_only_when_the_runs_change(text_file, tmp_path, monkeypatch):
    import research.experiments._lm_common as lm

    out, _ = run_quick_lm_experiment("abc-lm", text_file, tmp_path)
    calls = []
    monkeypatch.setattr(lm, "train_speed", lambda *a, **k: calls.append(1) or 123.0)
    saved = json.loads((out / SPEED_FILE).read_text())
    jobs, before = [Job(name, tuple(settings)) for name, settings in saved["settings"].items()], saved["speeds"]
    assert [job.name for job in jobs] == [job.name for _, job in jobs_of(QUICK_MODELS, QUICK)]
    assert lm.side_by_side_speeds(out, jobs, **MEASURE[True]) == before and not calls  # kept
    changed = [dataclasses.replace(jobs[0], settings=(*jobs[0].settings, "train.lr=0.01")), *jobs[1:]]
    again = lm.side_by_side_speeds(out, changed, **MEASURE[True])
    assert len(calls) == len(jobs) * SPEED_ROUNDS and all(s["train_tokens_per_s"] == 123.0 for s in again.values())


def test_seeds_share_everything_but_the_seed():
    pairs = jobs_of(MODELS, FULL)
    names = [job.name for _, job in pairs]
    assert len(names) == len(set(names)) == 22
    first = next(j for _, j in pairs if j.name == "softmax")
    second = next(j for _, j in pairs if j.name == "softmax, seed 1")
    assert [s for s in first.settings if s != "train.seed=0"] == [s for s in second.settings if s != "train.seed=1"]
    # every model's seed 0 comes before any seed 1
    seed_one = [i for i, (_, j) in enumerate(pairs) if j.name.endswith("seed 1")]
    assert len(seed_one) == 8 and min(seed_one) == len(pairs) - 8


@pytest.mark.parametrize("name", ["abc-lm", "persistent-lm"])
def test_an_override_replaces_the_default_it_names(name, monkeypatch, tmp_path):
    """train.steps=N gives the run folders' settings of a default with train.steps=N, so runs made
    with the override stay reusable once the default is changed to N."""
    module = get_experiment(name)
    seen = {}
    monkeypatch.setattr(module, "run_lm_experiment", lambda out, label, models, shared, **kw: seen.update(shared=shared))
    module.run(tmp_path, quick=False, overrides=["train.steps=4000", "train.lr=0.001"], jobs=1)
    replaced = {"train.steps": "train.steps=4000", "train.lr": "train.lr=0.001"}
    assert {s.split("=", 1)[0] for s in module.FULL} >= set(replaced)
    assert seen["shared"] == [replaced.get(s.split("=", 1)[0], s) for s in module.FULL]


def test_position_buckets_and_their_table():
    bpc = [float(p) for p in range(40)]  # bpc = position
    assert by_position_buckets(bpc) == {"0-7": 3.5, "8-31": 19.5, "32-39": 35.5}
    run = {"attention": "softmax", "options": {}, "params": 10, "steps": 5, "context": 3,
           "test_tokens": 8, "context_tokens": 8, "val_bpc": 2.0, "train_tokens_per_s": 1.0,
           "decode_tokens_per_s": 1.0, "train_s": 1.0, "slots_init": {}, "slots_trained": {},
           "test_bpc": 2.0, "test_bpc_context": 1.5}
    rows = [dict(run, seed=0),  # measured before the figure existed
            dict(run, seed=1, test_bpc_by_position={"0-7": 3.0, "8-15": 2.0}),
            dict(run, seed=0, test_bpc_by_position={"0-7": 3.5, "8-15": 2.5}),
            dict(run, seed=1, test_bpc_by_position={"0-7": 3.25, "8-15": 2.0})]
    base, abc, window = summarise(["softmax", "softmax", "abc", "window"], rows)
    assert base["by_position_seeds"] == [1] and base["test_bpc_by_position"]["0-7"] == 3.0
    lines = by_position_lines([base, abc, window], base)
    assert "| model | seeds | positions 0-7 | positions 8-15 |" in lines
    assert "| softmax | 1 | 3.000 | 2.000 |" in lines
    assert "| abc | 0 | 3.500 | 2.500 |" in lines  # other seeds: no difference drawn
    assert "| window | 1 | 3.250 (+0.250) | 2.000 (+0.000) |" in lines
    assert by_position_lines([dict(base, test_bpc_by_position=None)], base) == []


def test_summary_gives_mean_and_spread_over_seeds():
    run = {"attention": "softmax", "options": {}, "params": 10, "steps": 5, "context": 3, "test_tokens": 8,
           "context_tokens": 8, "val_bpc": 2.0, "train_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0,
           "train_s": 1.0, "slots_init": {}, "slots_trained": {}}
    rows = [dict(run, test_bpc=2.0, test_bpc_context=1.5), dict(run, test_bpc=2.5, test_bpc_context=1.0)]
    (m,) = summarise(["softmax", "softmax"], rows)
    assert m["seeds"] == 2 and m["test_bpc"] == 2.25 and m["test_bpc_spread"] == 0.5
    assert m["test_bpc_context"] == 1.25 and m["test_bpc_context_spread"] == 0.5


def test_summary_keeps_the_slot_figures_every_seed_has():
    run = {"attention": "abc-mlp", "options": {}, "params": 10, "steps": 5, "context": 3, "test_tokens": 8,
           "context_tokens": 8, "test_bpc": 2.0, "test_bpc_context": 1.5, "val_bpc": 2.0,
           "train_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0, "train_s": 1.0, "slots_init": {}}
    old = dict(run, slots_trained={"write_spread": 0.2})  # measured before write_age existed
    new = dict(run, slots_trained={"write_spread": 0.4, "write_age": 0.9})
    for rows in ([old, new], [new, old]):
        (m,) = summarise(["abc-mlp", "abc-mlp"], rows)
        assert m["slots_trained"] == {"write_spread": pytest.approx(0.3)}


def test_is_listed_with_a_description():
    module = get_experiment("abc-lm")
    assert "bounded-memory" in module.DESCRIPTION


def test_findings_weigh_gaps_against_the_seeds_spread():
    def model(name, bpc, spread, seeds=2, **kw):
        return {"model": name, "test_bpc": bpc, "test_bpc_spread": spread, "seeds": seeds,
                "test_bpc_context": bpc - 0.1, "context": 480, "options": {"num_slots": 32}, **kw}

    lines = "\n".join(findings([model("softmax", 1.9, 0.01), model("abc-mlp, M=32", 2.10, 0.02),
                                 model("abc-random, M=64", 2.11, 0.04),
                                 model("abc-linformer, M=64", 2.30, 0.02)]))
    assert "abc-mlp, M=32 and abc-random, M=64 are within the seeds' spread (-0.010)" in lines
    assert "abc-mlp, M=32 is ahead of abc-linformer, M=64 by 0.200" in lines
    assert "abc-mlp, M=32 +0.200 at context 0" in lines


def test_findings_say_every_seed_is_ahead_only_when_the_seeds_do_not_overlap():
    def model(name, bpc, spread):
        return {"model": name, "test_bpc": bpc, "test_bpc_spread": spread, "seeds": 2, "options": {"num_slots": 32}}

    def line(wide_bpc):
        rows = [model("abc-mlp, M=32", 2.285, 0.034), model("abc-mlp, M=32, W_phi init", wide_bpc, 0.020)]
        return next(text for text in findings(rows) if "Symmetric" in text)

    assert "every seed ahead of every seed" in line(2.238)   # 2.248 < 2.268
    assert "every seed ahead" not in line(2.260)             # 2.270 > 2.268: the seeds overlap


def test_findings_set_recency_against_abc_mlp_and_softmax():
    def model(name, bpc, spread, context_bpc):
        return {"model": name, "test_bpc": bpc, "test_bpc_spread": spread, "seeds": 2,
                "test_bpc_context": context_bpc, "context": 480, "options": {"num_slots": 32}}

    rows = [model("softmax", 2.000, 0.004, 1.980), model("abc-mlp, M=32", 2.120, 0.010, 2.100),
            model("abc-mlp, M=32, recency", 1.950, 0.010, 1.990)]
    line = next(text for text in findings(rows) if "Recency" in text)
    assert "abc-mlp, M=32, recency is ahead of abc-mlp, M=32 by 0.170, every seed ahead" in line
    assert "against softmax -0.050 at context 0, +0.010 at context 480." in line
    assert not any("Recency" in text for text in findings(rows[:2]))


def test_findings_set_table_8s_variants_against_abc_mlp_with_32_slots():
    def model(name, bpc):
        return {"model": name, "test_bpc": bpc, "seeds": 1, "options": {"num_slots": 32}}

    rows = [model("abc-mlp, M=32", 2.100), model("abc-mlp relu, M=32", 2.600),
            model("abc-window, n=64", 2.050), model("abc-cluster, M=32", 2.350)]
    lines = "\n".join(findings(rows))
    assert "abc-mlp relu, M=32 +0.500." in lines
    assert "abc-window, n=64 -0.050; abc-cluster, M=32 +0.250." in lines
    assert "Window and clustering" not in "\n".join(findings(rows[:2]))
