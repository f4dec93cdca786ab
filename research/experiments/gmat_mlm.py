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

    memattn experiment gmat-mlm [--quick] [steps=1200 seq_len=512 num_memory=64 ...]

Writes results.json, results.md and gmat_mlm.png to the output folder, and the trained
compressor checkpoint to `compressor_out` (for `memattn compress` / `memattn decompress`).
"""

from __future__ import annotations

import dataclasses
import math
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from memattn.config import AttentionConfig, ModelConfig
from memattn.data import load_corpus
from memattn.errors import ConfigError
from memattn.masked import mask_tokens, windows
from research.experiments import single_process
from research.experiments._common import command_of, plot_curves, torch_threads, train_steps, write_results
from memattn.models import Compressor, Encoder
from memattn.models.compressor import compress_ids, decompress_ids, save_compressor
from memattn.typed import parse_settings

DESCRIPTION = "GMAT: masked LM with chunked attention, without and with memory, and compressed into M vectors"
NAME = "gmat-mlm"


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
    threads: int = 1  # torch threads (on a shared 2-core CPU one thread runs fastest)
    budget_s: float = 0.0  # > 0: stop a model's training after this many seconds
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
        for name in ("num_memory", "n_memory_layers", "warmup", "compressor_warmup", "seed", "budget_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: expected a non-negative value, got {getattr(self, name)!r}")
        if self.num_memory == 0:
            raise ConfigError("num_memory: the memory encoder and the compressor need M > 0")


QUICK = dict(seq_len=128, chunk_size=32, num_memory=16, d_model=32, n_heads=2, n_layers=2,
             n_compress=1, n_memory_layers=1, n_decompress=1, steps=30, batch=8, warmup=5,
             compressor_warmup=5, eval_windows=8, compressor_out="")


class Variant:
    """One model of the comparison: how to build it, its logits and its training loss."""

    def __init__(self, name: str, model: torch.nn.Module, compressed: bool) -> None:
        self.name, self.model, self.compressed = name, model, compressed

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.compressed:
            return self.model(inputs)
        return self.model.mlm_logits(self.model(inputs))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        logits = self.logits(inputs)
        if self.compressed:  # rebuild every character from the M vectors
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return F.cross_entropy(logits[chosen], targets[chosen])


def build_variants(s: Settings, vocab_size: int) -> list[Variant]:
    def config(num_memory: int, n_layers: int, init_std: float = ModelConfig.init_std) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, d_model=s.d_model, n_layers=n_layers, n_heads=s.n_heads,
                           ff_mult=4, positions=s.positions, max_len=s.seq_len, init_std=init_std,
                           attention=AttentionConfig("gmat", {"num_memory": num_memory, "pattern": "chunked",
                                                              "chunk_size": s.chunk_size}))

    variants = []
    for name, M in (("chunked, M = 0", 0), (f"chunked, M = {s.num_memory}", s.num_memory)):
        torch.manual_seed(s.seed)
        variants.append(Variant(name, Encoder(config(M, s.n_layers)), compressed=False))
    torch.manual_seed(s.seed)
    layers = s.n_compress + s.n_memory_layers + s.n_decompress
    compressor = Compressor(config(s.num_memory, layers, s.compressor_init_std), n_compress=s.n_compress,
                            n_decompress=s.n_decompress)
    name = f"compressed, M = {s.num_memory} (N_c={s.n_compress}, N_m={s.n_memory_layers}, N_d={s.n_decompress})"
    variants.append(Variant(name, compressor, compressed=True))
    return variants


@torch.no_grad()
def evaluate(v: Variant, data: torch.Tensor, mask_id: int, vocab: int, seed: int, batch: int) -> dict[str, float]:
    """Masked error rate and perplexity on windows data [N, L] with a fixed masking; for the
    compressor also the error on the unmasked characters."""
    g = torch.Generator().manual_seed(seed)
    nll = wrong = count = other_wrong = other_count = 0.0
    for start in range(0, len(data), batch):
        targets = data[start:start + batch]
        inputs, chosen = mask_tokens(targets, mask_id, vocab, g)
        logits = v.logits(inputs)[..., :vocab]  # the mask symbol is never an answer
        nll += F.cross_entropy(logits[chosen], targets[chosen], reduction="sum").item()
        right = logits.argmax(-1) == targets
        wrong += (~right[chosen]).sum().item()
        count += chosen.sum().item()
        other_wrong += (~right[~chosen]).sum().item()
        other_count += (~chosen).sum().item()
    out = {"error_rate": wrong / count, "perplexity": math.exp(nll / count), "masked": int(count)}
    if v.compressed:
        out["unmasked_error_rate"] = other_wrong / other_count
    return out


def run(out_dir: Path, *, quick: bool = False, overrides: list[str] = (), jobs: int = 1) -> dict:
    """Train and score the three models; write the results (and the compressor) under out_dir."""
    single_process("gmat-mlm", jobs)
    s = parse_settings(Settings, list(overrides), QUICK if quick else {}, name=NAME)
    out_dir = Path(out_dir)
    with torch_threads(s.threads):
        results = _run(s, out_dir, quick)
    write_results(out_dir, results, render_markdown(results, command_of(out_dir, NAME, quick, overrides)))
    plot_curves(out_dir / "gmat_mlm.png", "masked LM: training loss",
                {r["model"]: r["losses"] for r in results["rows"]}, "cross-entropy")
    return results


def _run(s: Settings, out_dir: Path, quick: bool) -> dict[str, Any]:
    corpus = load_corpus(s.corpus, s.path or None, "char", s.cache_dir)
    vocab = corpus.vocab.size
    mask_id = vocab  # one symbol past the characters
    train = torch.from_numpy(corpus.train.astype(np.int64))
    splits = {name: windows(torch.from_numpy(getattr(corpus, name).astype(np.int64)), s.seq_len, s.eval_windows)
              for name in ("val", "test")}
    rows = []
    for v in build_variants(s, vocab + 1):
        data = torch.Generator().manual_seed(s.seed)  # the same windows and masks for every model

        def loss_of(step: int, v=v, data=data) -> torch.Tensor:
            starts = torch.randint(0, len(train) - s.seq_len, (s.batch,), generator=data)
            targets = train[starts[:, None] + torch.arange(s.seq_len)]
            inputs, chosen = mask_tokens(targets, mask_id, vocab, data)
            return v.loss(inputs, targets, chosen)

        lr, warmup = (s.compressor_lr, s.compressor_warmup) if v.compressed else (s.lr, s.warmup)
        trained = train_steps(v.model, loss_of, steps=s.steps, lr=lr, warmup=warmup,
                              log_every=max(1, s.steps // 10), label=f"{NAME}: {v.name}", budget_s=s.budget_s)
        row = {"model": v.name, "params": sum(p.numel() for p in v.model.parameters()), **trained}
        for split, windows_ in splits.items():
            row[split] = evaluate(v, windows_, mask_id, vocab, seed=1000 + s.seed, batch=s.batch)
        print(f"{NAME}: {v.name}: test error {row['test']['error_rate']:.3f}, "
              f"perplexity {row['test']['perplexity']:.2f}", flush=True)
        if v.compressed:
            row["sample"] = round_trip_sample(v.model, corpus, splits["test"][0], vocab)
            if s.compressor_out:
                save_compressor(s.compressor_out, v.model, vocab=corpus.vocab.to_json(), seq_len=s.seq_len,
                                step=trained["steps"], metrics={"test": row["test"], "val": row["val"]})
                row["checkpoint"] = s.compressor_out
        rows.append(row)
    return {"experiment": NAME, "quick": quick, "settings": dataclasses.asdict(s), "vocab_size": vocab,
            "rows": rows, "environment": {"torch": torch.__version__, "threads": s.threads,
                                          "machine": platform.machine()}}


def round_trip_sample(model: Compressor, corpus, window: torch.Tensor, vocab: int) -> dict[str, Any]:
    """One unmasked test window through compress -> M vectors -> decompress: the text both ways."""
    memory, lengths = compress_ids(model, window.numpy(), seq_len=len(window))
    rebuilt = decompress_ids(model, memory, lengths, n_symbols=vocab)
    return {"original": corpus.vocab.decode(window.numpy()), "rebuilt": corpus.vocab.decode(rebuilt),
            "character_error_rate": float((rebuilt != window.numpy()).mean())}


def render_markdown(results: dict, command: str) -> str:
    s = results["settings"]
    lines = [
        "# GMAT: masked language modelling with memory and with compression",
        "",
        f"Command: `{command}`" + (" (quick smoke run: numbers are not meaningful)" if results["quick"] else ""),
        "",
        f"Character level, corpus `{s['corpus']}` (vocabulary {results['vocab_size']} + a mask symbol), "
        f"windows of L = {s['seq_len']}, gmat attention with chunks of C = {s['chunk_size']}, {s['positions']} "
        f"positions, d_model {s['d_model']}, {s['n_heads']} heads; {s['steps']} steps of {s['batch']} windows "
        f"each with AdamW: the encoders at lr {s['lr']:g} from N(0, {ModelConfig.init_std:g}), the compressor at lr "
        f"{s['compressor_lr']:g} from N(0, {s['compressor_init_std']:g}). 15 % of the positions masked "
        f"(BERT 80/10/10). Scores on the masked "
        f"positions of the first {s['eval_windows']} windows of each split, with a fixed masking.",
        "",
        "| model | layers | params | train s | val error | val ppl | test error | test ppl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        layers = (f"{s['n_compress']}+{s['n_memory_layers']}+{s['n_decompress']}"
                  if r["model"].startswith("compressed") else str(s["n_layers"]))
        lines.append(f"| {r['model']} | {layers} | {r['params']:,} | {r['seconds']:.0f} | "
                     f"{r['val']['error_rate']:.3f} | {r['val']['perplexity']:.2f} | "
                     f"{r['test']['error_rate']:.3f} | {r['test']['perplexity']:.2f} |")
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
