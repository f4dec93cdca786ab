"""The main job: prepare the default corpus, train a small LM per mechanism, evaluate it on
the test split, sample from it, and compare every mechanism with softmax attention."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from memattn.config import load_config
from memattn.data import Vocab
from memattn.evaluate import as_tensor, evaluate
from memattn.generate import generate
from memattn.train import load_run_corpus, model_from_checkpoint, train

PROMPT = "ROMEO.\n"


def run_demo(preset: str, overrides: list[str], mechanisms: list[str], out_dir: str) -> list[dict]:
    rows = []
    for name in mechanisms:
        cfg = load_config(preset, [*overrides, f"attention={name}", f"train.out_dir={out_dir}/{name}"])
        if not rows:
            start = time.perf_counter()
            corpus = load_run_corpus(cfg)
            print(f"corpus {corpus.name}: {len(corpus.train):,} / {len(corpus.val):,} / "
                  f"{len(corpus.test):,} characters (train / val / test), vocabulary {corpus.vocab.size}, "
                  f"prepared in {time.perf_counter() - start:.1f}s")
        summary = train(cfg, overwrite=True)  # the demo always trains anew
        model, cfg, vocab_json = model_from_checkpoint(summary["checkpoint"])
        test = evaluate(model, as_tensor(corpus.test), seq_len=cfg.train.seq_len,
                        batch_size=cfg.train.batch_size)
        vocab = Vocab.from_json(vocab_json)
        prompt = torch.as_tensor(vocab.encode(PROMPT), dtype=torch.long)[None]
        start = time.perf_counter()
        tokens = [t.item() for t in generate(model, prompt, 300, temperature=0.8, seed=0)]
        decode_rate = len(tokens) / (time.perf_counter() - start)
        print(f"\n--- sample ({name}) ---\n{PROMPT}{vocab.decode(tokens)}\n---")
        rows.append({"attention": name, "params": summary["params"], "val_bpc": summary["val"]["bpc"],
                     "test_bpc": test["bpc"], "train_tokens_per_s": summary["tokens_per_s"],
                     "decode_tokens_per_s": decode_rate, "train_s": summary["wall_s"]})
    print_table(rows)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "summary.json").write_text(json.dumps(rows, indent=2))
    return rows


def print_table(rows: list[dict]) -> None:
    base = rows[0]
    print(f"\n{'attention':<14}{'params':>10}{'val bpc':>9}{'test bpc':>10}{'train tok/s':>13}"
          f"{'decode tok/s':>14}{'train s':>9}  vs {base['attention']} (test bpc)")
    for r in rows:
        delta = r["test_bpc"] - base["test_bpc"]
        print(f"{r['attention']:<14}{r['params']:>10,}{r['val_bpc']:>9.3f}{r['test_bpc']:>10.3f}"
              f"{r['train_tokens_per_s']:>13,.0f}{r['decode_tokens_per_s']:>14,.1f}{r['train_s']:>9.0f}"
              f"  {delta:+.3f}")
