"""ABC's chunked form on logits that drift along the sequence (as abc-mlp's recency makes
them): chunks halved where many would take the exact path, against chunks of 64 throughout.

    .venv/bin/python benchmarks/abc_drift.py [--drifts 0 0.5 1] [--lengths 512 2048]
        [--run results/abc-lm/runs/abc-mlp-m32-recency] [--repeats 5]
        [--out benchmarks/results/cpu/abc_drift]

One thread, fp32. Op: `abc_attention` forward + backward, B = 4, H = 8, D = 64, M = 32,
s = N(0, 1) + drift · (token index). LM (with --run, a trained abc-lm run folder whose
checkpoint is there): one training step (forward, backward) of that model on 16 random
sequences of 512. Each figure the median of --repeats calls after a warm-up call, the two
settings interleaved (`memattn.ops.abc.chunked._HALVE_DOWN_TO` = 16, the default, or 1024,
which turns halving off). A drift below 80 / 63 a token (log_z growing by less than 80 over
a chunk of 64) leaves every chunk of 64 on the fast path: the two settings then run the same code, and their difference is the noise of
the timing. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memattn.ops.abc.chunked as chunked  # noqa: E402
from research.bench.timing import median_times, script_command, write_figures  # noqa: E402
from memattn.ops.abc import abc_attention  # noqa: E402

B, H, D, M = 4, 8, 64, 32
SETTINGS = {"halved": 16, "chunks of 64": 1024}  # chunked._HALVE_DOWN_TO


def side_by_side(fn, repeats: int) -> dict:
    """Median seconds of fn() under each setting, interleaved, after a warm-up call each."""
    def under(down):
        def call():
            chunked._HALVE_DOWN_TO = down
            fn()
        return call

    saved = chunked._HALVE_DOWN_TO
    try:
        return median_times({name: under(down) for name, down in SETTINGS.items()},
                            repeats=repeats)
    finally:
        chunked._HALVE_DOWN_TO = saved


def op_step(T: int, drift: float):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, T, H, D, generator=g).requires_grad_() for _ in range(3))
    s = (torch.randn(B, T, H, M, generator=g) + drift * torch.arange(T)[:, None, None].float())
    s.requires_grad_()

    def run():
        o, _ = abc_attention(q, k, v, s)
        torch.autograd.grad(o.sum(), (q, k, v, s))
    return run


def lm_step(run_dir: str):
    from memattn.train import model_from_checkpoint

    model, cfg, _ = model_from_checkpoint(Path(run_dir) / "checkpoint.safetensors")
    model.train()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (16, 512), generator=g)

    def run():
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drifts", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--run", default=None, help="a trained abc-lm run folder (with recency)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/cpu/abc_drift")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for T in args.lengths:
        for drift in args.drifts:
            rows.append({"case": f"op, T = {T}, drift {drift:g} a token",
                         **side_by_side(op_step(T, drift), args.repeats)})
            print(rows[-1], flush=True)
    if args.run:
        rows.append({"case": f"LM step, {args.run}", **side_by_side(lm_step(args.run), args.repeats)})
        print(rows[-1], flush=True)
    command = script_command("benchmarks/abc_drift.py")
    lines = ["# ABC's chunked form on drifting logits: chunks halved against chunks of 64", "",
             "```", command, "```", "", __doc__.split("\n\n", 2)[2].strip(), "",
             "| case | halved (s) | chunks of 64 (s) | speed-up |", "|---|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['halved']:.3f} | {r['chunks of 64']:.3f} | "
              f"{r['chunks of 64'] / r['halved']:.2f}x |" for r in rows]
    write_figures(args.out, command, rows, lines)


if __name__ == "__main__":
    main()
