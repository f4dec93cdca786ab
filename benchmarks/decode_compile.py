"""Decoding one token, eager against `memattn.generate.decoding_step` (torch.compile), in one run.

    .venv/bin/python benchmarks/decode_compile.py [--attention softmax abc-mlp:num_slots=32 linear]
        [--contexts 256 1024 4096] [--batch 1] [--steps 50] [--threads 1] [--out DIR]

--attention names mechanisms as `memattn bench` does (NAME or NAME:OPTION=VALUE,...; by
default every causal mechanism of the registry at its default options, softmax first).
The small causal LM of `memattn bench` (d_model 128, 4 layers, 4 heads, vocabulary 256, fp32)
reads `context` random tokens into its cache, then decodes `--steps` greedy tokens through the
eager model and through the compiled step, alternately from two copies of the same cache;
ms per token is the median step after the first few (the compiled one's first calls compile).
Writes decode_compile.md and decode_compile.json to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from research.bench.common import Choice, parse_choice
from research.bench.report import BASELINE
from memattn.config import AttentionConfig, ModelConfig
from memattn.generate import decoding_step
from memattn.layers import mechanisms
from memattn.models import CausalLM


def measure(choice: Choice, context: int, batch: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_len=8192,
                                 attention=AttentionConfig(choice.name, dict(choice.options)))).eval()
    ids = torch.randint(0, 256, (batch, context))
    step = decoding_step(model)
    times = {"eager": [], "compiled": []}
    with torch.inference_mode():
        caches = {}
        for key in times:
            caches[key] = model.init_cache(batch)
            model(ids, cache=caches[key])
        token = ids[:, -1:]
        for i in range(steps + 5):
            for key, fn in (("eager", model), ("compiled", step)):
                start = time.perf_counter()
                logits = fn(token, cache=caches[key])
                if i >= 5:
                    times[key].append(time.perf_counter() - start)
            token = logits[:, -1:].argmax(-1)
    eager, compiled = (1e3 * statistics.median(times[k]) for k in ("eager", "compiled"))
    return {"attention": choice.label, "context": context, "batch": batch, "eager_ms": round(eager, 3),
            "compiled_ms": round(compiled, 3), "speedup": round(eager / compiled, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", nargs="+", default=None,
                   help="NAME or NAME:OPTION=VALUE,... (default: every causal mechanism)")
    p.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/cpu")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    names = a.attention or [BASELINE, *(n for n, m in mechanisms().items() if m.causal and n != BASELINE)]
    choices = [parse_choice(text) for text in names]
    rows = [measure(choice, c, a.batch, a.steps) for choice in choices for c in a.contexts]
    command = ("python benchmarks/decode_compile.py --attention " + " ".join(names) + " --contexts "
               + " ".join(map(str, a.contexts)) + f" --batch {a.batch} --steps {a.steps} --threads {a.threads}")
    lines = ["# Decoding one token: eager against torch.compile (`memattn.generate.decoding_step`)", "",
             f"```sh\n{command}\n```", "",
             f"torch {torch.__version__}, {platform.machine()}, {a.threads} thread(s), batch {a.batch}, fp32; "
             "median ms per token over the steps after the first five, eager and compiled alternated "
             "from two copies of one cache. On a machine shared with other jobs, read the ratios, "
             "not the times.", "",
             "| mechanism | context | eager ms | compiled ms | speedup |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {r['context']:,} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | "
                     f"{r['speedup']:.2f}x |")
    by = {(r["attention"], r["context"]): r for r in rows}
    if any(choice.label == BASELINE for choice in choices):
        lines += ["", "Compiled mechanism against compiled softmax (softmax ms / mechanism ms):", "",
                  "| mechanism | " + " | ".join(f"{c:,}" for c in a.contexts) + " |",
                  "|---|" + "---:|" * len(a.contexts)]
        for n in (choice.label for choice in choices if choice.label != BASELINE):
            lines.append(f"| {n} | " + " | ".join(
                f"{by[(BASELINE, c)]['compiled_ms'] / by[(n, c)]['compiled_ms']:.2f}x" for c in a.contexts) + " |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_compile.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    (out / "decode_compile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
