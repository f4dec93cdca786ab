"""`memattn experiment abc-warmstart --quick`: pretrain, convert, train on, compare."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_quick_lm_experiment

from research.experiments._lm_common import jobs_of
from research.experiments._runner import run_dir_of
from research.experiments.abc_warmstart import ON_STEPS, TRUNK, findings, models_of
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
    out, result = run_quick_lm_experiment("abc-warmstart", text_file, tmp_path)
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
    again = run_quick_lm_experiment("abc-warmstart", text_file, tmp_path)[1]
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
