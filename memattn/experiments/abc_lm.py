"""Attention with bounded-memory control (Peng et al. 2022) on a character-level LM: Table 3a
small, ABC_MLP's memory-size sweep and Table 8's variants, with seeds.

The same causal LM trunk (width, depth, heads, rotary positions, training length seq_len)
with its attention replaced; every model trains the same steps on the same batches (its seed
sets the init and the batches). Rows: softmax; ABC_MLP with n = 32 and 64; Linformer (64);
random control ABC_RD (64); the sliding window (n = 64); ABC_MLP (32) with a symmetry-breaking
init of W_φ alone; clustering (32); ABC_MLP with relu and sigmoid control (32); and ABC_MLP at
n = 8, 16 and 128 for the sweep (32 and 64 come from the main rows). The main rows and the
W_φ init run two seeds.

Each model is measured on the test split: bits per character at context 0 (segments of
seq_len) and at context seq_len − 32 (each 32-token segment read after the seq_len − 32
tokens before it, Table 3a's 480 at 512), greedy decoding speed with the cache, and, for
ABC_MLP, how its slots are used (`memattn.analysis`) at init and after training.

Each model is a run folder under out_dir/runs/: running the experiment again reuses finished
models and resumes unfinished ones; `--jobs N` trains N at once (one thread each).
Written to out_dir: results.json, results.md, learning_curves.png, memory_sweep.png, logs/.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import time
from pathlib import Path

import torch

from memattn.experiments._common import command_of, save_figure, write_results
from memattn.experiments._runner import Job, run_dir_of, run_jobs

DESCRIPTION = ("bounded-memory control (Peng et al. 2022): softmax against ABC_MLP, Linformer, "
               "random, window and cluster control, a memory-size sweep and control variants, "
               "with seeds, on a character LM")

# Shared by every row; `overrides` from the command line come after (e.g. train.steps=400).
# init_std ≈ 1/√d_model for every row (GPT-2's 0.02 is for d_model 768 and slow here).
FULL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.ff_mult=4",
        "model.positions=rotary", "model.dropout=0.0", "model.max_len=512", "model.init_std=0.088",
        "train.seq_len=512", "train.batch_size=16", "train.steps=1500", "train.lr=0.003",
        "train.warmup=100", "train.eval_every=250", "train.eval_batches=8", "train.log_every=25",
        "train.save_every=100", "train.threads=1"]
QUICK = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.ff_mult=4",
         "model.positions=rotary", "model.dropout=0.0", "model.max_len=96", "model.init_std=0.17",
         "train.seq_len=32", "train.batch_size=4", "train.steps=12", "train.lr=0.003",
         "train.warmup=2", "train.eval_every=6", "train.eval_batches=2", "train.log_every=3",
         "train.save_every=6", "train.threads=1"]
SCORED = 32  # tokens of each segment scored at the long context (Table 3a: 480 + 32 = 512)
TEST_TOKENS = {False: 65_536, True: 256}  # test targets scored at each context
DECODE_PROMPT = {False: 64, True: 16}
DECODE_TOKENS = {False: 200, True: 40}
USAGE_WINDOWS = 4  # test windows of seq_len for the slot statistics
PHI_INIT_STD = {False: 0.25, True: 0.5}  # W_φ std of the symmetry-breaking row (logit std ≈ 3)

# (row, mechanism, options, seeds)
MODELS = [
    ("softmax", "softmax", {}, 2),
    ("abc-mlp, M=32", "abc-mlp", {"num_slots": 32}, 2),
    ("abc-mlp, M=64", "abc-mlp", {"num_slots": 64}, 2),
    ("abc-linformer, M=64", "abc-linformer", {"num_slots": 64}, 2),
    ("abc-random, M=64", "abc-random", {"num_slots": 64}, 2),
    ("abc-window, n=64", "abc-window", {"window": 64}, 2),
    ("abc-mlp, M=32, W_phi init", "abc-mlp", {"num_slots": 32, "phi_init_std": PHI_INIT_STD[False]}, 2),
    ("abc-cluster, M=32", "abc-cluster", {"num_clusters": 32}, 1),
    ("abc-mlp relu, M=32", "abc-mlp", {"num_slots": 32, "activation": "relu"}, 1),
    ("abc-mlp sigmoid, M=32", "abc-mlp", {"num_slots": 32, "activation": "sigmoid"}, 1),
    ("abc-mlp, M=8", "abc-mlp", {"num_slots": 8}, 1),
    ("abc-mlp, M=16", "abc-mlp", {"num_slots": 16}, 1),
    ("abc-mlp, M=128", "abc-mlp", {"num_slots": 128}, 1),
]
QUICK_MODELS = [
    ("softmax", "softmax", {}, 2),
    ("abc-mlp, M=4", "abc-mlp", {"num_slots": 4}, 1),
    ("abc-mlp, M=8", "abc-mlp", {"num_slots": 8}, 1),
    ("abc-random, M=8", "abc-random", {"num_slots": 8}, 1),
    ("abc-mlp, M=4, W_phi init", "abc-mlp", {"num_slots": 4, "phi_init_std": PHI_INIT_STD[True]}, 1),
]
SWEEP = "abc-mlp, M="  # rows of plain ABC_MLP (exp control, model init) form the sweep


def jobs_of(shared: list[str], quick: bool) -> list[tuple[str, Job]]:
    """(model, job) for every seed of every model, every model's seed 0 first (so a partial
    table has one of each soonest); seed 0 keeps the model's name."""
    models = QUICK_MODELS if quick else MODELS
    out = []
    for seed in range(max(seeds for *_, seeds in models)):
        for name, mechanism, options, seeds in models:
            if seed < seeds:
                settings = (*shared, f"attention={mechanism}",
                            *(f"attention.{k}={v}" for k, v in options.items()), f"train.seed={seed}")
                out.append((name, Job(name if seed == 0 else f"{name}, seed {seed}", settings)))
    return out


def measure(model, cfg, run_dir: Path, *, quick: bool) -> dict:
    """Test bits per character at both contexts, decoding speed, and slot usage (ABC_MLP)."""
    from memattn.analysis import abc_slot_usage, mean_statistics
    from memattn.evaluate import as_tensor, evaluate
    from memattn.generate import generate
    from memattn.models import CausalLM
    from memattn.train import load_run_corpus

    test = as_tensor(load_run_corpus(cfg).test)
    seq_len, batch = cfg.train.seq_len, cfg.train.batch_size
    context = seq_len - min(SCORED, seq_len // 4)
    scored = seq_len - context
    tokens = TEST_TOKENS[quick]
    short = evaluate(model, test, seq_len=seq_len, batch_size=batch,
                     max_batches=-(-tokens // (seq_len * batch)))
    long = evaluate(model, test, seq_len=scored, batch_size=batch, context=context,
                    max_batches=-(-tokens // (scored * batch)))
    prompt = test[:DECODE_PROMPT[quick]]
    start = time.perf_counter()
    produced = sum(1 for _ in generate(model, prompt[None], DECODE_TOKENS[quick], temperature=0))
    decode = produced / (time.perf_counter() - start)
    windows = test[:USAGE_WINDOWS * seq_len].view(USAGE_WINDOWS, seq_len)
    torch.manual_seed(cfg.train.seed)  # the model as training began (train seeds the same way)
    initial = CausalLM(cfg.model).eval()
    return {"attention": cfg.model.attention.name, "options": cfg.model.attention.options,
            "seed": cfg.train.seed, "test_bpc": short["bpc"], "test_tokens": short["tokens"],
            "test_bpc_context": long["bpc"], "context": context, "context_tokens": long["tokens"],
            "decode_tokens_per_s": decode,
            "slots_init": mean_statistics(abc_slot_usage(initial, windows)),
            "slots_trained": mean_statistics(abc_slot_usage(model, windows))}


def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict:
    out_dir = Path(out_dir)
    shared = [*(QUICK if quick else FULL), *overrides]
    pairs = jobs_of(shared, quick)

    def report(rows: dict[str, dict]) -> dict:
        done = [(name, job) for name, job in pairs if job.name in rows]
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        for _, job in done:
            shutil.copyfile(run_dir_of(out_dir, job) / "log.jsonl", out_dir / "logs" / f"{job.slug}.jsonl")
        result = {"experiment": "abc-lm", "quick": quick,
                  "command": command_of(out_dir, "abc-lm", quick, overrides), "config": shared,
                  "finished": f"{len(done)} of {len(pairs)} runs",
                  "models": summarise([name for name, _ in done], [rows[job.name] for _, job in done]),
                  "runs": [rows[job.name] for _, job in done],
                  "decode": {"prompt_tokens": DECODE_PROMPT[quick], "new_tokens": DECODE_TOKENS[quick],
                             "batch": 1, "sampling": "greedy"}}
        write_results(out_dir, result, markdown(result))
        plot(out_dir, result, done)
        return result

    rows = run_jobs(out_dir, [job for _, job in pairs], functools.partial(measure, quick=quick),
                    workers=jobs, label="abc-lm", on_rows=report)
    return report({job.name: row for (_, job), row in zip(pairs, rows)})


def summarise(names: list[str], rows: list[dict]) -> list[dict]:
    """One entry per model: the mean and spread (max − min) of its seeds' figures."""
    by_model: dict[str, list[dict]] = {}
    for name, row in zip(names, rows):
        by_model.setdefault(name, []).append(row)
    models = []
    for name, runs in by_model.items():
        entry = {"model": name, "attention": runs[0]["attention"], "options": runs[0]["options"],
                 "seeds": len(runs), "params": runs[0]["params"], "steps": runs[0]["steps"]}
        for key in ("test_bpc", "test_bpc_context", "val_bpc", "train_tokens_per_s", "decode_tokens_per_s", "train_s"):
            values = [r[key] for r in runs]
            entry[key] = statistics.fmean(values)
            entry[f"{key}_spread"] = max(values) - min(values)
        entry["context"] = runs[0]["context"]
        entry["test_tokens"], entry["context_tokens"] = runs[0]["test_tokens"], runs[0]["context_tokens"]
        for when in ("slots_init", "slots_trained"):
            if runs[0][when]:
                entry[when] = {k: statistics.fmean(r[when][k] for r in runs) for k in runs[0][when]}
        models.append(entry)
    return models


def _bpc(m: dict, key: str) -> str:
    spread = f" ± {m[f'{key}_spread'] / 2:.3f}" if m["seeds"] > 1 else ""
    return f"{m[key]:.3f}{spread}"


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
        *([f"**In progress: {result['finished']} finished; the table holds those.**", ""]
          if result["finished"].split()[0] != result["finished"].split()[2] else []),
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
        f"segment scored after the {context} before it). ± is half the spread of two seeds.",
        "",
        f"| model | seeds | parameters | test bpc, context 0 | vs softmax | test bpc, context {context} "
        "| vs softmax | val bpc | train tokens/s | decode tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        lines.append(
            f"| {m['model']} | {m['seeds']} | {m['params']:,} | {_bpc(m, 'test_bpc')} | "
            f"{m['test_bpc'] - base['test_bpc']:+.3f} | {_bpc(m, 'test_bpc_context')} | "
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
            "cosine: mean cosine between two slots' keys (1 = copies).",
            "",
            "| model | write spread, init → trained | slots read | per query | key cosine |",
            "|---|---:|---:|---:|---:|",
        ]
        for m in usage:
            a, b = m["slots_init"], m["slots_trained"]
            lines.append(f"| {m['model']} | {a['write_spread']:.2f} → {b['write_spread']:.2f} | "
                         f"{a['slots_read']:.1f} → {b['slots_read']:.1f} | "
                         f"{a['read_spread']:.1f} → {b['read_spread']:.1f} | "
                         f"{a['key_cosine']:.2f} → {b['key_cosine']:.2f} |")
    lines += ["", "Setup (shared `key=value` settings): `" + " ".join(result["config"]) + "`", "",
              "Figures: `learning_curves.png` (validation bits per character against steps), "
              "`memory_sweep.png` (test bits per character of ABC_MLP against its memory size); "
              "logs under `logs/`, every seed's figures in `results.json`.", ""]
    return "\n".join(lines)


def plot(out_dir: Path, result: dict, pairs) -> None:
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, job in pairs:
        if job.name != name:
            continue  # seed 0 only
        log = [json.loads(line) for line in (out_dir / "logs" / f"{job.slug}.jsonl").read_text().splitlines()]
        points = [(x["step"], x["val_bpc"]) for x in log if "val_bpc" in x]
        if points:
            ax.plot(*zip(*points), marker=".", label=name)
    ax.set(title="validation", xlabel="step", ylabel="bits per character")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out_dir / "learning_curves.png", dpi=120)

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
