"""What the LM comparisons (abc-lm, persistent-lm) share: train a row, test it, plot the curves."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch

from memattn.config import load_config
from memattn.evaluate import evaluate
from memattn.experiments._common import save_figure


def train_and_test(out_dir: Path, name: str, shared: list[str], mechanism: str, options: dict,
                   test_ids: torch.Tensor, test_batches: int):
    """Train the row `name` (shared settings + attention=mechanism with options) under
    out_dir/runs, copy its log to out_dir/logs and test it.

    Returns (model, cfg, row): the trained model, its RunConfig and the row's figures.
    """
    from memattn.train import model_from_checkpoint, train

    run_dir = out_dir / "runs" / slug(name)
    cfg = load_config(None, [*shared, f"attention={mechanism}",
                             *(f"attention.{k}={v}" for k, v in options.items()),
                             f"train.out_dir={run_dir}"])
    start = time.perf_counter()
    summary = train(cfg, progress=False)
    train_s = time.perf_counter() - start
    model, cfg, _ = model_from_checkpoint(run_dir)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    test = evaluate(model, test_ids, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                    max_batches=test_batches)
    shutil.copyfile(run_dir / "log.jsonl", out_dir / "logs" / f"{slug(name)}.jsonl")
    row = {"model": name, "attention": mechanism, "options": options, "params": summary["params"],
           "test_bpc": test["bpc"], "test_tokens": test["tokens"], "val_bpc": summary["val"]["bpc"],
           "train_s": train_s, "train_tokens_per_s": summary["tokens_per_s"]}
    return model, cfg, row


def slug(name: str) -> str:
    return name.replace(", ", "-").replace("=", "").replace(" ", "-").lower()


def plot_curves(out_dir: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        log = [json.loads(line) for line in (out_dir / "logs" / f"{slug(r['model'])}.jsonl").read_text().splitlines()]
        train_pts = [(x["step"], x["loss"] / math.log(2)) for x in log if "loss" in x]
        val_pts = [(x["step"], x["val_bpc"]) for x in log if "val_bpc" in x]
        left.plot(*zip(*train_pts), label=r["model"])
        right.plot(*zip(*val_pts), marker="o", label=r["model"])
    left.set(title="training loss", xlabel="step", ylabel="bits per character")
    right.set(title="validation", xlabel="step", ylabel="bits per character")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out_dir / "learning_curves.png", dpi=120)
