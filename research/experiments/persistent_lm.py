"""Persistent memory in place of the feed-forward sublayer (Sukhbaatar et al. 2019), small.

The paper's ablation on a character-level LM: a transformer with feed-forward sublayers,
all-attention with N persistent vectors per head (no feed-forward), the variants attn-split,
head-split, single-head and ff-attn, and all-attention with N = 0; every model has the same
trunk (width, depth, heads, rotary positions, causal context of seq_len tokens) and trains the
same steps on the same batches; N is chosen per variant so that the model has the
transformer's parameter count (N = 0 cannot, and has fewer). Plus all-attention in the
paper's proportions (1.5 times the layers, N matched again: fewer vectors per layer), and
the paper's long-context setting: all-attention trained on consecutive segments
(train.segments), each attending to the previous segment's keys (a window of two segments)
with learned relative positions and an adaptive span per head, tested as one stream with
the state carried.

Each model is a run folder under out_dir/runs/ (reused or resumed when the command runs
again; `--jobs N` trains N at once); two seeds of each but ff-attn. Written to out_dir:
results.json, results.md, learning_curves.png, logs/.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from memattn.config import AttentionConfig, RunConfig, load_config
from research.experiments._common import compare, held_settings, setup_line
from research.experiments._lm_common import (Model, bpc_cell, by_length_lines, copied_note, progress_note,
                                            run_lm_experiment, speed_note)
# abc-lm's trunk and budget, so that its softmax rows are this experiment's transformer rows;
# `overrides` from the command line replace the defaults they name, as there
from research.experiments.abc_lm import FULL, MEASURE, QUICK
from memattn.models import CausalLM

DESCRIPTION = ("persistent memory vs feed-forward (Sukhbaatar et al. 2019): transformer, "
               "all-attention and its variants at equal parameters and steps, and all-attention "
               "over long context with adaptive spans")


def long_context(seq_len: int) -> dict:
    """All-attention over the current and the previous segment, relative positions, adaptive
    spans up to two segments (learned from a quarter of that), trained on segments."""
    return {"variant": "all-attn", "context": "window", "window": 2 * seq_len,
            "relative_positions": True, "adaptive_span": True, "span_max": 2 * seq_len,
            "span_ramp": max(4, seq_len // 16), "span_init": 0.25,
            "model.positions": "none", "train.segments": True}


def deeper(layers: int) -> int:
    """The layers of all-attention in the paper's proportions: 1.5 times the transformer's
    (18 against 12 at 39M parameters), so that the feed-forward's parameters go to more
    layers of attention rather than to more persistent vectors in as many layers."""
    return layers * 3 // 2


def models(quick: bool, layers: int) -> list[Model]:
    """(row, mechanism, options, seeds); options with a dot are settings of the run itself.
    n_persistent is set to match the transformer's parameters unless given; `layers` are the
    trunk's. Quick: one seed (two for the transformer)."""
    two = 1 if quick else 2
    return [
        ("transformer", "softmax", {}, 2),
        ("all-attn", "persistent", {"variant": "all-attn"}, two),
        (f"all-attn, {deeper(layers)} layers", "persistent",
         {"variant": "all-attn", "model.n_layers": deeper(layers)}, two),
        ("attn-split", "persistent", {"variant": "attn-split"}, two),
        ("head-split", "persistent", {"variant": "head-split"}, two),
        ("single-head", "persistent", {"variant": "single-head"}, two),
        ("ff-attn", "persistent", {"variant": "ff-attn"}, 1),
        ("all-attn, N=0", "persistent", {"variant": "all-attn", "n_persistent": 0}, two),
        ("all-attn, long context", "persistent", long_context(32 if quick else 512), two),
    ]


def count_parameters(cfg: RunConfig, vocab_size: int, **attention) -> int:
    """Parameters of cfg's model (with `attention` options replacing its mechanism's, if given)."""
    model = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    if attention:
        model = dataclasses.replace(model, attention=AttentionConfig(model.attention.name, attention))
    return CausalLM(model).num_parameters()


def matching_n(cfg: RunConfig, options: dict, target: int, vocab_size: int) -> int:
    """N whose model has the parameter count closest to `target` (parameters grow linearly in N)."""
    p1 = count_parameters(cfg, vocab_size, **options, n_persistent=1)
    p2 = count_parameters(cfg, vocab_size, **options, n_persistent=2)
    return max(1, round(1 + (target - p1) / (p2 - p1)))


def with_matching_n(shared: list[str], rows: list[Model]) -> list[Model]:
    """The rows with n_persistent set where not given, so that each model has the
    transformer's parameter count."""
    from memattn.train import load_run_corpus

    base = load_config(None, [*shared, "attention=softmax"])
    vocab = load_run_corpus(base).vocab.size
    target = count_parameters(base, vocab)
    out = []
    for name, mechanism, options, seeds in rows:
        if mechanism == "persistent" and "n_persistent" not in options:
            own = {k: v for k, v in options.items() if "." not in k}
            run = [f"{k}={v}" for k, v in options.items() if "." in k]
            cfg = load_config(None, [*shared, *run, f"attention={mechanism}"])
            options = {**options, "n_persistent": matching_n(cfg, own, target, vocab)}
        out.append((name, mechanism, options, seeds))
    return out


def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict:
    shared = held_settings([*(QUICK if quick else FULL), *overrides])
    layers = load_config(None, shared).model.n_layers
    return run_lm_experiment(out_dir, "persistent-lm", with_matching_n(shared, models(quick, layers)), shared,
                             quick=quick, overrides=overrides, jobs=jobs, measure_kw=MEASURE[quick],
                             markdown=markdown, stand_ins=True)


def markdown(result: dict) -> str:
    models = result["models"]
    by = {m["model"]: m for m in models}
    base = by.get("transformer") or {"test_bpc": float("nan"), "test_bpc_context": float("nan"), **models[0]}
    setting = dict(item.split("=", 1) for item in result["config"])
    steps, batch, seq = (int(setting[f"train.{k}"]) for k in ("steps", "batch_size", "seq_len"))
    context = base["context"]
    lines = [
        "# Persistent memory in place of the feed-forward sublayer",
        "",
        *progress_note(result),
        "Sukhbaatar et al. 2019, *Augmenting Self-attention with Persistent Memory*: the ablation, "
        "small. Same trunk, same batches, same number of steps for every model; N (persistent "
        "vectors per head, or per layer for single-head and ff-attn) chosen so that the model "
        "has the transformer's parameter count, except N = 0. The row with its number of layers "
        "in the name has 1.5 times the trunk's, the paper's proportions.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Budget: {steps:,} steps of {batch} x {seq} characters ({steps * batch * seq / 1e6:.1f} M "
        f"training characters) per model, the transformer trained in {base['train_s'] / 60:.0f} min on "
        f"one CPU thread. Test bits per character over the first {base['test_tokens']:,} characters of "
        f"the test split in segments of {seq}, each read from an empty memory, and with context: each "
        f"{seq - context}-character segment after the {context} before it, except for the long-context "
        "model, which reads the whole test split as streams with its segment memory carried (its "
        "training reads). ± is half the spread of two seeds. " + copied_note(result)
        + speed_note(result),
        "",
        f"| model | seeds | N | parameters | test bpc, segments of {seq} | vs transformer | with context "
        "| vs transformer | val bpc | train tokens/s | decode tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        n = m["options"].get("n_persistent", "–")
        with_context = bpc_cell(m, "test_bpc_context") + (" (stream)" if m["context"] < 0 else "")
        lines.append(f"| {m['model']} | {m['seeds']} | {n} | {m['params']:,} | {bpc_cell(m, 'test_bpc')} | "
                     f"{m['test_bpc'] - base['test_bpc']:+.3f} | {with_context} | "
                     f"{m['test_bpc_context'] - base['test_bpc_context']:+.3f} | {m['val_bpc']:.3f} | "
                     f"{m['train_tokens_per_s']:,.0f} | {m['decode_tokens_per_s']:,.0f} |")
    lengths = by_length_lines(models)
    lines += ["", *lengths, *([""] if lengths else []), *findings(by), "",
              setup_line(result["config"]), "",
              "Learning curves: `learning_curves.png` (validation bits per character against "
              "steps); logs under `logs/`, every seed's figures in `results.json`.", ""]
    return "\n".join(lines)


def spans_note(m: dict) -> str:
    """' Its learned spans ...' per layer (mean and largest over heads), or ''."""
    if not m.get("spans"):
        return ""
    layers = "; ".join(f"layer {i + 1}: {statistics.fmean(z):.0f} (largest {max(z):.0f})"
                       for i, z in enumerate(m["spans"]) if z)
    return (" Adaptive span (Sukhbaatar et al. 2019a), which this model uses, found short spans "
            "in the lower layers and long ones in a few heads of the upper layers. Its learned "
            f"spans, in tokens (mean over heads and seeds): {layers}.")


def findings(by: dict[str, dict]) -> list[str]:
    """The paper's findings next to what this table measured (test bits per character)."""
    lines = ["## The paper found / we measured", ""]
    if "all-attn" in by and "transformer" in by:
        lines.append("- **Persistent vectors can replace the feed-forward sublayer.** The paper found "
                     "all-attention on par with the transformer at equal parameters. We measured: "
                     + compare(by["all-attn"], by["transformer"]) + ".")
    deep = next((m for name, m in by.items() if name.startswith("all-attn, ") and name.endswith(" layers")), None)
    if deep is not None and "transformer" in by:
        lines.append("- **At the paper's depth.** The paper's all-attention models have 1.5 times "
                     "the layers of the transformers they match (18 against 12 at 39M parameters). "
                     f"We measured, with {deep['model'].split(', ')[1]} and N = "
                     f"{deep['options']['n_persistent']}: {compare(deep, by['transformer'])}"
                     + (f"; {compare(deep, by['all-attn'])}" if "all-attn" in by else "") + ".")
    if "all-attn" in by and "all-attn, N=0" in by:
        none = by["all-attn, N=0"]
        lines.append("- **Without persistent vectors the model is clearly worse.** The paper found "
                     f"N = 0 well behind. We measured: {compare(none, by['all-attn'])} (with "
                     f"{none['params'] / by['all-attn']['params']:.0%} of its parameters).")
    others = [by[n] for n in ("attn-split", "head-split", "single-head", "ff-attn") if n in by]
    if "all-attn" in by and others:
        lines.append("- **One joint softmax is best.** The paper found all-attn ahead of its "
                     "variants. We measured: " + "; ".join(compare(by["all-attn"], m) for m in others) + ".")
    if "all-attn, long context" in by and "all-attn" in by:
        long = by["all-attn, long context"]
        lines.append("- **Long context.** The paper's results come from all-attention over long "
                     "contexts with adaptive spans. We measured the segment-trained model at "
                     f"{long['test_bpc_context']:.3f} bits per character reading the test split as "
                     f"streams, against {by['all-attn']['test_bpc_context']:.3f} for all-attn with "
                     f"{by['all-attn']['context']} tokens of context." + spans_note(long))
    return lines if len(lines) > 2 else []
