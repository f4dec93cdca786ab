"""`memattn bench`: every registered mechanism measured side by side against softmax attention.

Four benchmarks, one module each (its docstring says exactly what it measures):

    decode   per-token latency and decoding-state bytes against context length (causal LM)
    encode   time and peak memory to encode a batch (bidirectional encoder; ABC's Table 6)
    train    forward + backward tokens/s against length: one layer, the small LM, the ABC op
             beside its peer (flash-linear-attention's chunk_abc, where installed on CUDA)
    lookup   per-query cost of a stored document: linear attention's C q against softmax

Mechanisms join from the registry (`memattn.layers.mechanisms()`); only softmax, the
baseline, is named. Peer libraries, where installed, join decode and train as rows
marked "(peer)" beside the mechanism they compute (`research.bench.peers`), with memattn's
figure over theirs. Each benchmark writes <name>.json, <name>.md and <name>.png under the
output folder; every figure is also given as its ratio to softmax measured in the same run.
A configuration that runs out of memory or fails is recorded ("oom" / "error") and the run
goes on. Sizes: presets per device and for --quick (`research.bench.settings`), changed with
SECTION.FIELD=VALUE overrides.

Shared instruments: `research.bench.timing` (environment, medians, peak memory),
`research.bench.report` (ratios, tables, plots).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

from research.bench import decode, encode, lookup, report, train
from research.bench.common import Progress, chosen_mechanisms, run_metadata
from research.bench.settings import DTYPES, BenchSettings, device_slug, parse_device, sizes_for
from memattn.errors import ConfigError

BENCHMARKS: dict[str, ModuleType] = {"decode": decode, "encode": encode, "train": train, "lookup": lookup}


def parse_targets(tokens: list[str], attention: list[str] = ()) -> tuple[list[str], list[str], list[str]]:
    """Split the command's words into (benchmark names, SECTION.FIELD=VALUE overrides,
    mechanisms). `attention` holds the words after --attention, which may run on into
    benchmark names and overrides (`--attention abc-mlp decode lm.d_model=64`): those are
    taken back. No name, or "all", means every benchmark. An unknown name raises ConfigError.
    """
    def not_a_mechanism(word: str) -> bool:
        return word in BENCHMARKS or word == "all" or ("=" in word and ":" not in word.split("=", 1)[0])

    mechanisms = [w for w in attention if not not_a_mechanism(w)]
    names, overrides = [], []
    for token in [*tokens, *(w for w in attention if not_a_mechanism(w))]:
        if "=" in token:
            overrides.append(token)
        elif token == "all":
            names += list(BENCHMARKS)
        elif token in BENCHMARKS:
            names.append(token)
        else:
            raise ConfigError(f"benchmark: unknown benchmark {token!r}; expected one of "
                              f"{', '.join(BENCHMARKS)} or all (sizes as SECTION.FIELD=VALUE)")
    return list(dict.fromkeys(names)) or list(BENCHMARKS), overrides, mechanisms


def make_settings(words: list[str], *, attention: list[str], device: str = "cpu", dtype: str = "fp32",
                  quick: bool = False, out: str | None = None, repeats: int | None = None,
                  warmup: int | None = None, threads: int = 0, command: str = "memattn bench",
                  progress: bool = True) -> tuple[list[str], BenchSettings]:
    """(benchmark names, settings) from the command's words, checked: a bad name, option,
    size, device or count raises ConfigError naming it. Defaults: every benchmark, 5 timed
    calls (3 with quick) after 1 warm-up, out benchmarks/results/<device>[/quick]."""
    names, overrides, attention = parse_targets(words, attention)
    dev = parse_device(device)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    for flag, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0), ("threads", threads, 0)):
        if value is not None and value < least:
            raise ConfigError(f"--{flag}: expected an integer >= {least}, got {value}")
    settings = BenchSettings(
        dev, DTYPES[dtype], sizes_for(dev, quick=quick, overrides=overrides),
        Path(out) if out else Path("benchmarks/results", device_slug(dev), "quick" if quick else ""),
        command, quick=quick, attention=tuple(attention), repeats=repeats or (3 if quick else 5),
        warmup=1 if warmup is None else warmup, progress=progress)
    chosen_mechanisms(settings)  # an unknown mechanism or option fails before anything runs
    return names, settings


def run_benchmarks(names: list[str], settings: BenchSettings) -> dict[str, list[Path]]:
    """Run the named benchmarks in order; return the files each wrote."""
    chosen_mechanisms(settings)  # an unknown mechanism or option fails before anything runs
    modules = [BENCHMARKS[n] for n in names]
    progress = Progress(sum(m.count(settings) for m in modules), settings.progress)
    written = {}
    try:
        for name, module in zip(names, modules):
            start = time.perf_counter()
            meta = run_metadata(settings)
            result = module.run(settings, progress)
            result.meta = {**meta, "wall_s": round(time.perf_counter() - start, 2)}
            written[name] = report.write(result, settings.out_dir)
    finally:
        progress.close()
    return written


__all__ = ["BENCHMARKS", "BenchSettings", "make_settings", "parse_targets", "run_benchmarks"]
