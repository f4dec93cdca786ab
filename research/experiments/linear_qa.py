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

    memattn experiment linear-qa [--quick] [--jobs N] [steps=600 hidden=32 doc_len=[100,400] ...]

Each (variant, seed) trains through `memattn train`'s loop as task=reading-qa (`ReadingQATask`,
registered here) in a run folder under runs/: early stopping (train.patience) on the validation
accuracy, the best evaluation's weights (best.safetensors) tested, row.json once measured. The
command continues what is unfinished and reuses what is done. Writes results.json, results.md
and linear_qa.png to the output folder.
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

from memattn.config import to_dict
from memattn.data.reading import ReadingBatch, ReadingConfig, ReadingTask
from memattn.errors import ConfigError
from memattn.models.qa import ATTENTIONS, QAConfig, ReadingQA
from memattn.ops.softmax import softmax_attention
from memattn.representations import encode, lookup
from memattn.tasks import StepLoss, Task, refuse_language_model_settings, register_task
from memattn.typed import parse_settings as parse_typed
from research.experiments._common import by_model, command_of, compare, save_figure, seed_figures, torch_threads, write_results
from research.experiments._runner import Job, run_jobs

DESCRIPTION = ("cheap linear attention: QA accuracy of none / softmax / linear / gated-linear "
               "and per-query lookup cost vs document length")
NAME = "reading-qa"  # the task its models train on


def check_values(obj, skip: tuple[str, ...] = ()) -> None:
    """ConfigError naming the first field of `obj` (not in `skip`) with a value, or a member,
    below one (`seed`: below zero); or a (shortest, longest) length range the wrong way round."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        values = value if isinstance(value, tuple) else (value,)
        if f.name not in skip and any(v < 0 or (v == 0 and f.name != "seed") for v in values):
            raise ConfigError(f"{f.name}: expected positive values, got {value!r}")
    for name in ("doc_len", "long_len"):
        lo, hi = getattr(obj, name)
        if lo > hi:
            raise ConfigError(f"{name}: expected [shortest, longest], got {[lo, hi]}")


@dataclass
class QAOptions:
    """task_options of task=reading-qa: the reader (`memattn.models.qa.ReadingQA`), the reading
    task it is trained and tested on, and its validation and test documents."""

    attention: str = "linear"
    embed: int = 32
    hidden: int = 32  # GRU width per direction: k = 2·hidden
    doc_len: tuple[int, int] = (100, 400)  # training and test documents, tokens
    long_len: tuple[int, int] = (1000, 2000)  # the longer test documents (not trained on)
    queries: int = 4  # cloze queries per document
    entities: int = 40
    places: int = 30  # answer classes: chance = 1 / places
    relations: int = 4
    val_docs: int = 500
    test_docs: int = 500

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention: expected one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        check_values(self, skip=("attention",))


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
    val_docs: int = QAOptions.val_docs
    batch: int = 32  # documents a step (each with `queries` queries)
    lr: float = 3e-3  # Adam, warm-up then cosine decay to a tenth
    hidden: int = QAOptions.hidden
    embed: int = QAOptions.embed
    doc_len: tuple[int, int] = QAOptions.doc_len
    long_len: tuple[int, int] = QAOptions.long_len
    queries: int = QAOptions.queries
    entities: int = QAOptions.entities
    places: int = QAOptions.places
    relations: int = QAOptions.relations
    test_docs: int = QAOptions.test_docs
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
        check_values(self, skip=("variants",))

    def options(self, attention: str) -> QAOptions:
        return QAOptions(attention, **{f.name: getattr(self, f.name) for f in dataclasses.fields(QAOptions)
                                      if f.name != "attention"})


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
    pairs = jobs_of(settings)
    rows = run_jobs(out_dir, [job for _, job in pairs], measure, workers=jobs, label="linear-qa")
    variants = summarise([variant for variant, _ in pairs], rows)
    with torch_threads(settings.threads):
        costs = lookup_costs(settings)
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


def job_of(s: Settings, variant: str, seed: int) -> Job:
    """A model's job: the `memattn train` settings of task=reading-qa with `variant` as its
    attention and s's reading task, trained from `seed` with Adam (AdamW without weight decay),
    warm-up over the first 5 % of the steps, then cosine to a tenth, until it converges
    (train.patience on the validation accuracy) or reaches s.steps."""
    options = [f"task_options.{k}={json.dumps(list(v) if isinstance(v, tuple) else v)}"
               for k, v in dataclasses.asdict(s.options(variant)).items()]
    train = [f"train.steps={s.steps}", f"train.batch_size={s.batch}", f"train.lr={s.lr}",
             f"train.warmup={max(1, s.steps // 20)}", "train.min_lr_ratio=0.1", "train.weight_decay=0",
             "train.betas=[0.9,0.999]", "train.grad_clip=1.0", f"train.eval_every={s.eval_every}",
             "train.log_every=1", f"train.save_every={s.eval_every}", f"train.patience={s.patience}",
             f"train.min_delta={s.min_delta}", f"train.seed={seed}", f"train.threads={s.threads}"]
    return Job(variant if seed == 0 else f"{variant}, seed {seed}", (f"task={NAME}", *options, *train))


def jobs_of(s: Settings) -> list[tuple[str, Job]]:
    """(variant, job) for every seed of every variant, seed 0 of each first."""
    return [(variant, job_of(s, variant, seed)) for seed in range(s.seeds) for variant in s.variants]


def reading_task(s: Settings | QAOptions, doc_len: tuple[int, int] | None = None) -> ReadingTask:
    return ReadingTask(ReadingConfig(n_entities=s.entities, n_places=s.places, n_relations=s.relations,
                                     doc_len=doc_len or s.doc_len, queries_per_doc=s.queries))


class ReadingQATask(Task):
    """task=reading-qa: `ReadingQA` on the synthetic reading task (task_options: `QAOptions`).
    Step s reads train.batch_size fresh documents drawn from (train.seed, s), the same for
    every attention; the loss is the mean cross-entropy of their answers; the evaluation, the
    accuracy on val_docs documents of their own, which train.patience stops on."""

    Options = QAOptions
    logged = ("accuracy",)
    selects = ("accuracy", "higher")

    @classmethod
    def check_config(cls, cfg) -> None:
        refuse_language_model_settings(cfg)

    @classmethod
    def build_model(cls, cfg) -> ReadingQA:
        o = cfg.task_settings
        reading = reading_task(o)
        return ReadingQA(QAConfig(reading.vocab_size, reading.n_answers, attention=o.attention,
                                  embed=o.embed, hidden=o.hidden))

    @classmethod
    def prepare(cls, cfg, ddp, resume: bool, source) -> ReadingQATask:
        from memattn.train import with_vocab_size

        if source is not None:
            raise ConfigError(f"train.init_from: task={NAME} trains its models from their initialisation")
        return cls(with_vocab_size(cfg, reading_task(cfg.task_settings).vocab_size))

    def __init__(self, cfg) -> None:
        self.cfg, self.options = cfg, cfg.task_settings
        self.reading = reading_task(self.options)
        self.val = self.reading.batch(self.options.val_docs, seed=f"{cfg.train.seed}/val")

    @property
    def model_name(self) -> str:
        return self.options.attention

    def batch(self, step: int, rank: int, world: int) -> ReadingBatch:
        docs = self.reading.batch(self.cfg.train.batch_size, seed=f"{self.cfg.train.seed}/train/{step}")
        return ReadingBatch(*(t.chunk(world)[rank] for t in (docs.docs, docs.doc_lengths, docs.queries,
                                                           docs.query_lengths, docs.answers)))

    def tokens(self, batch: ReadingBatch) -> int:
        return int(batch.doc_lengths.sum())

    def loss(self, model, batch: ReadingBatch) -> StepLoss:
        logits = model(batch.docs, batch.doc_lengths, batch.queries, batch.query_lengths)
        return StepLoss(F.cross_entropy(logits.flatten(0, 1), batch.answers.flatten()), 1)  # a mean already

    def evaluate(self, model, device) -> dict[str, float]:
        was = model.training
        model.eval()
        figure = accuracy(model, self.val.to(device))
        model.train(was)
        return {"accuracy": figure}

    def meta(self) -> dict:
        from memattn.data import Vocab

        # the token ids, named by stand-in characters: what a checkpoint's vocabulary records
        return {"vocab": Vocab("char", [chr(0x100 + i) for i in range(self.reading.vocab_size)]).to_json(),
                "corpus": NAME}


register_task(NAME, "question answering on synthetic documents (research.experiments.linear_qa)",
              "research.experiments.linear_qa:ReadingQATask")


def measure(model: ReadingQA, cfg, run_dir: Path) -> dict:
    """A trained model's figures (`_runner.Measure`; the model holds the weights of its best
    evaluation): test accuracy at the training lengths and on longer documents (and, for the
    linear forms, from the stored representations), and how its training went."""
    o, seed = cfg.task_settings, cfg.train.seed
    summary = json.loads((run_dir / "summary.json").read_text())
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    evals = [0] + [r["step"] for r in log if "val_accuracy" in r]
    test = reading_task(o).batch(o.test_docs, seed=f"{seed}/test")
    test_long = reading_task(o, o.long_len).batch(max(o.test_docs // 4, 8), seed=f"{seed}/long")
    row = {
        "variant": o.attention, "seed": seed,
        "accuracy": accuracy(model, test),
        "accuracy_long": accuracy(model, test_long),
        "best_step": summary["best_step"],
        "converged": summary["stopped"],
        "train_seconds": round(summary["train_seconds"], 2),
        "seconds_per_step": round(summary["train_seconds"] / max(1, summary["steps"]), 4),
        # the mean training loss of the steps since the evaluation before the last
        "final_loss": round(statistics.fmean(r["loss"] for r in log if "loss" in r and evals[-2] < r["step"] <= evals[-1]), 4),
        "parameters": model.num_parameters(),
    }
    if o.attention in ("linear", "gated-linear"):
        row["accuracy_from_representations"] = accuracy(model, test, stored=True)
    return row


FIGURES = ("accuracy", "accuracy_long", "accuracy_from_representations", "train_seconds",
           "seconds_per_step", "final_loss", "steps", "best_step")


def summarise(variants: list[str], rows: list[dict]) -> dict[str, dict]:
    """Per variant: the mean of its seeds' figures, their spread (max − min), and whether
    every seed converged."""
    return {variant: {"seeds": len(runs), "parameters": runs[0]["parameters"],
                      "converged": all(r["converged"] for r in runs), **seed_figures(runs, FIGURES),
                      "steps_timed_alone": any(r.get("timed") == "model steps" for r in runs)}
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
            f"{r['best_step']:,.0f} | {r['steps']:,.0f} | {r['train_seconds']:.0f}{' †' * r['steps_timed_alone']} | "
            f"{r['seconds_per_step']:.3f} | {r['parameters']:,} |")
    lines += [
        "",
        "Training time is the training loop's (steps with their data generation, and the "
        "evaluations), on a CPU that may be shared with other jobs; † marks runs trained by this "
        "experiment's former loop, which timed the model's steps only (forward, backward, update). "
        "\"From stored C\": the same "
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
