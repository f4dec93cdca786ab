"""Persistent memory in place of the feed-forward sublayer (Sukhbaatar et al. 2019), small.

The paper's ablation on a character-level LM: a transformer with feed-forward sublayers,
all-attention with N persistent vectors per head (no feed-forward), the variants attn-split,
head-split, single-head and ff-attn, and all-attention with N = 0. Every model has the same
trunk (width, depth, heads, rotary positions, causal context of seq_len tokens)
and trains the same number of steps on the same batches; N is chosen per variant so that
the model has the transformer's parameter count (N = 0 cannot, and has fewer).

Written to out_dir: results.json, results.md (table, the command from command.txt,
the setup), learning_curves.png, logs/<row>.jsonl; the runs (checkpoints) go to out_dir/runs/.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from memattn.config import AttentionConfig, RunConfig, load_config
from memattn.evaluate import as_tensor
from memattn.experiments._common import command_of, write_results
from memattn.experiments._lm_common import plot_curves, train_and_test
from memattn.models import CausalLM

DESCRIPTION = ("persistent memory vs feed-forward (Sukhbaatar et al. 2019): transformer, "
               "all-attention and its variants at equal parameters and steps")

# Shared by every row; `overrides` from the command line come after (e.g. train.steps=400).
# One thread: on a shared CPU it trains faster than two fighting other processes for cores.
FULL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.ff_mult=4",
        "model.positions=rotary", "model.dropout=0.0",
        "train.seq_len=128", "train.batch_size=8", "train.steps=500", "train.lr=0.003",
        "train.warmup=50", "train.eval_every=100", "train.eval_batches=16", "train.log_every=10",
        "train.save_every=500", "train.threads=1"]
QUICK = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.ff_mult=4",
         "model.positions=rotary", "model.dropout=0.0",
         "train.seq_len=32", "train.batch_size=4", "train.steps=12", "train.lr=0.003",
         "train.warmup=2", "train.eval_every=6", "train.eval_batches=2", "train.log_every=3",
         "train.save_every=12", "train.threads=1"]
TEST_BATCHES = {False: 80, True: 2}  # test windows read: batches of train.batch_size

# (row, mechanism, options); n_persistent is set to match the transformer's parameters
# unless given.
ROWS = [
    ("transformer", "softmax", {}),
    ("all-attn", "persistent", {"variant": "all-attn"}),
    ("attn-split", "persistent", {"variant": "attn-split"}),
    ("head-split", "persistent", {"variant": "head-split"}),
    ("single-head", "persistent", {"variant": "single-head"}),
    ("ff-attn", "persistent", {"variant": "ff-attn"}),
    ("all-attn, N=0", "persistent", {"variant": "all-attn", "n_persistent": 0}),
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


def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict:
    from memattn.train import load_run_corpus

    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    shared = [*(QUICK if quick else FULL), *overrides]
    base = load_config(None, shared)
    corpus = load_run_corpus(base)
    vocab = corpus.vocab.size
    test_ids = as_tensor(corpus.test)
    target = count_parameters(load_config(None, [*shared, "attention=softmax"]), vocab)
    rows = []
    for name, mechanism, options in ROWS:
        options = dict(options)
        if mechanism == "persistent" and "n_persistent" not in options:
            options["n_persistent"] = matching_n(load_config(None, [*shared, f"attention={mechanism}"]),
                                                 options, target, vocab)
        _, _, row = train_and_test(out_dir, name, shared, mechanism, options, test_ids,
                                   TEST_BATCHES[quick])
        rows.append(row)
        print(f"{name:<16} N={options.get('n_persistent', '-')!s:<6} {row['params']:>9,} params  "
              f"test {row['test_bpc']:.3f} bpc  {row['train_s']:6.0f} s", flush=True)
    command = command_of(out_dir, "persistent-lm", quick, overrides)
    result = {"experiment": "persistent-lm", "quick": quick, "command": command, "config": shared,
              "corpus": corpus.name, "test_tokens": rows[0]["test_tokens"], "rows": rows}
    write_results(out_dir, result, markdown(result))
    plot_curves(out_dir, rows)
    return result


def markdown(result: dict) -> str:
    rows = result["rows"]
    base = rows[0]
    lines = [
        "# Persistent memory in place of the feed-forward sublayer",
        "",
        "Sukhbaatar et al. 2019, *Augmenting Self-attention with Persistent Memory*: the ablation, "
        "small. Same trunk, same batches, same number of steps for every row; N (persistent "
        "vectors per head, or per layer for single-head and ff-attn) chosen so that the model "
        "has the transformer's parameter count, except N = 0.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Corpus: {result['corpus']}; test bits per character over the first "
        f"{result['test_tokens']:,} characters of the test split.",
        "",
        "| model | N | parameters | test bpc | vs transformer | val bpc | train time (s) | tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r["options"].get("n_persistent", "–")
        lines.append(f"| {r['model']} | {n} | {r['params']:,} | {r['test_bpc']:.3f} | "
                     f"{r['test_bpc'] - base['test_bpc']:+.3f} | {r['val_bpc']:.3f} | "
                     f"{r['train_s']:.0f} | {r['train_tokens_per_s']:,.0f} |")
    lines += ["", *findings(result), "", "Setup (shared `key=value` settings): `" + " ".join(result["config"]) + "`", "",
              "Learning curves: `learning_curves.png` (training loss and validation bits per "
              "character against steps); logs under `logs/`.", ""]
    return "\n".join(lines)


def findings(result: dict) -> list[str]:
    """The paper's three findings next to what this run measured (test bpc differences)."""
    bpc = {r["model"]: r["test_bpc"] for r in result["rows"]}
    params = {r["model"]: r["params"] for r in result["rows"]}
    setting = dict(item.split("=", 1) for item in result["config"])
    steps, batch, seq = (int(setting[f"train.{k}"]) for k in ("steps", "batch_size", "seq_len"))
    all_attn, base, none = bpc["all-attn"], bpc["transformer"], bpc["all-attn, N=0"]
    others = [name for name in ("attn-split", "head-split", "single-head", "ff-attn") if name in bpc]
    return [
        "## Against the paper's findings",
        "",
        f"- Paper: all-attention on par with the transformer. Here: all-attn {all_attn:.3f} "
        f"against {base:.3f} bits per character ({all_attn - base:+.3f}).",
        f"- Paper: N = 0 clearly worse. Here: {none:.3f}, {none - all_attn:+.3f} against all-attn "
        f"(with {params['all-attn, N=0'] / params['all-attn']:.0%} of its parameters).",
        "- Paper: all-attn ahead of the variants. Here, against all-attn: "
        + ", ".join(f"{name} {bpc[name] - all_attn:+.3f}" for name in others) + ".",
        "",
        f"Scale: {steps} steps of {batch} x {seq} characters ({steps * batch * seq:,} in all) for "
        "each model, one seed. The models are far from converged, so the table measures how "
        "fast each variant learns at the start rather than what it can reach; the paper's "
        "comparison is between trained models with long contexts.",
    ]
