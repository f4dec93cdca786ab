"""`memattn experiment persistent-lm --quick`: every model trains, parameters match, the
long-context model trains on segments and is tested as a stream, files are written."""

import json
import math

import pytest
from conftest import run_quick_lm_experiment

from memattn.analysis import learned_spans
from research.experiments import _lm_common, get_experiment
from research.experiments._runner import CHECKPOINT_FILE, SPEED_ROUNDS, STAND_IN, Job
from memattn.train import model_from_checkpoint


@pytest.mark.slow
def test_quick_run_writes_the_table_curves_and_command(text_file, tmp_path, monkeypatch):
    out, result = run_quick_lm_experiment("persistent-lm", text_file, tmp_path)
    models = {m["model"]: m for m in result["models"]}
    assert list(models) == ["transformer", "all-attn", "all-attn, 3 layers", "attn-split", "head-split",
                            "single-head", "ff-attn", "all-attn, N=0", "all-attn, long context"]
    assert models["transformer"]["seeds"] == 2 and len(result["runs"]) == 10
    _, cfg, _ = model_from_checkpoint(out / "runs" / "all-attn")
    uniform = math.log2(cfg.model.vocab_size)
    target = models["transformer"]["params"]
    for name, m in models.items():
        # trained its whole budget (a duration is no proof: a quick run can take under 0.05 s)
        assert m["test_bpc"] < uniform and m["steps"] == 12, name
        if name != "all-attn, N=0":  # N is sized to the transformer's parameter count
            assert abs(m["params"] - target) <= m["params"] * 0.01, name
    assert models["all-attn, N=0"]["params"] < target and models["all-attn, N=0"]["options"]["n_persistent"] == 0
    # the long-context model trained on segments with learned spans, tested as streams
    _, long_cfg, _ = model_from_checkpoint(out / "runs" / "all-attn-long-context")
    assert long_cfg.train.segments and long_cfg.model.attention.options["adaptive_span"]
    assert models["all-attn, long context"]["context"] == -1 and models["all-attn"]["context"] == 24
    # its learned spans are the checkpoint's, per layer and head, in the row and the findings
    long_model, _, _ = model_from_checkpoint(out / "runs" / "all-attn-long-context")
    spans = [block.attn.spans() for block in long_model.blocks]
    assert [pytest.approx(layer) for layer in spans] == models["all-attn, long context"]["spans"]
    assert "spans" not in models["all-attn"]
    assert result["command"].startswith("memattn experiment persistent-lm data.corpus=text")
    table = (out / "results.md").read_text()
    assert result["command"] in table and "| all-attn, N=0 | 1 | 0 |" in table and "(stream)" in table
    assert "The paper found / we measured" in table
    assert f"layer 1: {sum(spans[0]) / len(spans[0]):.0f} (largest {max(spans[0]):.0f})" in table
    assert (out / "learning_curves.png").stat().st_size > 1000
    assert len(list((out / "logs").glob("*.jsonl"))) == 10
    # in the paper's proportions: 1.5 times the trunk's 2 layers, fewer vectors per layer
    _, deep_cfg, _ = model_from_checkpoint(out / "runs" / "all-attn-3-layers")
    assert deep_cfg.model.n_layers == 3 and cfg.model.n_layers == 2
    assert 0 < models["all-attn, 3 layers"]["options"]["n_persistent"] < models["all-attn"]["options"]["n_persistent"]
    assert "**At the paper's depth.**" in table
    assert "rows copied" not in table
    # a row trained by another experiment with the same settings (abc-lm's softmax) is reused
    # where it is put, and the table says where it came from
    row_file = out / "runs" / "transformer" / "row.json"
    row = json.loads(row_file.read_text())
    row_file.write_text(json.dumps(dict(row, copied_from="results/abc-lm/runs/softmax")))
    _, again = run_quick_lm_experiment("persistent-lm", text_file, tmp_path)
    (reused,) = [run for run in again["runs"] if run["model"] == "transformer"]
    assert reused["test_bpc"] == row["test_bpc"] and reused["copied_from"]
    assert ("rows copied: transformer from `results/abc-lm/runs/softmax`"
            in (out / "results.md").read_text())
    # a fresh clone keeps the rows, not the checkpoints: the long-context model stands in for
    # the timings trained one step, with the spans the trained model learned (how far it reads)
    run_dir = out / "runs" / "all-attn-long-context"
    (run_dir / CHECKPOINT_FILE).unlink()
    job = Job("all-attn, long context", tuple(json.loads((run_dir / "settings.json").read_text())))
    timed = []
    monkeypatch.setattr(_lm_common, "train_speed", lambda model, cfg, ids: timed.append(learned_spans(model)) or 1.0)
    monkeypatch.setattr(_lm_common, "decode_speed", lambda model, prompt, tokens: 1.0)
    figures = _lm_common.side_by_side_speeds(out, [job], decode_prompt=8, decode_tokens=2, stand_ins=True)
    assert figures[job.name]["stand_in"] and len(timed) == SPEED_ROUNDS
    assert timed[0] == [pytest.approx(layer) for layer in models["all-attn, long context"]["spans"]]
    untouched, _, _ = model_from_checkpoint(run_dir / STAND_IN)
    assert learned_spans(untouched) != timed[0]


def test_is_listed_with_a_description():
    module = get_experiment("persistent-lm")
    assert "persistent" in module.DESCRIPTION

