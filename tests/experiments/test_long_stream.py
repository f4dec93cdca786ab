"""`memattn experiment long-stream --quick`: every model trains, each is read past its training
length through `evaluate_by_length` (bounded ones streamed, softmax as a window), the table
says how each was read and compares it with the same text read in windows of L."""

import pytest
from conftest import run_quick_lm_experiment

from memattn.evaluate import as_tensor, evaluate_by_length
from research.experiments._lm_common import LENGTH_FACTORS
from research.experiments._runner import Job
from memattn.train import load_run_corpus, model_from_checkpoint


@pytest.fixture
def long_text_file(tmp_path):
    """A corpus whose test split holds documents of 64 training lengths (64 x 32 tokens)."""
    import random

    rng = random.Random(1)
    words = ["the", "king", "queen", "doth", "speak", "thou", "art", "my", "lord", "good", "night"]
    path = tmp_path / "long.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + "."
                              for _ in range(4000)) + "\n")
    return path


@pytest.mark.slow
def test_quick_run_reads_every_model_past_its_training_length(long_text_file, tmp_path):
    out, result = run_quick_lm_experiment("long-stream", long_text_file, tmp_path)
    models = {m["model"]: m for m in result["models"]}
    assert list(models) == ["softmax", "abc-mlp, M=4, forget", "abc-mlp, M=4, recency", "abc-window, n=8",
                            "abc-mlp, M=4"]
    # the softmax row's figures are evaluate_by_length's on its trained model, by position bucket
    model, cfg, _ = model_from_checkpoint(out / "runs" / "softmax")
    corpus = load_run_corpus(cfg)
    L = cfg.train.seq_len
    direct = evaluate_by_length(model, as_tensor(corpus.test), lengths=[f * L for f in LENGTH_FACTORS],
                                train_len=L, streams=8, windows=True)
    ends = {b["end"]: b for b in direct["buckets"]}
    for f in LENGTH_FACTORS:
        row = models["softmax"]["test_bpc_by_length"][f"{f}x"]
        assert row["bpc"] == pytest.approx(ends[f * L]["bpc"], rel=1e-9) and row["read"] == "window"
        assert row["bpc_windows"] == pytest.approx(ends[f * L]["bpc_windows"], rel=1e-9)
    # bounded models stream with one state size, one stream's
    for name in ("abc-mlp, M=4, forget", "abc-window, n=8"):
        figures = models[name]["test_bpc_by_length"]
        (run,) = [r for r in result["runs"] if r["model"] == name]
        bounded, _, _ = model_from_checkpoint(out / "runs" / Job(name, tuple(run["settings"])).slug)
        assert {f["read"] for f in figures.values()} == {"stream"}
        assert figures["64x"]["state_bytes"] == figures["1x"]["state_bytes"] == bounded.init_cache(1).nbytes()
    table = (out / "results.md").read_text()
    assert "## Past the training length" in table and "| softmax | 0 |" in table
    assert "## We measured" in table and (out / "by_length.png").stat().st_size > 1000
