"""memattn's Triton kernels on a GPU against softmax and flash-linear-attention, in one run.

    .venv/bin/python benchmarks/gpu_kernels.py [--dims 64 128] [--slots 32 64]
        [--lengths 1024 2048 4096 8192 16384 32768] [--batch 8] [--heads 8]
        [--contexts 1024 4096 16384 32768] [--decode-batches 1 64]
        [--repeats 10] [--warmup 3] [--decode-steps 100] [--ops OP ...] [--out DIR] [--dry-run]
        [--skip-tests]

bf16 inputs, B·H = batch · heads (64 by default), head dim D = K = V.

- Training, causal, forward and forward + backward, against T:
    softmax       `scaled_dot_product_attention(is_causal=True)` under the FlashAttention
                  backend (`torch.nn.attention.sdpa_kernel`), on [B, H, T, D] views
    memattn-abc   `memattn.ops.abc.abc_attention(..., backend="triton")` (the chunked
                  Triton kernels), M slots
    fla-abc       flash-linear-attention's `fla.ops.abc.chunk_abc(q, k, v, s)`, [B, T, H, D]
                  layout, where installed. Same ABC_MLP normalisation (the memory is the
                  running softmax-weighted mean, z = logcumsumexp(s)) and scale K^-0.5;
                  its state keeps K̃ as [K, M] where memattn keeps [M, K].
    linear        `memattn.kernels.linear.linear_attention_triton` with α, β gates
    memattn-gsa   `memattn.ops.gsa.gated_slot_attention(..., backend="triton")`: gated slot
                  attention through the same kernels (abc_chunk with RESET), M slots, the
                  gsa layer's gates g = log σ(z) / 8; "GSA / ABC" in the report is its time
                  over memattn-abc's at the same shape
    fla-gsa       flash-linear-attention's `fla.ops.gsa.chunk_gsa(q, k, v, 1 - exp(g), g)`,
                  where installed: the same recurrence
- Decoding, one token for every sequence of the batch, against the context length:
    abc-step        `abc_attention_step(..., backend="triton", inplace=True)`: the fused
                    kernel, Python checks included
    abc-step-graph  the same step captured in a CUDA graph and replayed: the kernel alone
    abc-step-torch  the torch step (`backend="torch"`)
    gsa-step-graph  `gated_slot_attention_step(..., backend="triton", inplace=True)` (the ABC
                    step kernel with GSA's logits) captured in a CUDA graph
    softmax-kv      write k_t, v_t into a preallocated KV cache, then SDPA of one query over
                    the context (FlashAttention backend), captured in a CUDA graph
  tokens/s = batch / (seconds a step).

`--ops` keeps only the named operations (e.g. `--ops memattn-abc memattn-gsa fla-gsa` for the
gated kernels against plain ABC's). Timing: CUDA events around each call, `--warmup` calls first, the median of `--repeats`
(decoding: of `--repeats` runs of `--decode-steps` steps). A configuration that runs out of
memory (or fails) is recorded with its reason and the run goes on.

FLOPs (matmul multiply-adds × 2, "model" counts of the math, not of the kernels' extra work):
    softmax  fwd 2·B·H·T²·D (QKᵀ and PV, each 2·T²·D, halved by causality); fwd+bwd 3.5× fwd
    ABC      fwd 4·B·H·T·M·(K + V) (write K̃, Ṽ: 2·M·(K + V) a token; read: 2·M·(K + V));
             fwd+bwd 3× fwd
    linear   fwd 4·B·H·T·K·V (write 2·K·V, read 2·K·V a token); fwd+bwd 3× fwd
Bytes (the least a kernel must move): training, the inputs read and o written (fwd+bwd also
reads them again with do and writes their gradients); decoding, ABC reads and writes its fp32
state (log_z, K̃, Ṽ) plus the token's q, k, v, s; softmax reads the bf16 KV cache.
TFLOP/s and GB/s are set against the device's peaks (`PEAKS`: H100 SXM 989 TFLOP/s bf16 dense
and 3.35 TB/s; H200 989 TFLOP/s and 4.8 TB/s; an unknown device is set against the H100's).

The kernels' tests run first (the CUDA tests among them); a failure stops the benchmark.
Writes benchmarks/results/<device-name>/gpu_kernels.json and .md, with the exact command, after
every configuration: a run cut short keeps what it measured ("complete": false).
`--dry-run` lists the configurations (on any machine) and writes nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# bf16 dense TFLOP/s and HBM TB/s, by a word of the device's name; the first is the default.
PEAKS = {"H100": (989.0, 3.35), "H200": (989.0, 4.8)}
BF16 = 2  # bytes
TESTS = ["tests/ops/test_abc_decode_triton.py", "tests/ops/test_linear_triton.py",
         "tests/ops/test_gsa_triton.py"]
SLOT_OPS = ("memattn-abc", "fla-abc", "memattn-gsa", "fla-gsa")  # training ops with M slots
TRAIN_OPS = ("softmax", *SLOT_OPS, "linear")
DECODE_OPS = ("abc-step", "abc-step-graph", "abc-step-torch", "gsa-step-graph", "softmax-kv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[6:]))
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="head dims D")
    p.add_argument("--slots", type=int, nargs="+", default=[32, 64], help="ABC memory slots M")
    p.add_argument("--lengths", type=int, nargs="+",
                   default=[1024, 2048, 4096, 8192, 16384, 32768], help="training lengths T")
    p.add_argument("--batch", type=int, default=8, help="training batch B")
    p.add_argument("--heads", type=int, default=8, help="heads H (training and decoding)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768],
                   help="decoding context lengths")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=100, help="steps in one timed run")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--ops", nargs="+", default=[*TRAIN_OPS, *DECODE_OPS],
                   choices=[*TRAIN_OPS, *DECODE_OPS], help="the operations to time (default all)")
    p.add_argument("--out", default=None,
                   help="output folder (default benchmarks/results/<device-name>)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the configurations and exit (no GPU needed)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the kernels' tests first")
    p.add_argument("--scan-stages", type=int, default=None,
                   help="memattn.kernels.SCAN_STAGES and abc_chunk.STATE_STAGES for this run: "
                        "the kernels' scans over chunks as software-pipelined for loops "
                        "with that many stages (0: while)")
    args = p.parse_args(argv)
    for name in ("dims", "slots", "lengths", "contexts", "decode_batches"):
        if any(x < 1 for x in getattr(args, name)):
            p.error(f"--{name.replace('_', '-')}: expected positive integers")
    if args.scan_stages is not None and args.scan_stages < 0:
        p.error("--scan-stages: expected 0 or a positive integer")
    for name in ("batch", "heads", "repeats", "decode_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer")
    return args


def plan(args: argparse.Namespace) -> list[dict]:
    """Every configuration the run measures, in order (softmax does not depend on M: once
    per D and T; linear attention has no slots), head dim by head dim; only `--ops`."""
    B, H = args.batch, args.heads
    configs = []
    for D in args.dims:  # D outermost: a run cut short has whole head dims
        for mode in args.modes:
            for T in args.lengths:
                configs.append(dict(section="train", op="softmax", mode=mode, B=B, H=H, D=D, T=T))
                for M in args.slots:
                    for op in SLOT_OPS:
                        configs.append(dict(section="train", op=op, mode=mode, B=B, H=H, D=D,
                                            M=M, T=T))
                configs.append(dict(section="train", op="linear", mode=mode, B=B, H=H, D=D, T=T))
        for Bd in args.decode_batches:
            for ctx in args.contexts:
                for M in args.slots:
                    for op in DECODE_OPS[:-1]:
                        configs.append(dict(section="decode", op=op, B=Bd, H=H, D=D, M=M,
                                            context=ctx))
                configs.append(dict(section="decode", op="softmax-kv", B=Bd, H=H, D=D,
                                    context=ctx))
    return [c for c in configs if c["op"] in args.ops]


def flops(c: dict) -> float:
    """Model FLOPs of one call (see the module docstring); 0 for decoding."""
    if c["section"] != "train":
        return 0.0
    B, H, D, T = c["B"], c["H"], c["D"], c["T"]
    if c["op"] == "softmax":
        fwd, bwd_factor = 2.0 * B * H * T * T * D, 3.5
    elif c["op"] == "linear":
        fwd, bwd_factor = 4.0 * B * H * T * D * D, 3.0
    else:
        fwd, bwd_factor = 4.0 * B * H * T * c["M"] * (2 * D), 3.0
    return fwd * (bwd_factor if c["mode"] == "fwd+bwd" else 1.0)


def bytes_moved(c: dict) -> float:
    """The least bytes one call reads and writes (see the module docstring)."""
    B, H, D = c["B"], c["H"], c["D"]
    if c["section"] == "train":
        per_token = {"softmax": 3 * D, "linear": 3 * D + 2}.get(c["op"], 3 * D + c.get("M", 0))
        io = B * H * c["T"] * BF16 * (per_token + D)  # inputs read, o written
        return io if c["mode"] == "fwd" else io + B * H * c["T"] * BF16 * (2 * per_token + 2 * D)
    if c["op"].startswith(("abc", "gsa")):
        M = c["M"]
        state = 4 * B * H * (M + 2 * M * D)  # fp32 log_z, K̃, Ṽ (GSA: K̃, Ṽ and a scratch log_z)
        return 2 * state + B * H * BF16 * (4 * D + M)
    return B * H * (c["context"] + 1) * 2 * D * BF16 + B * H * BF16 * 4 * D


def describe(c: dict) -> str:
    keys = ("op", "mode", "B", "H", "D", "M", "T", "context")
    return " ".join(f"{k}={c[k]}" for k in keys if k in c)


# --- measurement (CUDA only below this line) ---------------------------------------------


def cuda_ms(fn, warmup: int, repeats: int) -> float:
    """Median milliseconds of fn() between two CUDA events, after `warmup` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def as_graph(fn):
    """fn captured in a CUDA graph (after one eager call on a side stream); returns replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def flash_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def memattn_abc():
    """The memattn Triton ABC op: abc_attention(backend="triton") where it takes a backend,
    else the kernel module's entry point (same contract)."""
    from memattn.ops.abc import abc_attention

    if "backend" in inspect.signature(abc_attention).parameters:
        return lambda q, k, v, s: abc_attention(q, k, v, s, causal=True, backend="triton")[0]
    from memattn.kernels.abc_chunk import abc_chunk_triton

    return lambda q, k, v, s: abc_chunk_triton(q, k, v, s)[0]


def memattn_gsa():
    """gated_slot_attention with the Triton kernels."""
    from memattn.ops.gsa import gated_slot_attention

    return lambda q, k, v, g: gated_slot_attention(q, k, v, g, backend="triton")[0]


def train_call(c: dict, peers: dict):
    """(a zero-argument callable running the configuration once, or None with a reason)."""
    import torch
    import torch.nn.functional as F

    B, H, D, T = c["B"], c["H"], c["D"], c["T"]
    g = torch.Generator(device="cuda").manual_seed(T * 131 + D)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k, v = rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, D)
    extra = {}
    if c["op"] == "softmax":
        def fwd(q, k, v):
            with flash_sdpa():
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                      v.transpose(1, 2), is_causal=True)
    elif c["op"] == "linear":
        from memattn.kernels.linear import linear_attention_triton

        extra = {"alpha": torch.sigmoid(rand(B, T, H).float() + 4.0).to(torch.bfloat16),
                 "beta": torch.sigmoid(rand(B, T, H).float()).to(torch.bfloat16)}
        k = k * D ** -0.5

        def fwd(q, k, v, alpha, beta):
            return linear_attention_triton(q, k, v, alpha=alpha, beta=beta)[0]
    else:
        op, reason = peers[c["op"]]
        if op is None:
            return None, reason
        if c["op"].endswith("gsa"):  # the gsa layer's gates, log σ(z) / 8: near 1
            extra = {"g": (F.logsigmoid(rand(B, T, H, c["M"]).float()) / 8).to(torch.bfloat16)}
        else:
            extra = {"s": rand(B, T, H, c["M"])}

        def fwd(q, k, v, w):
            return op(q, k, v, w)

    inputs = [q, k, v, *extra.values()]
    if c["mode"] == "fwd":
        def run():
            with torch.no_grad():
                fwd(*inputs)
        return run, ""
    leaves = [t.detach().requires_grad_() for t in inputs]
    do = rand(B, H, T, D) if c["op"] == "softmax" else rand(B, T, H, D)

    def run():
        o = fwd(*leaves)
        torch.autograd.grad(o, leaves, do)
    return run, ""


def decode_call(c: dict, args: argparse.Namespace):
    import torch
    import torch.nn.functional as F

    from memattn.ops.abc import ABCState, abc_attention_step
    from memattn.ops.gsa import GSAState, gated_slot_attention_step

    B, H, D, ctx = c["B"], c["H"], c["D"], c["context"]
    g = torch.Generator(device="cuda").manual_seed(ctx * 7 + B)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda", dtype=dtype)

    q_t, k_t, v_t = rand(B, H, D), rand(B, H, D), rand(B, H, D)
    steps = args.decode_steps
    if c["op"].startswith("gsa"):
        M = c["M"]
        g_t = (F.logsigmoid(rand(B, H, M).float()) / 8).to(torch.bfloat16)
        state = GSAState(rand(B, H, M, D, dtype=torch.float32), rand(B, H, M, D, dtype=torch.float32))

        def one():
            gated_slot_attention_step(q_t, k_t, v_t, g_t, state, inplace=True, backend="triton")
    elif c["op"].startswith("abc"):
        M = c["M"]
        s_t = rand(B, H, M)
        # The state after `ctx` tokens: its size, hence the step's cost, does not depend on ctx.
        f32 = torch.float32
        state = ABCState(rand(B, H, M, dtype=f32) + math.log(ctx), rand(B, H, M, D, dtype=f32),
                         rand(B, H, M, D, dtype=f32))
        backend = "torch" if c["op"] == "abc-step-torch" else "triton"

        def one():
            abc_attention_step(q_t, k_t, v_t, s_t, state, inplace=True, backend=backend)
    else:
        k_cache, v_cache = rand(B, H, ctx + 1, D), rand(B, H, ctx + 1, D)
        q_1 = q_t[:, :, None]

        def one():
            k_cache[:, :, ctx] = k_t
            v_cache[:, :, ctx] = v_t
            with flash_sdpa():
                F.scaled_dot_product_attention(q_1, k_cache, v_cache)

    step = as_graph(one) if c["op"].endswith("graph") or c["op"] == "softmax-kv" else one

    def run():
        with torch.inference_mode():
            for _ in range(steps):
                step()
    return run, ""


def device_peaks(name: str) -> tuple[float, float]:
    """(bf16 dense TFLOP/s, TB/s) of the device named `name` (the H100's if unknown)."""
    return next((v for k, v in PEAKS.items() if k in name), next(iter(PEAKS.values())))


def measure(c: dict, args: argparse.Namespace, peers: dict, peaks: tuple[float, float]) -> dict:
    """The configuration's row: status ok / oom / error / skipped, ms, rates."""
    import torch

    from research.bench.timing import failure, release

    row = dict(c)
    try:
        fn, reason = (train_call(c, peers) if c["section"] == "train" else decode_call(c, args))
        if fn is None:
            row.update(status="skipped", reason=reason)
            return row
        torch.cuda.reset_peak_memory_stats()
        ms = cuda_ms(fn, args.warmup, args.repeats)
        if c["section"] == "decode":
            ms /= args.decode_steps
            row["tokens_per_s"] = c["B"] / (ms / 1e3)
        row.update(status="ok", ms=ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        if flops(c):
            row["tflops"] = flops(c) / (ms / 1e3) / 1e12
            row["tflops_pct_peak"] = 100 * row["tflops"] / peaks[0]
        row["gbps"] = bytes_moved(c) / (ms / 1e3) / 1e9
        row["bw_pct_peak"] = 100 * row["gbps"] / (peaks[1] * 1e3)
    except Exception as e:  # noqa: BLE001  (OOM or a failing configuration: record, go on)
        row["status"], row["reason"] = failure(e)
    finally:
        release(torch.device("cuda"))
    return row


def peer_ops() -> dict:
    import torch

    from research.bench.peers import fla_chunk_abc, fla_chunk_gsa

    peers = {}
    try:
        peers["memattn-abc"] = (memattn_abc(), "")
    except ImportError as e:
        peers["memattn-abc"] = (None, f"memattn's Triton ABC is missing: {e}")
    peers["fla-abc"] = fla_chunk_abc(torch.device("cuda"))
    try:
        peers["memattn-gsa"] = (memattn_gsa(), "")
    except ImportError as e:
        peers["memattn-gsa"] = (None, f"memattn's gated slot attention is missing: {e}")
    peers["fla-gsa"] = fla_chunk_gsa(torch.device("cuda"))
    return peers


# --- report ------------------------------------------------------------------------------


def _cell(r: dict | None, key: str, fmt: str) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    return format(r[key], fmt)


def _ratio(base: dict | None, r: dict | None) -> str:
    if not base or not r or base["status"] != "ok" or r["status"] != "ok":
        return ""
    return f"{base['ms'] / r['ms']:.2f}x"


def markdown(res: dict) -> str:
    cfg, rows = res["config"], res["rows"]
    find = {}
    for r in rows:
        find[tuple(r.get(k) for k in ("section", "op", "mode", "B", "D", "M", "T", "context"))] = r

    def get(section, op, mode=None, B=None, D=None, M=None, T=None, context=None):
        return find.get((section, op, mode, B, D, M, T, context))

    lines = ["# memattn Triton kernels against softmax attention and flash-linear-attention", "",
             "```", res["command"], "```", "",
             (f"{res['device']}, torch {res['torch']}, triton {res['triton']}, "
              f"flash-linear-attention: {res['fla']}. bf16, B={cfg['batch']}, "
              f"H={cfg['heads']}. Median of {cfg['repeats']} after {cfg['warmup']} warm-up "
              "calls (CUDA events)."),
             "", (f"FLOP and byte counts: see benchmarks/gpu_kernels.py. Peaks: "
                  f"{res['peaks']['tflops_bf16_dense']:g} TFLOP/s bf16 dense, "
                  f"{res['peaks']['tbps']:g} TB/s."
                  + ("" if res["complete"] else
                     f" Cut short: {len(rows)} configurations measured, in the order of "
                     "`--dry-run`.")), ""]
    B = cfg["batch"]
    for D in cfg["dims"]:
        for mode in cfg["modes"]:
            lines += [f"## Training {mode}, D = {D}: ms (TFLOP/s)", ""]
            head = ["T", "softmax"]
            for M in cfg["slots"]:
                head += [f"memattn ABC M={M}", f"fla ABC M={M}", f"softmax / memattn M={M}",
                         f"fla / memattn M={M}"]
            head += ["linear α,β"]
            lines += _table_head(head)
            for T in cfg["lengths"]:
                sm = get("train", "softmax", mode, B, D, None, T)
                cells = [str(T), _both(sm)]
                for M in cfg["slots"]:
                    ours = get("train", "memattn-abc", mode, B, D, M, T)
                    fla = get("train", "fla-abc", mode, B, D, M, T)
                    cells += [_both(ours), _both(fla), _ratio(sm, ours), _ratio(fla, ours)]
                cells.append(_both(get("train", "linear", mode, B, D, None, T)))
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
            if not any(r["op"].endswith("gsa") for r in rows):
                continue
            lines += [f"## Gated slot attention, training {mode}, D = {D}: ms (TFLOP/s)", "",
                      "GSA / ABC: memattn's GSA time over its plain ABC time (1.10 = 10 % "
                      "slower).", ""]
            head = ["T"]
            for M in cfg["slots"]:
                head += [f"memattn GSA M={M}", f"fla GSA M={M}", f"GSA / ABC M={M} (time)",
                         f"fla / memattn GSA M={M}"]
            lines += _table_head(head)
            for T in cfg["lengths"]:
                cells = [str(T)]
                for M in cfg["slots"]:
                    abc = get("train", "memattn-abc", mode, B, D, M, T)
                    ours = get("train", "memattn-gsa", mode, B, D, M, T)
                    fla = get("train", "fla-gsa", mode, B, D, M, T)
                    cells += [_both(ours), _both(fla), _ratio(ours, abc), _ratio(fla, ours)]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    for D in cfg["dims"]:
        for Bd in cfg["decode_batches"]:
            lines += [f"## Decoding, batch {Bd}, D = {D}: tokens/s (GB/s, % of peak bandwidth)",
                      ""]
            head = ["context", "softmax + KV cache"]
            for M in cfg["slots"]:
                head += [f"ABC fused M={M}", f"ABC fused, graph M={M}", f"ABC torch M={M}",
                         f"GSA fused, graph M={M}", f"softmax / ABC graph M={M} (time)"]
            lines += _table_head(head)
            for ctx in cfg["contexts"]:
                sm = get("decode", "softmax-kv", None, Bd, D, None, None, ctx)
                cells = [str(ctx), _rate(sm)]
                for M in cfg["slots"]:
                    rs = [get("decode", op, None, Bd, D, M, None, ctx)
                          for op in ("abc-step", "abc-step-graph", "abc-step-torch",
                                     "gsa-step-graph")]
                    cells += [_rate(r) for r in rs] + [_ratio(sm, rs[1])]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["## Not measured", ""]
        lines += [f"- {describe(r)}: {r['status']} ({r.get('reason', '')})" for r in failed]
        lines.append("")
    return "\n".join(lines)


def _table_head(head: list[str]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]


def _both(r: dict | None) -> str:
    if r is None or r["status"] != "ok":
        return _cell(r, "ms", "")
    return f"{r['ms']:.3f} ({r['tflops']:.3g})"


def _rate(r: dict | None) -> str:
    if r is None or r["status"] != "ok":
        return _cell(r, "ms", "")
    return f"{r['tokens_per_s']:,.0f} ({r['gbps']:.0f}, {r['bw_pct_peak']:.0f}%)"


# --- main --------------------------------------------------------------------------------


def run_tests() -> None:
    tests = [t for t in TESTS if (ROOT / t).exists()]
    found = (str(p.relative_to(ROOT)) for p in (ROOT / "tests/ops").glob("test_*triton*.py"))
    tests += sorted(t for t in found if t not in tests)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(tests)} fail; no benchmark until they pass:\n" + done.stdout[-3000:])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs = plan(args)
    if args.dry_run:
        out = args.out or "benchmarks/results/<device-name>"
        print(f"{len(configs)} configurations; results would go to {out}/gpu_kernels.json and .md")
        for c in configs:
            print(f"  {c['section']:6s} {describe(c)}  flops={flops(c):.3g} "
                  f"bytes={bytes_moved(c):.3g}")
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_kernels.py needs a CUDA GPU; --dry-run lists the configurations")
    if not args.skip_tests:
        run_tests()
    import triton

    from research.bench.settings import device_slug

    device = torch.device("cuda")
    if args.scan_stages is not None:
        import memattn.kernels
        from memattn.kernels import abc_chunk

        memattn.kernels.SCAN_STAGES = abc_chunk.STATE_STAGES = args.scan_stages
    peers = peer_ops()
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/gpu_kernels.py",
                                                *(sys.argv[1:] if argv is None else argv)])
    name = torch.cuda.get_device_name(device)
    fla_reason = peers["fla-abc"][1]
    res = {
        "command": command,
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": "not installed" if "not installed" in fla_reason else (fla_reason or "installed"),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "dry_run")},
        "peaks": dict(zip(("tflops_bf16_dense", "tbps"), device_peaks(name))),
        "rows": [],
        "complete": False,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / device_slug(device)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i, c in enumerate(configs):
        r = measure(c, args, peers, device_peaks(name))
        res["rows"].append(r)
        res["complete"] = i + 1 == len(configs)
        res["wall_s"] = time.perf_counter() - t0
        write(out, res)
        done = (f"{r['ms']:.3f} ms" if r["status"] == "ok"
                else f"{r['status']}: {r.get('reason', '')}")
        print(f"[{i + 1}/{len(configs)}] {describe(c)}: {done}", flush=True)
    print(markdown(res))


def write(out: Path, res: dict) -> None:
    """gpu_kernels.json and .md in `out`, each replaced whole (a kill leaves the last pair)."""
    for name, text in (("gpu_kernels.json", json.dumps(res, indent=2) + "\n"),
                       ("gpu_kernels.md", markdown(res))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


if __name__ == "__main__":
    main()
