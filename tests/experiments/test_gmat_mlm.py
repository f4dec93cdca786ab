"""research.experiments.gmat_mlm: task=compression on the training loop (its loss, exact
resume, what it refuses) and the encoders' jobs as task=mlm."""

from __future__ import annotations

import json

import pytest

from memattn.config import load_config
from memattn.errors import ConfigError
from memattn.tasks import EvalOptions, task_class
from memattn.train import model_from_checkpoint, train
from memattn.typed import parse_settings
from research.experiments.gmat_mlm import QUICK, TASK, Settings, jobs_of

from conftest import train_crashing_at


def quick_jobs(text_file, tmp_path, *overrides):
    data = ["corpus=text", f"path={text_file}", f"cache_dir={tmp_path / 'cache'}"]
    return jobs_of(parse_settings(Settings, [*data, *overrides], QUICK, name="gmat-mlm"))


def config(tmp_path, job, *extra):
    return load_config(None, [*job.settings, f"train.out_dir={tmp_path}", *extra])


def test_the_encoders_are_masked_lms_and_the_compressor_its_own_task(text_file, tmp_path):
    encoder, memory, compressor = quick_jobs(text_file, tmp_path)
    assert [job.name for job in (encoder, memory, compressor)] == ["chunked, M=0", "chunked, M=16", "compressed, M=16"]
    assert [config(tmp_path, job).task for job in (encoder, memory, compressor)] == ["mlm", "mlm", TASK]
    cfg = config(tmp_path, compressor)
    assert (cfg.task_settings.n_compress, cfg.task_settings.n_decompress, cfg.model.n_layers) == (1, 1, 3)


def test_an_interrupted_compressor_run_resumes_exactly(text_file, tmp_path):
    job = quick_jobs(text_file, tmp_path, "steps=6", "compressor_warmup=2")[-1]
    extra = ("train.log_every=1", "train.save_every=2")
    train(config(tmp_path / "whole", job, *extra), progress=False)
    cut = config(tmp_path / "cut", job, *extra)
    train_crashing_at(cut, 3)  # after the checkpoint of step 2
    train(cut, resume=True, progress=False)
    logs = [[json.loads(line) for line in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("whole", "cut")]
    assert [(r["step"], r["loss"], r.get("val_perplexity")) for r in logs[0]] == \
        [(r["step"], r["loss"], r.get("val_perplexity")) for r in logs[1]]
    assert {"val_error_rate", "val_unmasked_error_rate"} <= set(logs[0][-1])
    model, cfg, vocab = model_from_checkpoint(tmp_path / "cut")
    with pytest.raises(ConfigError, match="a task=compression run; `memattn experiment gmat-mlm` measures it"):
        task_class(cfg.task).evaluate_checkpoint(model, cfg, vocab, EvalOptions(str(tmp_path / "cut")))


@pytest.mark.parametrize("extra, message", [
    (["task_options.n_decompress=3"], r"n_compress, n_decompress: 1 \+ 3 layers exceed model.n_layers=3"),
    (["train.distill_weight=1", "train.init_from=x"], "task=compression: train.segments and train.distill_weight"),
    (["train.label_smoothing=0.1"], "train.label_smoothing"),
    (["task_options.n_compress=0"], "n_compress: expected a positive value, got 0"),
])
def test_the_compression_task_refuses_what_it_cannot_train(text_file, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, quick_jobs(text_file, tmp_path)[-1], *extra)


def test_a_compressor_without_memory_tokens_is_refused_when_built(text_file, tmp_path):
    cfg = config(tmp_path, quick_jobs(text_file, tmp_path)[-1], "attention.num_memory=0")
    with pytest.raises(ConfigError, match="the compressor keeps only memory rows"):
        train(cfg, progress=False)
