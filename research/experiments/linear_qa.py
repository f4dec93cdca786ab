"""Cheap linear attention (de Brébisson & Vincent 2016): question answering and lookup cost.

Two measurements, as in the paper:

1. Accuracy. The same QA model (bidirectional GRU document encoder, GRU query encoder,
   `memattn.models.qa.ReadingQA`) is trained with attention none, softmax, linear and
   gated-linear, with equal settings and the same data, on the synthetic reading task
   (`memattn.data.reading`: cloze queries about entity facts spread through documents).
   Test accuracy on fresh documents of the training lengths, and on longer ones; training
   time; the linear forms' accuracy again from their stored k×k representations alone.
2. Lookup cost. Answering a batch of queries against one document of n states (k = 100):
   softmax attention reads all n states, O(n·k) a query; linear attention reads its
   precomputed C, O(k²) a query. Median time over repeats for n = 250 … 8,000, and the
   bytes each must keep per document (n·k against k²).

    memattn experiment linear-qa [--quick] [steps=600 hidden=32 doc_len=[100,400] seed=0 ...]

Writes results.json, results.md and linear_qa.png to the output folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from memattn.config import TrainConfig, to_dict
from memattn.data.reading import ReadingBatch, ReadingConfig, ReadingTask
from memattn.errors import ConfigError
from research.experiments._common import by_model, command_of, compare, save_figure, seed_figures, write_results
from research.experiments._runner import ROW_FILE, Job, finished_row, run_jobs
from memattn.fileio import atomic_write
from memattn.models.qa import ATTENTIONS, QAConfig, ReadingQA
from memattn.ops.softmax import softmax_attention
from memattn.representations import encode, lookup
from memattn.train import lr_at
from memattn.typed import parse_settings as parse_typed

DESCRIPTION = ("cheap linear attention: QA accuracy of none / softmax / linear / gated-linear "
               "and per-query lookup cost vs document length")


@dataclass
class Settings:
    """What the experiment runs; every field can be overridden as key=value."""

    variants: tuple[str, ...] = ATTENTIONS  # which attentions to train
    seeds: int = 2  # seeds per variant (init and batches)
    # convergence: validation accuracy every eval_every steps; a model has converged when
    # `patience` evaluations in a row fail to beat its best by min_delta; `steps` at most
    steps: int = 8000
    eval_every: int = 200
    patience: int = 5
    min_delta: float = 0.005
    val_docs: int = 500
    batch: int = 32  # documents a step (each with `queries` queries)
    lr: float = 3e-3  # Adam, warm-up then cosine decay to a tenth
    hidden: int = 32  # GRU width per direction: k = 2·hidden
    embed: int = 32
    doc_len: tuple[int, int] = (100, 400)  # training and test documents, tokens
    long_len: tuple[int, int] = (1000, 2000)  # the longer test documents (not trained on)
    queries: int = 4  # cloze queries per document
    entities: int = 40
    places: int = 30  # answer classes: chance = 1 / places
    relations: int = 4
    test_docs: int = 500
    seed: int = 0
    threads: int = 1  # torch threads (GRUs on a shared CPU run fastest on one)
    lookup_k: int = 100
    lookup_lengths: tuple[int, ...] = (250, 500, 1000, 2000, 4000, 8000)
    lookup_queries: int = 100  # queries answered per timed call
    lookup_repeats: int = 21

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in ATTENTIONS]
        if unknown or len(set(self.variants)) != len(self.variants):
            raise ConfigError(f"variants: expected distinct names among {', '.join(ATTENTIONS)}, "
                              f"got {list(self.variants)}")
        for f in dataclasses.fields(self):
            if f.name == "variants":
                continue
            value = getattr(self, f.name)
            values = value if isinstance(value, tuple) else (value,)
            if any(v < 0 or (v == 0 and f.name != "seed") for v in values):
                raise ConfigError(f"{f.name}: expected positive values, got {value!r}")
        for name in ("doc_len", "long_len"):
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ConfigError(f"{name}: expected [shortest, longest], got {[lo, hi]}")


QUICK = {"steps": 40, "eval_every": 10, "patience": 2, "val_docs": 32, "seeds": 1, "batch": 16,
         "hidden": 16, "embed": 16, "doc_len": (100, 200), "long_len": (300, 400), "test_docs": 64,
         "lookup_repeats": 5}


def parse_settings(overrides: list[str], *, quick: bool) -> Settings:
    """Settings from the defaults (or QUICK), then `key=value` overrides checked by type."""
    return parse_typed(Settings, overrides, QUICK if quick else {}, name="linear-qa")


def run(out_dir: Path, *, quick: bool = False, overrides: list[str] = (), jobs: int = 1) -> dict:
    """Train every (variant, seed) to convergence as a resumable run folder, `jobs` at a
    time; time lookups; write the results under out_dir."""
    settings = parse_settings(list(overrides), quick=quick)
    out_dir = Path(out_dir)
    pairs = jobs_of(settings, quick, list(overrides))
    rows = run_jobs(out_dir, [job for _, job in pairs], None, workers=jobs, label="linear-qa",
                    work=train_job, steps_of=lambda job: job_settings(job).steps)
    variants = summarise([variant for variant, _ in pairs], rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        costs = lookup_costs(settings)
    finally:
        torch.set_num_threads(threads)
    results = {
        "experiment": "linear-qa",
        "settings": to_dict(settings),
        "quick": quick,
        "chance": reading_task(settings).chance,
        "task": to_dict(reading_task(settings).config),
        "variants": variants,
        "runs": rows,
        "lookup": costs,
        "environment": {"torch": torch.__version__, "threads": settings.threads,
                        "machine": platform.machine(), "processor": platform.processor()},
    }
    write_results(out_dir, results,
                  render_markdown(results, command_of(out_dir, "linear-qa", quick, overrides)))
    plot(results, out_dir / "linear_qa.png")
    return results


def jobs_of(s: Settings, quick: bool, overrides: list[str]) -> list[tuple[str, Job]]:
    """(variant, job) for every seed of every variant, seed 0 of each first; a job's settings
    are the quick ones (if any), the overrides, then its own variant and seed."""
    base = [*(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in (QUICK if quick else {}).items()),
            *overrides]
    return [(variant, Job(variant if seed == 0 else f"{variant}, seed {seed}",
                          (*base, f"variants=[{variant}]", f"seed={seed}")))
            for seed in range(s.seeds) for variant in s.variants]


def job_settings(job: Job) -> Settings:
    return parse_settings(list(job.settings), quick=False)


def reading_task(s: Settings, doc_len: tuple[int, int] | None = None) -> ReadingTask:
    return ReadingTask(ReadingConfig(n_entities=s.entities, n_places=s.places, n_relations=s.relations,
                                     doc_len=doc_len or s.doc_len, queries_per_doc=s.queries))


def train_job(run_dir: Path, job: Job, measure=None) -> dict:
    """Train one variant from its seed on fresh batches until it converges (or `steps`), in
    run_dir: checkpoint.safetensors (model, optimiser, step, evaluations) every evaluation,
    best.safetensors (the weights of the best validation accuracy), log.jsonl; resumed from
    the checkpoint when there is one. The row (row.json) is the best weights' test figures."""
    from memattn.checkpoint import load_checkpoint, restore, save_checkpoint

    row = finished_row(run_dir, job)
    if row is not None:
        return row
    s = job_settings(job)
    (attention,) = s.variants
    torch.set_num_threads(s.threads)
    task = reading_task(s)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "settings.json", lambda tmp: tmp.write_text(json.dumps(list(job.settings))))
    torch.manual_seed(s.seed)
    model = ReadingQA(QAConfig(task.vocab_size, task.n_answers, attention=attention,
                               embed=s.embed, hidden=s.hidden))
    opt = torch.optim.Adam(model.parameters(), lr=s.lr)
    # warm-up over the first 5 % of the steps, then cosine to a tenth
    schedule = TrainConfig(steps=s.steps, lr=s.lr, warmup=max(1, s.steps // 20), min_lr_ratio=0.1)

    ckpt, best_file, log = run_dir / "checkpoint.safetensors", run_dir / "best.safetensors", run_dir / "log.jsonl"
    state = {"step": 0, "seconds": 0.0, "evals": [], "best": -1.0, "best_step": 0, "stale": 0}
    if ckpt.exists():
        saved = load_checkpoint(ckpt)
        restore(saved, model, opt)
        state = saved.meta["state"]
        kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= state["step"]]
        atomic_write(log, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)))
    val = task.batch(s.val_docs, seed=f"{s.seed}/val")
    model.train()
    losses: list[float] = []
    while state["step"] < s.steps and state["stale"] < s.patience:
        step = state["step"]
        batch = task.batch(s.batch, seed=f"{s.seed}/train/{step}")  # the same data for every variant
        for group in opt.param_groups:
            group["lr"] = lr_at(step, schedule)
        start = time.perf_counter()
        logits = model(batch.docs, batch.doc_lengths, batch.queries, batch.query_lengths)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.answers.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["seconds"] += time.perf_counter() - start
        state["step"] = step + 1
        losses.append(loss.item())
        if state["step"] % s.eval_every and state["step"] < s.steps:
            continue
        model.eval()
        acc = accuracy(model, val)
        model.train()
        improved = acc > state["best"] + s.min_delta
        state["stale"] = 0 if improved else state["stale"] + 1
        if acc > state["best"]:
            state["best"], state["best_step"] = acc, state["step"]
            save_checkpoint(best_file, model, step=state["step"], meta={"state": dict(state)})
        record = {"step": state["step"], "loss": round(statistics.fmean(losses), 4), "val_accuracy": acc}
        state["evals"].append(record)
        losses = []
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
        save_checkpoint(ckpt, model, step=state["step"], optimizer=opt, meta={"state": state})
    restore(load_checkpoint(best_file), model)
    model.eval()
    test = task.batch(s.test_docs, seed=f"{s.seed}/test")
    test_long = reading_task(s, s.long_len).batch(max(s.test_docs // 4, 8), seed=f"{s.seed}/long")
    row = {
        "variant": attention, "seed": s.seed, "settings": list(job.settings),
        "accuracy": accuracy(model, test),
        "accuracy_long": accuracy(model, test_long),
        "val_accuracy": state["best"], "best_step": state["best_step"], "steps": state["step"],
        "converged": state["stale"] >= s.patience,
        "train_seconds": round(state["seconds"], 2),
        "seconds_per_step": round(state["seconds"] / max(1, state["step"]), 4),
        "final_loss": state["evals"][-1]["loss"],
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if attention in ("linear", "gated-linear"):
        row["accuracy_from_representations"] = accuracy(model, test, stored=True)
    text = json.dumps(row, indent=2) + "\n"
    atomic_write(run_dir / ROW_FILE, lambda tmp: tmp.write_text(text))
    return row


FIGURES = ("accuracy", "accuracy_long", "accuracy_from_representations", "train_seconds",
           "seconds_per_step", "final_loss", "steps", "best_step")


def summarise(variants: list[str], rows: list[dict]) -> dict[str, dict]:
    """Per variant: the mean of its seeds' figures, their spread (max − min), and whether
    every seed converged."""
    return {variant: {"seeds": len(runs), "parameters": runs[0]["parameters"],
                      "converged": all(r["converged"] for r in runs), **seed_figures(runs, FIGURES)}
            for variant, runs in by_model(variants, rows).items()}


@torch.no_grad()
def accuracy(model: ReadingQA, data: ReadingBatch, *, stored: bool = False,
             chunk: int = 64) -> float:
    """Fraction of queries answered right; stored=True answers from k×k representations."""
    right = total = 0
    for i in range(0, len(data), chunk):
        part = slice(i, i + chunk)
        docs, lengths = data.docs[part], data.doc_lengths[part]
        docs = docs[:, : int(lengths.max())]
        if stored:
            logits = model.answer(model.represent(docs, lengths), data.queries[part],
                                  data.query_lengths[part])
        else:
            logits = model(docs, lengths, data.queries[part], data.query_lengths[part])
        right += int((logits.argmax(-1) == data.answers[part]).sum())
        total += data.answers[part].numel()
    return round(right / total, 4)


# Lookup cost --------------------------------------------------------------------------------


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def lookup_costs(s: Settings) -> list[dict]:
    """Per-query time of softmax (over n states) and linear (C q) reads, and memory held."""
    k, m = s.lookup_k, s.lookup_queries
    g = torch.Generator().manual_seed(s.seed)
    rows = []
    for n in s.lookup_lengths:
        h = torch.randn(1, n, k, generator=g) / math.sqrt(k)  # one document's states
        q = torch.randn(1, m, k, generator=g)
        reps = encode(h)  # C = Σ h hᵀ, once per document
        encode_seconds = _median_seconds(lambda h=h: encode(h), max(1, s.lookup_repeats // 3))
        states = h[:, :, None]  # [1, n, 1, k]: what softmax attention must keep

        def softmax_read(q=q, states=states):
            return softmax_attention(q[:, :, None], states, states, causal=False)[0]

        def linear_read(q=q, reps=reps):
            return lookup(reps, q)

        # Alternate the two so that a busy machine slows both alike.
        soft, lin = [], []
        for _ in range(3):
            soft.append(_median_seconds(softmax_read, max(1, s.lookup_repeats // 3)))
            lin.append(_median_seconds(linear_read, max(1, s.lookup_repeats // 3)))
        soft_us, lin_us = 1e6 * min(soft) / m, 1e6 * min(lin) / m
        rows.append({
            "n": n, "k": k, "queries_per_call": m,
            "softmax_us_per_query": round(soft_us, 3),
            "linear_us_per_query": round(lin_us, 3),
            "speedup": round(soft_us / lin_us, 2),
            "n_over_k": round(n / k, 2),
            "encode_ms": round(1e3 * encode_seconds, 3),
            "softmax_bytes": states.numel() * states.element_size(),
            "linear_bytes": reps.nbytes(),
        })
    return rows


# Output -------------------------------------------------------------------------------------


def render_markdown(results: dict, command: str) -> str:
    s = results["settings"]
    v = results["variants"]
    lines = [
        "# Cheap linear attention: question answering and lookup cost",
        "",
        "de Brébisson & Vincent 2016, *A cheap linear attention mechanism with fast lookups "
        "and fixed-size representations*, reproduced small on a synthetic reading task.",
        "",
        "```sh",
        command,
        "```",
        "",
        "## Accuracy",
        "",
        f"Synthetic reading task (`memattn.data.reading`): documents of {s['doc_len'][0]}–"
        f"{s['doc_len'][1]} tokens stating facts about {s['entities']} entities and "
        f"{s['relations']} relations among filler sentences; {s['queries']} cloze queries a "
        f"document (\"entity_17 lives in @placeholder\"), answered by one of {s['places']} "
        f"places. Chance (any reader that ignores the document): "
        f"{100 * results['chance']:.1f} %. Each variant: the same model (bidirectional GRU, "
        f"hidden {s['hidden']} per direction, so k = {2 * s['hidden']}), batches of "
        f"{s['batch']} documents (the same batches for every variant of a seed), {s['seeds']} "
        f"seed(s). Trained to convergence: validation accuracy ({s['val_docs']} documents) "
        f"every {s['eval_every']} steps, stopped once {s['patience']} evaluations in a row "
        f"fail to beat the best by {100 * s['min_delta']:g} points (at most {s['steps']:,} "
        f"steps); the weights of the best validation accuracy are tested on {s['test_docs']} "
        f"documents ({s['test_docs'] * s['queries']} queries); \"longer\" are documents of "
        f"{s['long_len'][0]}–{s['long_len'][1]} tokens, a length not trained on. ± is half "
        "the spread over seeds.",
        "",
        "| attention | seeds | test accuracy | longer documents | from stored C | converged | "
        "best step | steps | training time (s) | s / step | parameters |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]

    def pct(r: dict, key: str) -> str:
        if key not in r:
            return "—"
        spread = f" ± {50 * r[f'{key}_spread']:.1f}" if r["seeds"] > 1 else ""
        return f"{100 * r[key]:.1f}{spread} %"

    for name, r in v.items():
        lines.append(
            f"| {name} | {r['seeds']} | {pct(r, 'accuracy')} | {pct(r, 'accuracy_long')} | "
            f"{pct(r, 'accuracy_from_representations')} | {'yes' if r['converged'] else 'no'} | "
            f"{r['best_step']:,.0f} | {r['steps']:,.0f} | {r['train_seconds']:.0f} | "
            f"{r['seconds_per_step']:.3f} | {r['parameters']:,} |")
    lines += [
        "",
        "Training time counts the model's steps only (forward, backward, update; not the data "
        "generation), on a CPU that may be shared with other jobs. \"From stored C\": the same "
        "test queries answered from the documents' k×k representations alone "
        "(`ReadingQA.represent` then `ReadingQA.answer`). Each (variant, seed) is a run folder "
        "under `runs/` (resumed where it stopped; `--jobs N` trains N at once).",
        "",
        "## Lookup cost",
        "",
        f"One document of n states of size k = {s['lookup_k']}, a batch of "
        f"{s['lookup_queries']} queries per call, {results['environment']['threads']} "
        f"thread(s); the time per query is the best of three medians of "
        f"{max(1, s['lookup_repeats'] // 3)} calls. Softmax attention reads the n states "
        "(`softmax_attention`), linear attention reads C = Σ h hᵀ built once "
        "(`memattn.representations.lookup`). The states are random: a read costs the same "
        "whatever their values, so this part does not depend on the trained models (whose "
        f"k = 2·hidden = {2 * s['hidden']}). Bytes: what each must keep per document.",
        "",
        "| n | softmax µs / query | linear µs / query | speedup | n / k | encode C (ms) "
        "| softmax bytes | linear bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["lookup"]:
        lines.append(
            f"| {r['n']:,} | {r['softmax_us_per_query']:.2f} | {r['linear_us_per_query']:.2f} | "
            f"{r['speedup']:.1f}× | {r['n_over_k']:g} | {r['encode_ms']:.2f} | "
            f"{r['softmax_bytes']:,} | {r['linear_bytes']:,} |")
    env = results["environment"]
    lines += ["", f"torch {env['torch']}, {env['machine']}, {env['threads']} thread(s).", "",
              *findings(results), ""]
    if results["quick"]:
        lines.insert(2, "**Quick smoke run: too small for its numbers to mean anything.**\n")
    return "\n".join(lines)


def findings(results: dict) -> list[str]:
    """The paper's findings next to what this run measured."""
    v, rows = results["variants"], results["lookup"]
    lines = ["## The paper found / we measured", ""]

    def gap(a: str, b: str, key: str = "accuracy") -> str:
        return compare(dict(v[a], model=a), dict(v[b], model=b), key, higher_is_better=True, scale=100,
                       digits=1, unit=" points")

    ranking = " > ".join(f"{n} ({100 * v[n]['accuracy']:.1f} %)" for n in sorted(v, key=lambda n: -v[n]["accuracy"]))
    lines.append("- **Ranking.** The paper (CNN QA) found softmax > gated linear > linear > none. "
                 f"We measured {ranking}.")
    if "none" in v:
        lines.append("- **Attention reads the document.** The paper found every attention ahead of "
                     "none. We measured: " + "; ".join(gap(n, "none") for n in v if n != "none") + ".")
    if "gated-linear" in v and "linear" in v:
        lines.append("- **Gates help the linear form.** The paper found gated linear ahead of linear. "
                     "We measured: " + gap("gated-linear", "linear") + "; on the longer documents, "
                     + gap("gated-linear", "linear", "accuracy_long") + ".")
    stored = [n for n in v if "accuracy_from_representations" in v[n]]
    if stored:
        lines.append("- **A fixed-size representation answers alone.** The paper stores C = Σ h hᵀ "
                     "per document. We measured from stored C: " + "; ".join(
                         f"{n} {100 * v[n]['accuracy_from_representations']:.1f} % against "
                         f"{100 * v[n]['accuracy']:.1f} % directly" for n in stored) + ".")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        lines.append("- **Lookups cost O(k²), not O(n·k).** The paper found linear lookups "
                     "independent of the document length. We measured, from n = "
                     f"{first['n']:,} to {last['n']:,}: linear {first['linear_us_per_query']:.2f} → "
                     f"{last['linear_us_per_query']:.2f} µs a query, softmax "
                     f"{first['softmax_us_per_query']:.2f} → {last['softmax_us_per_query']:.2f} µs "
                     f"({last['speedup']:.0f}× at n = {last['n']:,}).")
    return lines


def plot(results: dict, path: Path) -> None:
    """Accuracy per variant, and lookup time per query against n (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(results["variants"])
    acc = [100 * results["variants"][n]["accuracy"] for n in names]
    longer = [100 * results["variants"][n]["accuracy_long"] for n in names]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], acc, 0.4, label="test (training lengths)")
    lo, hi = results["settings"]["long_len"]
    ax1.bar([i + 0.2 for i in x], longer, 0.4, label=f"longer documents ({lo}–{hi} tokens)")
    ax1.axhline(100 * results["chance"], color="gray", ls="--", lw=1, label="chance")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("accuracy (%)")
    ax1.set_title("reading task: accuracy by attention")
    ax1.set_ylim(0, 125)  # room for the legend above the bars
    ax1.legend(fontsize=7, loc="upper center", ncol=3)

    rows = results["lookup"]
    n = [r["n"] for r in rows]
    ax2.loglog(n, [r["softmax_us_per_query"] for r in rows], "o-", label="softmax: O(n·k)")
    ax2.loglog(n, [r["linear_us_per_query"] for r in rows], "s-", label="linear C q: O(k²)")
    for r in rows:
        ax2.annotate(f"{r['speedup']:.0f}×", (r["n"], r["linear_us_per_query"]),
                     textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax2.set_xticks(n, [f"{x:,}" for x in n])
    ax2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax2.set_xlabel("document length n (labels: speedup of linear over softmax)")
    ax2.set_ylabel("µs per query")
    ax2.set_title(f"lookup cost, k = {rows[0]['k']}" if rows else "lookup cost")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
