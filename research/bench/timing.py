"""Instruments shared by the benchmarks (and the scripts in benchmarks/): the process
environment, wall-clock medians, peak memory, the failures a configuration may meet, and the
files a script's figures are written to."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

# Read by OpenMP and glibc when a process starts, so a benchmark re-executes itself with them.
# On vCPUs that share a core, OpenMP workers that spin (the default) stall each other on
# every small parallel region; freed large tensors given back to the kernel are page-faulted
# in again on each call. Both settings apply to softmax and every mechanism alike.
ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1000000000000",
}


def environment_tuned() -> bool:
    """Whether this process runs with every setting of ENV."""
    return all(os.environ.get(k) == v for k, v in ENV.items())


def reexec_tuned(argv: list[str]) -> None:
    """Replace this process by `argv` (argv[0] an executable path) run with ENV set; return
    at once when ENV is already in place."""
    if environment_tuned():
        return
    os.execve(argv[0], argv, {**os.environ, **ENV})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(fns: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                 device: torch.device | None = None, interleave: bool = True) -> dict[str, float]:
    """Median seconds of each function over `repeats` calls, after `warmup` calls each.

    interleave: calls alternate (a, b, a, b, ...) so that a machine that gets busier during
    the run slows every function alike; for calls of microseconds, where one call's cache
    misses fall on the next, give False: each function's calls run in a block of their own.
    On CUDA each call is timed to its last kernel.
    """
    device = device or torch.device("cpu")
    times: dict[str, list[float]] = {name: [] for name in fns}

    def timed(name: str) -> None:
        start = time.perf_counter()
        fns[name]()
        synchronize(device)
        times[name].append(time.perf_counter() - start)

    if interleave:
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        synchronize(device)
        for _ in range(max(1, repeats)):
            for name in fns:
                timed(name)
    else:
        for name, fn in fns.items():
            for _ in range(warmup):
                fn()
            synchronize(device)
            for _ in range(max(1, repeats)):
                timed(name)
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_time(fn: Callable[[], object], *, repeats: int, warmup: int = 1,
                device: torch.device | None = None) -> float:
    """Median seconds of `repeats` calls of fn after `warmup` calls."""
    return median_times({"fn": fn}, repeats=repeats, warmup=warmup, device=device)["fn"]


def peak_allocated(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes torch held inside one call of fn(), above what it held when fn started.

    CUDA: `torch.cuda.max_memory_allocated` (the caching allocator's live tensors).
    CPU: the running sum of the allocations and frees that the PyTorch profiler records
    (`profile_memory=True`) inside the call: every tensor torch allocates, none of the
    Python objects or the allocator's cached pages; what was allocated before the call
    (weights, inputs) is not counted.
    """
    if device.type == "cuda":
        synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()  # frees are negative
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send what native code writes to file descriptor 2 to /dev/null (the profiler logs a
    line when it starts and stops); Python's own sys.stderr is flushed first, then restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_OOM_TYPES = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                               getattr(torch.cuda, "OutOfMemoryError", None), MemoryError) if t)
_OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def failure(error: Exception) -> tuple[str, str]:
    """("oom" or "error", a one-line reason) for an exception a configuration raised."""
    text = " ".join(str(error).split()) or type(error).__name__
    oom = isinstance(error, _OOM_TYPES) or any(w in text.lower() for w in _OOM_WORDS)
    return ("oom" if oom else "error"), f"{type(error).__name__}: {text[:300]}"


def release(device: torch.device) -> None:
    """Give back what a failed or finished configuration left allocated."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def script_command(script: str) -> str:
    """The command line that ran `script` (a path from the repository root) with this
    process's arguments, as it is written beside its figures."""
    return " ".join(shlex.quote(a) for a in [".venv/bin/python", script, *sys.argv[1:]])


def write_figures(out: str | Path, command: str, rows: list[dict], lines: list[str]) -> None:
    """OUT.json ({"command", "rows"}) and OUT.md (`lines`), folders made as needed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")
