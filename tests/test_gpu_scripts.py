"""benchmarks/gpu_kernels.py and benchmarks/gpu_profile.py where a CPU can check them: the
plan, the report of a run cut short, the device peaks and the profile's torch path. Their
GPU measurements run only on a GPU (benchmarks/gpu_session.sh)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kernels():
    return load("gpu_kernels")


def test_plan_measures_one_head_dim_whole_before_the_next(kernels):
    args = kernels.parse_args(["--dims", "64", "128", "--slots", "32", "--lengths", "1024",
                               "2048", "--contexts", "4096", "--decode-batches", "1"])
    configs = kernels.plan(args)
    dims = [c["D"] for c in configs]
    assert dims == sorted(dims) and set(dims) == {64, 128}
    # per D: 2 modes x 2 lengths x (softmax + 2 ABC ops + 2 GSA ops + linear), then 5 decoding ops
    assert len(configs) == 2 * (2 * 2 * 6 + 5)
    assert {c["section"] for c in configs if c["D"] == 64} == {"train", "decode"}


def test_ops_keeps_the_named_operations_and_the_report_sets_gsa_against_abc(kernels, tmp_path):
    args = kernels.parse_args(["--dims", "64", "--slots", "32", "--lengths", "1024", "--modes",
                               "fwd", "--ops", "memattn-abc", "memattn-gsa", "fla-gsa",
                               "gsa-step-graph", "--contexts", "1024", "--decode-batches", "1"])
    configs = kernels.plan(args)
    assert [c["op"] for c in configs] == ["memattn-abc", "memattn-gsa", "fla-gsa", "gsa-step-graph"]
    rows = [dict(c, status="ok", ms=ms, tflops=1.0, tokens_per_s=1e6, gbps=1.0, bw_pct_peak=1.0)
            for c, ms in zip(configs, (1.0, 1.1, 2.2, 0.01))]
    res = {"command": "cmd", "device": "NVIDIA H200", "torch": "t", "triton": "t",
           "fla": "installed", "peaks": {"tflops_bf16_dense": 989.0, "tbps": 4.8},
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "dry_run")},
           "rows": rows, "complete": True}
    text = kernels.markdown(res)
    gated = text.split("## Gated slot attention, training fwd, D = 64")[1]
    # GSA 1.100 ms, fla 2.200 ms, GSA / ABC = 1.10x (time), fla / memattn = 2.00x
    assert "| 1024 | 1.100 (1) | 2.200 (1) | 1.10x | 2.00x |" in gated


def test_device_peaks(kernels):
    assert kernels.device_peaks("NVIDIA H200") == (989.0, 4.8)
    assert kernels.device_peaks("NVIDIA H100 80GB HBM3") == (989.0, 3.35)
    assert kernels.device_peaks("Some GPU") == (989.0, 3.35)  # the first entry


def test_a_run_cut_short_keeps_its_rows_and_says_so(kernels, tmp_path):
    args = kernels.parse_args(["--dims", "64", "--slots", "32", "--lengths", "1024",
                               "--contexts", "1024", "--decode-batches", "1"])
    configs = kernels.plan(args)
    softmax, ours, fla = configs[:3]
    rows = [dict(softmax, status="ok", ms=2.0, tflops=1.0),
            dict(ours, status="ok", ms=0.5, tflops=4.0),
            dict(fla, status="oom", reason="CUDA out of memory")]
    res = {"command": "cmd", "device": "NVIDIA H200", "torch": "t", "triton": "t",
           "fla": "installed", "peaks": {"tflops_bf16_dense": 989.0, "tbps": 4.8},
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "dry_run")},
           "rows": rows, "complete": False}
    kernels.write(tmp_path, res)
    text = (tmp_path / "gpu_kernels.md").read_text()
    assert "Cut short: 3 configurations measured" in text and "4.8 TB/s" in text
    row = next(line for line in text.splitlines() if line.startswith("| 1024 |"))
    # softmax 2.000 ms, ours 0.500 ms, fla oom, softmax / ours = 4.00x, fla / ours empty
    assert row.startswith("| 1024 | 2.000 (1) | 0.500 (4) | oom | 4.00x |  |")
    assert "- op=fla-abc mode=fwd B=8 H=8 D=64 M=32 T=1024: oom (CUDA out of memory)" in text
    assert json.loads((tmp_path / "gpu_kernels.json").read_text())["complete"] is False
    assert not list(tmp_path.glob("*.tmp"))


def test_profile_on_the_cpu_reports_the_torch_form(tmp_path):
    profile = load("gpu_profile")
    profile.main(["--device", "cpu", "--dims", "16", "--slots", "4", "--length", "32",
                  "--batch", "1", "--heads", "1", "--calls", "1", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "gpu_profile.json").read_text())
    (case,) = res["cases"]
    rows = case["profile"]["memattn"]
    assert rows and all(r["ms"] > 0 and r["launches"] > 0 for r in rows)
    assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
    assert "fla chunk_abc" not in case["profile"] and case["chunks"] == []
    assert "**memattn**" in (tmp_path / "gpu_profile.md").read_text()


# The kernels memattn.kernels.abc_chunk launches, and those of them that work in sub-blocks.
KERNELS = ("_fwd_chunks", "_fwd_scan", "_fwd_output", "_bwd_dq", "_bwd_chunks", "_bwd_scan",
           "_bwd_dkv")
SUB_BLOCK = ("_fwd_output", "_bwd_dq", "_bwd_dkv")


def launch_choices(ac) -> dict:
    """What abc_chunk's kernels launch with, for tiles of 64 and 128 rows and M = 32 slots."""
    return {"warps": tuple(ac._warps(k, b) for k in KERNELS for b in (64, 128)),
            "whole chunks": tuple(k in ac.WHOLE_CHUNKS for k in SUB_BLOCK),
            "whole-chunk warps": tuple(ac._warps(k, b, whole=True) for k in SUB_BLOCK
                                       for b in (64, 128)),
            "diagonal in one step": tuple(ac._diag3(k, 32, ac._rows(k, 64))
                                          for k in SUB_BLOCK),
            "scan blocks": ac._state_blocks(64, 64), "scan stages": ac.STATE_STAGES,
            "sub-block rows": tuple(ac._rows(k, 64) for k in SUB_BLOCK), "bf16 dots": ac._precision(torch.zeros(1, dtype=torch.bfloat16)),
            "dk, dv apart": ac.SPLIT_DKV, "whole chunks' dk, dv apart": ac.WHOLE_SPLIT_DKV,
            "own block as factors": tuple(k in ac.FACTOR_DIAG for k in SUB_BLOCK)}


def test_the_per_kernel_settings_name_kernels_of_the_module():
    pytest.importorskip("triton", reason="the kernels' module imports triton")
    from memattn.kernels import abc_chunk as ac

    jit = type(ac._fwd_output)
    assert all(isinstance(getattr(ac, name, None), jit) for name in KERNELS)
    assert set(ac.SUB_WARPS) <= set(SUB_BLOCK) and set(ac.DIAG_3D) <= set(SUB_BLOCK)
    assert set(ac.FACTOR_DIAG) <= set(SUB_BLOCK) and set(ac.WHOLE_CHUNKS) <= set(SUB_BLOCK)
    assert set(ac.WHOLE_WARPS) == set(SUB_BLOCK)
    assert set(ac.SUB_ROWS) == set(SUB_BLOCK) and set(ac.SUB_ROWS.values()) <= {16, 32}
    assert all(w in (1, 2, 4, 8, 16) for table in (ac.SUB_WARPS, ac.WHOLE_WARPS)
               for pair in table.values() for w in pair)  # Triton: a power of two


def test_profile_variants_do_what_they_are_named_only_meanwhile():
    """Each variant replaces attributes abc_chunk has, with values of the same kind; its kernels
    launch as its name says ("2 warps", "diagonal blocks as loops", "scan blocks D <= 16"...);
    no two variants launch alike; and abc_chunk is as before afterwards."""
    pytest.importorskip("triton", reason="the kernels' module imports triton")
    profile = load("gpu_profile")
    from memattn.kernels import abc_chunk as ac

    before = launch_choices(ac)
    seen = {}
    for name, changes in profile.variants().items():
        for attr, value in changes.items():
            old = getattr(ac, attr)
            assert callable(value) if callable(old) else type(value) is type(old), (name, attr)
        c = seen[name] = profile.patched(changes, lambda: launch_choices(ac))
        assert launch_choices(ac) == before, name
        assert (c == before) is (name == "default"), name
        if m := re.search(r"(\d+) warps", name):
            assert set(c["warps"]) == {int(m[1])}, name
        if "diagonal blocks in one step" in name:
            assert all(c["diagonal in one step"]), name
        if "diagonal loops" in name or "diagonal blocks as loops" in name:
            assert not any(c["diagonal in one step"]), name
        if "while" in name:
            assert c["scan stages"] == 0, name
        if m := re.search(r"(\d+) stages", name):
            assert c["scan stages"] == int(m[1]), name
        if m := re.search(r"scan blocks (?:M <= (\d+), )?D <= (\d+)", name):
            assert c["scan blocks"] == (int(m[1] or 64), int(m[2])), name  # M = 64 unless capped
        if m := re.search(r"sub-blocks of (\d+) rows", name):
            assert set(c["sub-block rows"]) == {int(m[1])}, name
        if "two launches" in name:
            assert c["dk, dv apart"], name
        if "dk / dv in one launch" in name:
            assert not c["whole chunks' dk, dv apart"], name
        if "TF32" in name:
            assert c["bf16 dots"] == "tf32", name
        if "without factors" in name:
            assert not any(c["own block as factors"]), name
        if "no whole chunks" in name:
            assert not any(c["whole chunks"]), name
        if m := re.search(r"whole chunks in (\d+)-warp", name):
            assert set(c["whole-chunk warps"]) == {int(m[1])}, name
    assert len({tuple(c.items()) for c in seen.values()}) == len(seen)


def test_profile_times_the_variants_named_and_refuses_unknown_ones(capsys):
    pytest.importorskip("triton", reason="the kernels' module imports triton")
    profile = load("gpu_profile")
    assert profile.parse_args(["--variants", "default", "2 warps"]).variants == ["default",
                                                                                 "2 warps"]
    with pytest.raises(SystemExit):
        profile.parse_args(["--variants", "default", "3 warps"])
    assert "unknown ['3 warps']" in capsys.readouterr().err


def test_profile_report_gives_each_variant_its_kernels_times():
    profile = load("gpu_profile")
    res = {"command": "python3 benchmarks/gpu_profile.py", "device": "GPU", "torch": "2",
           "batch": 1, "heads": 1, "length": 64, "dtype": "bfloat16", "calls": 1,
           "cases": [{"D": 64, "M": 32, "profile": {}, "chunks": [], "variants": [
               {"name": "default", "fwd": 1.0, "fwd+bwd": 3.0,
                "kernels": {"_bwd_dkv": 1.5, "_fwd_output": 0.75}},
               {"name": "2 warps", "fwd": 0.5, "fwd+bwd": 2.0, "kernels": {"_fwd_output": 0.25}},
               {"name": "8 warps", "error": "OutOfResources: shared memory"}]}]}
    lines = profile.markdown(res).splitlines()
    assert "| variant (chunk 64) | fwd ms | fwd+bwd ms | `_bwd_dkv` | `_fwd_output` |" in lines
    assert "| default | 1.000 | 3.000 | 1.500 | 0.750 |" in lines
    assert "| 2 warps | 0.500 | 2.000 |  | 0.250 |" in lines
    assert "| 8 warps | OutOfResources: shared memory | OutOfResources: shared memory |  |  |" in lines
    assert "- `_fwd_output`: fastest with 2 warps (0.250 ms, 3.00x the default's 0.750)" in lines
    assert "- `_bwd_dkv`: fastest with default (1.500 ms, 1.00x the default's 1.500)" in lines


def test_programs_per_sm_follow_the_scarcest_resource():
    registers = load("kernel_registers")
    assert registers.programs_per_sm(255, 16384, 8) == 1  # 32 × 255 -> 8,192 a warp: all 65,536
    assert registers.programs_per_sm(128, 8192, 2) == 8  # registers: 65,536 / (4,096 × 2)
    assert registers.programs_per_sm(32, 100 * 1024, 1) == 2  # shared memory: 228 KB / 101 KB
    assert registers.programs_per_sm(16, 0, 1) == 32  # at most 32 programs an SM


def test_kernel_registers_compiles_every_kernel_offline(tmp_path):
    """Every kernel in every variant the report builds, compiled for sm_90 with the ptxas
    Triton ships: what the interpreter lets pass and compiled Triton refuses (a name that
    changes type in a loop, a branch on a value that is not a compile-time constant) shows
    here, without a GPU."""
    triton = pytest.importorskip("triton", reason="compiles with Triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton ships no ptxas")
    registers = load("kernel_registers")
    # in a process of its own: the tests define the kernels for Triton's interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_registers.py"), "--dims", "16",
                    "--slots", "16", "--warps", "2", "--rows", "16", "--out", str(tmp_path)],
                   env=env, check=True, capture_output=True)
    res = json.loads((tmp_path / "kernel_registers.json").read_text())
    rows = res["cases"][0]["rows"]
    assert {r["kernel"] for r in rows} == set(registers.KERNELS)
    for r in rows:
        cell = r["warps"]["2"]
        assert "error" not in cell, (r["kernel"], r["variant"], cell.get("error"))
        assert 16 <= cell["registers"] <= 255 and cell["spill_bytes"] >= 0
        assert cell["programs_per_sm"] == registers.programs_per_sm(
            cell["registers"], cell["shared_bytes"], 2) >= 1
    variants = [r["variant"] for r in rows if r["kernel"] == "fwd_output"]
    assert variants == ["whole chunk of 64 rows",
                        "16 rows, diagonal: loop, factors", "16 rows, diagonal: one step, factors",
                        "16 rows, diagonal: loop", "16 rows, diagonal: one step"]
    assert "| `fwd_output` | 16 rows, diagonal: loop |" in (tmp_path / "kernel_registers.md").read_text()


def test_kernel_model_writes_what_the_kernels_store():
    """The model's bytes written by the forward kernels and by the backward ones are the
    tensors `_forward` and `_backward` allocate for them (run in the interpreter), the chunks'
    own parts counted twice (the scans overwrite them with the memories or their gradients),
    and its bytes read include every input of the op."""
    from memattn.kernels import abc_chunk as ac

    model = load("kernel_model")
    B, H, T, D, M = 2, 2, 128, 16, 16
    g = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # else in the interpreter
    q, k, v, s = (torch.randn(B * T, H, n, generator=g).bfloat16().to(device)
                  for n in (D, D, D, M))
    plan = ac._plan(list(range(0, B * T + 1, T)), 64, D ** -0.5, "bf16", q.device)
    o, final, saved = ac._forward(q, k, v, s, None, None, None, plan)
    forward_out = [o, *final, *saved]
    grads = ac._backward(q, k, v, s, torch.randn_like(o), saved, final, None, plan)
    dq, dk, dv, ds, init_grads = grads
    kernels = {r["kernel"]: r for r in model.chunked(B, H, T, D, M, 64)}
    n, nc = B * T * H, B * H * T // 64
    # the chunks' own log-normalisers r and parts u, rebuilt from their shapes
    fwd = sum(kernels[n_]["written"] for n_ in ("_fwd_chunks", "_fwd_scan", "_fwd_output"))
    assert fwd == nc * M * (2 * D + 1) * 4 + sum(t.numel() * t.element_size() for t in forward_out)
    # the backward's handed-on tensors (dS, c, the memory gradients, each first the chunks' own
    # parts), rebuilt from their shapes
    handed = 2 * n * M * 2 + 2 * nc * M * (2 * D + 1) * 4  # dS, c in bf16
    bwd = sum(kernels[n_]["written"] for n_ in ("_bwd_dq", "_bwd_chunks", "_bwd_scan", "_bwd_dkv"))
    assert bwd == handed + sum(t.numel() * t.element_size() for t in (dq, dk, dv, ds, *init_grads))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, s))
    assert kernels["_fwd_output"]["read"] > inputs > kernels["_fwd_chunks"]["read"] / 2
    assert model.op_bytes(B, H, T, D, M)["fwd"] == inputs + o.numel() * 2


def test_kernel_model_gate_kernels_move_what_they_read_and_write():
    """The gate kernels' bytes are the tensors they take and give (run in the interpreter):
    g in bf16 -> s in fp32, and ds in fp32 with g -> dg in bf16."""
    from memattn.kernels import abc_chunk as ac, gsa_chunk as gc

    model = load("kernel_model")
    B, H, T, M = 2, 2, 128, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = -torch.rand(B * T, H, M, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    plan = ac._plan(list(range(0, B * T + 1, T)), 64, 1.0, "bf16", g.device)
    s = gc.gate_logits(g, plan)
    dg = gc.gate_grads(g, torch.randn_like(s), plan)
    size = {name: t.numel() * t.element_size() for name, t in (("g", g), ("s", s), ("dg", dg))}
    logits, grads = model.gate_kernels(B, H, T, M)
    assert (logits["read"], logits["written"]) == (size["g"], size["s"])
    assert (grads["read"], grads["written"]) == (size["g"] + size["s"], size["dg"])


def test_kernel_model_bounds_and_report(tmp_path):
    model = load("kernel_model")
    k = model.decode(64, 8, 64, 32)
    state = 64 * 8 * 32 * (2 * 64 + 1) * 4
    assert k["read"] > state and k["written"] > state
    gpu = model.GPUS["H100"]
    assert model.bound_us(k, gpu) == pytest.approx((k["read"] + k["written"]) / 3.35e6)
    assert model.gpu_of("NVIDIA H200") == "H200" and model.gpu_of("A100") == "H100"
    model.main(["--lengths", "2048", "--dims", "64", "--slots", "32", "--out", str(tmp_path)])
    text = (tmp_path / "kernel_model.md").read_text()
    assert "| `_bwd_dkv` | 1 |" in text and "## Decoding, one step" in text
    assert "Gated slot attention adds its gate kernels: `_gate_logits`" in text


def test_profile_sets_each_kernel_against_its_bound():
    profile = load("gpu_profile")
    case = {"D": 64, "M": 32, "chunks": [], "variants": [], "profile": {
        "memattn": [{"kernel": "_bwd_dkv", "ms": 2.0, "launches": 1},
                    {"kernel": "aten::copy_", "ms": 0.5, "launches": 2}]}}
    profile.attach_bounds(case, 8, 8, 8192, 64, 32, "NVIDIA H200")
    bound = case["profile"]["memattn"][0]["bound_ms"]
    assert case["gpu"] == "H200" and 0 < bound < 2.0
    assert "bound_ms" not in case["profile"]["memattn"][1]
    res = {"command": "c", "device": "NVIDIA H200", "torch": "2", "batch": 8, "heads": 8,
           "length": 8192, "dtype": "bfloat16", "calls": 1, "cases": [case]}
    text = profile.markdown(res)
    assert f"| `_bwd_dkv` | 2.000 | 1 | 80 % | {bound:.3f} | {100 * bound / 2:.0f} % |" in text
    assert "the op's inputs and outputs alone" in text


@pytest.mark.usefixtures("nan_empty")
def test_whole_chunks_growth_is_the_kernels_test(monkeypatch):
    """benchmarks/whole_chunks.py's growth of log_z over chunks of 64: closed forms (equal
    logits: a_t = log(t + 1), or log(e^z0 + t + 1) after a memory; GSA: minus the sum of the
    clamped log gates after a chunk's first token), and the chunks it puts under the limit are
    those the kernels' whole-chunk launch alone writes (buffers start as NaN)."""
    pytest.importorskip("triton", reason="the kernels' module imports triton")
    from memattn.kernels import abc_chunk, kernels_supported
    from memattn.kernels.gsa_chunk import GATE_FLOOR

    chunks = load("whole_chunks")
    s = torch.zeros(1, 128, 1, 3)
    torch.testing.assert_close(chunks.abc_growth(s, None),
                               torch.tensor([[[math.log(64), math.log(128 / 65)]]]))
    z0 = torch.full((1, 1, 3), math.log(10.0))
    torch.testing.assert_close(chunks.abc_growth(s, z0),
                               torch.tensor([[[math.log(74 / 11), math.log(138 / 75)]]]))
    g = torch.full((1, 128, 1, 3), -0.1)
    g[:, 64:] = -50.0  # clamped to GATE_FLOOR
    torch.testing.assert_close(chunks.gsa_growth(g, GATE_FLOOR),
                               torch.tensor([[[6.3, -63 * GATE_FLOOR]]]))

    rise = torch.cat((torch.full((64,), 1.0), torch.full((64,), 2.0)))  # about 63, then 126
    s = torch.cumsum(rise, 0)[None, :, None, None].expand(1, 128, 1, 4).contiguous()
    growth = chunks.abc_growth(s, None)[0, 0]
    assert growth[0] < abc_chunk._FACTOR_SPAN.value < growth[1]
    q, k, v = (torch.randn(1, 128, 1, 16, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    if not kernels_supported(q):
        pytest.skip("the kernels need a GPU or Triton's interpreter")
    launches = abc_chunk._sub_launches
    monkeypatch.setattr(abc_chunk, "WHOLE_PRECISIONS", ("ieee",))  # fp32 inputs here
    monkeypatch.setattr(abc_chunk, "_sub_launches", lambda *a: [
        (i, kw) for i, kw in launches(*a) if kw["UNITS"] == "whole"])
    o = abc_chunk.abc_chunk_triton(q, k, v, s, chunk_size=64)[0]
    assert torch.isfinite(o[:, :64]).all() and o[:, 64:].isnan().all()
