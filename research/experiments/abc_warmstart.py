"""Warm-starting bounded memories from a pretrained softmax model (Peng et al. 2022, §5.3,
small): pretrain softmax attention, convert it to ABC_MLP (n = 32 and 64), Linformer,
random control and gated linear attention, and train each on for K steps; compare with the
same mechanisms trained from scratch for the same K steps and with softmax trained on for
K steps.

A conversion is `train.init_from` (memattn.warmstart): the projections, embeddings, norms
and feed-forward layers are the pretrained model's, only the mechanism's own parameters
(ABC's φ, the gate) start new. Every model has the trunk of `abc-lm`. Done twice: with a
causal LM (test bits per character), and with a masked-LM encoder (task=mlm: test accuracy
at the masked positions; the paper's setting, which fine-tunes a pretrained RoBERTa).

The causal LM also has rows of the conversion recipe of LoLCATs and Liger (not in the paper):
attention transfer first (`train.transfer_steps`: the mechanism's own parameters alone trained
so that each layer reproduces the frozen softmax layer's output, memattn.transfer), then the
same K steps end to end, plain or with distillation from the pretrained model
(`train.distill_weight`).

Third, the conversion study (`_conversion_study`, written to out_dir/conversion): a softmax
teacher at abc-lm's budget (or a finished run folder given as `teacher=PATH`) converted to
ABC_MLP with the paper's write rule, the write rules that stream (ABC_MLP with forget rates,
gsa), gated linear attention and hybrids (one layer in four kept a window or softmax), by
recipe (weight copy, + attention transfer, + distillation) and budget (2, 5, 10 and 33 % of
the teacher's training tokens), each row measured at the training length and streamed to 16x,
and scored by lm-evaluation-harness from its exported Hugging Face folder.

The experiment's own settings, key=value among the run settings (a list in brackets):
`parts=[paper,mlm,conversion]` (which of the three to run; default all), and for the
conversion study `students=[...]`, `recipes=[...]`, `budgets=[...]` (which part of its grid to
train now; its table holds every finished run of the grid), `teacher=PATH` and `harness=false`
(no lm-evaluation-harness scores).

Each model is a run folder under out_dir/runs/ (out_dir/mlm/runs/, out_dir/conversion/runs/):
the pretrained model trains first (the others start from it), then the rest, `--jobs N` at a
time; running the experiment again reuses finished models and resumes unfinished ones.
Written to out_dir, out_dir/mlm and out_dir/conversion: results.json, results.md,
learning_curves.png, logs/ (and command.txt from the command line).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from memattn.errors import ConfigError
from memattn.typed import parse_settings
from research.experiments import _conversion_study as conversion
from research.experiments._common import command_of, compare, setup_line
from research.experiments._lm_common import (Model, bpc_cell, jobs_of, measure, progress_note,
                                            run_lm_experiment, speed_note)
from research.experiments._runner import finished_row, run_dir_of, run_experiment, source_run
from research.experiments.abc_lm import FULL as ABC_LM_FULL
from research.experiments.abc_lm import MEASURE
from research.experiments.abc_lm import QUICK as ABC_LM_QUICK

DESCRIPTION = ("warm start (Peng et al. 2022 §5.3): a pretrained softmax LM converted to ABC_MLP, "
               "Linformer, random control and gated linear attention and trained on, against the "
               "same trained from scratch; and a conversion study by student, recipe (weight copy, "
               "attention transfer, distillation) and budget")

PRETRAIN_STEPS = {False: 1500, True: 12}  # the pretrained softmax model: abc-lm's first budget
ON_STEPS = {False: 500, True: 6}  # K: every other model
# abc-lm's trunk with the budget it had when this experiment ran (abc-lm's own runs have since
# moved to 6,000 steps): the committed run folders were made with these settings
TRUNK = {quick: [f"train.steps={PRETRAIN_STEPS[quick]}" if s.startswith("train.steps=") else s
                 for s in (ABC_LM_QUICK if quick else ABC_LM_FULL)] for quick in (False, True)}
PRETRAINED = "softmax, pretrained"
CONVERTED = {
    False: [("abc-mlp, M=32", "abc-mlp", {"num_slots": 32}), ("abc-mlp, M=64", "abc-mlp", {"num_slots": 64}),
            ("abc-linformer, M=64", "abc-linformer", {"num_slots": 64}),
            ("abc-random, M=64", "abc-random", {"num_slots": 64}), ("gated-linear", "gated-linear", {})],
    True: [("abc-mlp, M=4", "abc-mlp", {"num_slots": 4}), ("abc-random, M=8", "abc-random", {"num_slots": 8})],
}


# The recipe's rows: transfer steps (their own learning rate) before the K ordinary steps, and
# the weight of the distillation term in the rows that add it.
TRANSFER = {False: {"train.transfer_steps": 300, "train.transfer_lr": 0.03},
            True: {"train.transfer_steps": 4, "train.transfer_lr": 0.03}}
DISTILL = {"train.distill_weight": 1.0}
RECIPE = {False: [("abc-mlp, M=32", "abc-mlp", {"num_slots": 32})],
          True: [("abc-mlp, M=4", "abc-mlp", {"num_slots": 4})]}


def models_of(quick: bool, source: Path, recipe: bool = True) -> list[Model]:
    """The pretrained model, softmax trained on, each mechanism from softmax and from scratch,
    then (recipe: causal LMs) the recipe's rows: from softmax after attention transfer, plain
    and distilled."""
    start = {"train.init_from": str(source)}
    models: list[Model] = [(PRETRAINED, "softmax", {"train.steps": PRETRAIN_STEPS[quick]}, 1),
                           ("softmax, trained on", "softmax", start, 1)]
    for name, mechanism, options in CONVERTED[quick]:
        models += [(f"{name}, from softmax", mechanism, {**options, **start}, 1),
                   (f"{name}, from scratch", mechanism, options, 1)]
    for name, mechanism, options in RECIPE[quick] if recipe else ():
        transfer = {**options, **start, **TRANSFER[quick]}
        models += [(f"{name}, from softmax, transfer", mechanism, transfer, 1),
                   (f"{name}, from softmax, transfer, distilled", mechanism, {**transfer, **DISTILL}, 1)]
    return models


PARTS = ("paper", "mlm", "conversion")


@dataclasses.dataclass
class Settings:
    """The experiment's own settings (key=value among the run settings, which go to every run)."""

    parts: tuple[str, ...] = PARTS
    students: tuple[str, ...] = tuple(conversion.students(False))
    recipes: tuple[str, ...] = conversion.RECIPES
    budgets: tuple[float, ...] = conversion.BUDGETS
    teacher: str = ""  # a finished softmax run folder to start the conversion study from
    harness: bool = True  # the conversion study's rows scored by lm-evaluation-harness too

    def __post_init__(self) -> None:
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown or not self.parts:
            raise ConfigError(f"parts: expected some of {', '.join(PARTS)}, got {list(self.parts)}")


def settings_of(quick: bool, overrides: list[str]) -> tuple[Settings, list[str]]:
    """(the experiment's settings, the run settings) of the command line's key=value overrides."""
    own = {f.name for f in dataclasses.fields(Settings)}
    mine = [o for o in overrides if o.split("=", 1)[0].strip() in own]
    return (parse_settings(Settings, mine, conversion.QUICK_SELECTION if quick else {}, name="abc-warmstart"),
            [o for o in overrides if o not in mine])


def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict:
    out_dir = Path(out_dir)
    study, run_overrides = settings_of(quick, overrides)
    result: dict = {}
    if "conversion" in study.parts:  # refused selections are said before anything trains
        conversion.check_selection(study.students, study.recipes, study.budgets, quick)
    if "paper" in study.parts:
        shared = [*TRUNK[quick], f"train.steps={ON_STEPS[quick]}", *run_overrides]
        measure_fn = functools.partial(measure, **MEASURE[quick])
        source = pretrained(out_dir, quick, shared, measure_fn, "abc-warmstart (pretraining softmax)")
        result = run_lm_experiment(out_dir, "abc-warmstart", models_of(quick, source), shared, quick=quick,
                                   overrides=overrides, jobs=jobs, measure_kw=MEASURE[quick], markdown=markdown)
    if "mlm" in study.parts:
        result["masked"] = run_masked(out_dir / "mlm", quick=quick, overrides=run_overrides, jobs=jobs,
                                      command=command_of(out_dir, "abc-warmstart", quick, overrides))
    if "conversion" in study.parts:
        result["conversion"] = conversion.run_study(
            out_dir / "conversion", quick=quick, overrides=overrides, run_overrides=run_overrides, jobs=jobs,
            chosen_students=study.students, recipes=study.recipes, budgets=study.budgets, teacher=study.teacher,
            harness=study.harness)
    return result


def pretrained(out_dir: Path, quick: bool, shared: list[str], measure_fn, label: str, recipe: bool = True) -> Path:
    """The pretrained model's run folder, with its weights while a model that starts from it is
    unfinished (`_runner.source_run`); recipe: whether the recipe's rows are among those."""
    (_, job), = jobs_of(models_of(quick, Path())[:1], shared)
    rest = jobs_of(models_of(quick, run_dir_of(out_dir, job), recipe)[1:], shared)
    needed = any(finished_row(run_dir_of(out_dir, other), other) is None for _, other in rest)
    return source_run(out_dir, job, measure_fn, needed=needed, label=label)


def run_masked(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int, command: str) -> dict:
    """The same comparison with masked-LM encoders (task=mlm), measured by masked accuracy;
    `command`: the one that made the whole experiment."""
    shared = ["task=mlm", *TRUNK[quick], f"train.steps={ON_STEPS[quick]}",
              *overrides]
    measure_fn = functools.partial(measure_masked, windows_count=MASKED_TEST_WINDOWS[quick])
    source = pretrained(out_dir, quick, shared, measure_fn, "abc-warmstart (pretraining a softmax encoder)",
                        recipe=False)
    pairs = jobs_of(models_of(quick, source, recipe=False), shared)  # transfer is for causal LMs
    return run_experiment(out_dir, "abc-warmstart", pairs, shared, quick=quick, overrides=overrides, jobs=jobs,
                          measure=measure_fn, summarise=summarise_masked, markdown=markdown_masked,
                          curve=("val_accuracy", "masked-token accuracy"), extra={"command": command})


MASKED_TEST_WINDOWS = {False: 128, True: 8}  # test windows of seq_len scored by every encoder


def measure_masked(model, cfg, run_dir: Path, *, windows_count: int) -> dict:
    """Loss and accuracy at the masked positions of the first test windows (masks from the seed)."""
    from memattn.evaluate import as_tensor
    from memattn.masked import evaluate_masked, windows
    from memattn.train import load_run_corpus

    test = windows(as_tensor(load_run_corpus(cfg).test), cfg.train.seq_len, windows_count)
    r = evaluate_masked(model, test, cfg.model.vocab_size - 1, cfg.train.batch_size, cfg.train.seed, "cpu")
    return {"attention": cfg.model.attention.name, "options": cfg.model.attention.options,
            "test_accuracy": r["accuracy"], "test_loss": r["loss"], "test_tokens": r["tokens"]}


def summarise_masked(names: list[str], rows: list[dict]) -> list[dict]:
    """One entry per model (one seed each)."""
    return [dict(row, model=name) for name, row in zip(names, rows)]


def markdown_masked(result: dict) -> str:
    models = result["models"]
    by = {m["model"]: m for m in models}
    base = by.get(PRETRAINED, models[0])
    setting = dict(item.split("=", 1) for item in result["config"])
    lines = [
        "# Warm-starting bounded memories from a pretrained softmax encoder (masked LM)",
        "",
        *progress_note(result),
        "Peng et al. 2022, §5.3 small: a softmax encoder pretrained with masked-LM training (15 % of "
        "the characters chosen, BERT's 80 / 10 / 10), converted to each mechanism (`train.init_from`) "
        "and trained on, against the same mechanism trained from scratch for as many steps.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Budget: the pretrained encoder {base['steps']:,} steps; every other model "
        f"{int(setting['train.steps']):,} steps of {setting['train.batch_size']} x {setting['train.seq_len']} "
        f"characters. Test: accuracy and loss at the {base['test_tokens']:,} masked positions of the "
        "first test windows (the same masks for every model).",
        "",
        "| model | parameters | steps | test masked accuracy | vs pretrained | test loss (nats) | val accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        lines.append(f"| {m['model']} | {m['params']:,} | {m['steps']:,} | {100 * m['test_accuracy']:.2f} % | "
                     f"{100 * (m['test_accuracy'] - base['test_accuracy']):+.2f} | {m['test_loss']:.3f} | "
                     f"{100 * m['val_accuracy']:.2f} % |")

    def points(a: dict, b: dict) -> str:
        return f"{a['model']} {100 * (a['test_accuracy'] - b['test_accuracy']):+.2f} points against {b['model']}"

    pairs, on = converted_pairs(by), by.get("softmax, trained on")
    if pairs:
        lines += ["", "## The paper found / we measured", "",
                  "- **A pretrained encoder is a better start.** The paper found ABC variants fine-tuned "
                  "from a pretrained RoBERTa far ahead of training from scratch. We measured, in masked "
                  "accuracy: " + "; ".join(points(a, b) for a, b in pairs) + "."]
        if on:
            lines.append("- **Close to the model it came from.** The paper found them close to the "
                         "pretrained model trained on alike. We measured: "
                         + "; ".join(points(a, on) for a, _ in pairs) + ".")
    lines += ["", setup_line(result["config"]), "",
              "Figures: `learning_curves.png` (validation masked accuracy against steps); logs under "
              "`logs/`, every run's figures in `results.json`.", ""]
    return "\n".join(lines)


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
        "from scratch for as many steps. Rows marked *transfer* follow the conversion recipe of "
        "LoLCATs and Liger (not in the paper): first attention transfer (`train.transfer_steps`: "
        "only the mechanism's own parameters train, so that each layer reproduces the frozen "
        "softmax layer's output on that layer's input), then the same steps end to end; "
        "*distilled* adds the KL divergence from the pretrained model (`train.distill_weight`).",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Budget: the pretrained softmax model {base['steps']:,} steps; every other model "
        f"{int(setting['train.steps']):,} steps of {batch} x {seq} characters. Test bits per character "
        f"at context 0 and at context {base['context']}, as in abc-lm. " + speed_note(result),
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
              setup_line(result["config"]), "",
              "Figures: `learning_curves.png`; logs under `logs/`, every run's figures in `results.json`.", ""]
    return "\n".join(lines)


def converted_pairs(by: dict[str, dict]) -> list[tuple[dict, dict]]:
    """(the row from softmax, the row from scratch) of every mechanism that has both."""
    return [(by[f"{n}, from softmax"], by[f"{n}, from scratch"]) for n in
            sorted({k.rsplit(", from ", 1)[0] for k in by if ", from " in k})
            if f"{n}, from softmax" in by and f"{n}, from scratch" in by]


def recipe_pairs(by: dict[str, dict]) -> list[tuple[dict, dict]]:
    """(a recipe row, the same mechanism from softmax by weight copy alone) of every recipe row."""
    return [(by[k], by[k.split(", transfer", 1)[0]]) for k in by
            if ", from softmax, transfer" in k and k.split(", transfer", 1)[0] in by]


def findings(by: dict[str, dict]) -> list[str]:
    """The paper's findings next to what this table measured (test bits per character)."""
    pairs = converted_pairs(by)
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
    recipe = recipe_pairs(by)
    if recipe:
        lines.append("- **Attention transfer first (LoLCATs, Liger; not in the paper).** Test bits per "
                     "character against weight copy alone at the same end-to-end steps: "
                     + "; ".join(f"{a['model']} {a['test_bpc'] - b['test_bpc']:+.3f}" for a, b in recipe)
                     + (" (against softmax trained on: "
                        + "; ".join(f"{a['model']} {a['test_bpc'] - on['test_bpc']:+.3f}" for a, _ in recipe)
                        + ")" if on else "") + ".")
    return lines if len(lines) > 2 else []
