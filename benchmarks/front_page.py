"""The picture at the top of README.md: quality past the training length, and decoding cost.

    .venv/bin/python benchmarks/front_page.py        # writes docs/front_page.png

Left: test bits per character against the position in a document, counted in training
lengths L (log scale), from `results/long-stream-300/results.json` (each model's
"test_bpc_by_length": buckets "1x", "4x", "16x", "64x", each with "bpc", "bpc_windows" and
"read"). Softmax reads one growing window; the bounded models stream through their fixed
state. Softmax's dotted line is the same text read in windows of L from an empty memory: no
memory of anything further back.

Right: decoding state bytes (solid, left axis) and milliseconds per token (dashed, right
axis) against the context (log-log), from `results/demo/summary.json` (each row's
"decoding": {context: {"ms_per_token", "state_bytes"}}).

Whatever rows the two files hold are drawn; a missing file, row or figure is skipped (a
panel without figures says so). Other files: --long-stream, --demo, --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LONG_STREAM = ROOT / "results/long-stream-300/results.json"
DEMO = ROOT / "results/demo/summary.json"
OUT = ROOT / "docs/front_page.png"
SOFTMAX = "softmax"


def read_json(path: Path):
    """The parsed file, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def by_length_rows(result) -> list[tuple[str, list[tuple[int, float]], list[tuple[int, float]]]]:
    """(model, [(factor, bpc)], [(factor, bpc in windows of L)]) for every model with figures;
    softmax first."""
    rows = []
    for m in (result or {}).get("models", []):
        buckets = m.get("test_bpc_by_length") or {}
        points, windows = [], []
        for key, figure in buckets.items():
            try:
                factor = int(str(key).rstrip("x"))
            except ValueError:
                continue
            if (figure or {}).get("bpc") is not None:
                points.append((factor, figure["bpc"]))
            if (figure or {}).get("bpc_windows") is not None:
                windows.append((factor, figure["bpc_windows"]))
        if points:
            rows.append((m.get("model", "?"), sorted(points), sorted(windows)))
    return sorted(rows, key=lambda r: r[0] != SOFTMAX)


def decoding_rows(rows) -> list[tuple[str, list[tuple[int, float, float]]]]:
    """(attention, [(context, state bytes, ms per token)]) for every row with figures."""
    out = []
    for r in rows or []:
        points = []
        for context, figure in (r.get("decoding") or {}).items():
            try:
                points.append((int(context), float(figure["state_bytes"]), float(figure["ms_per_token"])))
            except (KeyError, TypeError, ValueError):
                continue
        if points:
            out.append((r.get("attention", "?"), sorted(points)))
    return sorted(out, key=lambda r: r[0] != SOFTMAX)


def setting(result) -> str:
    """' (300 steps, L = 256)' from an experiment's config items, or '' where they are not there."""
    items = dict(str(i).split("=", 1) for i in (result or {}).get("config", []) if "=" in str(i))
    if "train.steps" not in items or "train.seq_len" not in items:
        return ""
    return f" ({int(items['train.steps']):,} steps, L = {int(items['train.seq_len']):,})"


def empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no figures yet:\n{what}", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def draw(long_stream: Path, demo: Path, out: Path) -> Path:
    fig, (ax_q, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))

    def colour(name: str, names: list[str]) -> str:
        """Softmax black, the other rows of a panel C0, C1, ... in their order."""
        others = [n for n in names if n != SOFTMAX]
        return "black" if name == SOFTMAX else f"C{others.index(name)}"

    result = read_json(long_stream)
    rows = by_length_rows(result)
    if rows:
        names = [r[0] for r in rows]
        for name, points, windows in rows:
            read = "window" if name == SOFTMAX else "stream"
            ax_q.plot(*zip(*points), marker="o", color=colour(name, names), label=f"{name} ({read})")
            if name == SOFTMAX and windows:
                ax_q.plot(*zip(*windows), linestyle=":", color=colour(name, names),
                          label=f"{name}, windows of L")
        ax_q.set_xscale("log", base=2)
        factors = sorted({f for _, points, _ in rows for f, _ in points})
        ax_q.set_xticks(factors, [f"{f}L" for f in factors])
        ax_q.set(xlabel="position in the document (L: the training length)", ylabel="test bits per character",
                 title="Reading past the training length" + setting(result))
        ax_q.grid(alpha=0.3)
        ax_q.legend(fontsize=7)
    else:
        empty(ax_q, str(long_stream.relative_to(ROOT) if long_stream.is_relative_to(ROOT) else long_stream))

    rows = decoding_rows(read_json(demo))
    if rows:
        ax_t = ax_s.twinx()
        names = [r[0] for r in rows]
        for name, points in rows:
            contexts, state, ms = zip(*points)
            ax_s.plot(contexts, [b / 2**20 for b in state], marker="o", color=colour(name, names),
                      label=f"{name}: state")
            ax_t.plot(contexts, ms, marker="s", linestyle="--", color=colour(name, names),
                      label=f"{name}: ms/token")
        for ax in (ax_s, ax_t):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        # ms per token may span less than a decade: label its minor ticks too
        ax_t.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax_s.set_xscale("log", base=2)
        contexts = sorted({c for _, points in rows for c, _, _ in points})
        ax_s.set_xticks(contexts, [f"{c:,}" for c in contexts])
        ax_s.set(xlabel="context (tokens)", ylabel="decoding state, MiB (solid)",
                 title="Decoding one token (batch 1, CPU)")
        ax_t.set_ylabel("ms per token (dashed)")
        ax_s.grid(alpha=0.3)
        handles = [h for ax in (ax_s, ax_t) for h in ax.get_legend_handles_labels()[0]]
        ax_s.legend(handles=handles, fontsize=7, loc="upper left")
    else:
        empty(ax_s, str(demo.relative_to(ROOT) if demo.is_relative_to(ROOT) else demo))

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-stream", type=Path, default=LONG_STREAM, help="results.json of long-stream")
    parser.add_argument("--demo", type=Path, default=DEMO, help="summary.json of `memattn demo`")
    parser.add_argument("--out", type=Path, default=OUT, help="the PNG to write")
    args = parser.parse_args(argv)
    print(f"wrote {draw(args.long_stream, args.demo, args.out)}")


if __name__ == "__main__":
    main()
