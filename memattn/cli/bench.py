"""`memattn bench`: every mechanism measured against softmax in one run (research.bench)."""

from __future__ import annotations

import sys
import time

from memattn.cli.common import non_negative_int, positive_int, research
from memattn.errors import ConfigError


def cmd_bench(args) -> int:
    import shlex

    import torch

    research()
    from research.bench import make_settings, run_benchmarks
    from research.bench.timing import reexec_tuned

    names, settings = make_settings(
        args.targets, attention=args.attention or [], device=args.device, dtype=args.dtype,
        quick=args.quick, out=args.out, repeats=args.repeats, warmup=args.warmup,
        threads=args.threads, command=args.command_line, progress=not args.quiet)
    from_command_line = sys.argv[1:] == shlex.split(args.command_line)[1:]
    if settings.device.type == "cpu" and from_command_line and not args.no_env_tuning:
        reexec_tuned([sys.executable, "-m", "memattn", *sys.argv[1:]])  # returns when already tuned
    if args.threads:
        torch.set_num_threads(args.threads)
    from memattn.fileio import check_writable, output_lock

    out = settings.out_dir
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file; give a folder for the results")
    check_writable(out)  # a folder that cannot be written fails now, not after the runs
    start = time.perf_counter()
    with output_lock(out, "--out", ConfigError):
        written = run_benchmarks(names, settings)
    for name, paths in written.items():
        print(f"{name}: " + ", ".join(str(p) for p in paths))
    print(f"[{len(names)} benchmark(s) in {time.perf_counter() - start:.0f} s on {settings.device}, "
          f"{args.dtype}, {torch.get_num_threads()} threads]", file=sys.stderr)
    return 0


def add_commands(sub) -> None:
    b = sub.add_parser("bench", help="measure every mechanism against softmax: decode, encode, train, lookup",
                       description="Measure every registered attention mechanism side by side against "
                       "softmax attention in one run, and write BENCHMARK.json, BENCHMARK.md (every "
                       "figure with its ratio to softmax) and BENCHMARK.png under --out. decode: per-token "
                       "latency and decoding-state bytes against context; encode: time and peak memory "
                       "to encode a batch; train: forward+backward tokens/s against length (a layer, a "
                       "small LM, the ABC op and its flash-linear-attention peer); lookup: per-query "
                       "cost of linear attention's stored C against softmax over the stored states. "
                       "Sizes are presets for the device (and --quick); change them with "
                       "SECTION.FIELD=VALUE, e.g. decode.contexts=[256,4096] decode.batch=8 lm.d_model=256 "
                       "(sections: lm, decode, encode, train, lookup).")
    b.add_argument("targets", nargs="*", metavar="BENCHMARK|KEY=VALUE",
                   help="decode, encode, train, lookup or all (default: all), and SECTION.FIELD=VALUE "
                   "size overrides")
    b.add_argument("--quick", action="store_true",
                   help="small sizes: all four benchmarks in under 2 minutes on a CPU")
    b.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    b.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="dtype of the models and inputs (default: %(default)s)")
    b.add_argument("--attention", nargs="+", metavar="NAME[:OPTION=VALUE,...]",
                   help="mechanisms to measure, at their default options or those given (e.g. "
                   "abc-meanpool:pool=512); default: every registered one. Softmax always runs as the baseline")
    b.add_argument("--out", help="output folder (default: benchmarks/results/DEVICE, or "
                   "benchmarks/results/DEVICE/quick with --quick; DEVICE is cpu or the GPU's name)")
    b.add_argument("--repeats", type=positive_int, help="timed calls per configuration, the median reported "
                   "(default: 5, 3 with --quick; decode times decode.steps greedy steps instead)")
    b.add_argument("--warmup", type=non_negative_int, help="untimed calls (decode: steps) before timing (default: 1)")
    b.add_argument("--threads", type=non_negative_int, default=0, help="torch threads on CPU (default: torch's choice)")
    b.add_argument("--no-env-tuning", action="store_true",
                   help="on CPU, do not re-run with OMP_WAIT_POLICY=PASSIVE and the glibc malloc settings "
                   "of research.bench.timing.ENV (measure the environment as it is)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(fn=cmd_bench)
