"""Attention with bounded-memory control (Peng et al. 2022) on a character-level LM: Table 3a
small, ABC_MLP's memory-size sweep and Table 8's variants, with seeds.

The same causal LM trunk (width, depth, heads, rotary positions, training length seq_len)
with its attention replaced; every model trains the same steps on the same batches (its seed
sets the init and the batches). Rows: softmax; ABC_MLP with n = 32 and 64; Linformer (64);
random control ABC_RD (64); the sliding window (n = 64); ABC_MLP (32) with a symmetry-breaking
init of W_φ alone; ABC_MLP (32) with a learned recency rate per slot (not in the paper: under
rotary positions a write otherwise sees its position only through the layers below);
clustering (32); ABC_MLP with relu and sigmoid control (32); and ABC_MLP at n = 8, 16 and 128
for the sweep (32 and 64 come from the main rows). The main rows, the W_φ init and recency run
two seeds.

Each model is measured on the test split: bits per character at context 0 (segments of
seq_len) and at context seq_len − 32 (each 32-token segment read after the seq_len − 32
tokens before it, Table 3a's 480 at 512), greedy decoding speed with the cache, and, for
ABC_MLP, how its slots are used (`memattn.analysis`) at init and after training.

Each model is a run folder under out_dir/runs/: running the experiment again reuses finished
models and resumes unfinished ones; `--jobs N` trains N at once (one thread each).
Written to out_dir: results.json, results.md, learning_curves.png, memory_sweep.png, logs/.
"""

from __future__ import annotations

from pathlib import Path

from research.experiments._common import compare, held_settings, save_figure, setup_line
from research.experiments._lm_common import (Model, bpc_cell, by_length_lines, by_position_lines,
                                            progress_note, run_lm_experiment, speed_note)

DESCRIPTION = ("bounded-memory control (Peng et al. 2022): softmax against ABC_MLP, Linformer, "
               "random, window and cluster control, a memory-size sweep and control variants, "
               "with seeds, on a character LM")

# Shared by every row. An override from the command line replaces the default it names, so
# `train.steps=N` makes the run folders that FULL with train.steps=N would make (still
# reusable once N becomes the default).
# init_std ≈ 1/√d_model for every row (GPT-2's 0.02 is for d_model 768 and slow here).
FULL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.ff_mult=4",
        "model.positions=rotary", "model.dropout=0.0", "model.max_len=512", "model.init_std=0.088",
        "train.seq_len=512", "train.batch_size=16", "train.steps=6000", "train.lr=0.003",
        "train.warmup=100", "train.eval_every=250", "train.eval_batches=8", "train.log_every=25",
        "train.save_every=100", "train.threads=1"]
QUICK = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.ff_mult=4",
         "model.positions=rotary", "model.dropout=0.0", "model.max_len=96", "model.init_std=0.17",
         "train.seq_len=32", "train.batch_size=4", "train.steps=12", "train.lr=0.003",
         "train.warmup=2", "train.eval_every=6", "train.eval_batches=2", "train.log_every=3",
         "train.save_every=6", "train.threads=1"]
MEASURE = {False: {"test_tokens": 65_536, "decode_prompt": 64, "decode_tokens": 200},
           True: {"test_tokens": 256, "decode_prompt": 16, "decode_tokens": 40}}
# The plain ABC_MLP rows keep the model's init for W_φ (phi_init_std=0, the paper's setting);
# the "W_phi init" rows draw W_φ with std √(8 / d_model), the library's default since they ran.
# No row's time or memory depends on its weights (no learned sparsity), so speeds of runs whose
# checkpoint is gone are taken on stand-ins (`_runner.measured_side_by_side`).
PLAIN = {"phi_init_std": 0}
PHI_INIT_STD = {False: 0.25, True: 0.5}  # √(8 / d_model) of FULL and QUICK

MODELS: list[Model] = [
    ("softmax", "softmax", {}, 2),
    ("abc-mlp, M=32", "abc-mlp", {"num_slots": 32, **PLAIN}, 2),
    ("abc-mlp, M=64", "abc-mlp", {"num_slots": 64, **PLAIN}, 2),
    ("abc-linformer, M=64", "abc-linformer", {"num_slots": 64}, 2),
    ("abc-random, M=64", "abc-random", {"num_slots": 64}, 2),
    ("abc-window, n=64", "abc-window", {"window": 64}, 2),
    ("abc-mlp, M=32, W_phi init", "abc-mlp", {"num_slots": 32, "phi_init_std": PHI_INIT_STD[False]}, 2),
    ("abc-mlp, M=32, recency", "abc-mlp", {"num_slots": 32, **PLAIN, "recency": True}, 2),
    ("abc-cluster, M=32", "abc-cluster", {"num_clusters": 32}, 1),
    ("abc-mlp relu, M=32", "abc-mlp", {"num_slots": 32, "activation": "relu", **PLAIN}, 1),
    ("abc-mlp sigmoid, M=32", "abc-mlp", {"num_slots": 32, "activation": "sigmoid", **PLAIN}, 1),
    ("abc-mlp, M=8", "abc-mlp", {"num_slots": 8, **PLAIN}, 1),
    ("abc-mlp, M=16", "abc-mlp", {"num_slots": 16, **PLAIN}, 1),
    ("abc-mlp, M=128", "abc-mlp", {"num_slots": 128, **PLAIN}, 1),
]
QUICK_MODELS: list[Model] = [
    ("softmax", "softmax", {}, 2),
    ("abc-mlp, M=4", "abc-mlp", {"num_slots": 4, **PLAIN}, 1),
    ("abc-mlp, M=8", "abc-mlp", {"num_slots": 8, **PLAIN}, 1),
    ("abc-random, M=8", "abc-random", {"num_slots": 8}, 1),
    ("abc-mlp, M=4, W_phi init", "abc-mlp", {"num_slots": 4, "phi_init_std": PHI_INIT_STD[True]}, 1),
    ("abc-mlp, M=4, recency", "abc-mlp", {"num_slots": 4, **PLAIN, "recency": True}, 1),
]
SWEEP = "abc-mlp, M="  # rows of plain ABC_MLP (exp control, model init) form the sweep


def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict:
    return run_lm_experiment(out_dir, "abc-lm", QUICK_MODELS if quick else MODELS,
                             held_settings([*(QUICK if quick else FULL), *overrides]), quick=quick,
                             overrides=overrides, jobs=jobs, measure_kw=MEASURE[quick],
                             markdown=markdown, plots=plot_sweep, stand_ins=True)


def markdown(result: dict) -> str:
    models = result["models"]
    base = next((m for m in models if m["attention"] == "softmax"), None) or {
        "test_bpc": float("nan"), "test_bpc_context": float("nan"), **models[0]}
    setting = dict(item.split("=", 1) for item in result["config"])
    steps, batch, seq = (int(setting[f"train.{k}"]) for k in ("steps", "batch_size", "seq_len"))
    context = base["context"]
    minutes = base["train_s"] / 60
    lines = [
        "# Attention with bounded-memory control on a character LM",
        "",
        *progress_note(result),
        "Peng et al. 2022, *ABC: Attention with Bounded-memory Control*, Table 3a small, with ABC_MLP's "
        "memory-size sweep and control variants. Same trunk, same batches, same number of steps for "
        "every model; only the attention differs.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Budget: {steps:,} steps of {batch} x {seq} characters ({steps * batch * seq / 1e6:.1f} M "
        f"training characters) per model; softmax has {base['params']:,} parameters and trained in "
        f"{minutes:.0f} min on one CPU thread. Test bits per character over the first "
        f"{base['test_tokens']:,} characters of the test split at context 0 (segments of {seq}) and over "
        f"{base['context_tokens']:,} characters at context {context} (each {seq - context}-character "
        f"segment scored after the {context} before it). ± is half the spread of two seeds. "
        + speed_note(result),
        "",
        f"| model | seeds | parameters | test bpc, context 0 | vs softmax | test bpc, context {context} "
        "| vs softmax | val bpc | train tokens/s | decode tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        lines.append(
            f"| {m['model']} | {m['seeds']} | {m['params']:,} | {bpc_cell(m, 'test_bpc')} | "
            f"{m['test_bpc'] - base['test_bpc']:+.3f} | {bpc_cell(m, 'test_bpc_context')} | "
            f"{m['test_bpc_context'] - base['test_bpc_context']:+.3f} | {m['val_bpc']:.3f} | "
            f"{m['train_tokens_per_s']:,.0f} | {m['decode_tokens_per_s']:,.0f} |")
    usage = [m for m in models if m.get("slots_trained")]
    if usage:
        lines += [
            "",
            "## How ABC_MLP uses its slots (`memattn.analysis.slot_statistics`, mean over layers)",
            "",
            "write spread: exp(entropy of a slot's write weights over the window) / window, 1 = the "
            "slot is the plain mean of the window; slots read: exp(entropy of the mean read), how "
            "many slots the queries use between them; per query: how many one query reads; key "
            "cosine: mean cosine between two slots' keys (1 = copies); write age: the mean age of what "
            "a slot holds over a plain prefix mean's (1 = writing ignores position, below 1 = recent "
            "tokens weigh more; — for runs measured before it was added).",
            "",
            "| model | write spread, init → trained | slots read | per query | key cosine | write age |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for m in usage:
            a, b = m["slots_init"], m["slots_trained"]
            age = f"{a['write_age']:.2f} → {b['write_age']:.2f}" if "write_age" in b else "—"
            lines.append(f"| {m['model']} | {a['write_spread']:.2f} → {b['write_spread']:.2f} | "
                         f"{a['slots_read']:.1f} → {b['slots_read']:.1f} | "
                         f"{a['read_spread']:.1f} → {b['read_spread']:.1f} | "
                         f"{a['key_cosine']:.2f} → {b['key_cosine']:.2f} | {age} |")
    positions, lengths = by_position_lines(models, base), by_length_lines(models)
    lines += ["", *positions, *([""] if positions else []), *lengths, *([""] if lengths else []),
              *findings(models), "",
              setup_line(result["config"]), "",
              "Figures: `learning_curves.png` (validation bits per character against steps), "
              "`memory_sweep.png` (test bits per character of ABC_MLP against its memory size); "
              "logs under `logs/`, every seed's figures in `results.json`.", ""]
    return "\n".join(lines)


def plot_sweep(out_dir: Path, result: dict) -> None:
    """memory_sweep.png: test bits per character of plain ABC_MLP against its slots n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted(((m["options"]["num_slots"], m) for m in result["models"] if m["model"].startswith(SWEEP)
                    and m["model"][len(SWEEP):].isdigit()), key=lambda pair: pair[0])
    base = next((m for m in result["models"] if m["attention"] == "softmax"), None)
    if not sweep or base is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    n = [s for s, _ in sweep]
    for key, label in (("test_bpc", "context 0"), ("test_bpc_context", f"context {base['context']}")):
        line, = ax.plot(n, [m[key] for _, m in sweep], marker="o", label=f"ABC_MLP, {label}")
        ax.axhline(base[key], color=line.get_color(), linestyle="--", linewidth=1,
                   label=f"softmax, {label}")
    ax.set_xscale("log", base=2)
    ax.set(title="ABC_MLP memory size", xlabel="slots n", ylabel="test bits per character")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out_dir / "memory_sweep.png", dpi=120)


def gaps(m: dict, base: dict) -> str:
    """'+x at context 0, +y at context N': m's test bits per character less base's."""
    return (f"{m['test_bpc'] - base['test_bpc']:+.3f} at context 0, "
            f"{m['test_bpc_context'] - base['test_bpc_context']:+.3f} at context {m['context']}")


def every_seed_ahead(a: dict, b: dict) -> bool:
    """Whether every seed of a has lower test bits per character than every seed of b (both
    with seeds; the spreads are max − min)."""
    return (min(a["seeds"], b["seeds"]) > 1
            and a["test_bpc"] + a["test_bpc_spread"] / 2 < b["test_bpc"] - b["test_bpc_spread"] / 2)


def findings(models: list[dict]) -> list[str]:
    """The paper's findings next to what this table measured (test bits per character)."""
    by = {m["model"]: m for m in models}
    lines = ["## The paper found / we measured", ""]
    mlp = [by[n] for n in ("abc-mlp, M=32", "abc-mlp, M=64") if n in by]
    rivals = [by[n] for n in ("abc-linformer, M=64", "abc-random, M=64") if n in by]
    if mlp and rivals:
        best = min(mlp, key=lambda m: m["test_bpc"])
        lines.append("- **Context-dependent control beats fixed control.** The paper found ABC_MLP "
                     "ahead of Linformer and random control (ABC_RD) in its language-modelling "
                     "table. We measured: " + "; ".join(compare(best, r) for r in rivals) + ".")
    if "softmax" in by and mlp:
        base = by["softmax"]
        lines.append("- **Close to softmax.** The paper found ABC_MLP with 32 or 64 slots close to "
                     "softmax attention (no or negligible loss). We measured: "
                     + "; ".join(f"{m['model']} {gaps(m, base)}" for m in mlp) + " against softmax.")
    sweep = sorted((m["options"]["num_slots"], m["test_bpc"]) for m in models
                   if m["model"].startswith(SWEEP) and m["model"][len(SWEEP):].isdigit())
    if len(sweep) > 2:
        improving = all(b < a for (_, a), (_, b) in zip(sweep, sweep[1:]))
        lines.append("- **More slots, better.** The paper found accuracy growing with the memory size. "
                     "We measured " + ", ".join(f"n = {n}: {bpc:.3f}" for n, bpc in sweep) + (
                         " — better with every doubling." if improving else
                         " — not better with every doubling."))
    if "abc-mlp, M=32" in by and "abc-mlp, M=32, W_phi init" in by:
        wide, plain = by["abc-mlp, M=32, W_phi init"], by["abc-mlp, M=32"]
        lines.append("- **Symmetric slots** (not in the paper). A larger init of W_φ alone: "
                     + compare(wide, plain) + (", every seed ahead of every seed of the model's init"
                                               if every_seed_ahead(wide, plain) else "")
                     + ". abc-mlp's default is this init (`attention.phi_init_std` unset: std "
                     "√(8 / d_model)); the other ABC_MLP rows here keep the model's init "
                     "(`attention.phi_init_std=0`).")
    if "abc-mlp, M=32" in by and "abc-mlp, M=32, recency" in by:
        tilted, plain = by["abc-mlp, M=32, recency"], by["abc-mlp, M=32"]
        lines.append("- **Recency** (not in the paper). With rotary positions, which only q and k see, "
                     "an ABC_MLP write depends on where its token is only through what the layers "
                     "below mixed into its input (not at all in the first layer; write age in the slot "
                     "table). With a learned rate per slot (`attention.recency=true`: β·i added to token i's "
                     "logit, the model's init for W_φ otherwise): " + compare(tilted, plain)
                     + (", every seed ahead of every seed without it" if every_seed_ahead(tilted, plain) else "")
                     + (f"; against softmax {gaps(tilted, by['softmax'])}" if "softmax" in by else "") + ".")
    for others, what in ((("abc-mlp relu, M=32", "abc-mlp sigmoid, M=32"), "Control activation"),
                         (("abc-window, n=64", "abc-cluster, M=32"), "Window and clustering control")):
        rows = [by[n] for n in others if n in by]
        if rows and "abc-mlp, M=32" in by:
            lines.append(f"- **{what}** (the paper's Table 8 compares them with ABC_MLP's learned exp "
                         "control for translation). We measured against abc-mlp, M=32: " + "; ".join(
                             f"{m['model']} {m['test_bpc'] - by['abc-mlp, M=32']['test_bpc']:+.3f}" for m in rows) + ".")
    return lines if len(lines) > 2 else []
