"""GMAT (Gupta & Berant 2020) §3.1, small: MAJORITY(L, p) with and without global memory.

MAJORITY(L, p): a sequence of L fair random bits cut into p contiguous segments of
(nearly) equal length; every token is tagged with the majority bit of its segment. Our
generator (`majority_batch`, seeded) draws the bits independently and breaks a tie (an
even segment with as many 0s as 1s) by flipping one of its bits at random. Margins are
then small, about √n for a segment of n bits, so a chunk of C bits often disagrees with
its segment. A prediction is an exact match when all L tags are right. The generator can
also draw wide margins, where a model finds the rule much sooner; training starts there
(`train_margins`, see Settings). Two kinds: "uniform" (the majority count uniform in
⌊n/2⌋+1 … n, bits in random order) and "runs" (each segment two runs: a prefix of random
length mostly of one bit, the rest mostly of the other).

A tag depends on the whole segment, but chunked attention lets a token see only its own
chunk of C tokens: without memory (M = 0) a 2-layer encoder can only guess from its
chunk; with M memory tokens that read everything, two layers suffice (write, then read).
With p = 3 the memory tokens must also part the segments between them, and they start as
near copies of each other (a saddle: no token prefers a memory token until that one
covers its segment, and the reverse). Two choices get MAJORITY(512, 3) past it. "runs":
under "uniform" any chunk of a segment already shows its majority, the model learns to
answer from its chunk and the memory path gets almost no gradient; inside a run a chunk
is wrong about its segment half of the time, only a count over the whole segment is
right. Weights N(0, 1/√d_model) rather than GPT-2's N(0, 0.02): larger random differences
between memory tokens. Exact match of probe runs at MAJORITY(512, 3), M = 8, 2,000 steps:
uniform / 0.02 0.08 (0.04 even with the position table replaced by a segment indicator),
uniform / 0.125 0.24, runs / 0.02 0.14, runs / 0.125 0.69 (0.84 after 3,000 steps; from
the experiment's own initial draw 0.30 after 3,000 and 0.87 after 5,000, the default). At
p = 1 nothing has to part: uniform / 0.02 gives 0.95 in 800 steps, uniform / 0.125 0.85,
runs / 0.125 0.75, so each task has its own `wide` and `init_std`.

Models: 2-layer encoders (`memattn.models.Encoder` with a tagging head), gmat attention
with the chunked pattern, split positions (p = 512·q + r), trained with AdamW on fresh
batches; M = 0 and M = num_memory on MAJORITY(512, 1), MAJORITY(512, 3) and
MAJORITY(8192, 1) (smaller batches, fewer steps and larger chunks at 8,192). The last task
starts from the trained MAJORITY(512, 1) model of the same M (its weights fit any L; the
split table's new block rows copy the trained one, so the memory's average over 16
blocks starts out as uniform as over one, and a short fine-tune at a low rate sharpens its
precision for margins of about √8192 in 8,192: exact match 0.84 after 200 steps, 0.93 after
500, the default).

    memattn experiment gmat-majority [--quick] [steps=800 segment_steps=5000 long_steps=500 ...]

Writes results.json, results.md and gmat_majority.png to the output folder.
"""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError
from research.experiments import single_process
from research.experiments._common import command_of, plot_curves, torch_threads, train_steps, write_results
from memattn.models import Encoder
from memattn.typed import parse_settings

DESCRIPTION = "GMAT: MAJORITY(L, p) tagging with chunked attention, without and with global memory"
NAME = "gmat-majority"


@dataclass
class Settings:
    """What the experiment runs; every field can be overridden as key=value."""

    d_model: int = 64
    n_heads: int = 4
    positions: str = "split"  # model.positions: split (p = 512·q + r), learned or rotary
    # training data: "wide" margins; "fair" coins; "curriculum": wide margins for the first
    # `wide_phase` of the steps, then half wide, half fair
    train_margins: str = "curriculum"
    wide: str = "uniform"  # the wide-margin sequences at p = 1: "runs" or "uniform" (see majority_batch)
    segment_wide: str = "runs"  # ... at p = 3
    wide_phase: float = 0.5  # curriculum: share of the steps on wide margins alone at L = 512
    long_wide_phase: float = 0.0  # ... at L = 8192 (a chained model already knows the rule)
    # "chain": MAJORITY(8192, 1) starts from the trained MAJORITY(512, 1) model of the same M
    # (the weights do not depend on L); "scratch": every model anew
    start: str = "chain"
    init_std: float = 0.02  # model.init_std at p = 1
    segment_init_std: float = 0.125  # ... at p = 3 (1/√d_model)
    num_memory: int = 8  # M of the memory models (the others have M = 0)
    chunk_size: int = 64  # C at L = 512
    long_chunk_size: int = 256  # C at L = 8192
    steps: int = 800  # training steps on MAJORITY(512, 1)
    segment_steps: int = 5000  # ... on MAJORITY(512, 3)
    long_steps: int = 500  # ... on MAJORITY(8192, 1)
    batch: int = 16  # sequences a step at L = 512
    long_batch: int = 2  # sequences a step at L = 8192
    lr: float = 3e-3
    long_lr: float = 2e-4  # at L = 8192 (fine-tuning, two sequences a step: larger rates unlearn)
    warmup: int = 30
    long_warmup: int = 10
    test_sequences: int = 200  # fresh sequences scored at L = 512
    long_test_sequences: int = 100  # ... at L = 8192
    seed: int = 0
    budget_s: float = 0.0  # > 0: stop a model's training after this many seconds
    threads: int = 1  # torch threads (on a shared 2-core CPU one thread runs fastest)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "positions":
                if value not in ("split", "learned", "rotary"):
                    raise ConfigError(f"positions: expected split, learned or rotary, got {value!r}")
            elif f.name == "start":
                if value not in ("chain", "scratch"):
                    raise ConfigError(f"start: expected chain or scratch, got {value!r}")
            elif f.name == "train_margins":
                if value not in ("wide", "fair", "curriculum"):
                    raise ConfigError(f"train_margins: expected wide, fair or curriculum, got {value!r}")
            elif f.name in ("wide", "segment_wide"):
                if value not in WIDE:
                    raise ConfigError(f"{f.name}: expected {' or '.join(WIDE)}, got {value!r}")
            elif f.name in ("wide_phase", "long_wide_phase"):
                if not 0 <= value <= 1:
                    raise ConfigError(f"{f.name}: expected a share in [0, 1], got {value!r}")
            elif value < 0 or (value == 0 and f.name not in ("seed", "budget_s", "warmup", "long_warmup")):
                raise ConfigError(f"{f.name}: expected a positive value, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")


WIDE = ("runs", "uniform")
TRAINING = {
    "wide": "wide-margin sequences ({wide}; {segment_wide} at p = 3)",
    "fair": "fair-coin sequences",
    "curriculum": "wide-margin sequences ({wide}; {segment_wide} at p = 3) alone for the first "
                  "{wide_phase:.0%} of the steps at L = 512 ({long_wide_phase:.0%} at L = 8192), then half "
                  "wide-margin, half fair-coin",
}
RUN_PURITY = 0.9  # "runs": the share of a run's bits that are its bit
QUICK = dict(d_model=32, steps=40, segment_steps=40, long_steps=4, batch=8, long_batch=1, test_sequences=32,
             long_test_sequences=4, warmup=5, long_warmup=1)
TASKS = ((512, 1), (512, 3), (8192, 1))


def majority_batch(length: int, parts: int, batch: int, generator: torch.Generator, *,
                   margins: str = "fair") -> tuple[torch.Tensor, torch.Tensor]:
    """MAJORITY(length, parts): (bits [batch, length] int64, tags [batch, length] int64).

    Segment s covers positions [s·length // parts, (s+1)·length // parts) and holds n bits.
    In every kind a tied segment gets one of its bits, chosen at random, flipped.
    margins "fair": the bits are fair coins (margins about √n). "uniform": the majority bit
    is a fair coin and its count is uniform in ⌊n/2⌋+1 … n, the bits in random order.
    "runs": a fair bit b fills a prefix of uniform length 1 … n-1 and 1 - b the rest, each
    bit then flipped with probability 1 - RUN_PURITY; the longer run decides the tag.
    """
    if parts < 1 or length < parts:
        raise ConfigError(f"parts: expected 1 <= parts <= length = {length}, got {parts}")
    if margins not in ("fair", *WIDE):
        raise ConfigError(f"margins: expected fair, {' or '.join(WIDE)}, got {margins!r}")
    bits = torch.randint(0, 2, (batch, length), generator=generator)
    bounds = [s * length // parts for s in range(parts + 1)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        n = hi - lo
        if margins == "uniform":
            majority = torch.randint(0, 2, (batch, 1), generator=generator)
            count = torch.randint(n // 2 + 1, n + 1, (batch, 1), generator=generator)
            order = torch.rand(batch, n, generator=generator).argsort(dim=1).argsort(dim=1)
            bits[:, lo:hi] = torch.where(order < count, majority, 1 - majority)
        elif margins == "runs" and n > 1:
            first = torch.randint(0, 2, (batch, 1), generator=generator)
            prefix = torch.arange(n) < torch.randint(1, n, (batch, 1), generator=generator)
            noise = (torch.rand(batch, n, generator=generator) >= RUN_PURITY).long()
            bits[:, lo:hi] = torch.where(prefix, first, 1 - first) ^ noise
        tied = torch.nonzero(2 * bits[:, lo:hi].sum(dim=1) == n).flatten()
        flip = torch.randint(lo, hi, (len(tied),), generator=generator)
        bits[tied, flip] = 1 - bits[tied, flip]
    tags = torch.empty(batch, length, dtype=torch.long)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        tags[:, lo:hi] = (2 * bits[:, lo:hi].sum(dim=1, keepdim=True) > hi - lo).long()
    return bits, tags


def build_model(length: int, num_memory: int, chunk_size: int, s: Settings, init_std: float) -> Encoder:
    cfg = ModelConfig(vocab_size=2, d_model=s.d_model, n_layers=2, n_heads=s.n_heads, ff_mult=2,
                      positions=s.positions, max_len=length, init_std=init_std,
                      attention=AttentionConfig("gmat", {"num_memory": num_memory, "pattern": "chunked",
                                                         "chunk_size": chunk_size}))
    return Encoder(cfg, n_tags=2)


@torch.no_grad()
def score(model: Encoder, length: int, parts: int, sequences: int, batch: int, seed: int,
          margins: str = "fair") -> dict[str, float]:
    """Exact match (all tags right) and token accuracy on `sequences` fresh sequences."""
    g = torch.Generator().manual_seed(seed)
    exact = correct = 0
    for start in range(0, sequences, batch):
        bits, tags = majority_batch(length, parts, min(batch, sequences - start), g, margins=margins)
        right = model.tag_logits(model(bits)).argmax(-1) == tags
        exact += int(right.all(dim=1).sum())
        correct += int(right.sum())
    return {"exact_match": exact / sequences, "token_accuracy": correct / (sequences * length)}


def start_from(model: Encoder, trained: Encoder) -> None:
    """Copy a shorter model's weights into `model`. Position rows it lacks: the split table's
    block rows (q ≥ 1) start as copies of its last block row, so that every block of 512
    positions looks like the one it was trained on; a learned table's rows keep their init."""
    own = model.state_dict()
    for name, t in trained.state_dict().items():
        if own[name].shape == t.shape:
            own[name] = t
        else:  # a position table of the shorter model: its first rows
            own[name][: t.shape[0]] = t
            if name.endswith("pos.high.weight"):
                own[name][t.shape[0]:] = t[-1]
    model.load_state_dict(own)


def run_one(length: int, parts: int, num_memory: int, s: Settings,
            init: Encoder | None = None) -> tuple[dict[str, Any], Encoder]:
    """Train and score one model (from `init`'s weights when given): (its row, the model)."""
    long = length > 512
    chunk = s.long_chunk_size if long else s.chunk_size
    batch = s.long_batch if long else s.batch
    torch.manual_seed(s.seed)
    segments = parts > 1
    model = build_model(length, num_memory, chunk, s, s.segment_init_std if segments else s.init_std)
    if init is not None:
        start_from(model, init)
    g = torch.Generator().manual_seed(s.seed * 1000 + length + parts)  # same data for M = 0 and M > 0

    steps = s.long_steps if long else s.segment_steps if segments else s.steps
    wide_steps = int(steps * (s.long_wide_phase if long else s.wide_phase))

    def loss_of(step: int) -> torch.Tensor:
        hard = {"wide": 0, "fair": batch, "curriculum": 0 if step < wide_steps else batch // 2}[s.train_margins]
        easy = majority_batch(length, parts, batch - hard, g,  # wide margins: find the rule
                              margins=s.segment_wide if segments else s.wide)
        fair = majority_batch(length, parts, hard, g)  # narrow margins: count precisely
        bits, tags = (torch.cat(pair) for pair in zip(easy, fair))
        return F.cross_entropy(model.tag_logits(model(bits)).flatten(0, 1), tags.flatten())

    label = f"{NAME}: MAJORITY({length}, {parts}) M={num_memory}"
    trained = train_steps(model, loss_of, steps=steps, lr=s.long_lr if long else s.lr,
                          warmup=s.long_warmup if long else s.warmup,
                          log_every=max(1, steps // 10), label=label,
                          budget_s=s.budget_s)
    sequences = s.long_test_sequences if long else s.test_sequences
    result = score(model, length, parts, sequences, batch=max(1, batch), seed=10_000 + s.seed)
    wide = score(model, length, parts, sequences, batch=max(1, batch), seed=20_000 + s.seed, margins="uniform")
    result["exact_match_wide"] = wide["exact_match"]
    print(f"{label}: exact match {result['exact_match']:.3f} (wide margins {wide['exact_match']:.3f}), "
          f"token accuracy {result['token_accuracy']:.4f}", flush=True)
    row = {"L": length, "p": parts, "M": num_memory, "chunk_size": chunk, "batch": batch,
           "params": sum(p.numel() for p in model.parameters()), "test_sequences": sequences,
           "init": "MAJORITY(512, 1)" if init is not None else "scratch", **result, **trained}
    return row, model


def run(out_dir: Path, *, quick: bool = False, overrides: list[str] = (), jobs: int = 1) -> dict:
    """Train and score M = 0 and M = num_memory on each task; write the results under out_dir."""
    single_process("gmat-majority", jobs)
    s = parse_settings(Settings, list(overrides), QUICK if quick else {}, name=NAME)
    out_dir = Path(out_dir)
    with torch_threads(s.threads):
        rows, first = [], {}
        for L, p in TASKS:
            for M in (0, s.num_memory):
                init = first.get(M) if s.start == "chain" and L > 512 else None
                row, model = run_one(L, p, M, s, init)
                rows.append(row)
                if (L, p) == (512, 1):
                    first[M] = model
    results = {"experiment": NAME, "quick": quick, "settings": dataclasses.asdict(s), "rows": rows,
               "environment": {"torch": torch.__version__, "threads": s.threads,
                               "machine": platform.machine()}}
    write_results(out_dir, results, render_markdown(results, command_of(out_dir, NAME, quick, overrides)))
    plot_curves(out_dir / "gmat_majority.png", "MAJORITY(L, p): training loss",
                {f"MAJORITY({r['L']}, {r['p']}) M={r['M']}": r["losses"] for r in rows}, "cross-entropy")
    return results


def render_markdown(results: dict, command: str) -> str:
    s = results["settings"]
    lines = [
        "# GMAT: MAJORITY(L, p) with chunked attention, without and with global memory",
        "",
        f"Command: `{command}`" + (" (quick smoke run: numbers are not meaningful)" if results["quick"] else ""),
        "",
        f"2-layer encoders, d_model {s['d_model']}, {s['n_heads']} heads, gmat attention with the "
        f"chunked pattern, {s['positions']} positions, weights initialised N(0, {s['init_std']}) "
        f"(N(0, {s['segment_init_std']}) at p = 3); AdamW with warm-up and cosine decay. Training "
        f"data: {TRAINING[s['train_margins']].format(**s)}. Exact match = every tag of a sequence right, on fresh "
        "fair-coin sequences of our own seeded generator (margins about √n, so no chunk of C bits can "
        "decide alone), and on fresh wide-margin ones (a majority count uniform in n/2 … n).",
        "",
        "| task | M | chunk C | start | steps × batch | train s | exact match | token accuracy | "
        "exact match, wide margins |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(f"| MAJORITY({r['L']}, {r['p']}) | {r['M']} | {r['chunk_size']} | {r['init']} | "
                     f"{r['steps']} × {r['batch']} | {r['seconds']:.0f} | {r['exact_match']:.3f} | "
                     f"{r['token_accuracy']:.4f} | {r['exact_match_wide']:.3f} |")
    lines += [
        "",
        "The paper reports exact match 0.98–1.0 with M = 8 where the sparse model without "
        "memory fails; compare the rows above (exact match over "
        f"{s['test_sequences']} sequences at L = 512, {s['long_test_sequences']} at L = 8192).",
        "",
    ]
    return "\n".join(lines)
