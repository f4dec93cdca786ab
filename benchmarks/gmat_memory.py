"""Peak memory and time of one attention layer, forward + backward, as the length grows:
gmat (chunked, window, lsh; M = 8 memory tokens) against softmax attention, in one run.

    .venv/bin/python benchmarks/gmat_memory.py [--lengths 2048 4096 8192 16384] [--out benchmarks/results/cpu/gmat_memory]

Peak memory: the running sum of the CPU allocations and frees the PyTorch profiler
records inside the call (inputs excluded). Time: the median of a few calls, one thread.
Softmax runs through `scaled_dot_product_attention`, whose fused CPU kernel does not
store L×L scores either, but whose work grows as L²; it is skipped past --softmax-max.
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from research.bench.timing import median_time, peak_allocated
from memattn.layers import LayerSpec, build_attention
from memattn.layers.base import memory_layout

D_MODEL, HEADS, M = 64, 4, 8


def case(name: str, options: dict, L: int):
    spec = LayerSpec(d_model=D_MODEL, n_heads=HEADS, causal=False, positions="none")
    layer = build_attention(name, options, spec)
    layout = memory_layout(name, options, causal=False)  # the memory tokens the model would insert
    rows = L + (layout.tokens if layout is not None else 0)
    x = torch.randn(1, rows, D_MODEL, requires_grad=True)

    def run():
        y, _ = layer(x)
        y.square().sum().backward()

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--softmax-max", type=int, default=8192, help="longest L timed for softmax")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/cpu/gmat_memory")
    args = p.parse_args()
    torch.set_num_threads(1)
    variants = {
        "softmax": ("softmax", {}),
        "gmat chunked C=64": ("gmat", {"num_memory": M, "pattern": "chunked", "chunk_size": 64}),
        "gmat window w=32": ("gmat", {"num_memory": M, "pattern": "window", "window": 32}),
        "gmat lsh C=64": ("gmat", {"num_memory": M, "pattern": "lsh", "chunk_size": 64, "n_buckets": 8}),
    }
    rows = []
    case("gmat", variants["gmat chunked C=64"][1], 256)()  # warm-up
    for label, (name, options) in variants.items():
        for L in args.lengths:
            if name == "softmax" and L > args.softmax_max:
                continue
            run = case(name, options, L)
            peak = peak_allocated(run, torch.device("cpu"))
            seconds = median_time(run, repeats=args.repeats, warmup=0)  # the measured call warmed it
            rows.append({"layer": label, "L": L, "peak_mib": round(peak / 2**20, 2),
                         "seconds": round(seconds, 4)})
            print(f"{label:20s} L={L:6d} peak {peak / 2**20:8.2f} MiB  {seconds:.3f} s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"d_model": D_MODEL, "heads": HEADS, "batch": 1, "dtype": "float32", "threads": 1,
            "torch": torch.__version__,
            "command": "python benchmarks/gmat_memory.py --lengths " + " ".join(map(str, args.lengths))}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["# One attention layer, forward + backward: peak memory and time", "",
             f"`{meta['command']}`; d_model {D_MODEL}, {HEADS} heads, batch 1, fp32, one CPU thread, "
             f"torch {torch.__version__}. × columns: the ratio to the shortest length measured for that "
             "layer; the last column: softmax's time at the same length over this layer's.", "",
             "| layer | L | peak MiB | × | seconds | × | faster than softmax |", "|---|---|---|---|---|---|---|"]
    first: dict[str, dict] = {}
    softmax = {r["L"]: r["seconds"] for r in rows if r["layer"] == "softmax"}
    for r in rows:
        base = first.setdefault(r["layer"], r)
        versus = f"{softmax[r['L']] / r['seconds']:.1f}x" if r["L"] in softmax else "—"
        lines.append(f"| {r['layer']} | {r['L']} | {r['peak_mib']:.2f} | {r['peak_mib'] / base['peak_mib']:.2f} | "
                     f"{r['seconds']:.3f} | {r['seconds'] / base['seconds']:.2f} | {versus} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
