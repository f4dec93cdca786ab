"""The main job: prepare the default corpus, train softmax attention, turn it into each
memory mechanism asked for, and show what the memory buys — quality (also far past the
training length: test bpc over the first 16,384 tokens), speed, and a decoding cost and
state that stay flat as the context grows.

The first mechanism (softmax) trains from scratch. Each other one starts from it through
`train.init_from` (its projections, embeddings, norms and feed-forward layers copied, only
the mechanism's own parameters new: the papers' warm-start setting) and trains on for
`warm_steps` steps; `warm_steps=0` trains it from scratch with the baseline's budget instead.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from memattn.config import load_config
from memattn.data import Vocab
from memattn.errors import ConfigError
from memattn.evaluate import as_tensor, evaluate, evaluate_by_length
from memattn.fileio import atomic_write, atomic_write_text, check_writable, output_lock
from memattn.generate import decoding_step, generate
from memattn.train import holds_run, load_run_corpus, model_from_checkpoint, train

PROMPT = "ROMEO.\n"
CONTEXTS = (256, 1024, 4096, 16384)  # decoding cost and state measured after this many tokens
SHOWN = (256, 16384)  # the two the table prints


def decoding_costs(models: list, context: int, steps: int = 32, chunk: int = 2048,
                   compiled: list | None = None) -> list[dict[str, float]]:
    """Median ms per decoded token and bytes of the decoding state of each of `models` (batch 1)
    after `context` tokens (read in chunks with its cache), eager ("ms_per_token") and, where
    `compiled` gives each model's compiled step (`memattn.generate.decoding_step`), compiled
    ("ms_per_token_compiled"), each from a cache of its own. The steps run side by side, one of
    each in turn, so that a change in the machine's load falls on all of them alike."""
    gen = torch.Generator().manual_seed(0)
    steppers = [(i, m) for i, m in enumerate(models)] + [(i, c) for i, c in enumerate(compiled or [])]
    caches, logits, states, times = [], [], [], [[] for _ in steppers]
    with torch.inference_mode():
        for i, _ in steppers:
            model, cache = models[i], models[i].init_cache(1)
            for start in range(0, context, chunk):
                tokens = torch.randint(0, model.cfg.vocab_size, (1, min(chunk, context - start)), generator=gen)
                out = model(tokens, cache=cache)
            caches.append(cache)
            logits.append(out)
            states.append(cache.nbytes())
        for _ in range(steps + 1):  # the first step warms up (and compiles)
            for j, (_, step) in enumerate(steppers):
                token = logits[j][:, -1].argmax(-1, keepdim=True)
                start = time.perf_counter()
                logits[j] = step(token, cache=caches[j])
                times[j].append(time.perf_counter() - start)
    figures = [{"ms_per_token": 1e3 * statistics.median(times[i][1:]), "state_bytes": states[i]}
               for i in range(len(models))]
    for j, (i, _) in enumerate(steppers[len(models):], len(models)):
        figures[i]["ms_per_token_compiled"] = 1e3 * statistics.median(times[j][1:])
    return figures


def bpc_at(model, ids, length: int, train_len: int, chars_per_token: float) -> dict:
    """Test bits per character over the first `length` tokens of the test split, one document
    read by `evaluate_by_length` (a bounded model streamed, softmax as one window):
    {"length", "tokens", "bpc", "read"}, bpc and read None with a "note" where not read."""
    if len(ids) <= length:
        return {"length": length, "tokens": 0, "bpc": None, "read": None,
                "note": f"not read: the test split holds {len(ids):,} tokens, fewer than {length + 1:,}"}
    result = evaluate_by_length(model, ids, lengths=[length], train_len=train_len, chars_per_token=chars_per_token)
    return result["lengths"][0]


def run_demo(preset: str, overrides: list[str], mechanisms: list[str], out_dir: str,
             warm_steps: int = 200, contexts: tuple[int, ...] = CONTEXTS, overwrite: bool = False,
             compile: bool = True) -> list[dict]:
    """Train, measure and compare `mechanisms` (the baseline first), each in the run folder
    out_dir/NAME, and write out_dir/summary.json and decoding.png. Decoding is timed eager and,
    with `compile`, through torch.compile as `memattn generate --compile` decodes. A folder that holds an
    earlier demo is refused before anything is written, unless `overwrite` (its runs are then
    replaced, each kept until its replacement has a checkpoint)."""
    repeated = sorted({m for m in mechanisms if mechanisms.count(m) > 1})
    if repeated:
        raise ConfigError(f"--attention: {', '.join(repeated)} named twice; each mechanism is trained once, in "
                          "its own run folder")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out-dir: {out} is a file; give a folder for the demo's runs")
    with output_lock(out, "--out-dir", ConfigError):
        earlier = [name for name in mechanisms if holds_run(out / name)]
        if (out / "summary.json").exists():
            earlier.insert(0, "summary.json")
        if earlier and not overwrite:
            raise ConfigError(f"--out-dir: {out} holds an earlier demo ({', '.join(earlier)}); replace it with "
                              "--overwrite, or choose another --out-dir")
        check_writable(out)  # before the corpus is prepared and anything trained
        return _run_demo(preset, overrides, mechanisms, out_dir, warm_steps, contexts, overwrite, compile)


def _run_demo(preset: str, overrides: list[str], mechanisms: list[str], out_dir: str,
              warm_steps: int, contexts: tuple[int, ...], overwrite: bool, compile: bool) -> list[dict]:
    rows, models = [], []
    base_dir = f"{out_dir}/{mechanisms[0]}"
    shown = [c for c in SHOWN if c in contexts] or list(contexts[-1:])
    for name in mechanisms:
        extra = [f"attention={name}", f"train.out_dir={out_dir}/{name}"]
        if rows and warm_steps:
            extra += [f"train.init_from={base_dir}", f"train.steps={warm_steps}"]
        cfg = load_config(preset, [*overrides, *extra])
        if not rows:
            start = time.perf_counter()
            corpus = load_run_corpus(cfg)
            print(f"corpus {corpus.name}: {len(corpus.train):,} / {len(corpus.val):,} / "
                  f"{len(corpus.test):,} characters (train / val / test), vocabulary {corpus.vocab.size}, "
                  f"prepared in {time.perf_counter() - start:.1f}s")
        how = (f"from {mechanisms[0]}, +{warm_steps} steps" if rows and warm_steps
               else f"{cfg.train.steps} steps")
        print(f"\n=== {name}: {how} ===")
        summary = train(cfg, overwrite=overwrite)
        model, cfg, vocab_json = model_from_checkpoint(summary["checkpoint"])
        test = evaluate(model, as_tensor(corpus.test), seq_len=cfg.train.seq_len,
                        batch_size=cfg.train.batch_size, chars_per_token=corpus.chars_per_token("test"))
        long = bpc_at(model, as_tensor(corpus.test), shown[-1], cfg.train.seq_len, corpus.chars_per_token("test"))
        vocab = Vocab.from_json(vocab_json)
        prompt = torch.as_tensor(vocab.encode(PROMPT), dtype=torch.long)[None]
        tokens = [t.item() for t in generate(model, prompt, 300, temperature=0.8, seed=0)]
        print(f"\n--- sample ({name}) ---\n{PROMPT}{vocab.decode(tokens)}\n---")
        models.append(model)
        rows.append({"attention": name, "trained": how, "params": summary["params"],
                     "val_bpc": summary["val"]["bpc"], "test_bpc": test["bpc"], "long_bpc": long,
                     "train_tokens_per_s": summary["tokens_per_s"], "train_s": summary["wall_s"],
                     "decoding": {}})
    compiled = [decoding_step(m) for m in models] if compile else None
    for c in contexts:
        for row, cost in zip(rows, decoding_costs(models, c, compiled=compiled)):
            row["decoding"][str(c)] = cost
    print_table(rows, shown)
    out = Path(out_dir)
    atomic_write_text(out / "summary.json", json.dumps(rows, indent=2))
    plot_decoding(rows, out / "decoding.png")
    return rows


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def print_table(rows: list[dict], shown: list[int]) -> None:
    """The demo's table; where decoding was also timed compiled, ms/token shows 'eager / compiled'."""
    base = rows[0]
    compiled = "ms_per_token_compiled" in rows[0]["decoding"][str(shown[0])]
    timed, width = (" eager/compiled", 34) if compiled else ("", 18)
    at = f"bpc @{base['long_bpc']['length']:,}"
    head = (f"{'attention':<12}{'trained':<26}{'params':>9}{'val bpc':>9}{'test bpc':>9}{'vs ' + base['attention']:>12}"
            f"{at:>18}{'train tok/s':>12}" + "".join(f"{'ms/token @' + f'{c:,}' + timed:>{width}}{'state @' + f'{c:,}':>16}"
                                                     for c in shown))
    print("\n" + head)
    for r in rows:
        line = (f"{r['attention']:<12}{r['trained']:<26}{r['params']:>9,}{r['val_bpc']:>9.3f}{r['test_bpc']:>9.3f}"
                f"{r['test_bpc'] - base['test_bpc']:>+12.3f}{_long(r['long_bpc']):>18}{r['train_tokens_per_s']:>12,.0f}")
        for c in shown:
            d = r["decoding"][str(c)]
            ms = f"{d['ms_per_token']:.2f}" + (f" / {d['ms_per_token_compiled']:.2f}" if compiled else "")
            line += f"{ms:>{width}}{_bytes(d['state_bytes']):>16}"
        print(line)


def _long(figure: dict) -> str:
    """A `bpc_at` figure for the table: '1.234 (stream)', or 'not read'."""
    return "not read" if figure["bpc"] is None else f"{figure['bpc']:.3f} ({figure['read']})"


def plot_decoding(rows: list[dict], path: Path) -> None:
    """Decoding ms per token and state bytes against the context length, one line a model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed; the figures are in {path.parent / 'summary.json'})")
        return
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in rows:
        cs = sorted(int(c) for c in r["decoding"])
        ax_t.plot(cs, [r["decoding"][str(c)]["ms_per_token"] for c in cs], marker="o", label=r["attention"])
        ax_s.plot(cs, [r["decoding"][str(c)]["state_bytes"] / 2**20 for c in cs], marker="o", label=r["attention"])
    for ax, title in ((ax_t, "decoding: ms per token"), (ax_s, "decoding state: MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    print(f"plot: {path}")
