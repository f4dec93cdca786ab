"""Where the time of memattn's chunked ABC kernels goes, on a GPU: a profile per kernel
against flash-linear-attention's `chunk_abc`, and the op's time against its chunk size.

    python3 benchmarks/gpu_profile.py [--dims 64 128] [--slots 32 64] [--length 8192]
        [--batch 8] [--heads 8] [--chunk-sizes 16 32 64 128 256] [--calls 3] [--out DIR]
        [--device cuda|cpu]

bf16 on CUDA, forward + backward, inputs [B, T, H, D] as in gpu_kernels.py.
- Profile: `torch.profiler` over `--calls` calls of each op after one warm-up call; every
  kernel's own device time per call, its launches per call and its share of the op.
- Chunk sizes: memattn's op (`abc_chunk_triton(chunk_size=...)`) timed with CUDA events,
  fwd and fwd+bwd (median of 10 after 3 warm-up calls).
- Variants, timed alike at the default chunk size, with every kernel's own time (the profile's),
  so that each kernel's launch choices can be taken from the variant that is best for it:
  every chunk in sub-blocks (no whole-chunk launches, `WHOLE_CHUNKS`), the whole-chunk
  launches at 4 or 16 warps (`WHOLE_WARPS`), the backward's whole-chunk dk / dv in one launch
  (`WHOLE_SPLIT_DKV`), the earlier defaults (8 warps, diagonal blocks as loops, scans as
  while loops), the blocks of the chunk kernels and the scans (`_fwd_chunks`, `_fwd_scan`,
  `_bwd_chunks`, `_bwd_scan`) along D capped at 32 and 16, or
  along M at 16 and D at 32 (more programs for the scans), 1, 2, 4 or 8 warps for every
  kernel, the scans' chunk loops as while loops or software-pipelined with 2 stages (3 by
  default), sub-blocks of 16 or 32 rows in every sub-block kernel (`SUB_ROWS` sets each
  kernel's; 32 also with the diagonal blocks in one step and with 8 warps), fp32 operands
  with TF32 products in place of bf16 ones (and with them p, dS, c handed on in fp32:
  `abc_chunk._saved_dtype`), every sub-block kernel's diagonal blocks in one step (with the
  default warps and with 4) or as loops, and the backward's dk / dv in two launches (with
  the diagonal blocks either way), and a sub-block's own block without the dots of its
  factors; each patches `_state_blocks`, `_warps`, `SUB_WARPS`, `SUB_ROWS`, `HALF_DOTS`,
  `DIAG_3D`, `DIAG_3D_MAX`, `FACTOR_DIAG`, `WHOLE_CHUNKS`, `WHOLE_WARPS`, `WHOLE_SPLIT_DKV`,
  `STATE_STAGES` or `SPLIT_DKV` of `memattn.kernels.abc_chunk` for its run only.
  `--variants NAME ...` times those alone (default: every one).
`--device cpu` runs the same report on the torch form in float32 (no fla, no chunk sizes): a
check of the script itself on a machine without a GPU.
On CUDA, each memattn kernel's time is set against its bound from benchmarks/kernel_model.py
(bytes and FLOPs of the kernel as designed) and the op's against its inputs and outputs alone.
Writes gpu_profile.json and .md in --out (default benchmarks/results/<device-name>) after
every measurement.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_kernels import cuda_ms  # noqa: E402  (the same timing as there)
from benchmarks.kernel_model import GPUS, bound_us, chunked, gpu_of, op_bytes  # noqa: E402
from research.bench.peers import fla_chunk_abc  # noqa: E402
from research.bench.settings import device_slug  # noqa: E402
from memattn.ops.abc import abc_attention  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=None,
                   help="the variants to time, by name (default: every one)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    unknown = set(args.variants or ()) - set(variants())
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; known: {list(variants())}")
    return args


def inputs(B, T, H, D, M, device, dtype, requires_grad=True):
    g = torch.Generator().manual_seed(T + D + M)
    xs = [torch.randn(B, T, H, n, generator=g) for n in (D, D, D, M)]
    do = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    return [x.to(device, dtype).requires_grad_(requires_grad) for x in xs], do


def fwd_bwd(op, xs, do):
    def run():
        o = op(*xs)
        torch.autograd.grad(o, xs, do)
    return run


def kernel_times(run, calls: int, device: torch.device) -> list[dict]:
    """[{kernel, ms, launches}] per call, largest first, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    run()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) or 0) if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": e.key, "ms": us / 1e3 / calls, "launches": e.count / calls})
    return sorted(rows, key=lambda r: -r["ms"])


def variants() -> dict:
    """name -> {attribute of memattn.kernels.abc_chunk: replacement} (see the docstring)."""
    from memattn.kernels import abc_chunk as ac

    def blocks(cap_d, cap_m=64):
        return lambda M, D: (min(cap_m, ac._pad(M)), min(cap_d, ac._pad(D)))

    # in the order they are measured, the likeliest gains first (a run cut short keeps them)
    every = tuple(ac.SUB_WARPS)
    out = {"default": {},
           "sub-blocks only (no whole chunks)": {"WHOLE_CHUNKS": ()},
           **{f"whole chunks in {w}-warp programs": {
               "WHOLE_WARPS": dict.fromkeys(ac.WHOLE_WARPS, (w, w))} for w in (4, 16)},
           "whole chunks, dk / dv in one launch": {"WHOLE_SPLIT_DKV": False},
           "own blocks without factors": {"FACTOR_DIAG": ()},
           "earlier defaults (8 warps, diagonal loops, while scans)": {
               "SUB_WARPS": {}, "DIAG_3D": (), "STATE_STAGES": 0},
           "TF32 dots": {"HALF_DOTS": False},
           "dk / dv in two launches, diagonal blocks in one step": {"SPLIT_DKV": True,
                                                                    "DIAG_3D": every},
           "backward dk / dv in two launches": {"SPLIT_DKV": True},
           "diagonal blocks in one step": {"DIAG_3D": every},
           "diagonal blocks as loops": {"DIAG_3D": ()},
           "diagonal blocks in one step, 4 warps": {"DIAG_3D": every,
                                                    "_warps": lambda *b, **kw: 4}}
    out.update({f"{w} warps": {"_warps": lambda *b, w=w, **kw: w} for w in (2, 4)})
    out["scan blocks D <= 32"] = {"_state_blocks": blocks(32)}
    out["scan blocks M <= 16, D <= 32"] = {"_state_blocks": blocks(32, 16)}
    out["scans as while loops"] = {"STATE_STAGES": 0}
    out["scans pipelined, 2 stages"] = {"STATE_STAGES": 2}
    out.update(sub_rows_variants())
    out.update({f"{w} warps": {"_warps": lambda *b, w=w, **kw: w} for w in (8, 1)})
    out["scan blocks D <= 16"] = {"_state_blocks": blocks(16)}
    return out


def sub_rows_variants() -> dict:
    """Sub-blocks of 16 and of 32 rows in every sub-block kernel (each kernel's own time then
    sets its `SUB_ROWS`), 32 with the diagonal blocks in one step ([32, 32, M] tiles) and with
    8 warps; those equal to the default left out."""
    from memattn.kernels import abc_chunk as ac

    def rows(n):
        return dict.fromkeys(ac.SUB_ROWS, n)
    out = {f"sub-blocks of {n} rows": {"SUB_ROWS": rows(n)} for n in (16, 32)
           if rows(n) != ac.SUB_ROWS}
    out["sub-blocks of 32 rows, diagonal blocks in one step"] = {
        "SUB_ROWS": rows(32), "DIAG_3D": tuple(ac.SUB_ROWS), "DIAG_3D_MAX": 32 * 32 * 64}
    out["sub-blocks of 32 rows, 8 warps"] = {"SUB_ROWS": rows(32),
                                             "_warps": lambda *b, **kw: 8}
    return out


def patched(changes: dict, fn):
    """fn() with the attributes of memattn.kernels.abc_chunk that `changes` names replaced
    meanwhile."""
    from memattn.kernels import abc_chunk

    saved = {name: getattr(abc_chunk, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(abc_chunk, name, value)
        return fn()
    finally:
        for name, value in saved.items():
            setattr(abc_chunk, name, value)


def attempt(fn):
    """fn() or {"error": reason} (an OOM or a failing configuration does not end the run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def markdown(res: dict) -> str:
    lines = ["# memattn's chunked ABC kernels: a profile per kernel and the chunk size", "",
             "```", res["command"], "```", "", f"{res['device']}, torch {res['torch']}; "
             f"B={res['batch']}, H={res['heads']}, T={res['length']}, {res['dtype']}, "
             f"fwd+bwd; {res['calls']} profiled calls after one warm-up.", ""]
    for case in res["cases"]:
        lines += [f"## D = {case['D']}, M = {case['M']}", ""]
        for op, rows in case["profile"].items():
            if isinstance(rows, dict):
                lines += [f"{op}: {rows['error']}", ""]
                continue
            total = sum(r["ms"] for r in rows)
            lines += [f"**{op}**: {total:.3f} ms of kernels a call", "",
                      "| kernel | ms a call | launches a call | share | model bound ms "
                      "| fraction of the bound |", "|---|---:|---:|---:|---:|---:|"]
            for r in rows[:12]:
                bound = r.get("bound_ms")
                cells = ("", "") if bound is None else (f"{bound:.3f}",
                                                        f"{100 * bound / r['ms']:.0f} %")
                lines.append(f"| `{r['kernel'][:70]}` | {r['ms']:.3f} | {r['launches']:g} | "
                             f"{100 * r['ms'] / total:.0f} % | {cells[0]} | {cells[1]} |")
            if op == "memattn" and "op_bound_ms" in case:
                modelled = sum(r.get("bound_ms", 0.0) for r in rows)
                lines += ["", f"Bounds (benchmarks/kernel_model.py, {case['gpu']}): the kernels' "
                          f"{modelled:.3f} ms together, {100 * modelled / total:.0f} % of their "
                          f"time; the op's inputs and outputs alone {case['op_bound_ms']:.3f} ms, "
                          f"{100 * case['op_bound_ms'] / total:.1f} % of it."]
            lines.append("")
        for key, head in (("variants", "variant (chunk 64)"), ("chunks", "chunk size")):
            if not case.get(key):
                continue
            # the six longest kernels of the first variant that has them, as columns
            kernels = next((list(c["kernels"])[:6] for c in case[key] if "kernels" in c), [])
            lines += [f"| {head} | fwd ms | fwd+bwd ms |" + "".join(f" `{k[:24]}` |"
                                                                 for k in kernels),
                      "|---|---:|---:|" + "---:|" * len(kernels)]
            for c in case[key]:
                cells = [c.get(m, c.get("error", "")) for m in ("fwd", "fwd+bwd")]
                cells += [c.get("kernels", {}).get(k, "") for k in kernels]
                lines.append(f"| {c['name']} | " + " | ".join(
                    f"{x:.3f}" if isinstance(x, float) else str(x) for x in cells) + " |")
            lines.append("")
            if key == "variants":
                lines += fastest_per_kernel(case[key], kernels)
    return "\n".join(lines)


def fastest_per_kernel(rows: list[dict], kernels: list[str]) -> list[str]:
    """For each kernel, the variant under which it took least time, against the first row's
    (the default's) time: each kernel's launch choices can be set on their own."""
    timed = [r for r in rows if "kernels" in r]
    if not timed:
        return []
    out = []
    for k in kernels:
        times = [(r["kernels"][k], r["name"]) for r in timed if k in r["kernels"]]
        best, name = min(times)
        base = timed[0]["kernels"].get(k)
        gain = f", {base / best:.2f}x the default's {base:.3f}" if base else ""
        out.append(f"- `{k}`: fastest with {name} ({best:.3f} ms{gain})")
    return [*out, ""]


def attach_bounds(case: dict, B: int, H: int, T: int, D: int, M: int, device: str) -> None:
    """Each memattn kernel's bound from the model (`bound_ms`) beside its measured time, and
    the op's own bound (its inputs and outputs once) on the case."""
    case["gpu"] = gpu_of(device)
    gpu = GPUS[case["gpu"]]
    model = {k["kernel"]: k for k in chunked(B, H, T, D, M, 64)}
    for r in case["profile"]["memattn"]:
        name = next((n for n in model if n in r["kernel"]), None)
        if name is not None:
            r["bound_ms"] = bound_us(model[name], gpu) / 1e3
    case["op_bound_ms"] = op_bytes(B, H, T, D, M)["fwd+bwd"] / (gpu["tb_s"] * 1e9)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_profile.py: no CUDA GPU here; --device cpu checks the script")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "triton" if device.type == "cuda" else "torch"
    fla, fla_reason = fla_chunk_abc(device)
    B, H, T = args.batch, args.heads, args.length
    res = {"command": " ".join(shlex.quote(a) for a in ["python3", "benchmarks/gpu_profile.py",
                                                        *(sys.argv[1:] if argv is None else argv)]),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
           "batch": B, "heads": H, "length": T, "calls": args.calls, "fla": fla_reason or "installed",
           "cases": []}
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / device_slug(device)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def save():  # after every measurement: a run cut short keeps what it measured
        res["wall_s"] = time.perf_counter() - t0
        (out / "gpu_profile.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "gpu_profile.md").write_text(markdown(res))

    for D in args.dims:
        for M in args.slots:
            xs, do = inputs(B, T, H, D, M, device, dtype)
            ops = {"memattn": lambda q, k, v, s: abc_attention(q, k, v, s, backend=backend)[0]}
            if fla is not None:
                ops["fla chunk_abc"] = fla
            case = {"D": D, "M": M, "chunks": [], "variants": [], "profile": {}}
            res["cases"].append(case)
            for name, op in ops.items():
                case["profile"][name] = attempt(
                    lambda op=op: kernel_times(fwd_bwd(op, xs, do), args.calls, device))
                save()
            if device.type == "cuda" and isinstance(case["profile"]["memattn"], list):
                attach_bounds(case, B, H, T, D, M, res["device"])
                save()
            if device.type == "cuda":
                from memattn.kernels.abc_chunk import abc_chunk_triton

                def chunked(chunk):
                    return lambda q, k, v, s: abc_chunk_triton(q, k, v, s, chunk_size=chunk)[0]

                def both(op):
                    with torch.no_grad():
                        fwd = cuda_ms(lambda: op(*xs), 3, 10)
                    return {"fwd": fwd, "fwd+bwd": cuda_ms(fwd_bwd(op, xs, do), 3, 10)}

                def timed(op):
                    kernels = kernel_times(fwd_bwd(op, xs, do), args.calls, device)
                    return {**both(op), "kernels": {r["kernel"]: r["ms"] for r in kernels}}

                for name, changes in variants().items():
                    if args.variants and name not in args.variants:
                        continue
                    case["variants"].append({"name": name, **attempt(
                        lambda ch=changes: patched(ch, lambda: timed(chunked(64))))})
                    save()
                for chunk in args.chunk_sizes:
                    case["chunks"].append({"name": str(chunk),
                                           **attempt(lambda c=chunk: both(chunked(c)))})
                    save()
            print(f"D={D} M={M} done ({res['wall_s']:.0f} s)", flush=True)
    print(markdown(res))


if __name__ == "__main__":
    main()
