"""`memattn experiment abc-mt --quick`: every model trains on a generated language pair, is
measured (BLEU, decoding profile) and lands in the tables."""

import json

import pytest

from research.experiments import get_experiment
from research.experiments._runner import SPEED_FILE
from research.experiments.abc_mt import (FIGURE_1, FULL, MODELS, QUICK_MODELS, findings, grid_cells, grid_note,
                                        jobs_of, quick_pairs)

pytest.importorskip("sacrebleu")


@pytest.mark.slow
def test_quick_run_writes_the_tables_and_the_decoding_figure(tmp_path):
    out = tmp_path / "mt"
    result = get_experiment("abc-mt").run(out, quick=True, overrides=[f"data.cache_dir={tmp_path}/cache"], jobs=1)
    models = {m["model"]: m for m in result["models"]}
    assert list(models) == ["softmax BASE", "abc-mlp 4/2", "abc-random 4/4"]
    assert models["softmax BASE"]["seeds"] == 2 and len(result["runs"]) == 4
    for m in models.values():
        assert 0 <= m["test_bleu"] <= 100 and m["test_ppl"] > 1 and m["test_sentences"] == 8
    # Figure 1: softmax's state grows with the output, ABC_MLP's stays the same size
    soft = [p["state_bytes"] for p in models["softmax BASE"]["decoding"]]
    mlp = [p["state_bytes"] for p in models["abc-mlp 4/2"]["decoding"]]
    assert soft[0] < soft[1] < soft[2] and mlp[0] == mlp[1] == mlp[2]
    assert models["abc-random 4/4"]["decoding"] == []
    # timings taken side by side once all were trained: the rows carry the pass's figures
    speeds = json.loads((out / SPEED_FILE).read_text())["speeds"]
    assert result["side_by_side"] and len(speeds) == 4
    assert models["abc-random 4/4"]["train_tokens_per_s"] == speeds["abc-random 4/4"]["train_tokens_per_s"] > 0
    assert models["abc-mlp 4/2"]["decoding"] == speeds["abc-mlp 4/2"]["decoding"]
    table = (out / "results.md").read_text()
    assert "measured once every model was trained" in table
    assert result["command"] in table and "| abc-random 4/4 | 1 |" in table and "In progress" not in table
    assert (out / "decoding.png").stat().st_size > 1000 and (out / "learning_curves.png").stat().st_size > 1000
    # run again: every model is reused, nothing retrained
    again = get_experiment("abc-mt").run(out, quick=True, overrides=[f"data.cache_dir={tmp_path}/cache"], jobs=1)
    assert again["runs"] == result["runs"]
    # a fresh clone keeps the rows, not the checkpoints: models trained one step stand in for
    # the timings, with the trained models' state sizes
    for path in (out / "runs").glob("*/*"):
        if path.name not in ("row.json", "settings.json"):
            path.unlink()
    (out / SPEED_FILE).unlink()
    cloned = get_experiment("abc-mt").run(out, quick=True, overrides=[f"data.cache_dir={tmp_path}/cache"], jobs=1)
    assert cloned["side_by_side"] and all(run["stand_in"] for run in cloned["runs"])
    profile = {m["model"]: m["decoding"] for m in cloned["models"]}["abc-mlp 4/2"]
    assert [p["state_bytes"] for p in profile] == mlp and all(p["seconds"] > 0 for p in profile)
    assert [r["test_bleu"] for r in cloned["runs"]] == [r["test_bleu"] for r in result["runs"]]


def test_the_full_experiment_plans_every_row_and_table_7s_grid():
    pairs = jobs_of(MODELS, FULL)
    names = [job.name for _, job in pairs]
    assert len(names) == len(set(names)) == 17
    assert sum(name.endswith("seed 1") for name in names) == 2
    sizes = {(c, k) for c in (8, 16, 32, 64) for k in (8, c)}
    fake = [{"model": m[0], "test_bleu": 0.0} for m in MODELS]
    assert set(grid_cells(fake)) == sizes
    assert set(FIGURE_1[False]["profiled"]) <= set(names)
    assert set(FIGURE_1[True]["profiled"]) <= {m[0] for m in QUICK_MODELS}
    exp_all = next(job for _, job in pairs if job.name == "MLP-exp-all 32/8")
    assert "model.encoder_attention.name=abc-mlp" in exp_all.settings
    assert exp_all.settings.index("model.encoder_attention.name=abc-mlp") > \
        exp_all.settings.index("model.encoder_attention.name=softmax")  # the row's own comes last


def test_quick_pairs_need_the_source_word_order(tmp_path):
    folder = quick_pairs(tmp_path)
    src, tgt = (folder / "train.tsv").read_text().splitlines()[0].split("\t")
    assert len(src.split()) == len(tgt.split())
    assert sorted((folder / p.name).name for p in folder.iterdir()) == ["test.tsv", "train.tsv", "val.tsv"]


def test_findings_set_table_8s_controls_and_mlp_exp_all_against_their_abc_mlp_row():
    bleu = {"softmax BASE": 20.0, "abc-mlp 32/32": 15.0, "abc-window 32/32": 13.5, "abc-cluster 32/32": 16.0,
            "abc-mlp 32/8": 14.0, "abc-mlp sigmoid 32/8": 12.25, "MLP-exp-all 32/8": 11.0}
    text = "\n".join(findings([{"model": n, "test_bleu": b, "attention": "", "decoding": []} for n, b in bleu.items()]))
    assert "abc-window 32/32 -1.50; abc-cluster 32/32 +1.00." in text
    assert "abc-mlp sigmoid 32/8 -1.75." in text and "relu 32/8" not in text
    assert "We measured 11.00 BLEU against 14.00 with the decoder's alone bounded and 20.00 for BASE." in text


def test_table_7s_note_names_the_cells_left_out_and_those_not_finished():
    planned = sorted(grid_cells([{"model": m[0]} for m in MODELS]))
    finished = {(8, 8): {}, (16, 8): {}, (16, 16): {}, (32, 8): {}, (32, 32): {}}
    note = " ".join(grid_note(planned, finished))
    assert "Cells left out for the CPU budget (cross/causal): 32/16, 64/16, 64/32." in note
    assert "Not finished yet: 64/8, 64/64." in note
    assert "finished" not in " ".join(grid_note(planned, {tuple(c): {} for c in planned}))
    assert grid_note([], {}) == []


def test_findings_read_table_7_along_both_axes():
    bleu = {"softmax BASE": 20.0, "abc-mlp 8/8": 11.0, "abc-mlp 16/8": 12.0, "abc-mlp 16/16": 12.5,
            "abc-mlp 32/8": 13.25, "abc-mlp 64/8": 15.0, "abc-mlp 64/64": 14.0}
    text = "\n".join(findings([{"model": n, "test_bleu": b, "attention": "", "decoding": []} for n, b in bleu.items()]))
    assert ("We measured causal 8 against causal = cross: cross 16: 12.00 against 12.50 (-0.50); "
            "cross 64: 15.00 against 14.00 (+1.00) BLEU.") in text  # 32/32 not finished: no cross 32 pair
    assert "at causal 8: cross 8: 11.00, cross 16: 12.00, cross 32: 13.25, cross 64: 15.00 BLEU, against 20.00 for BASE." in text
