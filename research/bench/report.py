"""Results of one benchmark: rows of measurements, their ratios to softmax measured in the
same run (and, for a peer library's row, memattn's figure over the peer's), and the files
they are written to (JSON, markdown tables, PNG plots)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memattn.fileio import atomic_write

BASELINE = "softmax"  # the label of the row every other row is divided by
STATUSES = ("ok", "oom", "error", "skipped")


@dataclass(frozen=True)
class Metric:
    """A figure a benchmark records: its key in a row, how it reads and prints."""

    key: str
    title: str
    fmt: Callable[[float], str]
    ratio: bool = True  # shown with its ratio to softmax
    scale: float = 1.0  # plotted as value · scale (seconds as ms: 1e3), to match the title


@dataclass(frozen=True)
class Section:
    """A group of rows compared with each other at each x (e.g. one attention layer)."""

    name: str
    title: str
    text: str
    metrics: tuple[Metric, ...]
    x_name: str | None = None  # "context", "length", ... None: one configuration


@dataclass
class Row:
    section: str
    label: str  # the row's name in tables, e.g. "abc-mlp n=64"
    mechanism: str
    options: dict[str, Any] = field(default_factory=dict)
    x: int | None = None
    status: str = "ok"
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    shape: dict[str, Any] = field(default_factory=dict)  # batch and the like, where it varies
    vs_softmax: dict[str, float] = field(default_factory=dict)
    versus: str = ""  # a peer library's row: the label of the memattn row it is measured against
    memattn_over_peer: dict[str, float] = field(default_factory=dict)  # peer rows: memattn / this


@dataclass
class Result:
    name: str  # the benchmark: file names <name>.json / .md / .png
    title: str
    intro: str
    sections: list[Section]
    meta: dict[str, Any]
    settings: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def add_ratios(rows: list[Row], baseline: str = BASELINE) -> None:
    """Set each row's vs_softmax[metric] = its value / the baseline row's value, the baseline
    being the row labelled `baseline` in the same section at the same x (measured in the
    same run). Rows that failed, or whose baseline failed, get no ratio. A peer's row (one
    with `versus`) also gets memattn_over_peer[metric] = the memattn row's value / its own."""
    base = {(r.section, r.x): r for r in rows if r.label == baseline and r.status == "ok"}
    ok = {(r.section, r.label, r.x): r for r in rows if r.status == "ok"}
    for r in rows:
        r.vs_softmax, r.memattn_over_peer = {}, {}
        if r.status != "ok":
            continue
        r.vs_softmax = _divide(r, base.get((r.section, r.x)))
        mine = ok.get((r.section, r.versus, r.x)) if r.versus else None
        if mine is not None:
            r.memattn_over_peer = _divide(mine, r)


def _divide(row: Row, by: Row | None) -> dict[str, float]:
    """{metric: row's value / by's value} where both are finite and by's is not 0."""
    out = {}
    for key, value in (row.metrics.items() if by is not None else ()):
        b = by.metrics.get(key)
        if b and value is not None and math.isfinite(b) and math.isfinite(value):
            out[key] = value / b
    return out


# Formatting ----------------------------------------------------------------------------------


def _num(x: float) -> str:
    """Three significant digits, never in exponent form."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{_num(n / size)} {unit}"
    return f"{n:.0f} B"


def fmt_ms(seconds: float) -> str:
    return f"{_num(1e3 * seconds)} ms" if seconds < 1 else f"{_num(seconds)} s"


def fmt_us(seconds: float) -> str:
    return f"{_num(1e6 * seconds)} µs"


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def fmt_ratio(r: float) -> str:
    if r < 0.095:
        return f"{r:.2g}×"  # 0.0029×, not 0.00×
    return f"{r:.2f}×" if r < 10 else f"{r:.1f}×" if r < 100 else f"{r:,.0f}×"


def _cell(row: Row | None, metric: Metric) -> str:
    if row is None:
        return "—"
    if row.status != "ok":
        return row.status
    value = row.metrics.get(metric.key)
    if value is None:
        return "—"
    text = metric.fmt(value)
    ratio = row.vs_softmax.get(metric.key)
    if metric.ratio and ratio is not None and row.label != BASELINE:
        text += f" ({fmt_ratio(ratio)})"
    return text


def _labels(rows: list[Row]) -> list[str]:
    """Row labels in order of first appearance, softmax first."""
    seen = list(dict.fromkeys(r.label for r in rows))
    return sorted(seen, key=lambda label: label != BASELINE)


def _shown(result: Result, section: Section) -> list[Row]:
    return [r for r in result.rows if r.section == section.name and r.status != "skipped"]


def markdown(result: Result) -> str:
    """Tables of every figure, each with its ratio to softmax in the same run."""
    m = result.meta
    device = m.get("gpu") or m.get("cpu") or m["device"]
    lines = [
        f"# {result.title}", "", "```sh", m["command"], "```", "",
        f"{m['device']} ({device}), {m['dtype']}, {m['threads']} threads, torch {m['torch']}, "
        f"memattn {m['memattn']}, Python {m['python']}; median of {m['repeats']} timed calls after "
        f"{m['warmup']} warm-up call(s). Environment: "
        + (", ".join(f"`{k}={v}`" for k, v in m["env"].items()) or "as is") + ".", "",
        result.intro, "",
        ("Each cell: the figure, then in parentheses its ratio to softmax measured in the same run "
         "(this / softmax; for times and bytes below 1 is better, for throughput above 1). "
         "oom: out of memory; error: the configuration failed (reasons below)."), "",
    ]
    for section in result.sections:
        rows = _shown(result, section)
        lines += [f"## {section.title}", "", section.text, ""]
        if not rows:
            lines += ["No configuration ran.", ""]
            continue
        labels = _labels(rows)
        if section.x_name is None:
            head = ["mechanism", *(mt.title for mt in section.metrics)]
            lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(section.metrics)]
            for label in labels:
                row = next(r for r in rows if r.label == label)
                lines.append("| " + " | ".join([label, *(_cell(row, mt) for mt in section.metrics)]) + " |")
            lines.append("")
            continue
        xs = sorted({r.x for r in rows})
        for metric in section.metrics:
            by = {(r.label, r.x): r for r in rows}
            lines += [f"**{metric.title}** by {section.x_name}", "",
                      "| mechanism | " + " | ".join(f"{x:,}" for x in xs) + " |",
                      "|---|" + "---:|" * len(xs)]
            for label in labels:
                lines.append(f"| {label} | " + " | ".join(_cell(by.get((label, x)), metric) for x in xs) + " |")
            lines.append("")
    lines += peer_tables(result)
    skipped = dict.fromkeys(f"- {r.label}: {r.reason}" for r in result.rows if r.status == "skipped")
    failed = dict.fromkeys(f"- {r.label}" + (f" at {r.x:,}" if r.x is not None else "") + f" ({r.status}): {r.reason}"
                           for r in result.rows if r.status in ("oom", "error"))
    if skipped:
        lines += ["## Skipped", "", *skipped, ""]
    if failed:
        lines += ["## Failures", "", *failed, ""]
    if result.notes:
        lines += ["## Notes", "", *(f"- {n}" for n in result.notes), ""]
    return "\n".join(lines).rstrip() + "\n"


def peer_tables(result: Result) -> list[str]:
    """Markdown lines: for each section with peer rows, each metric, memattn's figure over the
    peer's at each x ([] when no peer row ran)."""
    lines: list[str] = []
    for section in result.sections:
        peers = [r for r in _shown(result, section) if r.versus]
        if not peers:
            continue
        pairs = list(dict.fromkeys((r.versus, r.label) for r in peers))
        xs = sorted({r.x for r in peers}, key=lambda x: (x is None, x))
        by = {(r.label, r.x): r for r in peers}
        lines += [f"### {section.title}", ""]
        for metric in section.metrics:
            lines += [f"**{metric.title}**" + (f" by {section.x_name}" if section.x_name else ""), "",
                      "| memattn / peer | " + " | ".join("" if x is None else f"{x:,}" for x in xs) + " |",
                      "|---|" + "---:|" * len(xs)]
            for mine, peer in pairs:
                cells = []
                for x in xs:
                    r = by.get((peer, x))
                    ratio = None if r is None else r.memattn_over_peer.get(metric.key)
                    cells.append(r.status if r is not None and r.status != "ok" else
                                 "—" if ratio is None else fmt_ratio(ratio))
                lines.append(f"| {mine} / {peer} | " + " | ".join(cells) + " |")
            lines.append("")
    intro = ("Each cell: memattn's figure / the peer's, measured side by side in this run (times "
             "and bytes: below 1 memattn is better; tokens/s: above 1).")
    return ["## memattn against its peers", "", intro, "", *lines] if lines else []


def plot(result: Result, path: Path) -> bool:
    """One panel a metric of each section: log-log lines against x, or bars of the ratio to
    softmax where a section has one configuration. False when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = [(s, mt) for s in result.sections for mt in s.metrics if _shown(result, s)]
    if not panels:
        return False
    cols = min(2, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 4.3 * rows_n), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for ax, (section, metric) in zip(axes.flat, panels):
        rows = _shown(result, section)
        labels = _labels(rows)
        others = [label for label in labels if label != BASELINE]
        color = {label: colors[i % len(colors)] for i, label in enumerate(others)}
        color[BASELINE] = "black"
        if section.x_name is None:
            ok = [r for r in rows if r.status == "ok" and metric.key in r.vs_softmax]
            ax.barh([r.label for r in ok], [r.vs_softmax[metric.key] for r in ok],
                    color=[color[r.label] for r in ok])
            ax.axvline(1.0, color="gray", lw=1, ls="--")
            ax.invert_yaxis()
            ax.tick_params(axis="y", labelsize=7)
            ax.set_xlabel(f"{metric.title}: ratio to softmax")
        else:
            for label in labels:
                pts = sorted((r.x, metric.scale * r.metrics[metric.key]) for r in rows
                             if r.label == label and r.status == "ok" and r.metrics.get(metric.key))
                if pts:
                    ax.plot(*zip(*pts), "o-" if label == BASELINE else ".-", color=color[label],
                            lw=2.5 if label == BASELINE else 1.2, ms=4, label=label)
            ax.set_xscale("log")
            ax.set_yscale("log")
            xs = sorted({r.x for r in rows})
            ax.set_xticks(xs, [f"{x:,}" for x in xs], fontsize=7)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xlabel(section.x_name)
            ax.set_ylabel(metric.title)
            ax.legend(fontsize=6, ncol=2)
        ax.set_title(section.title, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{result.title} — {result.meta['device']}, {result.meta['dtype']}", fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return True


def as_json(result: Result) -> dict[str, Any]:
    return {
        "benchmark": result.name, "title": result.title, "meta": result.meta,
        "settings": result.settings,
        "sections": [{"name": s.name, "title": s.title, "x": s.x_name,
                      "metrics": {mt.key: mt.title for mt in s.metrics}} for s in result.sections],
        "rows": [r.__dict__ for r in result.rows],
        "notes": result.notes,
    }


def write(result: Result, out_dir: Path) -> list[Path]:
    """Write <name>.json, <name>.md and <name>.png under out_dir; return the paths written."""
    add_ratios(result.rows)
    out_dir = Path(out_dir)
    paths = [out_dir / f"{result.name}.json", out_dir / f"{result.name}.md"]
    try:
        import matplotlib  # noqa: F401  (an optional dependency: memattn[plot])
    except ImportError:
        result.notes.append("No plot: matplotlib is not installed (pip install matplotlib).")
    else:
        if plot(result, out_dir / f"{result.name}.png"):
            paths.append(out_dir / f"{result.name}.png")
    text = json.dumps(as_json(result), indent=2) + "\n"
    atomic_write(paths[0], lambda tmp: tmp.write_text(text))
    md = markdown(result)
    atomic_write(paths[1], lambda tmp: tmp.write_text(md, encoding="utf-8"))
    return paths
