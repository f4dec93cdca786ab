"""encode: time and peak memory to encode one batch with a bidirectional encoder, each
mechanism against softmax attention (the analogue of ABC's Table 6).

ABC's comparison: softmax against abc-linformer and abc-mlp with n = 64 and 128 slots.
Here every bidirectional mechanism whose registration names the option that sizes its
memory (`Mechanism.state_size`) runs at each n of `encode.slots` (that option set to n);
the others, and those given options on the command line, run at their options. One
forward pass of `memattn.models.Encoder` (random weights, random tokens) under
`torch.inference_mode`, the hidden states as output. Time: the median wall time of a pass.
Peak memory: the most bytes of tensors torch held at once during one pass, above the
weights and inputs held before it (CUDA: `torch.cuda.max_memory_allocated`; CPU: the
running sum of the allocations and frees the PyTorch profiler records with
`profile_memory=True`; neither counts the allocator's cached, unused pages).
"""

from __future__ import annotations

import torch

from research.bench.common import Progress, choice_label, chosen_mechanisms, measure, model_config
from research.bench.report import Metric, Result, Row, Section, fmt_bytes, fmt_ms, fmt_rate
from research.bench.settings import BenchSettings
from research.bench.timing import median_time, peak_allocated
from memattn.models import Encoder

NAME = "encode"


def variants(s: BenchSettings) -> tuple[list[tuple[str, str, dict]], list[tuple[str, str]]]:
    """([(label, mechanism, options)], [(label, mechanism, why skipped)]), softmax first; a
    sized row's label is what --attention would call it (NAME OPTION=VALUE ...)."""
    runs, skipped = [], []
    for c in chosen_mechanisms(s):
        size = c.mechanism.state_size
        if not c.mechanism.bidirectional:
            skipped.append((c.label, c.name, "causal only: it has no bidirectional form for an encoder"))
        elif size is not None and size.option is not None and not c.options:
            for n in s.sizes.encode.slots:
                options = size.sized(n, s.sizes.encode.length)
                runs.append((choice_label(c.name, options), c.name, options))
        else:
            runs.append((c.label, c.name, c.options))
    return runs, skipped


def count(s: BenchSettings) -> int:
    return len(variants(s)[0])


def run(s: BenchSettings, progress: Progress) -> Result:
    e = s.sizes.encode
    what = (f"{e.n_layers} layers, d_model {e.d_model}, {e.n_heads} heads of "
            f"{e.d_model // e.n_heads}, feed-forward {e.ff_mult:g}·d, rotary positions; a batch of "
            f"{e.batch} sequences of {e.length} tokens")
    section = Section(NAME, f"Encoding a batch ({e.batch} × {e.length} tokens)",
                      f"The encoder: {what}. Peak memory: the whole batch, above the weights.",
                      (Metric("seconds", "time per batch", fmt_ms, scale=1e3),
                       Metric("tokens_per_s", "tokens/s", fmt_rate),
                       Metric("peak_bytes", "peak memory", fmt_bytes)))
    result = Result(NAME, "Encoding: time and peak memory of one batch",
                    __doc__.split("\n\n", 1)[1].strip(), [section], {},
                    {"encode": vars(e), "encoder_shape": what})
    runs, skipped = variants(s)
    result.rows += [Row(NAME, label, name, status="skipped", reason=why) for label, name, why in skipped]
    for label, name, options in runs:
        progress.step(f"encode {label}")
        row = Row(NAME, label, name, options, shape={"batch": e.batch, "length": e.length})

        def one(name=name, options=options) -> dict[str, float]:
            torch.manual_seed(0)
            model = Encoder(model_config(name, options, e, e.length)).to(s.device, s.dtype).eval()
            idx = torch.randint(0, e.vocab_size, (e.batch, e.length), device=s.device)

            def forward():
                with torch.inference_mode():
                    model(idx)

            seconds = median_time(forward, repeats=s.repeats, warmup=s.warmup, device=s.device)
            return {"seconds": seconds, "tokens_per_s": e.batch * e.length / seconds,
                    "peak_bytes": peak_allocated(forward, s.device)}

        result.rows.append(measure(row, one, s))
        progress.done()
    return result
