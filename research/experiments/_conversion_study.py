"""abc-warmstart's conversion study: how much of a softmax model a bounded memory keeps, by
student, recipe and budget.

Teacher: softmax attention at abc-lm's budget (its trunk, 6,000 steps of 16 x 512 characters),
trained here or given as a finished run folder (`teacher=PATH`, e.g. one trained elsewhere).
Students start from it (`train.init_from`: every shared weight copied, the mechanism's own new):

    abc-mlp          ABC_MLP with the paper's write rule (a weighted mean of the whole prefix)
    abc-mlp-forget   ABC_MLP with a forget rate per slot (`attention.forget=true`: streams)
    gsa              gated slots (streams)
    gated-linear     gated linear attention
    hybrid-window    gsa in every layer but the last, which is kept a sliding window
    hybrid-softmax   gsa in every layer but the last, which is kept softmax

Recipes: `copy` (the weight copy alone, then end-to-end steps), `transfer` (attention transfer
first, `train.transfer_steps`: the mechanism's own parameters alone trained so that each layer
reproduces the frozen softmax layer), `distill` (transfer, then end-to-end steps with the KL
divergence from the teacher, `train.distill_weight`). Budgets: a share of the teacher's training
tokens (2, 5, 10 and 33 %), all steps of the student counted (with transfer, TRANSFER_SHARE of
them are transfer steps), on the teacher's batches' shape.

Each row: test bits per character at the training length L and streamed to 16 L (bounded models
through their fixed state, softmax as one window; `_lm_common.measure`), the state bytes of
one stream and, with `harness=true` (the default), the scores of lm-evaluation-harness on tasks
drawn from the test split, the model loaded from its exported Hugging Face folder
(`research.harness.harness_scores`: bits per byte, multiple-choice accuracy, one-word exact
match). Selected in parts (`students=[...]`, `recipes=[...]`, `budgets=[...]`): the table
holds every finished run of the grid, so the grid fills over several commands.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from memattn.errors import ConfigError
from memattn.fileio import atomic_write_text
from research.experiments._common import held_settings, setup_line
from research.experiments._lm_common import Model, jobs_of, measure, progress_note, summarise
from research.experiments._runner import (CHECKPOINT_FILE, Job, finished_row, run_dir_of, run_experiment,
                                          source_run)
from research.experiments.abc_lm import FULL as ABC_LM_FULL
from research.experiments.abc_lm import MEASURE
from research.experiments.abc_lm import QUICK as ABC_LM_QUICK

RECIPES = ("copy", "transfer", "distill")
BUDGETS = (2.0, 5.0, 10.0, 33.0)  # % of the teacher's training tokens
TRANSFER_SHARE = 0.2  # of a transfer recipe's steps, the transfer steps
TRANSFER_LR = 0.03
DISTILL_WEIGHT = 1.0
TEACHER_STEPS = {False: 6000, True: 100}  # abc-lm's budget; quick: enough steps for 2 % to be one
TEACHER = "softmax, teacher"
# the lm-evaluation-harness tasks of every row (`research.harness.split_tasks`)
HARNESS = {False: {"documents": 8, "document_chars": 2048, "items": 100, "context_chars": 256},
           True: {"documents": 2, "document_chars": 64, "items": 4, "context_chars": 8}}


def students(quick: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each student by name: (mechanism, options; an option with a dot is a run setting)."""
    slots, window, last = (4, 8, 1) if quick else (32, 64, 3)  # abc-lm's trunk has 4 layers (quick: 2)
    gsa = {"num_slots": slots}
    return {"abc-mlp": ("abc-mlp", {"num_slots": slots}),
            "abc-mlp-forget": ("abc-mlp", {"num_slots": slots, "forget": True}),
            "gsa": ("gsa", gsa),
            "gated-linear": ("gated-linear", {}),
            "hybrid-window": ("gsa", {**gsa, f"model.attention_layers.{last}.name": "abc-window",
                                      f"model.attention_layers.{last}.window": window}),
            "hybrid-softmax": ("gsa", {**gsa, f"model.attention_layers.{last}": "softmax"})}


QUICK_SELECTION = {"students": ("gsa", "hybrid-window"), "budgets": (10.0, 33.0)}


def check_selection(chosen_students, recipes, budgets, quick: bool) -> None:
    """ConfigError naming the option of a student, recipe or budget the study does not have."""
    for option, chosen, known in (("students", chosen_students, list(students(quick))),
                                  ("recipes", recipes, list(RECIPES))):
        unknown = [c for c in chosen if c not in known]
        if unknown or not chosen:
            raise ConfigError(f"{option}: expected some of {', '.join(known)}, got {list(chosen)}")
    if not budgets or any(not 0 < b <= 100 for b in budgets):
        raise ConfigError(f"budgets: expected percentages of the teacher's tokens in (0, 100], got {list(budgets)}")


def trunk(quick: bool, overrides: list[str]) -> list[str]:
    """The settings every model shares: abc-lm's, the teacher's steps, then the overrides."""
    return held_settings([*(ABC_LM_QUICK if quick else ABC_LM_FULL), f"train.steps={TEACHER_STEPS[quick]}",
                          *overrides])


def teacher_job(shared: list[str]) -> Job:
    (_, job), = jobs_of([(TEACHER, "softmax", {}, 1)], shared)
    return job


def student_models(quick: bool, shared: list[str], teacher: Path, teacher_tokens: int,
                   chosen_students, recipes, budgets) -> list[tuple[Model, dict[str, Any]]]:
    """(model, its place in the grid) of every student x recipe x budget chosen, in that order."""
    from memattn.config import load_config

    cfg = load_config(None, shared).train
    per_step = cfg.batch_size * cfg.seq_len
    out = []
    for student in chosen_students:
        mechanism, options = students(quick)[student]
        for recipe in recipes:
            for budget in budgets:
                steps = max(1, round(budget / 100 * teacher_tokens / per_step))
                transfer = max(1, round(TRANSFER_SHARE * steps)) if recipe != "copy" else 0
                ordinary = max(1, steps - transfer)
                settings = {**options, "train.init_from": str(teacher), "train.steps": ordinary,
                            "train.warmup": min(cfg.warmup, max(1, ordinary // 10))}
                if transfer:
                    settings.update({"train.transfer_steps": transfer, "train.transfer_lr": TRANSFER_LR})
                if recipe == "distill":
                    settings["train.distill_weight"] = DISTILL_WEIGHT
                name = f"{student}, {recipe}, {budget:g} pct"
                out.append(((name, mechanism, settings, 1),
                            {"model": name, "student": student, "recipe": recipe, "budget": budget,
                             "steps": ordinary, "transfer_steps": transfer, "tokens": (ordinary + transfer) * per_step}))
    return out


def measure_row(model, cfg, run_dir: Path, *, harness: dict[str, int] | None, **kw) -> dict[str, Any]:
    """`_lm_common.measure`'s figures and, given the tasks' sizes, lm-evaluation-harness's."""
    from memattn.train import load_run_corpus
    from research.harness import harness_scores

    row = measure(model, cfg, run_dir, **kw)
    if harness:
        corpus = load_run_corpus(cfg)
        row["harness"] = harness_scores(run_dir, corpus.vocab.decode(corpus.test), cfg.train.seq_len, **harness)
    return row


def given_teacher(path: Path, shared: list[str]) -> tuple[Path, Any]:
    """(run folder, RunConfig) of a teacher given by `teacher=PATH`: a finished softmax causal LM
    whose model, data and training length are the students' (ConfigError naming `teacher` else)."""
    from memattn.checkpoint import CheckpointError, load_checkpoint
    from memattn.config import RunConfig, from_dict, load_config, to_dict
    from memattn.transfer import softmax_mechanisms

    try:
        ckpt = load_checkpoint(path)
    except (CheckpointError, OSError) as e:
        raise ConfigError(f"teacher: {path} holds no run to start from ({e})") from None
    config = ckpt.meta.get("config")
    if not isinstance(config, dict) or config.get("task", "lm") != "lm":
        raise ConfigError(f"teacher: {path} is not a causal language model trained by `memattn train`")
    other = softmax_mechanisms(config.get("model") or {})
    if other is not None:
        raise ConfigError(f"teacher: {path} has {other} attention; the teacher is a softmax model")
    cfg = from_dict(RunConfig, config)
    if ckpt.step < cfg.train.steps:
        raise ConfigError(f"teacher: {path} stopped at step {ckpt.step:,} of {cfg.train.steps:,}; finish it "
                          f"first (memattn train ... --resume)")
    theirs, mine = to_dict(cfg), to_dict(load_config(None, [*shared, "attention=softmax"]))
    ignored = {"model": {"vocab_size"}, "data": {"cache_dir"}}
    for section in ("model", "data"):
        for key, value in mine[section].items():
            if key not in ignored[section] and theirs[section].get(key) != value:
                raise ConfigError(f"teacher: {path} was trained with {section}.{key}={theirs[section].get(key)!r}, "
                                  f"the students here with {value!r}; give the study the teacher's settings "
                                  "(key=value)")
    if cfg.train.seq_len != mine["train"]["seq_len"]:
        raise ConfigError(f"teacher: {path} was trained with train.seq_len={cfg.train.seq_len}, the students "
                          f"here with {mine['train']['seq_len']}; give the study the teacher's settings (key=value)")
    return ckpt.path.parent if ckpt.path.name == CHECKPOINT_FILE else ckpt.path, cfg


def measured_teacher(out_dir: Path, path: Path, measure_fn) -> dict[str, Any]:
    """The test figures of a given teacher (`measure_row`), kept in out_dir/teacher.json and taken
    again only when the teacher's folder or checkpoint step changes, or a figure asked for is
    missing (the harness's)."""
    from memattn.checkpoint import load_checkpoint
    from memattn.train import model_from_checkpoint

    step = load_checkpoint(path).step
    saved = out_dir / "teacher.json"
    if saved.exists():
        row = json.loads(saved.read_text())
        wanted = measure_fn.keywords.get("harness") is None or "harness" in row
        if row.get("path") == str(path) and row.get("checkpoint_step") == step and wanted:
            return row
    model, cfg, _ = model_from_checkpoint(path)
    row = {"model": TEACHER, "path": str(path), "checkpoint_step": step, "steps": cfg.train.steps,
           "params": model.num_parameters(), **measure_fn(model, cfg, path)}
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(saved, json.dumps(row, indent=2) + "\n")
    return row


def run_study(out_dir: Path, *, quick: bool, overrides: list[str], run_overrides: list[str], jobs: int,
              chosen_students, recipes, budgets, teacher: str, harness: bool = True) -> dict:
    """Train the chosen part of the grid in out_dir (reusing and resuming run folders), then write
    the table of every finished run of the grid: results.json, results.md, command.txt."""
    from memattn.config import load_config

    check_selection(chosen_students, recipes, budgets, quick)
    out_dir = Path(out_dir)
    shared = trunk(quick, run_overrides)
    measure_fn = functools.partial(measure_row, harness=HARNESS[quick] if harness else None, **MEASURE[quick])
    if teacher:
        path, cfg = given_teacher(Path(teacher), shared)
        teacher_row = measured_teacher(out_dir, path, measure_fn)
    else:
        job = teacher_job(shared)
        path, cfg = run_dir_of(out_dir, job), load_config(None, list(job.settings))
    teacher_tokens = cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len
    grid = student_models(quick, shared, path, teacher_tokens, list(students(quick)), RECIPES, BUDGETS)
    chosen = {place["model"] for _, place in
              student_models(quick, shared, path, teacher_tokens, chosen_students, recipes, budgets)}
    pairs = jobs_of([model for model, _ in grid], shared)
    if not teacher:
        needed = any(finished_row(run_dir_of(out_dir, j), j) is None for name, j in pairs if name in chosen)
        source_run(out_dir, job, measure_fn, needed=needed, label="abc-warmstart (training the teacher)")
        teacher_row = finished_row(path, job)
    kept = [(name, j) for name, j in pairs if name in chosen or finished_row(run_dir_of(out_dir, j), j) is not None]
    extra = {"teacher": {**teacher_row, "path": str(path), "tokens": teacher_tokens},
             "grid": [place for _, place in grid], "selected": sorted(chosen)}
    return run_experiment(out_dir, "abc-warmstart", kept, shared, quick=quick, overrides=overrides, jobs=jobs,
                          measure=measure_fn, summarise=summarise, markdown=markdown,
                          curve=("val_bpc", "bits per character"), extra=extra)


def length_figure(row: dict, key: str) -> dict | None:
    """The row's figures at `key` ("1x", "16x") of `test_bpc_by_length`, None where not read."""
    figures = (row.get("test_bpc_by_length") or {}).get(key)
    return figures if figures and figures.get("bpc") is not None else None


def length_documents(row: dict) -> int:
    return next((f["documents"] for f in (row.get("test_bpc_by_length") or {}).values() if f.get("bpc") is not None), 0)


def state_cell(row: dict) -> str:
    read = [f for f in (row.get("test_bpc_by_length") or {}).values() if f.get("bpc") is not None]
    return f"{read[0]['state_bytes']:,}" if read and read[0].get("state_bytes") else "grows" if read else "—"


def markdown(result: dict) -> str:
    teacher, grid = result["teacher"], result["grid"]
    by = {m["model"]: m for m in result["models"]}
    setting = dict(item.split("=", 1) for item in result["config"])
    batch, seq = (int(setting[f"train.{k}"]) for k in ("batch_size", "seq_len"))
    budgets = sorted({g["budget"] for g in grid})
    steps = {g["budget"]: g["steps"] + g["transfer_steps"] for g in grid if g["recipe"] == "copy"}
    far = length_figure(teacher, "16x")
    rows = grid_rows(grid, by, budgets)
    lines = [
        "# Converting a softmax model: students, recipes and budgets",
        "",
        *progress_note(result),
        f"**{len(by)} of the grid's {len(grid)} runs are in the table**" + (
            " (the grid is run in parts: `students=[...]`, `recipes=[...]`, `budgets=[...]`)." if len(by) < len(grid)
            else "."),
        "",
        "A softmax teacher at abc-lm's budget, converted to each student (`train.init_from`: every shared "
        "weight copied, the mechanism's own new) and trained on a share of the teacher's training tokens. "
        "Recipes: *copy*, the weight copy alone then end-to-end steps; *transfer*, attention transfer first "
        f"(`train.transfer_steps`, {100 * TRANSFER_SHARE:.0f} % of the student's steps: only the mechanism's own "
        "parameters train, so that each layer reproduces the frozen softmax layer's output), then end-to-end "
        "steps; *distill*, the same with the KL divergence from the teacher added "
        f"(`train.distill_weight={DISTILL_WEIGHT:g}`). Every step of a student counts in its budget.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Teacher: softmax, {teacher['steps']:,} steps of {batch} x {seq} characters ({teacher['tokens']:,} "
        f"tokens), `{teacher['path']}`" + (f", read at 16 L as one {far['read']}" if far else "")
        + ". Budgets, in steps of the same shape: " + ", ".join(f"{b:g} % = {steps[b]:,}" for b in budgets if b in steps)
        + f"; {length_documents(teacher)} test documents, each read from its first token.",
        "",
    ]
    for key, title, note in (
            ("1x", "Test bits per character at the training length L", "positions [0, L) of each test document"),
            ("16x", "Streamed to 16 L",
             "positions [8 L, 16 L) of each test document (bounded models streamed through their fixed "
             "state, softmax layers read as one window); in parentheses the change from the same positions "
             "read in windows of L")):
        lines += [f"## {title}", "", f"{note[0].upper()}{note[1:]}; the teacher: "
                  + (f"{length_figure(teacher, key)['bpc']:.3f}." if length_figure(teacher, key) else "not read."), "",
                  "| student | recipe | " + " | ".join(f"{b:g} %" for b in budgets) + " | state bytes, one stream |",
                  "|---|---|" + "---:|" * len(budgets) + "---:|"]
        for student, recipe, runs in rows:
            cells, state = [], "—"
            for row in runs:
                figure = length_figure(row, key) if row else None
                if row:
                    state = state_cell(row)
                cells.append("—" if figure is None else f"{figure['bpc']:.3f}" if key == "1x" else
                             f"{figure['bpc']:.3f} ({100 * (figure['bpc'] / figure['bpc_windows'] - 1):+.1f} %)")
            if any(c != "—" for c in cells):
                lines.append(f"| {student} | {recipe} | " + " | ".join(cells) + f" | {state} |")
        lines.append("")
    lines += harness_lines(teacher, rows, budgets)
    lines += [setup_line(result["config"]), "",
              "Figures: `learning_curves.png`; logs under `logs/`, every run's figures in `results.json` "
              "(`test_bpc_by_length`: 1x, 4x, 16x, 64x).", ""]
    return "\n".join(lines)


def grid_rows(grid: list[dict], by: dict[str, dict], budgets: list[float]) -> list[tuple[str, str, list[dict | None]]]:
    """(student, recipe, its finished row at each budget or None) of every student and recipe of the grid."""
    place = {(g["student"], g["recipe"], g["budget"]): g["model"] for g in grid}
    return [(student, recipe, [by.get(place.get((student, recipe, b))) for b in budgets])
            for student in dict.fromkeys(g["student"] for g in grid) for recipe in dict.fromkeys(g["recipe"] for g in grid)]


def harness_cell(row: dict | None) -> str:
    h = (row or {}).get("harness")
    return "—" if not h else f"{h['bits_per_byte']:.3f} / {100 * h['choice_acc']:.0f} % / {100 * h['word_exact']:.0f} %"


def harness_lines(teacher: dict, rows: list[tuple[str, str, list[dict | None]]], budgets: list[float]) -> list[str]:
    """The section of lm-evaluation-harness's scores: rows (student, recipe, its row at each budget)."""
    h = teacher.get("harness") or next((r["harness"] for _, _, cells in rows for r in cells if r and r.get("harness")),
                                       None)
    if h is None:
        return []
    return ["## Through lm-evaluation-harness", "",
            "Each model exported (`memattn export-hf`) and scored by the `lm_eval` command, which loads the "
            "folder through its `auto_map`, on tasks drawn from the test split (`research.harness`): "
            f"{h['documents']} documents of {h['document_chars']:,} characters, read in lm-eval's windows of L "
            f"(bits per byte); {h['items']} multiple-choice items, the {h['context_chars']} characters before a "
            "word then that word against three other words of the test text of its length (accuracy; chance "
            "25 %); the same words asked for by greedy generation after the same characters (exact match). "
            f"Cells: bits per byte / accuracy / exact match. The teacher: {harness_cell(teacher)}.", "",
            "| student | recipe | " + " | ".join(f"{b:g} %" for b in budgets) + " |",
            "|---|---|" + "---:|" * len(budgets),
            *(f"| {student} | {recipe} | " + " | ".join(harness_cell(r) for r in cells) + " |"
              for student, recipe, cells in rows if any(r and r.get("harness") for r in cells)), ""]
