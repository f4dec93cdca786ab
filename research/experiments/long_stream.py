"""Long streams at constant memory: character LMs read far past their training length.

A bounded memory is chosen to read and generate streams longer than a KV cache allows; this
experiment measures what such a model reads there. The trunk, budget and batches of `abc-lm`
(6,000 steps of 16 x 512 characters, two seeds); only the attention, and in it the write rule,
differs (and in the last row the positions). Rows: softmax (a growing KV cache, rotary positions); ABC_MLP with the paper's write
rule (each slot a weighted mean over the whole prefix); ABC_MLP with a learned rate per slot
(`attention.recency`); ABC_MLP with data-dependent forget rates (`attention.forget`); gated
slots (`gsa`: each slot decays by a gate computed from the token); the sliding window (n = 64);
gsa without positions (no rotary on q and k: does order come from the gates alone, and does
either reading hold past L?).

Each model is measured as in `abc-lm` (test bits per character at context 0 and 480, decoding
speed) and past its training length L (`memattn.evaluate.evaluate_by_length`): bits per
character of two test documents read from their first token, at positions [0, L) and up to
4L, 16L and 64L; bounded models stream through their fixed state, softmax reads one window
as far as memory allows.

Each model is a run folder under out_dir/runs/: running the experiment again reuses finished
models and resumes unfinished ones; `--jobs N` trains N at once (one thread each).
Written to out_dir: results.json, results.md, learning_curves.png, by_length.png, logs/.
"""

from __future__ import annotations

from pathlib import Path

from research.experiments._common import held_settings, save_figure, setup_line
from research.experiments._lm_common import (Model, bpc_cell, by_length_lines, progress_note,
                                            run_lm_experiment, speed_note)
from research.experiments.abc_lm import FULL, MEASURE, PLAIN, QUICK

DESCRIPTION = ("long streams: softmax against write rules that forget (recency, forget rates, gated "
               "slots) and the paper's ABC_MLP, read to 64x the training length, with seeds")

MODELS: list[Model] = [
    ("softmax", "softmax", {}, 2),
    ("abc-mlp, M=32, forget", "abc-mlp", {"num_slots": 32, **PLAIN, "forget": True}, 2),
    ("gsa, M=32", "gsa", {"num_slots": 32}, 2),
    ("abc-mlp, M=32, recency", "abc-mlp", {"num_slots": 32, **PLAIN, "recency": True}, 2),
    ("abc-window, n=64", "abc-window", {"window": 64}, 2),
    ("abc-mlp, M=32", "abc-mlp", {"num_slots": 32, **PLAIN}, 2),
    # rotary positions or none past the training length: the same gated slots without them
    ("gsa, M=32, no positions", "gsa", {"num_slots": 32, "model.positions": "none"}, 2),
]
QUICK_MODELS: list[Model] = [
    ("softmax", "softmax", {}, 1),
    ("abc-mlp, M=4, forget", "abc-mlp", {"num_slots": 4, **PLAIN, "forget": True}, 1),
    ("abc-mlp, M=4, recency", "abc-mlp", {"num_slots": 4, **PLAIN, "recency": True}, 1),
    ("abc-window, n=8", "abc-window", {"window": 8}, 1),
    ("abc-mlp, M=4", "abc-mlp", {"num_slots": 4, **PLAIN}, 1),
]


def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict:
    return run_lm_experiment(out_dir, "long-stream", QUICK_MODELS if quick else MODELS,
                             held_settings([*(QUICK if quick else FULL), *overrides]), quick=quick,
                             overrides=overrides, jobs=jobs, measure_kw=MEASURE[quick],
                             markdown=markdown, plots=plot_by_length)


def markdown(result: dict) -> str:
    models = result["models"]
    setting = dict(item.split("=", 1) for item in result["config"])
    steps, batch, seq = (int(setting[f"train.{k}"]) for k in ("steps", "batch_size", "seq_len"))
    context = models[0]["context"]
    lines = [
        "# Long streams at constant memory",
        "",
        *progress_note(result),
        "Character LMs read far past their training length: softmax against write rules of a bounded "
        "memory. Same trunk, batches and steps as `abc-lm`; only the attention differs.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Budget: {steps:,} steps of {batch} x {seq} characters ({steps * batch * seq / 1e6:.1f} M "
        f"training characters) per model. ± is half the spread of two seeds. " + speed_note(result),
        "",
        f"| model | seeds | parameters | test bpc, context 0 | test bpc, context {context} | val bpc "
        "| train tokens/s | decode tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        lines.append(f"| {m['model']} | {m['seeds']} | {m['params']:,} | {bpc_cell(m, 'test_bpc')} | "
                     f"{bpc_cell(m, 'test_bpc_context')} | {m['val_bpc']:.3f} | "
                     f"{m['train_tokens_per_s']:,.0f} | {m['decode_tokens_per_s']:,.0f} |")
    lines += ["", *by_length_lines(models), "", *findings(models), "", setup_line(result["config"]), "",
              "Figures: `learning_curves.png` (validation bits per character against steps), "
              "`by_length.png` (test bits per character against position); logs under `logs/`, every "
              "seed's figures in `results.json`.", ""]
    return "\n".join(lines)


def holds(m: dict, factor: str, within: float = 0.02) -> bool | None:
    """Whether m's bpc at `factor` is within `within` (relative) of the same positions read in
    windows of the training length; None where not read."""
    f = (m.get("test_bpc_by_length") or {}).get(factor, {})
    return None if f.get("bpc") is None else f["bpc"] <= f["bpc_windows"] * (1 + within)


def findings(models: list[dict]) -> list[str]:
    """What the table measured past the training length, in words."""
    measured = [m for m in models if m.get("test_bpc_by_length")]
    if not measured:
        return []
    lines = ["## We measured", ""]
    for factor in ("16x", "64x"):
        held = [m["model"] for m in measured if holds(m, factor)]
        lost = [m["model"] for m in measured if holds(m, factor) is False]
        unread = [m["model"] for m in measured if holds(m, factor) is None]
        lines.append(f"- **At {factor} the training length**: within 2 % of the same text read in windows of "
                     "the training length: "
                     f"{', '.join(held) or 'none'}; further off: {', '.join(lost) or 'none'}"
                     + (f"; not read: {', '.join(unread)}" if unread else "") + ".")
    return lines


def plot_by_length(out_dir: Path, result: dict) -> None:
    """by_length.png: test bits per character at L, 4L, 16L and 64L, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [m for m in result["models"] if m.get("test_bpc_by_length")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for m in rows:
        points = [(int(k[:-1]), f["bpc"]) for k, f in m["test_bpc_by_length"].items() if f["bpc"] is not None]
        ax.plot(*zip(*points), marker="o", label=m["model"])
    ax.set_xscale("log", base=2)
    ax.set(title="Past the training length", xlabel="position, in training lengths L",
           ylabel="test bits per character")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out_dir / "by_length.png", dpi=120)
