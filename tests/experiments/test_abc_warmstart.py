"""`memattn experiment abc-warmstart --quick`: pretrain, convert, train on, compare."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import rolling, run_quick_lm_experiment

from research.experiments._conversion_study import HARNESS
from research.experiments._lm_common import jobs_of
from research.experiments._runner import run_dir_of
from research.experiments.abc_warmstart import ON_STEPS, TRUNK, findings, models_of
from research.harness import split_tasks
from memattn.errors import ConfigError
from memattn.masked import mask_tokens
from memattn.train import load_run_corpus, model_from_checkpoint

REPO = Path(__file__).resolve().parents[2]


@torch.no_grad()
def recount_masked(run_dir, windows):
    """(right guesses, masked positions) of the encoder saved in run_dir over the first `windows`
    windows of seq_len test characters, masked as BERT does with the run's seed, batch by batch."""
    model, cfg, _ = model_from_checkpoint(run_dir)
    model.eval()
    L, mask_id = cfg.train.seq_len, cfg.model.vocab_size - 1  # the last id is the mask token
    test = torch.as_tensor(load_run_corpus(cfg).test[:windows * L], dtype=torch.long).view(windows, L)
    g = torch.Generator().manual_seed(cfg.train.seed)
    right = count = 0
    for x in test.split(cfg.train.batch_size):
        inputs, chosen = mask_tokens(x, mask_id, mask_id, g)
        guesses = model(inputs, mlm=True).argmax(-1)
        right += int((guesses[chosen] == x[chosen]).sum())
        count += int(chosen.sum())
    return right, count


@pytest.mark.slow
def test_quick_run_pretrains_then_starts_every_conversion_from_it(text_file, tmp_path):
    out, result = run_quick_lm_experiment("abc-warmstart", text_file, tmp_path, "parts=[paper,mlm]")
    names = [m["model"] for m in result["models"]]
    assert names == ["softmax, pretrained", "softmax, trained on", "abc-mlp, M=4, from softmax",
                     "abc-mlp, M=4, from scratch", "abc-random, M=8, from softmax", "abc-random, M=8, from scratch",
                     "abc-mlp, M=4, from softmax, transfer", "abc-mlp, M=4, from softmax, transfer, distilled"]
    by = {m["model"]: m for m in result["models"]}
    assert by["softmax, pretrained"]["steps"] == 12 and by["abc-mlp, M=4, from softmax"]["steps"] == 6
    pretrained = out / "runs" / "softmax-pretrained"
    settings_m4 = json.loads((out / "runs" / "abc-mlp-m4-from-softmax" / "settings.json").read_text())
    for name in ("softmax-trained-on", "abc-mlp-m4-from-softmax"):
        settings = json.loads((out / "runs" / name / "settings.json").read_text())
        assert f"train.init_from={pretrained}" in settings
    scratch = json.loads((out / "runs" / "abc-mlp-m4-from-scratch" / "settings.json").read_text())
    assert not any(s.startswith("train.init_from") for s in scratch)
    # the recipe's rows: attention transfer (logged as such), then the same steps end to end
    recipe = json.loads((out / "runs" / "abc-mlp-m4-from-softmax-transfer-distilled" / "settings.json").read_text())
    assert recipe == [*settings_m4[:-1], "train.transfer_steps=4", "train.transfer_lr=0.03",
                      "train.distill_weight=1.0", settings_m4[-1]]
    log = [json.loads(line) for line in
           (out / "runs" / "abc-mlp-m4-from-softmax-transfer" / "log.jsonl").read_text().splitlines()]
    assert [r["transfer_step"] for r in log if r.get("phase") == "transfer"] == [3, 4]
    assert by["abc-mlp, M=4, from softmax, transfer"]["steps"] == 6
    table = (out / "results.md").read_text()
    assert "| abc-random, M=8, from scratch |" in table and "The paper found / we measured" in table
    assert "| abc-mlp, M=4, from softmax, transfer, distilled |" in table and "Attention transfer first" in table
    assert result["side_by_side"] and "measured once every model was trained, in one process on one thread, 3 rounds" in table

    # the masked-LM half: encoders, started from a pretrained softmax encoder or from scratch
    masked = json.loads((out / "mlm" / "results.json").read_text())
    assert [m["model"] for m in masked["models"]] == names[:6] and masked["command"] == result["command"]
    by_masked = {m["model"]: m for m in masked["models"]}
    for name, slug in (("softmax, pretrained", "softmax-pretrained"),
                       ("abc-mlp, M=4, from softmax", "abc-mlp-m4-from-softmax")):
        right, count = recount_masked(out / "mlm" / "runs" / slug, windows=8)
        assert by_masked[name]["test_tokens"] == count > 0
        assert by_masked[name]["test_accuracy"] == pytest.approx(right / count)
    encoder = json.loads((out / "mlm" / "runs" / "abc-mlp-m4-from-softmax" / "settings.json").read_text())
    assert "task=mlm" in encoder and f"train.init_from={out / 'mlm' / 'runs' / 'softmax-pretrained'}" in encoder
    masked_table = (out / "mlm" / "results.md").read_text()
    assert "masked accuracy" in masked_table and "points against softmax, trained on" in masked_table
    assert (out / "mlm" / "learning_curves.png").exists()

    # a fresh clone keeps only the rows: a conversion left unfinished there needs the pretrained
    # weights, so the pretrained model is trained again (to the same figures) and the rest reused
    saved = (pretrained / "row.json").read_text()
    for path in (out / "runs").glob("*/*"):
        if path.name not in ("row.json", "settings.json"):
            path.unlink()
    (out / "runs" / "abc-mlp-m4-from-softmax" / "row.json").unlink()
    again = run_quick_lm_experiment("abc-warmstart", text_file, tmp_path, "parts=[paper,mlm]")[1]
    assert (pretrained / "checkpoint.safetensors").exists()
    before, after = json.loads(saved), json.loads((pretrained / "row.json").read_text())
    assert {k: v for k, v in after.items() if k.startswith(("val_", "test_"))} == \
        {k: v for k, v in before.items() if k.startswith(("val_", "test_"))}
    assert not (out / "runs" / "softmax-trained-on" / "checkpoint.safetensors").exists()  # reused
    assert [m["model"] for m in again["models"]] == names
    assert json.loads((out / "runs" / "abc-mlp-m4-from-softmax" / "settings.json").read_text()) == settings_m4


@pytest.mark.parametrize("half", ["", "mlm"])
def test_the_committed_run_folders_are_the_jobs_the_experiment_makes(half):
    """Rows added to the experiment leave the committed ones as they were: each committed run
    folder's settings are those of the job of its name, so running it again reuses them."""
    out = Path("results/abc-warmstart") / half  # the settings name folders relative to the repository
    shared = [*(["task=mlm"] if half else []), *TRUNK[False], f"train.steps={ON_STEPS[False]}"]
    (_, first), = jobs_of(models_of(False, Path())[:1], shared)
    jobs = {job.slug: job for _, job in jobs_of(models_of(False, run_dir_of(out, first), recipe=not half), shared)}
    committed = sorted((REPO / out / "runs").glob("*/settings.json"))
    assert len(committed) == 12
    for path in committed:
        assert json.loads(path.read_text()) == list(jobs[path.parent.name].settings), path
    assert not half or not any("transfer" in slug for slug in jobs)


def test_findings_compare_each_start():
    def m(name, bpc):
        return {"model": name, "test_bpc": bpc, "test_bpc_spread": 0.0, "seeds": 1}
    by = {m_["model"]: m_ for m_ in (m("softmax, trained on", 2.0), m("abc-mlp, M=32, from softmax", 2.1),
                                     m("abc-mlp, M=32, from scratch", 2.5))}
    text = "\n".join(findings(by))
    assert "abc-mlp, M=32, from softmax is ahead of abc-mlp, M=32, from scratch by 0.400" in text
    assert "abc-mlp, M=32, from softmax +0.100 against softmax trained on" in text
    by["abc-mlp, M=32, from softmax, transfer"] = m("abc-mlp, M=32, from softmax, transfer", 2.05)
    text = "\n".join(findings(by))
    assert "Attention transfer first" in text and "abc-mlp, M=32, from softmax, transfer -0.050" in text
    assert "against softmax trained on: abc-mlp, M=32, from softmax, transfer +0.050" in text


def study(text_file, tmp_path, out, *settings):
    """`memattn experiment abc-warmstart --quick parts=[conversion] ...`: the conversion table."""
    from memattn.cli import main

    pytest.importorskip("lm_eval", reason="the conversion table scores each model through lm-evaluation-harness")
    data = ["data.corpus=text", f"data.path={text_file}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(["experiment", "abc-warmstart", *data, "parts=[conversion]", *settings, "--quick",
                 "--out-dir", str(out)]) == 0
    return json.loads((out / "conversion" / "results.json").read_text())


@pytest.mark.slow
def test_conversion_study_trains_its_grid_in_parts_from_one_teacher(text_file, tmp_path):
    from memattn.evaluate import as_tensor, evaluate_by_length

    out = tmp_path / "results"
    first = study(text_file, tmp_path, out, "students=[gsa,hybrid-window]", "recipes=[copy,distill]", "budgets=[33]",
                  "harness=false")
    runs = out / "conversion" / "runs"
    teacher = runs / "softmax-teacher"
    assert [m["model"] for m in first["models"]] == ["gsa, copy, 33 pct", "gsa, distill, 33 pct",
                                                     "hybrid-window, copy, 33 pct", "hybrid-window, distill, 33 pct"]
    # the teacher: softmax with abc-lm's quick trunk, 100 steps of 4 x 32 tokens; 33 % of its
    # 12,800 tokens is 33 steps, of which a fifth (7) transfer steps in the distill recipe
    settings = {m["model"]: json.loads((runs / slug / "settings.json").read_text()) for m, slug in
                ((m, m["model"].replace(", ", "-").replace(" ", "-")) for m in first["models"])}
    assert "attention=softmax" in json.loads((teacher / "settings.json").read_text())
    for name, s in settings.items():
        assert f"train.init_from={teacher}" in s and s[-1] == "train.seed=0"
    copy, distill = settings["gsa, copy, 33 pct"], settings["gsa, distill, 33 pct"]
    assert "train.steps=33" in copy and not any("transfer" in x or "distill" in x for x in copy)
    assert {"train.steps=26", "train.transfer_steps=7", "train.distill_weight=1.0"} <= set(distill)
    assert {"model.attention_layers.1.name=abc-window", "model.attention_layers.1.window=8"} <= \
        set(settings["hybrid-window, copy, 33 pct"])
    log = [json.loads(line) for line in (runs / "gsa-distill-33-pct" / "log.jsonl").read_text().splitlines()]
    assert [r["transfer_step"] for r in log if r.get("phase") == "transfer"][-1] == 7
    assert any("distill" in r for r in log)

    # a row's figures past the training length are evaluate_by_length's on its trained model
    model, cfg, _ = model_from_checkpoint(runs / "hybrid-window-copy-33-pct")
    L = cfg.train.seq_len
    direct = evaluate_by_length(model, as_tensor(load_run_corpus(cfg).test), lengths=[L, 4 * L, 16 * L],
                                train_len=L, streams=8, windows=True)
    ends = {b["end"]: b for b in direct["buckets"]}
    row = {m["model"]: m for m in first["models"]}["hybrid-window, copy, 33 pct"]["test_bpc_by_length"]
    for f in (1, 16):
        assert row[f"{f}x"]["bpc"] == pytest.approx(ends[f * L]["bpc"], rel=1e-9) and row[f"{f}x"]["read"] == "stream"
    assert row["16x"]["state_bytes"] == model.init_cache(1).nbytes()
    table = (out / "conversion" / "results.md").read_text()
    assert "| hybrid-window | distill | — | — | — | " in table and "**4 of the grid's 72 runs" in table
    assert (out / "conversion" / "command.txt").read_text().startswith("memattn experiment abc-warmstart")

    # another part: the runs done are reused (the teacher too), the table holds both parts
    stamp = (runs / "gsa-copy-33-pct" / "row.json").stat().st_mtime_ns, (teacher / "row.json").stat().st_mtime_ns
    second = study(text_file, tmp_path, out, "students=[gsa]", "recipes=[transfer]", "budgets=[10]", "harness=false")
    assert [m["model"] for m in second["models"]] == ["gsa, copy, 33 pct", "gsa, transfer, 10 pct",
                                                     "gsa, distill, 33 pct", "hybrid-window, copy, 33 pct",
                                                     "hybrid-window, distill, 33 pct"]
    assert stamp == ((runs / "gsa-copy-33-pct" / "row.json").stat().st_mtime_ns, (teacher / "row.json").stat().st_mtime_ns)

    # a teacher given as a finished run folder: not trained again, measured once, students start from
    # it; with the harness (the default) every row has lm-evaluation-harness's scores of its tasks
    given = study(text_file, tmp_path, tmp_path / "given", f"teacher={teacher}", "students=[gsa]", "recipes=[copy]",
                  "budgets=[10]")
    assert not (tmp_path / "given" / "conversion" / "runs" / "softmax-teacher").exists()
    assert given["teacher"]["path"] == str(teacher) and given["teacher"]["test_bpc"] == first["teacher"]["test_bpc"]
    (gsa,) = given["runs"]
    sizes = HARNESS[True]
    for row in (given["teacher"], gsa):
        assert {k: row["harness"][k] for k in sizes} == sizes and 0 <= row["harness"]["choice_acc"] <= 1
    # the teacher's bits per byte: its test documents read in windows of L (lm-eval's rolling windows)
    net, cfg, _ = model_from_checkpoint(teacher)
    corpus = load_run_corpus(cfg)
    docs, _, _ = split_tasks(corpus.vocab.decode(corpus.test), **sizes)
    with torch.no_grad():
        ll = sum(rolling(net, corpus.vocab.encode(d).tolist(), int(corpus.vocab.encode("\n")[0]), cfg.train.seq_len)
                 for d in docs)
    assert given["teacher"]["harness"]["bits_per_byte"] == pytest.approx(
        -ll / sum(len(d.encode()) for d in docs) / math.log(2), abs=1e-6)
    table = (tmp_path / "given" / "conversion" / "results.md").read_text()
    h = gsa["harness"]
    assert "## Through lm-evaluation-harness" in table and (
        f"| gsa | copy | — | — | {h['bits_per_byte']:.3f} / {100 * h['choice_acc']:.0f} % / {100 * h['word_exact']:.0f} % | — |"
        in table)
    assert f"train.init_from={teacher}" in gsa["settings"] and "train.steps=10" in gsa["settings"]
    with pytest.raises(ConfigError, match=r"teacher: .* has 'gsa' attention; the teacher is a softmax model"):
        from research.experiments._conversion_study import given_teacher, trunk

        given_teacher(runs / "gsa-copy-33-pct", trunk(True, []))


@pytest.mark.parametrize(("setting", "message"), [
    ("students=[gsa,mamba]", r"students: expected some of abc-mlp, abc-mlp-forget, gsa, .*got \['gsa', 'mamba'\]"),
    ("recipes=[lora]", r"recipes: expected some of copy, transfer, distill"),
    ("budgets=[0,5]", r"budgets: expected percentages of the teacher's tokens in \(0, 100\]"),
    ("parts=[paper,study]", r"parts: expected some of paper, mlm, conversion"),
    ("budgets=5", r"budgets: expected a list of float"),
])
def test_the_study_refuses_what_it_does_not_have(setting, message, tmp_path, capsys):
    from memattn.cli import main

    assert main(["experiment", "abc-warmstart", setting, "--quick", "--out-dir", str(tmp_path / "out")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_a_given_teacher_must_be_a_finished_run_of_the_students_settings(text_file, tmp_path):
    from memattn.config import load_config
    from memattn.train import train
    from research.experiments._conversion_study import given_teacher, trunk

    data = ["data.corpus=text", f"data.path={text_file}", f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(ConfigError, match=r"teacher: .*nowhere holds no run to start from"):
        given_teacher(tmp_path / "nowhere", trunk(True, data))
    cfg = load_config(None, [*trunk(True, data), "train.steps=2", "model.d_model=16", f"train.out_dir={tmp_path / 't'}"])
    train(cfg, progress=False)
    with pytest.raises(ConfigError, match=r"teacher: .* was trained with model.d_model=16, the students here with 32"):
        given_teacher(tmp_path / "t", trunk(True, [*data, "train.steps=2"]))
