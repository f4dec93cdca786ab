"""Registers, spills, shared memory and occupancy of memattn's chunked ABC kernels, compiled
offline for a GPU architecture: no GPU needed.

    python3 benchmarks/kernel_registers.py [--dims 64 128] [--slots 32 64] [--warps 1 2 4 8]
        [--kernels fwd_output bwd_dkv ...] [--rows 16 32] [--arch 90] [--dtype bf16] [--out DIR]

Each kernel of `memattn.kernels.abc_chunk` is built as its launch builds it (block sizes,
PREC, chunk of 64 tokens; the sub-block kernels on whole chunks, `WHOLE_CHUNKS`, and with
sub-blocks of each of --rows rows (BC, `SUB_ROWS`), their diagonal block as a loop and in one
step, `DIAG_3D`; `_bwd_dkv` in one launch and split, `SPLIT_DKV`; `_fwd_output` and `_bwd_dq`
with a sub-block's own block as the dots of its factors where exact and without,
`FACTOR_DIAG`), and so are gated slot attention's gate
kernels (`memattn.kernels.gsa_chunk`) and the decoding step (`abc_decode`, each write rule),
with the divisibility the JIT gives head sizes that are multiples of 16, compiled by Triton
for `sm_<arch>` and assembled by the ptxas
Triton ships, whose report gives the registers per thread and the bytes spilled. Programs
per SM: the fewest that the registers (65,536 per SM, allocated 256 per warp), the shared
memory (228 KB, 1 KB of it reserved per program) and the 64 warps / 32 programs of an SM
allow. These kernels wait on memory and on their own serial steps rather than on
arithmetic, so the number of programs an SM holds at once is what hides that latency.
Writes kernel_registers.json and .md in --out (default benchmarks/results/sm_<arch>).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KERNELS = ("fwd_chunks", "fwd_scan", "fwd_output", "bwd_dq", "bwd_chunks", "bwd_scan", "bwd_dkv",
           "gate_logits", "gate_grads", "decode_step")
REGS_PER_SM, SMEM_PER_SM, RESERVED_SMEM, MAX_WARPS, MAX_PROGRAMS = 65536, 228 * 1024, 1024, 64, 32
# pointer arguments in the inputs' dtype (the others are fp32, or int32 for the layout)
INPUT_POINTERS = {"q", "k", "v", "s", "do", "o", "dq", "dk", "dv", "ds", "x", "g", "dg",
                  "q_ptr", "k_ptr", "v_ptr", "w_ptr", "o_ptr"}
LAYOUT_POINTERS = {"cu", "boff", "sub_idx", "chunk_idx"}
SIZES = ("H", "K", "V", "M", "D")
STRIDES = ("sq_b", "sq_h", "sk_b", "sk_h", "sv_b", "sv_h", "sw_b", "sw_h")  # the decoding step's


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32], choices=[16, 32],
                   help="rows of a sub-block (BC) of the sub-block kernels")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    """How many programs of `warps` warps one SM holds at once (see the docstring)."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = SMEM_PER_SM // (smem + RESERVED_SMEM)
    return max(0, min(by_regs, by_smem, MAX_WARPS // warps, MAX_PROGRAMS))


def builds(name: str, D: int, M: int, dtype: str,
           rows: tuple[int, ...] = (16,)) -> list[tuple[str, object, dict]]:
    """(variant, jit function, constexprs) of one kernel as `abc_chunk` launches it; a sub-block
    kernel with sub-blocks of each of `rows` rows."""
    import triton

    from memattn.kernels import abc_chunk as ac, abc_decode as ad, gsa_chunk as gc

    if name in ("gate_logits", "gate_grads"):  # gated slot attention's gates <-> ABC's logits
        return [("chunk of 64", getattr(gc, f"_{name}"), {"BT": 64, "BM": gc._gate_block(M)})]
    if name == "decode_step":  # one token, whole tiles of [M, D]
        pow2 = {"BM": triton.next_power_of_2(M), "BK": triton.next_power_of_2(D),
                "BV": triton.next_power_of_2(D)}  # as `abc_decode._launch` pads them
        return [(f"{rule} write", ad._abc_step_kernel, {"RULE": rule, **pow2})
                for rule in ("normalised", "gated", "additive")]
    prec = {"bf16": "bf16", "fp16": "fp16", "fp32": "ieee"}[dtype]
    BM, BD = ac._state_blocks(M, D)
    if name in ("fwd_chunks", "bwd_chunks"):  # the K̃ launch, every chunk at once
        own = {"STORE_LC": True} if name == "fwd_chunks" else {"IS_V": False}
        return [("K̃ launch", getattr(ac, f"_{name}"),
                 {**own, "BT": 64, "BM": BM, "BD": BD, "PREC": prec})]
    if name in ("fwd_scan", "bwd_scan"):
        fn, own = ((ac._fwd_scan, {"HAS_INIT": False, "STORE_Z": True, "RESET": False})
                   if name == "fwd_scan"
                   else (ac._bwd_scan, {"IS_V": False, "HAS_DFINAL": False}))
        return [(f"{stages} stages" if stages else "while loop", fn,
                 {**own, "BT": 64, "BM": BM, "BD": BD, "STAGES": stages})
                for stages in (0, 2)]
    fn = getattr(ac, f"_{name}")
    blocks = {"BT": 64, "BK": ac._pad(D), "BV": ac._pad(D), "BM": ac._pad(M), "PREC": prec}
    # the keys' and values' sides of `_bwd_dkv`; in sub-blocks, the own block with and without
    # its factors (FACTOR_DIAG) in the other two
    sides = {"": {"SIDES": 0}, ", keys' side": {"SIDES": 1}, ", values' side": {"SIDES": 2}} \
        if name == "bwd_dkv" else {"": {}}
    owns = {"": "tokens"} if name == "bwd_dkv" else {", factors": "either", "": "tokens"}
    whole = [(f"whole chunk of 64 rows{side}", fn,
              {**blocks, "BC": 64, "DIAG3": False, "OWN": "factors", "UNITS": "whole", **extra})
             for side, extra in sides.items()]
    return whole + [(f"{bc} rows, diagonal: {diag}{own_name}{side}", fn,
                     {**blocks, "BC": bc, "DIAG3": diag == "one step", "OWN": own,
                      "UNITS": "rest", **extra})
                    for bc in rows for side, extra in sides.items()
                    for own_name, own in owns.items() for diag in ("loop", "one step")]


def compile_report(fn, constexprs: dict, *, D: int, M: int, dtype: str, warps: int,
                   arch: int) -> dict:
    """Compile fn for sm_<arch> and read ptxas's report: registers, spills, shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    sizes = {"H": 8, "K": D, "V": D, "D": D, "M": M}
    signature, given, attrs = {}, {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg], given[(i,)] = "constexpr", constexprs[arg]
            continue
        signature[arg] = ("i32" if arg in SIZES or arg in STRIDES else "fp32" if arg == "scale"
                          else "*i32" if arg in LAYOUT_POINTERS
                          else f"*{dtype}" if arg in INPUT_POINTERS else "*fp32")
        if signature[arg].startswith("*") or sizes.get(arg, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=given, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([str(ptxas), "-v", "--gpu-name", f"sm_{arch}a", str(ptx), "-o",
                                 str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    smem = int(kernel.metadata.shared)
    return {"registers": regs, "spill_bytes": spill, "shared_bytes": smem,
            "programs_per_sm": programs_per_sm(regs, smem, warps)}


def markdown(res: dict) -> str:
    lines = ["# memattn's chunked ABC kernels compiled offline: registers and occupancy", "",
             "```", res["command"], "```", "",
             f"Triton {res['triton']}, sm_{res['arch']}a, {res['dtype']} inputs, chunks of 64, "
             "H = 8. Each cell: registers per thread / bytes spilled / programs an SM holds at "
             "once (its warps in parentheses).", ""]
    for case in res["cases"]:
        lines += [f"## D = {case['D']}, M = {case['M']}", "",
                  "| kernel | variant | " + " | ".join(f"{w} warps" for w in res["warps"]) + " |",
                  "|---|---|" + "---:|" * len(res["warps"])]
        for row in case["rows"]:
            cells = []
            for w in res["warps"]:
                r = row["warps"].get(str(w))
                cells.append(r["error"] if "error" in r else
                             f"{r['registers']} / {r['spill_bytes']} / {r['programs_per_sm']} "
                             f"({r['programs_per_sm'] * w})")
            lines.append(f"| `{row['kernel']}` | {row['variant']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import triton

    from memattn.kernels import interpreting

    if interpreting():
        sys.exit("kernel_registers.py compiles the kernels: run it without TRITON_INTERPRET=1")

    res = {"command": " ".join(shlex.quote(a) for a in ["python3", "benchmarks/kernel_registers.py",
                                                        *(sys.argv[1:] if argv is None else argv)]),
           "triton": triton.__version__, "arch": args.arch, "dtype": args.dtype,
           "warps": args.warps, "cases": []}
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"sm_{args.arch}"
    out.mkdir(parents=True, exist_ok=True)
    for D in args.dims:
        for M in args.slots:
            case = {"D": D, "M": M, "rows": []}
            res["cases"].append(case)
            for name in args.kernels:
                for variant, fn, constexprs in builds(name, D, M, args.dtype, tuple(args.rows)):
                    row = {"kernel": name, "variant": variant, "warps": {}}
                    for w in args.warps:
                        try:
                            row["warps"][str(w)] = compile_report(
                                fn, constexprs, D=D, M=M, dtype=args.dtype, warps=w, arch=args.arch)
                        except Exception as e:  # noqa: BLE001  (one failing build ends nothing)
                            row["warps"][str(w)] = {"error": f"{type(e).__name__}: {e}"[:200]}
                    case["rows"].append(row)
                    print(f"D={D} M={M} {name} {variant}: done", flush=True)
            (out / "kernel_registers.json").write_text(json.dumps(res, indent=2) + "\n")
            (out / "kernel_registers.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
