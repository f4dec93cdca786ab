"""What the LM comparisons (abc-lm, persistent-lm) share: models with seeds turned into
run-folder jobs (`_runner`), the test measurements of a trained model, the summary of a
model over its seeds, and the tables written as models finish (`_runner.run_experiment`)."""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from research.experiments._common import by_model, seed_figures
from research.experiments._runner import (STAND_IN, Job, finished_row, measured_side_by_side, run_experiment, side_by_side_note)
from research.harness import SCORES

# (row, mechanism, options, seeds); an option whose key has a dot is a setting of the run
# itself (e.g. "train.segments"), the others are the mechanism's (attention.KEY)
Model = tuple[str, str, dict[str, Any], int]

SCORED = 32  # tokens of each segment scored at the long context (ABC's Table 3a: 480 + 32 = 512)
USAGE_WINDOWS = 4  # test windows of seq_len for ABC_MLP's slot statistics
SPEED_STEPS = 4  # timed training steps of a model in that pass
POSITION_EDGES = (0, 8, 32, 64, 128, 256)  # buckets of the positions in a test segment
# past the training length L: bpc at positions [0, L) and in the buckets ending at 4L, 16L, 64L
LENGTH_FACTORS = (1, 4, 16, 64)
LENGTH_DOCUMENTS = 8  # test documents of 64·L tokens, read from their first token


def by_position_buckets(bpc: list[float]) -> dict[str, float]:
    """Bits per character at each position of a segment -> their mean over the positions
    [0, 8), [8, 32), … up to the segment's end, keyed "first-last"."""
    edges = [e for e in POSITION_EDGES if e < len(bpc)] + [len(bpc)]
    return {f"{lo}-{hi - 1}": statistics.fmean(bpc[lo:hi]) for lo, hi in zip(edges, edges[1:])}


SEED_FIGURES = ("test_bpc", "test_bpc_context", "val_bpc", "train_tokens_per_s",
                "decode_tokens_per_s", "train_s")


def jobs_of(models: list[Model], shared: list[str]) -> list[tuple[str, Job]]:
    """(model, job) for every seed of every model, every model's seed 0 first (so a partial
    table has one of each soonest); seed 0 keeps the model's name."""
    out = []
    for seed in range(max(seeds for *_, seeds in models)):
        for name, mechanism, options, seeds in models:
            if seed < seeds:
                settings = (*shared, f"attention={mechanism}",
                            *(f"{k if '.' in k else f'attention.{k}'}={v}" for k, v in options.items()),
                            f"train.seed={seed}")
                out.append((name, Job(name if seed == 0 else f"{name}, seed {seed}", settings)))
    return out


def measure(model, cfg, run_dir: Path, *, test_tokens: int, decode_prompt: int,
            decode_tokens: int) -> dict[str, Any]:
    """Figures of a trained model on the test split of its corpus.

    test_bpc: segments of seq_len, each read from an empty memory (test_bpc_by_position: the
    same by where in the segment the target lies, `by_position_buckets`). test_bpc_context: each
    segment of SCORED tokens read after the seq_len − SCORED before it; for a model trained on
    segments (train.segments) instead one stream per batch row, each layer's state carried
    over the whole split (context -1). Both over about test_tokens targets. Decoding: greedy
    tokens per second after a decode_prompt-token prompt, batch 1. Slot statistics
    (`memattn.analysis`) of ABC_MLP layers at init and after training. Past the training
    length: `by_length`.
    """
    from memattn.analysis import abc_slot_usage, learned_spans, mean_statistics
    from memattn.evaluate import as_tensor, evaluate
    from memattn.models import CausalLM
    from memattn.train import load_run_corpus

    corpus = load_run_corpus(cfg)
    test, ratio = as_tensor(corpus.test), corpus.chars_per_token("test")
    seq_len, batch = cfg.train.seq_len, cfg.train.batch_size
    short = evaluate(model, test, seq_len=seq_len, batch_size=batch, chars_per_token=ratio,
                     max_batches=-(-test_tokens // (seq_len * batch)), by_position=True)
    if cfg.train.segments:
        context = -1
        long = evaluate(model, test, seq_len=seq_len, batch_size=batch, segments=True, chars_per_token=ratio)
    else:
        context = seq_len - min(SCORED, seq_len // 4)
        scored = seq_len - context
        long = evaluate(model, test, seq_len=scored, batch_size=batch, context=context,
                        chars_per_token=ratio, max_batches=-(-test_tokens // (scored * batch)))
    decode = decode_speed(model, test[:decode_prompt], decode_tokens)
    windows = test[:USAGE_WINDOWS * seq_len].view(USAGE_WINDOWS, seq_len)
    torch.manual_seed(cfg.train.seed)  # the model as training began (train seeds the same way)
    initial = CausalLM(cfg.model).eval()
    return {"attention": cfg.model.attention.name, "options": cfg.model.attention.options,
            "seed": cfg.train.seed, "test_bpc": short["bpc"], "test_tokens": short["tokens"],
            "test_bpc_by_position": by_position_buckets(short["bpc_by_position"]),
            "test_bpc_context": long["bpc"], "context": context, "context_tokens": long["tokens"],
            "decode_tokens_per_s": decode, "spans": learned_spans(model),
            "slots_init": mean_statistics(abc_slot_usage(initial, windows)),
            "slots_trained": mean_statistics(abc_slot_usage(model, windows)),
            "test_bpc_by_length": by_length(model, test, seq_len, ratio)}


def by_length(model, test: torch.Tensor, seq_len: int, ratio: float) -> dict[str, dict[str, Any]]:
    """Test bits per character at the training length L and past it (`evaluate_by_length` over
    up to LENGTH_DOCUMENTS documents of 64·L tokens): {"1x": positions [0, L), "4x": [2L, 4L),
    "16x": [8L, 16L), "64x": [32L, 64L)}, each {"bpc", "bpc_windows" (the same positions read
    in windows of L from an empty memory), "read", "documents", "state_bytes" (of one document's
    fixed state, None for a growing one)} or, where the
    split is too short or the model cannot read that far, {"bpc": None, "note"}."""
    from memattn.evaluate import evaluate_by_length

    fit = [f for f in LENGTH_FACTORS if f * seq_len < len(test)]
    result = evaluate_by_length(model, test, lengths=[f * seq_len for f in fit], train_len=seq_len,
                                streams=LENGTH_DOCUMENTS, chars_per_token=ratio, windows=True)
    ends = {b["end"]: b for b in result["buckets"]}
    state = model.init_cache(1).nbytes() if result["read"] == "stream" else None  # a fixed size
    out = {}
    for f in LENGTH_FACTORS:
        b = ends.get(f * seq_len)
        if b is None:
            out[f"{f}x"] = {"bpc": None, "note": f"the test split holds {len(test):,} tokens"}
        elif b["bpc"] is None:
            out[f"{f}x"] = {"bpc": None, "note": b["note"]}
        else:
            out[f"{f}x"] = {"bpc": b["bpc"], "bpc_windows": b["bpc_windows"], "read": b["read"],
                            "documents": result["documents"], "state_bytes": state}
    return out


def decode_speed(model, prompt: torch.Tensor, tokens: int) -> float:
    """Greedy decoding tokens per second with the cache, batch 1, after prompt [T]."""
    from memattn.generate import generate

    start = time.perf_counter()
    produced = sum(1 for _ in generate(model, prompt[None], tokens, temperature=0))
    return produced / (time.perf_counter() - start)


def train_speed(model, cfg, ids: torch.Tensor, steps: int = SPEED_STEPS) -> float:
    """Training tokens per second of a run's step (`_common.training_tokens_per_s`): forward
    (with a carried memory for a segment-trained run) and the loss with the model's auxiliary
    terms, on a batch of the run's shape from ids."""
    import torch.nn.functional as F

    from research.experiments._common import training_tokens_per_s

    tc = cfg.train
    window = ids[:tc.batch_size * (tc.seq_len + 1)].view(tc.batch_size, tc.seq_len + 1)
    x, y = window[:, :-1], window[:, 1:]

    def loss_of() -> tuple[torch.Tensor, int]:
        logits = model(x, cache=model.init_cache(x.shape[0])) if tc.segments else model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        aux = model.aux_loss()
        return (loss if aux is None else loss + aux), x.numel()

    return training_tokens_per_s(model, loss_of, steps)


def side_by_side_speeds(out_dir: Path, jobs: list[Job], *, decode_prompt: int, decode_tokens: int,
                        stand_ins: bool = False, **_) -> dict[str, dict[str, Any]] | None:
    """Training and decoding tokens per second of every finished model, by job name, taken
    side by side (`_runner.measured_side_by_side`, with its `stand_ins`: a stand-in gets the
    spans its trained model learned, as its row has them, which set how far a head reads)."""
    from memattn.analysis import set_learned_spans
    from memattn.evaluate import as_tensor
    from memattn.train import load_run_corpus, model_from_checkpoint

    def speeds(job: Job, run_dir: Path) -> dict[str, float]:
        model, cfg, _ = model_from_checkpoint(run_dir)
        if run_dir.name == STAND_IN:
            set_learned_spans(model, finished_row(run_dir.parent, job).get("spans", []))
        corpus = load_run_corpus(cfg)
        return {"train_tokens_per_s": train_speed(model, cfg, as_tensor(corpus.train)),
                "decode_tokens_per_s": decode_speed(model, as_tensor(corpus.test)[:decode_prompt], decode_tokens)}

    return measured_side_by_side(out_dir, jobs, speeds, stand_ins=stand_ins)


def summarise(names: list[str], rows: list[dict]) -> list[dict]:
    """One entry per model (in order of first appearance): the mean of its seeds' figures and
    their spread (max − min)."""
    models = []
    for name, runs in by_model(names, rows).items():
        entry = {"model": name, "seeds": len(runs)}
        for key in ("attention", "options", "params", "steps", "context", "test_tokens", "context_tokens"):
            entry[key] = runs[0][key]
        entry.update(seed_figures(runs, SEED_FIGURES))
        if runs[0].get("spans"):  # [seed][layer][head] -> the mean over seeds, [layer][head]
            entry["spans"] = [[statistics.fmean(h) for h in zip(*layers)]
                              for layers in zip(*(r["spans"] for r in runs))]
        for when in ("slots_init", "slots_trained"):
            if runs[0][when]:  # the figures every seed has (rows measured before one was added lack it)
                entry[when] = {k: statistics.fmean(r[when][k] for r in runs) for k in runs[0][when]
                               if all(k in r[when] for r in runs)}
        measured = [r for r in runs if r.get("test_bpc_by_length")]
        if measured:  # the mean over the seeds that have each figure
            entry["length_seeds"] = [r["seed"] for r in measured]
            entry["test_bpc_by_length"] = {
                k: ({**measured[0]["test_bpc_by_length"][k],
                     **{f: statistics.fmean(r["test_bpc_by_length"][k][f] for r in measured)
                        for f in ("bpc", "bpc_windows")}}
                    if all(r["test_bpc_by_length"][k]["bpc"] is not None for r in measured)
                    else measured[0]["test_bpc_by_length"][k])
                for k in measured[0]["test_bpc_by_length"]}
        scored = [r["harness"] for r in runs if r.get("harness")]  # lm-evaluation-harness (research.harness)
        if scored:
            entry["harness"] = {**scored[0], **{k: statistics.fmean(h[k] for h in scored) for k in SCORES}}
        # rows measured before this figure existed lack it
        having = [r for r in runs if r.get("test_bpc_by_position")]
        if having:
            entry["by_position_seeds"] = [r["seed"] for r in having]
            entry["test_bpc_by_position"] = {
                k: statistics.fmean(r["test_bpc_by_position"][k] for r in having)
                for k in having[0]["test_bpc_by_position"]}
        models.append(entry)
    return models


def by_position_lines(models: list[dict], base: dict) -> list[str]:
    """A table of test bits per character by position in the segment (context 0) for the
    models measured so (`by_position_buckets`), each against `base` over the same seeds."""
    rows = [m for m in models if m.get("test_bpc_by_position")]
    if not rows:
        return []
    buckets = list(rows[0]["test_bpc_by_position"])
    lines = ["## Where in the segment the loss falls (context 0)", "",
             "Test bits per character by the target's position in its segment (read from an empty "
             "memory), the mean over each range of positions; in parentheses the difference from "
             f"{base['model']} over the same seeds. Only runs measured since this figure was "
             "added have it: their seeds are listed.", "",
             "| model | seeds | " + " | ".join(f"positions {b}" for b in buckets) + " |",
             "|---|---|" + "---:|" * len(buckets)]
    ref = base.get("test_bpc_by_position") if base.get("by_position_seeds") else None
    for m in rows:
        same = ref is not None and m["by_position_seeds"] == base["by_position_seeds"]
        cells = [f"{m['test_bpc_by_position'][b]:.3f}"
                 + (f" ({m['test_bpc_by_position'][b] - ref[b]:+.3f})" if same and m is not base else "")
                 for b in buckets]
        lines.append(f"| {m['model']} | {', '.join(map(str, m['by_position_seeds']))} | "
                     + " | ".join(cells) + " |")
    return lines


def by_length_lines(models: list[dict]) -> list[str]:
    """A table of test bits per character at the training length L and past it (`by_length`)
    for the models measured so, each against the same positions read in windows of L."""
    rows = [m for m in models if m.get("test_bpc_by_length")]
    if not rows:
        return []
    keys = list(rows[0]["test_bpc_by_length"])
    documents = next((f["documents"] for m in rows for f in m["test_bpc_by_length"].values()
                      if f["bpc"] is not None), 0)
    lines = ["## Past the training length", "",
             f"Test bits per character of {documents} test documents, each read from its first token "
             "(`memattn eval --lengths`), at positions [0, L) of the training length L and at the positions "
             "ending at 4L, 16L and 64L ([2L, 4L), [8L, 16L), [32L, 64L)); in parentheses the change from the "
             "same positions read in windows of L from an empty memory, the reading the model was trained "
             "for, so that the text is the same on both sides. A bounded model streams through its fixed "
             "state (stream); softmax reads one window as far as memory allows (window, up to 16,384 "
             "tokens). Only runs measured since this figure was added have it: their seeds are listed.", "",
             "| model | seeds | " + " | ".join("bpc at [0, L)" if k == "1x" else f"at {k[:-1]}L" for k in keys)
             + " | read | state bytes, one stream |", "|---|---|" + "---:|" * len(keys) + "---|---:|"]
    for m in rows:
        figures = m["test_bpc_by_length"]
        cells = []
        for k in keys:
            f = figures[k]
            cells.append("not read" if f["bpc"] is None else f"{f['bpc']:.3f}" if k == keys[0]
                         else f"{f['bpc']:.3f} ({100 * (f['bpc'] / f['bpc_windows'] - 1):+.1f} %)")
        read = [f for f in figures.values() if f["bpc"] is not None]
        state = f"{read[0]['state_bytes']:,}" if read and read[0].get("state_bytes") else "grows"
        lines.append(f"| {m['model']} | {', '.join(map(str, m['length_seeds']))} | " + " | ".join(cells)
                     + f" | {read[0]['read'] if read else '—'} | {state} |")
    notes = sorted({f["note"] for m in rows for f in m["test_bpc_by_length"].values() if f["bpc"] is None})
    if notes:
        lines += ["", "; ".join(n[0].upper() + n[1:] for n in notes) + "."]  # each note says "not read: why"
    return lines


def bpc_cell(m: dict, key: str) -> str:
    """'mean ± half the spread' over seeds, or the one figure."""
    spread = f" ± {m[f'{key}_spread'] / 2:.3f}" if m["seeds"] > 1 else ""
    return f"{m[key]:.3f}{spread}"


def run_lm_experiment(out_dir: Path, name: str, models: list[Model], shared: list[str], *,
                      quick: bool, overrides: list[str], jobs: int, measure_kw: dict[str, Any],
                      markdown: Callable[[dict], str], extra: dict[str, Any] | None = None,
                      plots: Callable[[Path, dict], None] | None = None,
                      stand_ins: bool = False) -> dict:
    """`run_experiment` with the LM measurements: every seed of every model, tables and
    validation bits per character written as models finish. stand_ins: speeds of runs whose
    checkpoint is gone may be taken on a stand-in (`side_by_side_speeds`)."""
    return run_experiment(out_dir, name, jobs_of(models, shared), shared, quick=quick, overrides=overrides,
                          jobs=jobs, measure=functools.partial(measure, **measure_kw), summarise=summarise,
                          markdown=markdown, curve=("val_bpc", "bits per character"), plots=plots,
                          extra=extra, side_by_side=functools.partial(side_by_side_speeds, **measure_kw,
                                                                      stand_ins=stand_ins))


def speed_note(result: dict) -> str:
    """Where the table's tokens/s come from."""
    return side_by_side_note(result, "Tokens/s", "training is a forward, backward and optimiser step on a "
                             "batch of the run's shape, decoding is greedy at batch 1 after a prompt")


def copied_note(result: dict) -> str:
    """A sentence naming the runs whose row another experiment trained with the same settings
    (their row.json carries "copied_from", the folder it came from), or ''."""
    copied = [f"{run['model']} from `{run['copied_from']}`" for run in result["runs"]
              if run.get("copied_from")]
    if not copied:
        return ""
    return ("Trained by another experiment with the same settings and batches, their rows "
            f"copied: {'; '.join(copied)}. ")


def progress_note(result: dict) -> list[str]:
    """A line for a table that does not hold every run yet."""
    if result["finished"] == result["runs_planned"]:
        return []
    return [f"**In progress: {result['finished']} of {result['runs_planned']} runs finished; the "
            "table holds those.**", ""]
