"""A bandwidth and work model of memattn's ABC kernels (and gated slot attention's gate kernels
beside them): what each one must move and compute,
how many programs it runs and how far each walks in sequence, so that a measured time can be
set against the time the hardware allows.

    python3 benchmarks/kernel_model.py [--dims 64 128] [--slots 32 64]
        [--lengths 2048 8192 32768] [--batch 8] [--heads 8] [--chunk 64] [--rows 16 32]
        [--gpu H100|H200] [--out DIR]

Writes kernel_model.md and .json to --out (default benchmarks/results/model). No GPU needed:
the figures are counts from the kernels' source (memattn/kernels/abc_chunk.py and
abc_decode.py), for bf16 inputs, as the kernels store them: the per-token tensors the
sub-block kernels hand each other (the probabilities p, dS, c) in bf16, the others (lc, lse,
the normalisers, the memories and their gradients) and the states in fp32. Each case is
given for sub-blocks of each of --rows rows (BC) in every sub-block kernel: 64, the chunk,
for the whole chunks they take where a chunk's own weights are exact as dots of their
factors (`abc_chunk.WHOLE_CHUNKS`, the default), 16 or 32 for the sub-blocks of the other
chunks (`abc_chunk.SUB_ROWS`): the rows change their work, grid and depth, not their bytes.
`gpu_profile.py` puts each kernel's measured time beside its bound from here.

Per kernel (one call, all launches of it):
    read, written  bytes from and to HBM, every tensor element the kernel touches counted
                   once. Re-reads of a tile by several programs (a chunk's memory by each of
                   its sub-blocks; the earlier sub-blocks of a chunk) are left out: they are
                   served from L2 when the programs of a chunk run together, and the model is
                   the least the kernel as designed must move.
    flops          2 × the multiply-adds of its tl.dot products as written (the work of the
                   chunked form, more than the math's 4·T·M·(K + V) a head).
    programs       its grid; per SM on the 132 SMs of an H100 / H200.
    depth          the chunks one program walks in order (the short scans, each step
                   elementwise on a loaded [M, D] tile), the chunks it reads (1: the kernels
                   over every chunk at once), or the sub-blocks it reads (the sub-block
                   kernels).
    bound µs       max(bytes / bandwidth, flops / bf16 peak): the time no kernel of this
                   design can beat; the fraction of it a measured time reaches is bound / time.
The op's own bound counts only its inputs and outputs (what a single fused kernel would move):
the gap between it and the sum of the kernels' bounds is the round trips through HBM of the
tensors the kernels hand each other (the chunks' own states, the chunk-start memories, the
local log-cumsum-exp lc, S, dS, c and the memory gradients).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPUS = {"H100": {"sms": 132, "tb_s": 3.35, "tflop_s": 989.0},
        "H200": {"sms": 132, "tb_s": 4.8, "tflop_s": 989.0}}
HALF, F32 = 2, 4  # bytes of a bf16 input element, of an fp32 saved one
SUB = 64  # rows of a sub-block (BC) by default: whole chunks (abc_chunk.WHOLE_CHUNKS)


def _pad(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _kernel(name, launches, read, written, flops, programs, depth) -> dict:
    return {"kernel": name, "launches": launches, "read": float(read), "written": float(written),
            "flops": float(flops), "programs": programs, "depth": depth}


def chunked(B: int, H: int, T: int, D: int, M: int, chunk: int = 64, rows: int = SUB,
            saved: int = HALF) -> list[dict]:
    """The seven kernels of `abc_chunk_triton` forward + backward, K = V = D, for B sequences
    of T tokens and H heads, sub-blocks of `rows` rows (at most the chunk) and the handed-on
    p, dS, c of `saved` bytes an element (bf16 inputs: 2; fp32: 4)."""
    K = V = D
    n = B * T * H  # (token, head) pairs
    nc = B * H * (T // chunk)  # (chunk, head) pairs
    bc = min(rows, chunk)  # BC
    subs = T // bc  # sub-blocks a sequence
    per_chunk = chunk // bc
    earlier = (per_chunk - 1) / 2  # earlier sub-blocks of its chunk a sub-block reads, on average
    BM = min(64, _pad(M))

    def tiles(D):  # [M, D] tiles of one launch over D features
        return max(1, D // min(64, _pad(D))) * max(1, M // BM)

    # a pass "x -> slots" or "slots -> x" over a sub-block: the memory term, the earlier
    # sub-blocks of the chunk (two dots each), the diagonal block (one dot, plus one of its
    # factors u, v in the kernels of abc_chunk.FACTOR_DIAG and in whole chunks, else
    # elementwise)
    def sub_pass(width, factors=bc == chunk):
        return 2 * bc * M * width + earlier * (2 * bc * bc * width + 2 * bc * bc * M) \
            + 2 * bc * bc * width + factors * 2 * bc * bc * M
    memories = nc * M * (K + V) * F32  # the chunk-start memories hk, hv (or their gradients)
    final = B * H * M * (K + V + 1) * F32  # the final state (or the initial state's gradients)
    out = [
        # twice, every chunk at once: x = k (also r and lc) and x = v -> the chunks' own parts u
        _kernel("_fwd_chunks", 2, n * (K + V) * HALF + 2 * n * M * HALF,
                memories + n * M * F32 + nc * M * F32, 2 * n * M * (K + V),
                nc * (tiles(K) + tiles(V)), 1),
        # twice, elementwise over the chunks of a sequence: u, r -> the chunk-start memories in
        # u's place (also zprev, zend with x = k) and the final state
        _kernel("_fwd_scan", 2, memories + 2 * nc * M * F32, memories + 2 * nc * M * F32 + final,
                0, B * H * (tiles(K) + tiles(V)), T // chunk),
        # q, k, v, s, lc, zprev, the memories -> o, p, lse
        _kernel("_fwd_output", 1, n * (2 * K + V + M) * HALF + n * M * F32 + nc * M * F32
                + memories, n * V * HALF + n * M * saved + n * F32,
                B * H * subs * (sub_pass(K, True) + sub_pass(V, True)), B * subs * H,
                1 + earlier),
        # do, v, k, s, lc, p, lse, zprev, the memories -> dq, dS, c
        _kernel("_bwd_dq", 1, n * (K + 2 * V + M) * HALF + n * (M + 1) * F32 + n * M * saved
                + nc * M * F32 + memories, n * K * HALF + 2 * n * M * saved,
                B * H * subs * (sub_pass(V, True) + sub_pass(K, True)), B * subs * H,
                1 + earlier),
        # twice, every chunk at once: K̃ side q, dS, c, lc; Ṽ side do, p, lc; both zprev
        # -> the chunks' own parts w (and wc on the K̃ side)
        _kernel("_bwd_chunks", 2, n * (K + V) * HALF + 2 * n * M * F32 + 3 * n * M * saved
                + 2 * nc * M * F32, memories + nc * M * F32, 2 * n * M * (K + V),
                nc * (tiles(K) + tiles(V)), 1),
        # twice, elementwise over the chunks, last first: w, wc, zprev, zend -> dh, dc per chunk
        # in w's place and the initial state's gradients
        _kernel("_bwd_scan", 2, memories + nc * M * F32 + 4 * nc * M * F32,
                memories + nc * M * F32 + final, 0, B * H * (tiles(K) + tiles(V)), T // chunk),
        # q, k, v, s, do, lc, p, dS, c, zprev, zend, dh, dhc -> dk, dv, ds
        _kernel("_bwd_dkv", 1, n * (2 * K + 2 * V + M) * HALF + n * M * F32 + 3 * n * M * saved
                + 3 * nc * M * F32 + memories, n * (K + V + M) * HALF,
                B * H * subs * (2 * sub_pass(K) + 2 * sub_pass(V)), B * subs * H,
                1 + earlier),
    ]
    return out


def gate_kernels(B: int, H: int, T: int, M: int, chunk: int = 64) -> list[dict]:
    """Gated slot attention's two kernels beside ABC's (memattn/kernels/gsa_chunk.py): the log
    gates g -> the fp32 logits s, and ds (fp32) with g -> dg; one program per (chunk, head,
    block of up to 32 slots), elementwise but for a cumulative sum inside the chunk."""
    n = B * T * H
    programs = B * H * (T // chunk) * -(-M // 32)  # gsa_chunk._gate_block: at most 32 slots
    return [_kernel("_gate_logits", 1, n * M * HALF, n * M * F32, 0, programs, 1),
            _kernel("_gate_grads", 1, n * M * (HALF + F32), n * M * HALF, 0, programs, 1)]


def op_bytes(B: int, H: int, T: int, D: int, M: int) -> dict:
    """The op's inputs and outputs: forward q, k, v, s -> o; backward also do -> dq, dk, dv, ds."""
    n = B * T * H
    fwd = n * (3 * D + M + D) * HALF
    return {"fwd": float(fwd), "fwd+bwd": float(fwd + n * (3 * D + M + D + 3 * D + M) * HALF)}


def decode(B: int, H: int, D: int, M: int) -> dict:
    """One step of `abc_step_triton`: the fp32 state (log_z, K̃, Ṽ) read and written in place,
    the token's q, k, v, s read and o written; one program per (sequence, head)."""
    state = B * H * M * (2 * D + 1) * F32
    return _kernel("abc_decode", 1, state + B * H * (3 * D + M) * HALF, state + B * H * D * HALF,
                   B * H * 2 * M * 2 * D * 2, B * H, 1)


def bound_us(k: dict, gpu: dict) -> float:
    return max((k["read"] + k["written"]) / (gpu["tb_s"] * 1e12),
               k["flops"] / (gpu["tflop_s"] * 1e12)) * 1e6


def gpu_of(device: str) -> str:
    """The key of GPUS for a device called `device` (the H100's if unknown)."""
    return next((k for k in GPUS if k in device), "H100")


def markdown(res: dict) -> str:
    gpu = GPUS[res["gpu"]]
    lines = ["# A bandwidth and work model of the ABC kernels", "", "```", res["command"], "```",
             "", f"B = {res['batch']}, H = {res['heads']}, chunk {res['chunk']}, bf16 inputs "
             "(p, dS, c in bf16); "
             f"{res['gpu']}: {gpu['tb_s']} TB/s, {gpu['tflop_s']:.0f} TFLOP/s bf16, "
             f"{gpu['sms']} SMs. See benchmarks/kernel_model.py for what is counted.", ""]
    for case in res["cases"]:
        T, D, M = case["T"], case["D"], case["M"]
        units = ("whole chunks" if case["rows"] >= res["chunk"]
                 else f"sub-blocks of {case['rows']} rows")
        lines += [f"## T = {T}, D = {D}, M = {M}, {units}", "",
                  "| kernel | launches | MB read | MB written | GFLOP | FLOP/byte | programs "
                  "| per SM | depth | bound µs |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        total = 0.0
        for k in case["kernels"]:
            moved = k["read"] + k["written"]
            total += bound_us(k, gpu)
            lines.append(f"| `{k['kernel']}` | {k['launches']} | {k['read'] / 1e6:.1f} | "
                         f"{k['written'] / 1e6:.1f} | {k['flops'] / 1e9:.2f} | "
                         f"{k['flops'] / moved:.1f} | {k['programs']:,} | "
                         f"{k['programs'] / gpu['sms']:.1f} | {k['depth']:g} | "
                         f"{bound_us(k, gpu):.0f} |")
        op = case["op_bytes"]["fwd+bwd"]
        lines += ["", f"Sum of the kernels' bounds {total:.0f} µs; the op's own bound (inputs and "
                  f"outputs only) {op / 1e6:.0f} MB, {op / (gpu['tb_s'] * 1e6):.0f} µs: "
                  f"{total / (op / (gpu['tb_s'] * 1e6)):.1f}x of it is the tensors the kernels "
                  "hand each other through HBM.", ""]
        gates = "; ".join(f"`{k['kernel']}` {(k['read'] + k['written']) / 1e6:.0f} MB, "
                          f"{bound_us(k, gpu):.0f} µs" for k in case["gates"])
        lines += [f"Gated slot attention adds its gate kernels: {gates}.", ""]
    lines += ["## Decoding, one step", "", "| batch | D | M | state MB | MB moved | bound µs |",
              "|---:|---:|---:|---:|---:|---:|"]
    for d in res["decode"]:
        k = d["kernel"]
        lines.append(f"| {d['B']} | {d['D']} | {d['M']} | {d['state'] / 1e6:.2f} | "
                     f"{(k['read'] + k['written']) / 1e6:.2f} | {bound_us(k, gpu):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 16],
                   help="rows of a sub-block (BC) of the sub-block kernels (the chunk: whole "
                        "chunks)")
    p.add_argument("--gpu", choices=list(GPUS), default="H100")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "model"))
    args = p.parse_args(argv)
    B, H = args.batch, args.heads
    res = {"command": "python3 benchmarks/kernel_model.py " + " ".join(argv or []),
           "gpu": args.gpu, "batch": B, "heads": H, "chunk": args.chunk, "cases": [],
           "decode": []}
    for T in args.lengths:
        for D in args.dims:
            for M in args.slots:
                for rows in args.rows:
                    res["cases"].append({"T": T, "D": D, "M": M, "rows": rows,
                                         "kernels": chunked(B, H, T, D, M, args.chunk, rows),
                                         "gates": gate_kernels(B, H, T, M, args.chunk),
                                         "op_bytes": op_bytes(B, H, T, D, M)})
    for Bd in (1, 64):
        for D in args.dims:
            for M in args.slots:
                res["decode"].append({"B": Bd, "D": D, "M": M,
                                      "state": Bd * H * M * (2 * D + 1) * F32,
                                      "kernel": decode(Bd, H, D, M)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_model.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "kernel_model.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
