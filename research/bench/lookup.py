"""lookup: the cost of answering one query from a stored document, against its length
(de Brébisson & Vincent's fixed-size representations; cf. results/linear-qa).

A document is n states h [n, k] (random: a read costs the same whatever their values).
softmax attention keeps all n states and reads them for every query (`softmax_attention`,
O(n·k) a query); linear attention keeps C = Σ h hᵀ (k×k, `memattn.representations.encode`,
once a document) and reads C q (`memattn.representations.lookup`, O(k²), whatever n).
Time: the median wall time of one call answering every query of every document (at least
25 calls, each read's calls in a block of their own), divided by the queries. Bytes: what each keeps per document. The
linear row also gives the one-off time to build C.
"""

from __future__ import annotations

import math

import torch

from research.bench.common import Progress
from research.bench.report import BASELINE, Metric, Result, Row, Section, fmt_bytes, fmt_ms, fmt_us
from research.bench.settings import BenchSettings
from research.bench.timing import failure, median_time, median_times, release
from memattn.ops import softmax_attention
from memattn.representations import encode, lookup

NAME = "lookup"
LINEAR = "linear"
CALLS = 25  # the fewest timed calls of each read


def count(s: BenchSettings) -> int:
    return len(set(s.sizes.lookup.lengths))


def costs(s: BenchSettings, n: int) -> tuple[dict[str, float], dict[str, float]]:
    """(softmax metrics, linear metrics) for documents of n states."""
    z = s.sizes.lookup
    g = torch.Generator(device=s.device).manual_seed(n)
    h = (torch.randn(z.documents, n, z.key_dim, device=s.device, generator=g) / math.sqrt(z.key_dim)).to(s.dtype)
    q = torch.randn(z.documents, z.queries, z.key_dim, device=s.device, generator=g).to(s.dtype)
    reps = encode(h)  # C [N, 1, k, k], accumulated in fp32 for fp16 / bf16
    q_lin = q.to(reps.dtype)
    states = h[:, :, None]  # [N, n, 1, k]: what softmax attention must keep

    def softmax_read():
        return softmax_attention(q[:, :, None], states, states, causal=False)[0]

    def linear_read():
        return lookup(reps, q_lin)

    # Reads take microseconds: many calls, each read timed in a block of its own.
    repeats = max(s.repeats, CALLS)
    t = median_times({BASELINE: softmax_read, LINEAR: linear_read}, repeats=repeats,
                     warmup=max(s.warmup, 1), device=s.device, interleave=False)
    built = median_time(lambda: encode(h), repeats=s.repeats, warmup=s.warmup, device=s.device)
    per = z.documents * z.queries
    soft = {"seconds_per_query": t[BASELINE] / per,
            "bytes_per_document": states[0].numel() * states.element_size()}
    lin = {"seconds_per_query": t[LINEAR] / per, "bytes_per_document": reps.nbytes() / z.documents,
           "encode_seconds_per_document": built / z.documents}
    return soft, lin


def run(s: BenchSettings, progress: Progress) -> Result:
    z = s.sizes.lookup
    section = Section(
        NAME, f"One query against a stored document (k = {z.key_dim})",
        f"{z.documents} document(s) of n states of size k = {z.key_dim}, {z.queries} queries each, "
        "answered in one call. Build C: the one-off time to write a document into C.",
        (Metric("seconds_per_query", "µs per query", fmt_us, scale=1e6),
         Metric("bytes_per_document", "bytes kept per document", fmt_bytes),
         Metric("encode_seconds_per_document", "build C per document (ms)", fmt_ms, ratio=False,
                scale=1e3)),
        x_name="document length n")
    result = Result(NAME, "Lookup: per-query cost against document length",
                    __doc__.split("\n\n", 1)[1].strip(), [section], {}, {"lookup": vars(z)})
    for n in sorted(set(z.lengths)):
        progress.step(f"lookup n={n:,}")
        soft = Row(NAME, BASELINE, BASELINE, x=n)
        lin = Row(NAME, LINEAR, LINEAR, {"feature_map": "identity", "normalize": False}, x=n)
        try:
            a, b = costs(s, n)
            soft.metrics.update(a)
            lin.metrics.update(b)
        except Exception as e:  # noqa: BLE001  (recorded, and the run goes on)
            status, reason = failure(e)
            for row in (soft, lin):
                row.status, row.reason = status, reason
        finally:
            release(s.device)
        result.rows += [soft, lin]
        progress.done()
    return result
