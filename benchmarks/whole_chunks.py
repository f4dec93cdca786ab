"""Which chunks the Triton kernels take whole in trained models: how much the log-normaliser
grows over each chunk of 64 tokens.

    .venv/bin/python benchmarks/whole_chunks.py [--runs results/long-stream/runs]
        [--models abc-mlp-m32 abc-mlp-m32-recency abc-mlp-m32-forget gsa-m32]
        [--lengths 512 8192] [--sequences 4] [--out benchmarks/results/cpu/whole_chunks]

`memattn.kernels.abc_chunk` takes a chunk of bf16 or fp16 inputs in one program, its own block
as dots of factors, where log_z grows by less than 80 over it (40 if the factors' reference
were a at the chunk's first token rather than midway along it), and in sub-blocks elsewhere
(`WHOLE_CHUNKS`, `WHOLE_PRECISIONS`, `_growth`, `_diag_factors`). This reads --sequences
stretches of each trained model's test text (the run's own corpus) of every length in
--lengths, each read from an empty memory as the model reads it (in windows of its max_len,
each layer's memory carried on), records every layer's slot logits (ABC_MLP and its write
rules: the s the op receives) or log gates (gated slot attention), and computes per
(sequence, head, chunk) the kernels' test: ABC, a = logaddexp over the logits so far,
growth = max over slots of a at the chunk's last token minus a at its first; GSA, whose
kernels restart log_z at every chunk (its gates clamped to
memattn.kernels.gsa_chunk.GATE_FLOOR), growth = max over slots of minus the sum of the
chunk's log gates after its first token. Models whose layers differ in attention
(`model.attention_layers`) are refused. No kernel runs: the figures are the test's inputs,
on the CPU, fp32. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from research.bench.timing import script_command, write_figures  # noqa: E402

CHUNK = 64
# abc_chunk._FACTOR_SPAN, and the same with the factors' reference at the first token
LIMITS = {"below 80": 80.0, "below 40 (r at the first token)": 40.0}


def abc_growth(s: torch.Tensor, log_z0: torch.Tensor | None) -> torch.Tensor:
    """s [B, T, H, M] slot logits read after a memory of log-normaliser log_z0 [B, H, M] (None:
    an empty one) -> [B, H, chunks] growth of log_z over each chunk of CHUNK tokens (max over
    slots), T a multiple of CHUNK."""
    a = torch.logcumsumexp(s.double(), dim=1)  # [B, T, H, M]
    if log_z0 is not None:
        a = torch.logaddexp(log_z0.double()[:, None], a)
    first, last = a[:, ::CHUNK], a[:, CHUNK - 1::CHUNK]
    return (last - first).amax(-1).transpose(1, 2).float()


def gsa_growth(g: torch.Tensor, floor: float) -> torch.Tensor:
    """g [B, T, H, M] log gates -> [B, H, chunks] growth of log_z over each chunk as the GSA
    kernels see it: log_z restarts at 0 at every chunk and falls by the clamped gates."""
    g = g.double().clamp(min=floor)
    B, T, H, M = g.shape
    per_chunk = g.view(B, T // CHUNK, CHUNK, H, M)[:, :, 1:].sum(2)  # [B, chunks, H, M]
    return (-per_chunk).amax(-1).transpose(1, 2).float()


def record(model, idx: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(kind, tensor, log_z0) of every ABC or GSA op call while the model reads idx (a model
    reads a text longer than its max_len in windows, each layer's memory carried on): ("abc",
    s, the initial state's log_z or None) or ("gsa", g, None)."""
    import memattn.layers.abc.common as common
    import memattn.layers.abc.gated as gated

    calls, originals = [], (common.abc_attention, gated.gated_slot_attention)

    def abc(q, k, v, s, **kw):
        init = kw.get("initial_state")
        calls.append(("abc", s.detach(), None if init is None else init.log_z.detach()))
        return originals[0](q, k, v, s, **kw)

    def gsa(q, k, v, g, **kw):
        calls.append(("gsa", g.detach(), None))
        return originals[1](q, k, v, g, **kw)

    common.abc_attention, gated.gated_slot_attention = abc, gsa
    try:
        with torch.no_grad():
            model(idx)
    finally:
        common.abc_attention, gated.gated_slot_attention = originals
    return calls


def measure(run: Path, lengths: list[int], sequences: int) -> dict:
    from memattn.evaluate import as_tensor
    from memattn.kernels.gsa_chunk import GATE_FLOOR
    from memattn.train import load_run_corpus, model_from_checkpoint

    model, cfg, _ = model_from_checkpoint(run / "checkpoint.safetensors")
    if cfg.model.attention_layers:  # every layer's op calls are told apart by their order
        raise SystemExit(f"--models: {run.name} mixes attention kinds by layer "
                         "(model.attention_layers); this reads models of one kind")
    n_layers = cfg.model.n_layers
    test = as_tensor(load_run_corpus(cfg).test)
    out = {"model": run.name, "attention": cfg.model.attention.name,
           "train_length": cfg.train.seq_len, "lengths": []}
    for T in lengths:
        if sequences * T > len(test):
            raise SystemExit(f"--lengths: {sequences} sequences of {T} need more test tokens "
                             f"than {run.name}'s {len(test):,}")
        idx = test[: sequences * T].view(sequences, T)
        calls = record(model, idx)
        layers = []
        for i in range(n_layers):  # the calls of layer i: every n_layers-th, window by window
            growth = torch.cat([abc_growth(x, z0) if kind == "abc" else gsa_growth(x, GATE_FLOOR)
                                for kind, x, z0 in calls[i::n_layers]], dim=-1)
            kind = calls[i][0]
            layers.append({"layer": i, "kind": kind, "chunks": growth.numel(),
                           "median": growth.median().item(), "max": growth.max().item(),
                           "whole": {name: (growth < limit).float().mean().item()
                                     for name, limit in LIMITS.items()}})
        out["lengths"].append({"T": T, "sequences": sequences, "layers": layers})
    return out


def markdown(command: str, models: list[dict]) -> list[str]:
    lines = ["# Chunks the Triton kernels take whole in trained models", "", "```",
             command, "```", "",
             "Growth of log_z over each chunk of 64 tokens, per (sequence, head, chunk), the "
             "largest over the slots; a chunk is taken whole where it is under the limit "
             "(benchmarks/whole_chunks.py says how it is computed). Test text of each run's "
             "corpus, each sequence read from an empty memory (past the model's max_len in "
             "windows, its memory carried on).", "",
             "| model | T | layer | chunks | median growth | largest | whole, "
             + " | whole, ".join(LIMITS) + " |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(LIMITS)]
    for m in models:
        for ln in m["lengths"]:
            for layer in ln["layers"]:
                shares = " | ".join(f"{100 * layer['whole'][k]:.1f} %" for k in LIMITS)
                lines.append(f"| {m['model']} | {ln['T']:,} | {layer['layer']} | "
                             f"{layer['chunks']:,} | {layer['median']:.2f} | "
                             f"{layer['max']:.2f} | {shares} |")
    return lines


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="results/long-stream/runs")
    p.add_argument("--models", nargs="+",
                   default=["abc-mlp-m32", "abc-mlp-m32-recency", "abc-mlp-m32-forget", "gsa-m32"])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 8192])
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/cpu/whole_chunks")
    args = p.parse_args(argv)
    bad = [T for T in args.lengths if T % CHUNK or T <= 0]
    if bad:
        p.error(f"--lengths: positive multiples of {CHUNK}, got {bad}")
    torch.set_num_threads(1)
    command, models = script_command("benchmarks/whole_chunks.py"), []
    for name in args.models:
        run = Path(args.runs) / name
        if not (run / "checkpoint.safetensors").is_file():
            p.error(f"--models: {run} holds no checkpoint.safetensors")
        models.append(measure(run, args.lengths, args.sequences))
        print(f"{name}: done", flush=True)
    write_figures(args.out, command, models, markdown(command, models))
    return models


if __name__ == "__main__":
    main()
