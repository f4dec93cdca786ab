"""Training speed of the write rules that forget against plain ABC_MLP, side by side, on the
trained models of an LM experiment (their learned gates and rates set which path a chunk takes).

    .venv/bin/python benchmarks/write_rules_speed.py [--runs results/long-stream-300/runs]
        [--models abc-mlp-m32 abc-mlp-m32-forget gsa-m32 abc-mlp-m32-recency] [--repeats 7]
        [--out benchmarks/results/cpu/write_rules_speed]

One thread, fp32. Each model: one training step (forward, backward, AdamW at learning rate 0)
on 16 test-split sequences of its training length, from its checkpoint; the models' steps
interleaved (a, b, c, a, b, c, ...) so that a change in the machine's load falls on all of
them alike, each figure the median of --repeats steps after a warm-up step. Tokens/s and the
ratio to the first model. Writes OUT.json and OUT.md.
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

from research.bench.timing import median_times, script_command, write_figures  # noqa: E402

BATCH = 16


def training_step(run_dir: Path):
    """A training step of the run's model on BATCH sequences of its training length: (the
    step as a function, tokens it trains on)."""
    from memattn.evaluate import as_tensor
    from memattn.train import load_run_corpus, model_from_checkpoint

    model, cfg, _ = model_from_checkpoint(run_dir)
    ids = as_tensor(load_run_corpus(cfg).test)
    L = cfg.train.seq_len
    x = ids[: BATCH * (L + 1)].view(BATCH, L + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    model.train()

    def step():
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        aux = model.aux_loss()
        (loss if aux is None else loss + aux).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, BATCH * L


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="results/long-stream-300/runs")
    p.add_argument("--models", nargs="+",
                   default=["abc-mlp-m32", "abc-mlp-m32-forget", "gsa-m32", "abc-mlp-m32-recency"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/cpu/write_rules_speed")
    args = p.parse_args()
    torch.set_num_threads(1)
    steps = {name: training_step(Path(args.runs) / name) for name in args.models}
    seconds = median_times({name: fn for name, (fn, _) in steps.items()}, repeats=args.repeats)
    rows = [{"model": name, "tokens_per_s": steps[name][1] / seconds[name]} for name in args.models]
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        print(row, flush=True)
    command = script_command("benchmarks/write_rules_speed.py")
    lines = ["# Training speed of the write rules, side by side", "", "```", command, "```", "",
             __doc__.split("\n\n", 2)[2].strip(), "", f"Models: `{args.runs}`.", "",
             f"| model | training tokens/s | against {rows[0]['model']} |", "|---|---:|---:|"]
    lines += [f"| {r['model']} | {r['tokens_per_s']:,.0f} | {r['ratio']:.2f}x |" for r in rows]
    write_figures(args.out, command, rows, lines)


if __name__ == "__main__":
    main()
