"""Attention with bounded-memory control (Peng et al. 2022) in translation, §5.2 small: the
decoder's causal and cross attention replaced by bounded memories of separate sizes.

Encoder-decoders on English → Spanish verse pairs of the Bible (World English Bible and
Reina-Valera 1909, Debian's sword-text-web and sword-text-sparv read with diatheke; split by
book, `research.data.bible`), a joint BPE vocabulary, label smoothing. Every model has the same
trunk and trains the same steps on the same batches; the encoder is softmax except in
MLP-exp-all. Rows (cross / causal memory sizes): softmax BASE; ABC_MLP 32/32 and 32/8;
Linformer, ABC_RD, window and cluster at 32/32; ABC_MLP with relu and sigmoid control at 32/8;
MLP-exp-all (ABC_MLP everywhere, encoder 32); and of Table 7's grid of cross ∈ {8, 16, 32, 64}
× causal ≤ cross for ABC_MLP the cells causal 8 and causal = cross (the others left out for
the CPU budget). BASE and ABC_MLP 32/8 run two seeds.

Each model is measured on the test split: loss and perplexity of the references, SacreBLEU
and chrF of beam-search translations. Once every model is trained, all are timed side by side
(training tokens/s) and, for BASE and ABC_MLP 32/8 (Figure 1), the time to decode a sentence
and the bytes of the decoding state (self and cross memories) against the output length.

Each model is a run folder under out_dir/runs/ (`research.experiments._runner`): running the
experiment again reuses finished models and resumes the others; `--jobs N` trains N at once.
`--quick` uses a small generated language pair instead of the Bible. Written to out_dir:
results.json, results.md, learning_curves.png, decoding.png, logs/.
"""

from __future__ import annotations

import functools
import random
import time
from pathlib import Path
from typing import Any

from research.experiments._common import by_model, save_figure, seed_figures, setup_line
from research.experiments._runner import Job, measured_side_by_side, run_experiment, side_by_side_note

DESCRIPTION = ("bounded-memory control (Peng et al. 2022) in translation: bounded cross and causal "
               "memories of separate sizes against softmax, with BLEU, on English-Spanish Bible verses")

FULL = ["task=translation", "data.corpus=parallel", "data.level=bpe", "data.bpe_size=4000",
        "model.d_model=128", "model.n_layers=3", "model.n_heads=4", "model.ff_mult=4",
        "model.positions=rotary", "model.dropout=0.1", "model.max_len=256", "model.init_std=0.088",
        "model.encoder_attention.name=softmax", "train.batch_size=32", "train.steps=3000",
        "train.lr=0.002", "train.warmup=200", "train.label_smoothing=0.1", "train.eval_every=500",
        "train.eval_batches=10", "train.log_every=25", "train.save_every=100", "train.threads=1"]
QUICK = ["task=translation", "data.corpus=parallel", "data.level=bpe", "data.bpe_size=300",
         "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.ff_mult=2",
         "model.positions=rotary", "model.dropout=0.0", "model.max_len=64", "model.init_std=0.17",
         "model.encoder_attention.name=softmax", "train.batch_size=8", "train.steps=10",
         "train.lr=0.003", "train.warmup=2", "train.label_smoothing=0.1", "train.eval_every=5",
         "train.eval_batches=2", "train.log_every=5", "train.save_every=5", "train.threads=1"]
MEASURE = {False: {"beam": 5, "sentences": 0}, True: {"beam": 2, "sentences": 8}}
# Figure 1: the rows whose decoding cost is drawn against the output length, and the lengths
FIGURE_1 = {False: {"profiled": ("softmax BASE", "abc-mlp 32/8"), "lengths": (16, 32, 64, 128, 256, 512)},
            True: {"profiled": ("softmax BASE", "abc-mlp 4/2"), "lengths": (4, 8, 16)}}


def mlp(cross: int, causal: int, **options) -> dict[str, Any]:
    return {"num_slots": causal, "cross_slots": cross, **options}


# (row, decoder mechanism, its options, seeds, settings of the run itself)
Model = tuple[str, str, dict[str, Any], int, tuple[str, ...]]
MODELS: list[Model] = [
    ("softmax BASE", "softmax", {}, 2, ()),
    ("abc-mlp 32/32", "abc-mlp", mlp(32, 32), 1, ()),
    ("abc-mlp 32/8", "abc-mlp", mlp(32, 8), 2, ()),
    ("abc-linformer 32/32", "abc-linformer", {"num_slots": 32}, 1, ()),
    ("abc-random 32/32", "abc-random", {"num_slots": 32}, 1, ()),
    ("abc-window 32/32", "abc-window", {"window": 32}, 1, ()),
    ("abc-cluster 32/32", "abc-cluster", {"num_clusters": 32}, 1, ()),
    ("abc-mlp relu 32/8", "abc-mlp", mlp(32, 8, activation="relu"), 1, ()),
    ("abc-mlp sigmoid 32/8", "abc-mlp", mlp(32, 8, activation="sigmoid"), 1, ()),
    ("MLP-exp-all 32/8", "abc-mlp", mlp(32, 8), 1,
     ("model.encoder_attention.name=abc-mlp", "model.encoder_attention.num_slots=32")),
    # Table 7's grid, as far as a CPU budget goes: every cross size with causal 8 and with
    # causal = cross (32/8 and 32/32 are rows above)
    *[(f"abc-mlp {cross}/{causal}", "abc-mlp", mlp(cross, causal), 1, ())
      for cross in (8, 16, 64) for causal in sorted({8, cross})],
]
QUICK_MODELS: list[Model] = [
    ("softmax BASE", "softmax", {}, 2, ()),
    ("abc-mlp 4/2", "abc-mlp", mlp(4, 2), 1, ()),
    ("abc-random 4/4", "abc-random", {"num_slots": 4}, 1, ()),
]
GRID = "abc-mlp "  # rows "abc-mlp CROSS/CAUSAL" with plain exp control form Table 7's grid
SEED_FIGURES = ("test_bleu", "test_chrf", "test_ppl", "val_ppl", "train_tokens_per_s", "train_s")


def jobs_of(models: list[Model], shared: list[str]) -> list[tuple[str, Job]]:
    """(model, job) for every seed of every model, every model's seed 0 first."""
    out = []
    for seed in range(max(m[3] for m in models)):
        for name, mechanism, options, seeds, extra in models:
            if seed < seeds:
                settings = (*shared, f"attention={mechanism}",
                            *(f"attention.{k}={v}" for k, v in options.items()), *extra,
                            f"train.seed={seed}")
                out.append((name, Job(name if seed == 0 else f"{name}, seed {seed}", settings)))
    return out


def decoding_profile(model, src, lengths, bos: int) -> list[dict[str, Any]]:
    """Greedy decoding of one source sentence src [1, S] forced to max(lengths) tokens (no
    stop): for each length, the seconds from the start (encoding included) and the bytes of
    the decoding state then (decoder cache and source memories)."""
    import torch

    from memattn.models.seq2seq import memory_nbytes

    out = []
    with torch.no_grad():
        start = time.perf_counter()
        memories = model.encode(src)
        cache = model.init_cache(1)
        token = torch.full((1, 1), bos, dtype=torch.long)
        for step in range(1, max(lengths) + 1):
            token = model.decode(token, memories, cache=cache)[:, -1].argmax(-1, keepdim=True)
            if step in lengths:
                out.append({"length": step, "seconds": time.perf_counter() - start,
                            "state_bytes": cache.nbytes() + memory_nbytes(memories)})
    return out


def corpus_of(cfg, run_dir: Path):
    """The parallel corpus of a trained run, read with its vocabulary."""
    from memattn.checkpoint import load_checkpoint
    from memattn.data import Vocab
    from memattn.translation import load_parallel_corpus

    return load_parallel_corpus(cfg, Vocab.from_json(load_checkpoint(run_dir / "checkpoint.safetensors").meta["vocab"]))


def measure(model, cfg, run_dir: Path, *, beam: int, sentences: int) -> dict[str, Any]:
    """Figures of a trained translation model on its test split (the first `sentences`
    pairs, 0: all): reference loss / perplexity, beam-search BLEU and chrF."""
    from memattn.translation import evaluate_pairs, score_translations, translate_texts

    corpus = corpus_of(cfg, run_dir)
    vocab, test = corpus.vocab, corpus.split("test")
    n = min(sentences, len(test)) if sentences else len(test)
    batch = cfg.train.batch_size
    ref = evaluate_pairs(model, test, vocab, batch_size=batch, max_batches=-(-n // batch), device="cpu")
    start = time.perf_counter()
    hyps = translate_texts(model, vocab, test.source_text[:n], beam=beam, batch_size=batch,
                           where="the test split")
    seconds = time.perf_counter() - start
    scores = score_translations(hyps, test.target_text[:n])
    return {"attention": cfg.model.attention.name, "options": cfg.model.attention.options,
            "seed": cfg.train.seed, "test_loss": ref["loss"], "test_ppl": ref["ppl"],
            "test_bleu": scores["bleu"], "test_chrf": scores["chrf"],
            "bleu_signature": scores["bleu_signature"], "test_sentences": n, "beam": beam,
            "translate_s": round(seconds, 1), "examples": [
                {"source": s, "reference": r, "output": h}
                for s, r, h in list(zip(test.source_text, test.target_text, hyps))[:3]],
            "decoding": []}  # Figure 1's rows: taken side by side once every model is trained


def side_by_side(out_dir: Path, jobs: list[Job], *, profiled: tuple[str, ...], lengths) -> dict[str, dict] | None:
    """Training target tokens per second of every model (step 0's batch) and the decoding
    profile of the `profiled` rows (the first test sentence), by job name, taken side by side
    (`_runner.measured_side_by_side`; no mechanism here has a cost that depends on its
    weights, so runs whose checkpoint is gone are measured on stand-ins)."""
    import torch

    from research.experiments._common import training_tokens_per_s
    from memattn.train import model_from_checkpoint
    from memattn.translation import TranslationTask

    def figures(job: Job, run_dir: Path) -> dict[str, Any]:
        model, cfg, _ = model_from_checkpoint(run_dir)
        task = TranslationTask(cfg, corpus_of(cfg, run_dir))
        batch = task.batch(0, 0, 1)

        def loss_of() -> tuple[torch.Tensor, int]:
            total, scored, _ = task.loss(model, batch)
            return total / scored, task.tokens(batch)

        speed = training_tokens_per_s(model, loss_of)
        source = torch.as_tensor(task.corpus.split("test").source[0], dtype=torch.long)[None]
        return {"train_tokens_per_s": speed,
                "decoding": decoding_profile(model, source, lengths, task.vocab.bos_id) if job.name in profiled else []}

    return measured_side_by_side(out_dir, jobs, figures, stand_ins=True)


def summarise(names: list[str], rows: list[dict]) -> list[dict]:
    """One entry per model: the mean of its seeds' figures and their spread (max − min)."""
    return [{"model": name, "seeds": len(runs), **{k: runs[0][k] for k in (
                "attention", "options", "params", "steps", "test_sentences", "beam", "bleu_signature",
                "examples", "decoding")}, **seed_figures(runs, SEED_FIGURES)}
            for name, runs in by_model(names, rows).items()]


def quick_pairs(folder: Path, seed: int = 0) -> Path:
    """A small generated language pair for --quick: each source word has its own target word
    and adjacent words swap pairwise, so a model must read the source to translate it."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(24)]
    mapping = {w: f"t{(i * 7) % 24}" for i, w in enumerate(words)}
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 400), ("val", 40), ("test", 40)):
        lines = []
        for _ in range(count):
            src = [rng.choice(words) for _ in range(rng.randint(2, 8))]
            tgt = [mapping[w] for w in src]
            for i in range(0, len(tgt) - 1, 2):
                tgt[i], tgt[i + 1] = tgt[i + 1], tgt[i]
            lines.append(f"{' '.join(src)}\t{' '.join(tgt)}\n")
        (folder / f"{split}.tsv").write_text("".join(lines), encoding="utf-8")
    return folder


def data_settings(out_dir: Path, quick: bool, overrides: list[str]) -> list[str]:
    """The data of the experiment: what the overrides name, else (quick) a generated pair, else
    the Bible (prepared and cached by `research.data.bible`, installing its packages)."""
    if any(o.split("=", 1)[0] in ("data.path", "data.source", "data.name") for o in overrides):
        return []
    if quick:
        return [f"data.path={quick_pairs(Path(out_dir) / 'data')}"]
    from research.data.bible import prepare_bible

    return [f"data.path={prepare_bible('.cache/memattn')}"]


def run(out_dir: Path, *, quick: bool, overrides: list[str], jobs: int = 1) -> dict:
    shared = [*(QUICK if quick else FULL), *data_settings(out_dir, quick, overrides), *overrides]
    models = QUICK_MODELS if quick else MODELS
    return run_experiment(out_dir, "abc-mt", jobs_of(models, shared), shared,
                          quick=quick, overrides=overrides, jobs=jobs,
                          measure=functools.partial(measure, **MEASURE[quick]), summarise=summarise,
                          markdown=markdown, curve=("val_ppl", "perplexity"), plots=plot_decoding,
                          extra={"grid_planned": sorted(grid_cells([{"model": m[0]} for m in models]))},
                          side_by_side=functools.partial(side_by_side, **FIGURE_1[quick]))


def cell(m: dict, key: str, digits: int = 2) -> str:
    """'mean ± half the spread' over seeds, or the one figure."""
    spread = f" ± {m[f'{key}_spread'] / 2:.{digits}f}" if m["seeds"] > 1 else ""
    return f"{m[key]:.{digits}f}{spread}"


def grid_cells(models: list[dict]) -> dict[tuple[int, int], dict]:
    """Table 7's cells (cross, causal) -> model, from the plain ABC_MLP rows."""
    out = {}
    for m in models:
        size = m["model"][len(GRID):]
        if m["model"].startswith(GRID) and "/" in size and size.replace("/", "").isdigit():
            cross, causal = map(int, size.split("/"))
            out[(cross, causal)] = m
    return out


def cell_names(cells) -> str:
    return ", ".join(f"{cross}/{causal}" for cross, causal in cells)


def grid_note(planned: list, finished: dict) -> list[str]:
    """The lines under Table 7's grid naming its empty cells: those of cross × causal ≤ cross
    (over the sizes of the planned cells) that were left out, and planned ones not finished."""
    planned = {tuple(c) for c in planned}
    sizes = sorted({s for c in planned for s in c})
    crosses = sorted({cross for cross, _ in planned})
    left_out = [(c, k) for c in crosses for k in sizes if k <= c and (c, k) not in planned]
    waiting = sorted(planned - set(finished))
    lines = []
    if left_out:
        lines.append(f"Cells left out for the CPU budget (cross/causal): {cell_names(left_out)}.")
    if waiting:
        lines.append(f"Not finished yet: {cell_names(waiting)}.")
    return ["", " ".join(lines)] if lines else []


def markdown(result: dict) -> str:
    models = result["models"]
    base = next((m for m in models if m["attention"] == "softmax"), models[0])
    setting = dict(item.split("=", 1) for item in result["config"])
    steps, batch = int(setting["train.steps"]), int(setting["train.batch_size"])
    lines = [
        "# Attention with bounded-memory control in translation",
        "",
        *([f"**In progress: {result['finished']} of {result['runs_planned']} runs finished; the "
           "tables hold those.**", ""] if result["finished"] < result["runs_planned"] else []),
        "Peng et al. 2022, *ABC: Attention with Bounded-memory Control*, §5.2 (Tables 4, 7, 8 and "
        "Figure 1) small: the decoder's causal and cross attention are bounded memories of separate "
        "sizes (cross / causal slots); same trunk, batches and steps for every model.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Budget: {steps:,} steps of {batch} sentence pairs per model; BASE has {base['params']:,} "
        f"parameters and trained in {base['train_s'] / 60:.0f} min on one CPU thread. Test: "
        f"{base['test_sentences']:,} sentences, beam {base['beam']}, length penalty 0.6; "
        f"SacreBLEU `{base['bleu_signature']}`. ± is half the spread of two seeds. " + timing_note(result),
        "",
        "| model | seeds | parameters | test BLEU | vs BASE | chrF | test perplexity | val perplexity "
        "| train tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        lines.append(f"| {m['model']} | {m['seeds']} | {m['params']:,} | {cell(m, 'test_bleu')} | "
                     f"{m['test_bleu'] - base['test_bleu']:+.2f} | {cell(m, 'test_chrf')} | "
                     f"{m['test_ppl']:.2f} | {m['val_ppl']:.2f} | {m['train_tokens_per_s']:,.0f} |")
    grid = grid_cells(models)
    if grid:
        sizes = sorted({c for c, _ in grid} | {c for _, c in grid})
        lines += ["", "## ABC_MLP's memory sizes (Table 7): test BLEU, cross rows × causal columns", "",
                  "| cross \\ causal | " + " | ".join(map(str, sizes)) + " |",
                  "|---|" + "---:|" * len(sizes)]
        for cross in sorted({c for c, _ in grid}):
            lines.append(f"| {cross} | " + " | ".join(
                f"{grid[(cross, c)]['test_bleu']:.2f}" if (cross, c) in grid else "" for c in sizes) + " |")
        lines += grid_note(result.get("grid_planned", []), grid)
    profiled = [m for m in models if m["decoding"]]
    if profiled:
        lengths = [p["length"] for p in profiled[0]["decoding"]]
        lines += ["", "## Decoding one sentence (Figure 1): seconds, and state KiB, against output length",
                  "", "| model | " + " | ".join(str(n) for n in lengths) + " |",
                  "|---|" + "---:|" * len(lengths)]
        for m in profiled:
            lines.append(f"| {m['model']} | " + " | ".join(
                f"{p['seconds']:.2f} s, {p['state_bytes'] / 1024:,.0f} KiB" for p in m["decoding"]) + " |")
    lines += ["", "## Examples (BASE, test)", ""]
    for e in base["examples"]:
        lines += [f"- source: {e['source']}", f"  - reference: {e['reference']}", f"  - output: {e['output']}"]
    lines += ["", *findings(models), "",
              setup_line(result["config"]), "",
              "Figures: `learning_curves.png` (validation perplexity against steps), `decoding.png` "
              "(Figure 1: time and state bytes against output length); logs under `logs/`, every "
              "seed's figures and three example translations per model in `results.json`.", ""]
    return "\n".join(lines)


def timing_note(result: dict) -> str:
    """Where the tokens/s and decoding times come from."""
    return side_by_side_note(result, "Tokens/s and decoding times", "training is a forward, backward and "
                             "optimiser step on a batch of the run's shape, decoding is greedy at batch 1")


def findings(models: list[dict]) -> list[str]:
    """The paper's findings next to what these tables measured (test BLEU)."""
    by = {m["model"]: m for m in models}
    lines = ["## The paper found / we measured", ""]
    base = by.get("softmax BASE")
    if base and "abc-mlp 32/8" in by:
        m = by["abc-mlp 32/8"]
        lines.append(f"- **Small bounded memories match softmax.** The paper found ABC_MLP with 32 cross "
                     f"and 8 causal slots on par with the softmax BASE. We measured "
                     f"{m['test_bleu']:.2f} against {base['test_bleu']:.2f} BLEU "
                     f"({m['test_bleu'] - base['test_bleu']:+.2f}).")
    rivals = [by[n] for n in ("abc-linformer 32/32", "abc-random 32/32") if n in by]
    if rivals and "abc-mlp 32/32" in by:
        m = by["abc-mlp 32/32"]
        lines.append("- **Learned control beats fixed control.** The paper found ABC_MLP ahead of "
                     "Linformer and ABC_RD at the same sizes. We measured: " + "; ".join(
                         f"{m['model']} {m['test_bleu'] - r['test_bleu']:+.2f} BLEU against {r['model']}"
                         for r in rivals) + ".")
    for plain, others, what in (("abc-mlp 32/32", ("abc-window 32/32", "abc-cluster 32/32"),
                                 "window and clustering control"),
                                ("abc-mlp 32/8", ("abc-mlp relu 32/8", "abc-mlp sigmoid 32/8"),
                                 "relu and sigmoid in place of exp")):
        rows = [by[n] for n in others if n in by]
        if rows and plain in by:
            lines.append(f"- **Table 8: {what}.** The paper compares them with ABC_MLP's learned exp "
                         f"control, the one it proposes. We measured {plain} at "
                         f"{by[plain]['test_bleu']:.2f} BLEU; " + "; ".join(
                             f"{r['model']} {r['test_bleu'] - by[plain]['test_bleu']:+.2f}" for r in rows) + ".")
    if base and "MLP-exp-all 32/8" in by and "abc-mlp 32/8" in by:
        every, decoder = by["MLP-exp-all 32/8"], by["abc-mlp 32/8"]
        lines.append(f"- **Every attention bounded** (MLP-exp-all: the encoder's too, 32 slots), a row of "
                     f"the paper's Table 4. We measured {every['test_bleu']:.2f} BLEU against "
                     f"{decoder['test_bleu']:.2f} with the decoder's alone bounded and "
                     f"{base['test_bleu']:.2f} for BASE.")
    grid = grid_cells(models)
    crosses = sorted({c for c, _ in grid})
    pairs = [(cross, grid[(cross, 8)]["test_bleu"], grid[(cross, cross)]["test_bleu"])
             for cross in crosses if cross > 8 and {(cross, 8), (cross, cross)} <= set(grid)]
    if pairs:
        lines.append("- **A small causal memory is enough.** The paper found 8 causal slots enough next to "
                     "32 cross slots. We measured causal 8 against causal = cross: " + "; ".join(
                         f"cross {c}: {small:.2f} against {same:.2f} ({small - same:+.2f})"
                         for c, small, same in pairs) + " BLEU.")
    column = [(cross, grid[(cross, 8)]["test_bleu"]) for cross in crosses if (cross, 8) in grid]
    if len(column) > 1:
        lines.append("- **The cross memory's size** (Table 7's other axis). We measured at causal 8: " + ", ".join(
            f"cross {c}: {b:.2f}" for c, b in column) + " BLEU" + (
            f", against {base['test_bleu']:.2f} for BASE." if base else "."))
    profiled = {m["attention"]: m for m in models if m["decoding"]}
    if {"softmax", "abc-mlp"} <= set(profiled):
        s, a = profiled["softmax"]["decoding"], profiled["abc-mlp"]["decoding"]
        lines.append(f"- **Decoding cost flat in the length.** The paper found ABC_MLP's decoding time "
                     f"and memory flat in the output length and softmax's growing. We measured the "
                     f"state from {s[0]['length']} to {s[-1]['length']} tokens: softmax "
                     f"{s[0]['state_bytes'] / 1024:,.0f} → {s[-1]['state_bytes'] / 1024:,.0f} KiB, "
                     f"ABC_MLP {a[0]['state_bytes'] / 1024:,.0f} → {a[-1]['state_bytes'] / 1024:,.0f} KiB; "
                     f"time for {s[-1]['length']} tokens {s[-1]['seconds']:.2f} s against "
                     f"{a[-1]['seconds']:.2f} s.")
    return lines


def plot_decoding(out_dir: Path, result: dict) -> None:
    """decoding.png: seconds to decode a sentence and state bytes against its length."""
    profiled = [m for m in result["models"] if m["decoding"]]
    if not profiled:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for m in profiled:
        n = [p["length"] for p in m["decoding"]]
        left.plot(n, [p["seconds"] for p in m["decoding"]], marker="o", label=m["model"])
        right.plot(n, [p["state_bytes"] / 1024 for p in m["decoding"]], marker="o", label=m["model"])
    for ax, label in ((left, "seconds per sentence"), (right, "decoding state, KiB")):
        ax.set(xlabel="output tokens", ylabel=label, xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("abc-mt: decoding one sentence (batch 1, CPU)")
    fig.tight_layout()
    save_figure(fig, out_dir / "decoding.png", dpi=120)
