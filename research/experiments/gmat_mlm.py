"""GMAT (Gupta & Berant 2020) masked language modelling, small: memory and compression.

Three character-level models on the default corpus (Shakespeare's plays), equal width
and number of steps, all with gmat attention and the chunked pattern:

    chunked, M = 0        an encoder whose tokens see only their chunk of C
    chunked, M            the same encoder with M global memory tokens
    compressed, M         a `memattn.models.Compressor`: N_c layers over memory and
                          sequence, N_m over the M memory vectors alone, N_d layers that
                          rebuild all L positions from those M vectors and the positions

Masking as in BERT: 15 % of the positions, of which 80 % become a mask symbol, 10 % a
random character and 10 % stay. The encoders learn to predict the masked characters; the
compressor sees the masked sequence only through its M vectors and learns to rebuild every
character (masked or not, so that `memattn decompress` returns text). Its M memory tokens
start as near copies of each other, and no position prefers one of them: a saddle where
the compressor rebuilds only the unigram distribution (~3.3 nats) for hundreds of steps.
It gets off it sooner from weights N(0, 1/√d_model) at a lower rate than the encoders'
(training loss of probe runs: 1/√64 at 5e-3 3.28 nats after 400 steps; 0.02 at 1e-3 3.19
after 2,000; 1/√64 at 2e-3 3.00 after 480, 2.43 after 1,200). Scores on the masked
positions of fixed windows of the validation and test plays: error rate (1 - accuracy)
and perplexity exp(mean cross-entropy); for the compressor also the error on the
unmasked characters it rebuilt.

Each model trains through `memattn train`'s loop in a run folder under runs/: the encoders
as task=mlm (step s reads windows and masks drawn from (train.seed, s), the same for both),
the compressor as task=compression (`CompressionTask`, registered here: the same batches,
every character rebuilt). The command continues what is unfinished and reuses what is done
(`--jobs N`: N models at once). The loop stops on its step budget only: a time budget is a
number of steps.

    memattn experiment gmat-mlm [--quick] [--jobs N] [steps=1200 seq_len=512 num_memory=64 ...]

Writes results.json, results.md and gmat_mlm.png to the output folder, and the trained
compressor checkpoint to its run folder and `compressor_out` (for `memattn compress` /
`memattn decompress`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memattn.config import ModelConfig
from memattn.errors import ConfigError
from memattn.fileio import atomic_write
from memattn.masked import MaskedLMTask, mask_tokens, windows
from memattn.models import Compressor
from memattn.models.compressor import compress_ids, decompress_ids, save_compressor
from memattn.tasks import StepLoss, register_task
from memattn.typed import parse_settings
from research.experiments._common import command_of, plot_curves, write_results
from research.experiments._runner import Job, run_dir_of, run_jobs

DESCRIPTION = "GMAT: masked LM with chunked attention, without and with memory, and compressed into M vectors"
NAME = "gmat-mlm"
TASK = "compression"  # the task its compressor trains on
COMPRESSOR_FILE = "compressor.safetensors"  # the compressor's checkpoint in its run folder (save_compressor)


@dataclass
class Settings:
    """What the experiment runs; every field can be overridden as key=value."""

    corpus: str = "shakespeare"  # any data.corpus; "text" needs `path`
    path: str = ""
    cache_dir: str = ".cache/memattn"
    seq_len: int = 512  # L
    chunk_size: int = 64  # C
    num_memory: int = 64  # M of the memory encoder and of the compressor
    d_model: int = 64
    # model.positions of every model; the compressor's decompression queries always have a
    # learned table (split) of their own when these are not absolute
    positions: str = "rotary"
    n_heads: int = 4
    n_layers: int = 4  # the encoders
    n_compress: int = 2  # N_c
    n_memory_layers: int = 1  # N_m
    n_decompress: int = 2  # N_d
    steps: int = 1200
    batch: int = 16
    lr: float = 5e-3
    warmup: int = 40
    eval_windows: int = 64  # windows of seq_len per split scored
    seed: int = 0
    threads: int = 1  # torch threads of a model's worker (on a shared 2-core CPU one thread runs fastest)
    compressor_lr: float = 2e-3
    compressor_warmup: int = 100
    compressor_init_std: float = 0.125  # model.init_std of the compressor (1/√d_model)
    compressor_out: str = "runs/gmat-mlm/compressor.safetensors"  # "" to skip saving

    def __post_init__(self) -> None:
        for name in ("seq_len", "chunk_size", "d_model", "n_heads", "n_layers", "n_compress",
                     "n_decompress", "steps", "batch", "lr", "eval_windows", "threads", "compressor_lr",
                     "compressor_init_std"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: expected a positive value, got {getattr(self, name)!r}")
        for name in ("num_memory", "n_memory_layers", "warmup", "compressor_warmup", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: expected a non-negative value, got {getattr(self, name)!r}")
        if self.num_memory == 0:
            raise ConfigError("num_memory: the memory encoder and the compressor need M > 0")


QUICK = dict(seq_len=128, chunk_size=32, num_memory=16, d_model=32, n_heads=2, n_layers=2,
             n_compress=1, n_memory_layers=1, n_decompress=1, steps=30, batch=8, warmup=5,
             compressor_warmup=5, eval_windows=8, compressor_out="")


@dataclass
class CompressionOptions:
    """task_options of task=compression: how the compressor's model.n_layers divide (N_c
    compress, N_d decompress, the N_m = n_layers - N_c - N_d between them read the memory alone)."""

    n_compress: int = 2
    n_decompress: int = 2

    def __post_init__(self) -> None:
        for name in ("n_compress", "n_decompress"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected a positive value, got {getattr(self, name)!r}")


def logits_of(model, inputs: torch.Tensor) -> torch.Tensor:
    """Token logits [B, L, vocab + 1] of masked inputs [B, L]: a compressor's rebuilt sequence,
    an encoder's masked-LM head."""
    return model(inputs) if isinstance(model, Compressor) else model(inputs, mlm=True)


class CompressionTask(MaskedLMTask):
    """task=compression: a `Compressor` (attention with memory tokens, gmat) on task=mlm's
    batches, trained to rebuild every character of the masked window from its M vectors (the
    cross-entropy over all positions); the evaluation, `evaluate`'s figures on the first
    train.eval_batches × batch_size windows of the validation split."""

    Options = CompressionOptions
    logged = ("error_rate", "perplexity", "unmasked_error_rate")
    selects = ("perplexity", "lower")

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        o = cfg.task_settings
        if o.n_compress + o.n_decompress > cfg.model.n_layers:
            raise ConfigError(f"task_options.n_compress, n_decompress: {o.n_compress} + {o.n_decompress} layers "
                              f"exceed model.n_layers={cfg.model.n_layers}")

    @classmethod
    def build_model(cls, cfg) -> Compressor:
        o = cfg.task_settings
        return Compressor(cfg.model, n_compress=o.n_compress, n_decompress=o.n_decompress)

    def loss(self, model, batch) -> StepLoss:
        logits = model(batch.inputs)  # [B, L, vocab + 1]
        total = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum")
        return StepLoss(total, batch.targets.numel())

    def evaluate(self, model, device, ids: torch.Tensor | None = None,
                 max_batches: int | None = None) -> dict[str, float]:
        tc = self.cfg.train
        data = windows(self.val_ids, tc.seq_len, max(1, tc.eval_batches) * tc.batch_size)
        return evaluate(model, data, self.vocab, seed=tc.seed, batch=tc.batch_size, device=device)

    @classmethod
    def evaluate_checkpoint(cls, model, cfg, vocab, options):
        raise ConfigError(f"{options.checkpoint}: a task={TASK} run; `memattn experiment gmat-mlm` measures it, "
                          f"and `memattn compress` reads its compressor ({COMPRESSOR_FILE} in its run folder)")


register_task(TASK, "a GMAT compressor rebuilding masked text from M vectors (research.experiments.gmat_mlm)",
              "research.experiments.gmat_mlm:CompressionTask")


@torch.no_grad()
def evaluate(model, data: torch.Tensor, vocab: int, seed: int, batch: int, device="cpu") -> dict[str, float]:
    """Masked error rate and perplexity on windows data [N, L] with a fixed masking (mask id =
    vocab); for the compressor also the error on the unmasked characters."""
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    nll = wrong = count = other_wrong = other_count = 0.0
    for start in range(0, len(data), batch):
        targets = data[start:start + batch]
        inputs, chosen = mask_tokens(targets, vocab, vocab, g)
        logits = logits_of(model, inputs.to(device)).cpu()[..., :vocab]  # the mask symbol is never an answer
        nll += F.cross_entropy(logits[chosen], targets[chosen], reduction="sum").item()
        right = logits.argmax(-1) == targets
        wrong += (~right[chosen]).sum().item()
        count += chosen.sum().item()
        other_wrong += (~right[~chosen]).sum().item()
        other_count += (~chosen).sum().item()
    model.train(was)
    out = {"error_rate": wrong / count, "perplexity": math.exp(nll / count), "masked": int(count)}
    if isinstance(model, Compressor):
        out["unmasked_error_rate"] = other_wrong / other_count
    return out


def jobs_of(s: Settings) -> list[Job]:
    """The three models' jobs: the encoders as task=mlm, the compressor as task=compression, on
    the same windows and masks, with AdamW (betas 0.9, 0.98, weight decay 0.01) with warm-up and
    cosine to a tenth, evaluated and saved at the end."""
    every = max(1, s.steps // 10)
    data = [f"data.corpus={s.corpus}", *([f"data.path={s.path}"] if s.path else []), "data.level=char",
            f"data.cache_dir={s.cache_dir}"]
    model = [f"model.d_model={s.d_model}", f"model.n_heads={s.n_heads}", "model.ff_mult=4",
             f"model.positions={s.positions}", f"model.max_len={s.seq_len}"]
    train = [f"train.steps={s.steps}", f"train.batch_size={s.batch}", f"train.seq_len={s.seq_len}",
             "train.min_lr_ratio=0.1", "train.weight_decay=0.01", "train.betas=[0.9,0.98]", "train.grad_clip=1.0",
             f"train.log_every={every}", f"train.save_every={every}", f"train.eval_every={s.steps}",
             f"train.eval_batches={max(1, s.eval_windows // s.batch)}", f"train.seed={s.seed}",
             f"train.threads={s.threads}"]

    def gmat(num_memory: int) -> list[str]:
        return ["attention=gmat", f"attention.num_memory={num_memory}", "attention.pattern=chunked",
                f"attention.chunk_size={s.chunk_size}"]

    encoder = [f"model.n_layers={s.n_layers}", f"train.lr={s.lr}", f"train.warmup={min(s.warmup, s.steps)}"]
    layers = s.n_compress + s.n_memory_layers + s.n_decompress
    compressor = [f"task_options.n_compress={s.n_compress}", f"task_options.n_decompress={s.n_decompress}",
                  f"model.n_layers={layers}", f"model.init_std={s.compressor_init_std}", f"train.lr={s.compressor_lr}",
                  f"train.warmup={min(s.compressor_warmup, s.steps)}"]
    return [*(Job(f"chunked, M={M}", ("task=mlm", *data, *model, *encoder, *train, *gmat(M)))
              for M in (0, s.num_memory)),
            Job(f"compressed, M={s.num_memory}", (f"task={TASK}", *data, *model, *compressor, *train,
                                                  *gmat(s.num_memory)))]


def measure(model, cfg, run_dir: Path, *, eval_windows: int) -> dict[str, Any]:
    """A trained model's figures (`_runner.Measure`): `evaluate`'s on the first `eval_windows`
    windows of the validation and test splits, masked from seed 1000 + train.seed, and its
    training curve; a compressor also rebuilds one test window through compress -> M vectors ->
    decompress, and is saved for `memattn compress` (COMPRESSOR_FILE)."""
    from memattn.evaluate import as_tensor
    from memattn.train import load_run_corpus

    tc = cfg.train
    corpus = load_run_corpus(cfg)
    vocab = cfg.model.vocab_size - 1  # the mask symbol is one past the characters
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    row: dict[str, Any] = {"vocab_size": vocab, "layers": str(cfg.model.n_layers),
                           "losses": [[r["step"], round(r["loss"], 5)] for r in log if "loss" in r]}
    splits = {split: windows(as_tensor(corpus.split(split)), tc.seq_len, eval_windows) for split in ("val", "test")}
    for split, data in splits.items():
        row[split] = evaluate(model, data, vocab, seed=1000 + tc.seed, batch=tc.batch_size)
    if isinstance(model, Compressor):
        o = cfg.task_settings
        row["layers"] = f"{o.n_compress}+{cfg.model.n_layers - o.n_compress - o.n_decompress}+{o.n_decompress}"
        row["sample"] = round_trip_sample(model, corpus, splits["test"][0], vocab)
        save_compressor(run_dir / COMPRESSOR_FILE, model, vocab=corpus.vocab.to_json(), seq_len=tc.seq_len,
                        step=tc.steps, metrics={"test": row["test"], "val": row["val"]})
    return row


def run(out_dir: Path, *, quick: bool = False, overrides: list[str] = (), jobs: int = 1) -> dict:
    """Train (or reuse, or resume) and score the three models, `jobs` at a time; write the
    results under out_dir, the compressor to s.compressor_out."""
    s = parse_settings(Settings, list(overrides), QUICK if quick else {}, name=NAME)
    out_dir = Path(out_dir)
    planned = jobs_of(s)

    def report(rows: dict[str, dict]) -> dict:
        done = [rows[job.name] for job in planned if job.name in rows]
        results = {"experiment": NAME, "quick": quick, "command": command_of(out_dir, NAME, quick, overrides),
                   "settings": dataclasses.asdict(s), "vocab_size": done[0]["vocab_size"] if done else None,
                   "finished": len(done), "runs_planned": len(planned), "rows": done,
                   "environment": {"torch": torch.__version__, "threads": s.threads, "machine": platform.machine()}}
        write_results(out_dir, results, render_markdown(results))
        plot_curves(out_dir / "gmat_mlm.png", "masked LM: training loss",
                    {r["model"]: r["losses"] for r in done}, "cross-entropy")
        return results

    rows = run_jobs(out_dir, planned, functools.partial(measure, eval_windows=s.eval_windows), workers=jobs,
                    label=NAME, on_rows=report)
    saved = run_dir_of(out_dir, planned[-1]) / COMPRESSOR_FILE
    if s.compressor_out and saved.exists():
        Path(s.compressor_out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(s.compressor_out), lambda tmp: shutil.copyfile(saved, tmp))
        rows[-1] = {**rows[-1], "checkpoint": s.compressor_out}
    return report({job.name: row for job, row in zip(planned, rows)})


def round_trip_sample(model: Compressor, corpus, window: torch.Tensor, vocab: int) -> dict[str, Any]:
    """One unmasked test window through compress -> M vectors -> decompress: the text both ways."""
    memory, lengths = compress_ids(model, window.numpy(), seq_len=len(window))
    rebuilt = decompress_ids(model, memory, lengths, n_symbols=vocab)
    return {"original": corpus.vocab.decode(window.numpy()), "rebuilt": corpus.vocab.decode(rebuilt),
            "character_error_rate": float((rebuilt != window.numpy()).mean())}


def render_markdown(results: dict) -> str:
    s = results["settings"]
    lines = [
        "# GMAT: masked language modelling with memory and with compression",
        "",
        f"Command: `{results['command']}`" + (" (quick smoke run: numbers are not meaningful)"
                                              if results["quick"] else ""),
        "",
        f"Character level, corpus `{s['corpus']}` (vocabulary {results['vocab_size']} + a mask symbol), "
        f"windows of L = {s['seq_len']}, gmat attention with chunks of C = {s['chunk_size']}, {s['positions']} "
        f"positions, d_model {s['d_model']}, {s['n_heads']} heads; {s['steps']} steps of {s['batch']} windows "
        f"each with AdamW: the encoders at lr {s['lr']:g} from N(0, {ModelConfig.init_std:g}), the compressor at lr "
        f"{s['compressor_lr']:g} from N(0, {s['compressor_init_std']:g}). 15 % of the positions masked "
        f"(BERT 80/10/10). Scores on the masked "
        f"positions of the first {s['eval_windows']} windows of each split, with a fixed masking. "
        f"{results['finished']} of {results['runs_planned']} models trained; each is a run folder under `runs/`.",
        "",
        "| model | layers | params | train s | val error | val ppl | test error | test ppl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    former = [r for r in results["rows"] if r.get("loop") == "former"]
    for r in results["rows"]:
        lines.append(f"| {r['model']} | {r['layers']} | {r['params']:,} | {r['train_s']:.0f}{' †' * (r in former)} | "
                     f"{r['val']['error_rate']:.3f} | {r['val']['perplexity']:.2f} | "
                     f"{r['test']['error_rate']:.3f} | {r['test']['perplexity']:.2f} |")
    if former:
        lines += ["", FORMER_LOOP]
    compressed = [r for r in results["rows"] if "sample" in r]
    if compressed:
        r = compressed[0]
        lines += [
            "",
            f"The compressor rebuilds the unmasked characters with error {r['test']['unmasked_error_rate']:.3f} "
            f"(test); it is trained to rebuild every character from its {s['num_memory']} vectors, the "
            "encoders only the masked ones. One unmasked test window through `compress` -> "
            f"{s['num_memory']} vectors -> `decompress` (character error "
            f"{r['sample']['character_error_rate']:.3f}), first 240 characters:",
            "",
            "```text",
            r["sample"]["original"][:240],
            "```",
            "",
            "```text",
            r["sample"]["rebuilt"][:240],
            "```",
        ]
        if r.get("checkpoint"):
            lines += ["", f"The compressor checkpoint was written to `{r['checkpoint']}`: "
                      f"`memattn compress {r['checkpoint']} FILE -o FILE.safetensors`, then "
                      f"`memattn decompress FILE.safetensors --checkpoint {r['checkpoint']}`."]
    lines.append("")
    return "\n".join(lines)


FORMER_LOOP = ("† trained by this experiment's former loop, before its models were run folders of task=mlm "
               "and task=compression: the same models, schedule and scored windows, but every step's windows "
               "and masks drawn from one generator advanced step by step (a run of the settings in its folder "
               "draws them from (train.seed, step)), and the time of the model's steps alone.")
