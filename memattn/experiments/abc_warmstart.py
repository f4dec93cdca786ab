"""Warm-starting bounded memories from a pretrained softmax model (Peng et al. 2022, §5.3,
small): pretrain softmax attention, convert it to ABC_MLP (n = 32 and 64), Linformer,
random control and gated linear attention, and train each on for K steps; compare with the
same mechanisms trained from scratch for the same K steps and with softmax trained on for
K steps.

A conversion is `train.init_from` (memattn.warmstart): the projections, embeddings, norms
and feed-forward layers are the pretrained model's, only the mechanism's own parameters
(ABC's φ, the gate) start new. Every model has the trunk of `abc-lm`; the causal LM only
(the paper's masked-LM setting is not run here).

Each model is a run folder under out_dir/runs/: the pretrained model trains first (the
others start from it), then the rest, `--jobs N` at a time; running the experiment again
reuses finished models and resumes unfinished ones. Written to out_dir: results.json,
results.md, learning_curves.png, logs/.
"""

from __future__ import annotations

import functools
from pathlib import Path

from memattn.experiments._lm_common import (Model, bpc_cell, compare, jobs_of, measure, progress_note,
                                            run_lm_experiment)
from memattn.experiments._runner import run_dir_of, run_jobs
from memattn.experiments.abc_lm import FULL as ABC_LM_FULL
from memattn.experiments.abc_lm import MEASURE
from memattn.experiments.abc_lm import QUICK as ABC_LM_QUICK

DESCRIPTION = ("warm start (Peng et al. 2022 §5.3): a pretrained softmax LM converted to ABC_MLP, "
               "Linformer, random control and gated linear attention and trained on, against the "
               "same trained from scratch")

PRETRAIN_STEPS = {False: 1500, True: 12}  # the pretrained softmax model: abc-lm's budget
ON_STEPS = {False: 500, True: 6}  # K: every other model
PRETRAINED = "softmax, pretrained"
CONVERTED = {
    False: [("abc-mlp, M=32", "abc-mlp", {"num_slots": 32}), ("abc-mlp, M=64", "abc-mlp", {"num_slots": 64}),
            ("abc-linformer, M=64", "abc-linformer", {"num_slots": 64}),
            ("abc-random, M=64", "abc-random", {"num_slots": 64}), ("gated-linear", "gated-linear", {})],
    True: [("abc-mlp, M=4", "abc-mlp", {"num_slots": 4}), ("abc-random, M=8", "abc-random", {"num_slots": 8})],
}


def models_of(quick: bool, source: Path) -> list[Model]:
    """The pretrained model, softmax trained on, and each mechanism from softmax and from scratch."""
    start = {"train.init_from": str(source)}
    models: list[Model] = [(PRETRAINED, "softmax", {"train.steps": PRETRAIN_STEPS[quick]}, 1),
                           ("softmax, trained on", "softmax", start, 1)]
    for name, mechanism, options in CONVERTED[quick]:
        models += [(f"{name}, from softmax", mechanism, {**options, **start}, 1),
                   (f"{name}, from scratch", mechanism, options, 1)]
    return models


def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict:
    out_dir = Path(out_dir)
    shared = [*(ABC_LM_QUICK if quick else ABC_LM_FULL), f"train.steps={ON_STEPS[quick]}", *overrides]
    measure_fn = functools.partial(measure, **MEASURE[quick])
    first = models_of(quick, Path())[:1]
    (_, pretrain), = jobs_of(first, shared)
    run_jobs(out_dir, [pretrain], measure_fn, workers=1, label="abc-warmstart (pretraining softmax)")
    models = models_of(quick, run_dir_of(out_dir, pretrain))
    return run_lm_experiment(out_dir, "abc-warmstart", models, shared, quick=quick, overrides=overrides,
                             jobs=jobs, measure_kw=MEASURE[quick], markdown=markdown)


def markdown(result: dict) -> str:
    models = result["models"]
    by = {m["model"]: m for m in models}
    base = by.get(PRETRAINED, models[0])
    setting = dict(item.split("=", 1) for item in result["config"])
    batch, seq = (int(setting[f"train.{k}"]) for k in ("batch_size", "seq_len"))
    lines = [
        "# Warm-starting bounded memories from a pretrained softmax model",
        "",
        *progress_note(result),
        "Peng et al. 2022, *ABC: Attention with Bounded-memory Control*, §5.3 small, on a character "
        "LM: a pretrained softmax model converted (`train.init_from`: every shared tensor copied, "
        "the mechanism's own parameters new) and trained on, against the same mechanism trained "
        "from scratch for as many steps.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Budget: the pretrained softmax model {base['steps']:,} steps; every other model "
        f"{int(setting['train.steps']):,} steps of {batch} x {seq} characters. Test bits per character "
        f"at context 0 and at context {base['context']}, as in abc-lm.",
        "",
        f"| model | parameters | steps | test bpc, context 0 | vs pretrained | test bpc, context {base['context']} "
        "| val bpc | train tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        lines.append(f"| {m['model']} | {m['params']:,} | {m['steps']:,} | {bpc_cell(m, 'test_bpc')} | "
                     f"{m['test_bpc'] - base['test_bpc']:+.3f} | {bpc_cell(m, 'test_bpc_context')} | "
                     f"{m['val_bpc']:.3f} | {m['train_tokens_per_s']:,.0f} |")
    lines += ["", *findings(by), "",
              "Setup (shared `key=value` settings): `" + " ".join(result["config"]) + "`", "",
              "Figures: `learning_curves.png`; logs under `logs/`, every run's figures in `results.json`.", ""]
    return "\n".join(lines)


def findings(by: dict[str, dict]) -> list[str]:
    """The paper's findings next to what this table measured (test bits per character)."""
    pairs = [(by[f"{n}, from softmax"], by[f"{n}, from scratch"]) for n in
             sorted({k.rsplit(", from ", 1)[0] for k in by if ", from " in k})
             if f"{n}, from softmax" in by and f"{n}, from scratch" in by]
    lines = ["## The paper found / we measured", ""]
    if pairs:
        lines.append("- **A pretrained model is a better start.** The paper found ABC_MLP started from a "
                     "pretrained softmax model and trained on well ahead of training it from scratch. "
                     "We measured: " + "; ".join(compare(a, b) for a, b in pairs) + ".")
    on = by.get("softmax, trained on")
    mlp = [by[k] for k in by if k.startswith("abc-mlp") and k.endswith("from softmax")]
    if on and mlp:
        lines.append("- **Close to the model it came from.** The paper found converted ABC_MLP close to "
                     "the softmax model trained on alike. We measured: "
                     + "; ".join(f"{m['model']} {m['test_bpc'] - on['test_bpc']:+.3f}" for m in mlp)
                     + " against softmax trained on.")
    return lines if len(lines) > 2 else []
