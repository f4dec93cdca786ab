"""memattn.kernels.abc_chunk (abc_chunk_triton, abc_attention(backend="triton")) and the
packed variable-length forms: outputs, final states and every gradient against the reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes are tiny; test_on_gpu repeats the checks with larger ones.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from conftest import assert_named_close, assert_packed_is_each_sequence, outputs_and_grads

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from memattn.errors import ConfigError, ShapeError
from memattn.kernels import abc_chunk, kernels_supported
from memattn.kernels.abc_chunk import abc_chunk_triton
from memattn.ops.abc import ABCState, abc_attention, abc_chunked, abc_reference
from memattn.ops.abc.varlen import abc_varlen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set: the kernels cannot run",
                allow_module_level=True)

# Every buffer the kernels fill starts as NaN: a read before a write shows.
pytestmark = pytest.mark.usefixtures("nan_empty")

F32 = {"atol": 2e-5, "rtol": 2e-5}
# abc_chunk.WHOLE_PRECISIONS widened to every dot precision: the whole-chunk launches run
# fp32 inputs too, where their math is checked at fp32's tolerances.
EVERY_PRECISION = ("ieee", "tf32", "bf16", "fp16")
HALF = {"atol": 4e-2, "rtol": 4e-2}


def make_inputs(B=2, T=7, H=2, K=16, V=8, M=5, *, N=None, s_scale=1.0, dtype=torch.float32,
                seed=0, device=DEVICE):
    """q [B, T, H, K], k [B, T, H, K], v [B, T, H, V], s [B, T, H, M] and an ABCState of
    batch N (default B), rounded to `dtype` and held in float64 (leaves for the reference)."""
    g = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, M), (N, H, M), (N, H, M, K),
              (N, H, M, V)]
    xs = [torch.randn(*sh, generator=g, dtype=torch.float64) for sh in shapes]
    xs[3] = xs[3] * s_scale
    xs[4] = xs[4] * s_scale
    return [x.to(dtype).to(device=device, dtype=torch.float64) for x in xs]


def run(fn, xs, dtype, *, with_state=True, **kw):
    return outputs_and_grads(fn, xs, dtype, ABCState, with_state=with_state, **kw)


NAMES = ["o", "log_z", "k", "v", "dq", "dk", "dv", "ds", "dlog_z0", "dk0", "dv0"]


def assert_all_close(got, want, **tol):
    assert_named_close(got, want, NAMES, **tol)


# The GPU tests first: a run cut short on a GPU machine gets to them before the rest.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu():
    """Larger shapes on the GPU: several chunks of 64, K, V, M not powers of two, varlen, bf16."""
    xs = make_inputs(B=2, T=300, H=3, K=72, V=40, M=24, seed=1)
    want = run(abc_chunked, xs, torch.float64)
    assert_all_close(run(abc_chunk_triton, xs, torch.float32), want, atol=1e-4, rtol=1e-4)
    assert_all_close(run(abc_chunk_triton, xs, torch.bfloat16), want, atol=6e-2, rtol=6e-2)

    # Logits of 1e3: float32 rounds them by ~6e-5, which ds amplifies; the torch path in
    # float32 misses ds by ~5e-3. The kernels may miss by no more than twice its error.
    big = make_inputs(B=1, T=300, H=2, K=64, V=64, M=32, s_scale=1e3, seed=2)
    want = run(abc_chunked, big, torch.float64)
    torch32 = run(abc_chunked, big, torch.float32)
    for name, a, b, c in zip(NAMES, run(abc_chunk_triton, big, torch.float32), torch32, want):
        assert torch.isfinite(a).all(), name
        bound = max(2e-4, 2 * (b - c).abs().max().item())
        torch.testing.assert_close(a, c, atol=bound, rtol=2e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")

    bounds = [0, 1, 130, 131, 400]
    xs = make_inputs(B=1, T=400, H=2, K=64, V=32, M=20, N=4, seed=3)
    cu = torch.tensor(bounds, device=DEVICE)
    assert_all_close(run(abc_attention, xs, torch.float32, cu_seqlens=cu),
                     run(abc_varlen, xs, torch.float64, cu_seqlens=cu), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stages, sub, half_dots, diag3, split, factors, whole", [
    (2, 16, True, False, False, True, False), (3, 16, True, False, False, True, False),
    (0, 32, True, False, False, True, False), (0, 16, False, False, False, True, False),
    (0, 16, True, True, False, True, False), (0, 16, True, False, True, True, False),
    (2, 16, True, True, True, True, False), (0, 16, True, False, False, False, False),
    (2, 16, True, False, False, True, True), (0, 16, True, False, True, True, True),
    (0, 16, False, False, False, True, True)])
def test_kernel_variants_on_gpu(monkeypatch, stages, sub, half_dots, diag3, split, factors,
                                whole):
    """The launch variants benchmarks/gpu_profile.py times, against the reference: the scans'
    `for` form (software-pipelined when compiled; the interpreter runs only the `while`
    form), sub-blocks of 32 rows, TF32 products for bf16 inputs, diagonal blocks in one
    step, the backward's dk / dv in two launches, the own blocks without their factors, each
    chunk in sub-blocks or (whole) the chunks exact as factors whole. Several chunks, bf16,
    and a packed batch of 1, 129, 1 and 269 tokens."""
    monkeypatch.setattr(abc_chunk, "STATE_STAGES", stages)
    monkeypatch.setattr(abc_chunk, "SUB_ROWS", dict.fromkeys(abc_chunk.SUB_ROWS, sub))
    monkeypatch.setattr(abc_chunk, "HALF_DOTS", half_dots)
    monkeypatch.setattr(abc_chunk, "DIAG_3D", tuple(abc_chunk.SUB_WARPS) if diag3 else ())
    monkeypatch.setattr(abc_chunk, "SPLIT_DKV", split)
    monkeypatch.setattr(abc_chunk, "FACTOR_DIAG", abc_chunk.FACTOR_DIAG if factors else ())
    monkeypatch.setattr(abc_chunk, "WHOLE_CHUNKS", abc_chunk.WHOLE_CHUNKS if whole else ())
    monkeypatch.setattr(abc_chunk, "WHOLE_PRECISIONS", EVERY_PRECISION)
    xs = make_inputs(B=2, T=300, H=3, K=64, V=40, M=24, seed=4)
    want = run(abc_chunked, xs, torch.float64)
    assert_all_close(run(abc_chunk_triton, xs, torch.float32), want, atol=1e-4, rtol=1e-4)
    assert_all_close(run(abc_chunk_triton, xs, torch.bfloat16), want, atol=6e-2, rtol=6e-2)
    xs = make_inputs(B=1, T=400, H=2, K=64, V=32, M=20, N=4, seed=5)
    cu = torch.tensor([0, 1, 130, 131, 400], device=DEVICE)
    assert_all_close(run(abc_attention, xs, torch.float32, cu_seqlens=cu),
                     run(abc_varlen, xs, torch.float64, cu_seqlens=cu), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("T", "chunk"), [(1, 16), (7, 16), (37, 16), (37, 32)])
def test_matches_reference(T, chunk):
    """Odd lengths, several chunks (16), several sub-blocks in a chunk (32), K ≠ V, M = 5."""
    xs = make_inputs(T=T)
    got = run(abc_chunk_triton, xs, torch.float32, chunk_size=chunk)
    want = run(abc_reference, xs, torch.float64)
    assert_all_close(got, want, **F32)


def test_scans_split_into_blocks(monkeypatch):
    """The scans' programs over blocks of 16 slots and 16 features (gpu_profile.py's variants
    cap them for more parallel scans): M = 20, K = 40, V = 24 each span two or three blocks."""
    monkeypatch.setattr(abc_chunk, "_state_blocks", lambda M, D: (16, 16))
    xs = make_inputs(T=37, K=40, V=24, M=20)
    got = run(abc_chunk_triton, xs, torch.float32, chunk_size=16)
    assert_all_close(got, run(abc_reference, xs, torch.float64), **F32)


def test_backend_triton_without_state():
    """abc_attention(backend="triton"), no initial state, a loss on o only."""
    xs = make_inputs(B=1, T=20, H=3, K=16, V=16, M=16)
    q, k, v, s = (x.float().requires_grad_() for x in xs[:4])
    o, state = abc_attention(q, k, v, s, backend="triton")
    assert state is None
    do = torch.randn_like(o)
    got = [o, *torch.autograd.grad(o, (q, k, v, s), do)]
    o_ref, _ = abc_reference(*(x.requires_grad_() for x in xs[:4]))
    want = [o_ref, *torch.autograd.grad(o_ref, xs[:4], do.double())]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, **F32)


def test_gradients_through_the_final_state_only():
    """A loss on the final state alone (o unused): gradients of k, v, s and the initial state."""
    xs = make_inputs(B=1, T=9)
    grads = []
    for fn, dt in ((abc_chunk_triton, torch.float32), (abc_reference, torch.float64)):
        leaves = [x.to(dt).requires_grad_() for x in xs[:4]]
        state = [x.to(dt).requires_grad_() for x in xs[4:]]
        _, final = fn(*leaves, initial_state=ABCState(*state), output_final_state=True)
        loss = final.log_z.sum() + (final.k * 0.5).sum() - final.v.sum()
        grads.append(torch.autograd.grad(loss, leaves[1:] + state))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a.double(), b, **F32)


@pytest.mark.parametrize("diag3, split, whole", [(True, False, False), (False, True, False),
                                                 (True, True, False), (False, True, True)])
def test_kernel_variants(monkeypatch, diag3, split, whole):
    """DIAG_3D: each sub-block's own block as one [BC, BC, M] tile instead of a loop over its
    tokens; SPLIT_DKV: the backward's dk / dv / ds in two launches; every chunk in sub-blocks,
    or (whole) the chunks exact as factors whole. Several chunks and sub-blocks, a packed
    batch, bf16 operands, logits of 1e3."""
    monkeypatch.setattr(abc_chunk, "DIAG_3D", tuple(abc_chunk.SUB_WARPS) if diag3 else ())
    monkeypatch.setattr(abc_chunk, "SPLIT_DKV", split)
    monkeypatch.setattr(abc_chunk, "WHOLE_CHUNKS", abc_chunk.WHOLE_CHUNKS if whole else ())
    monkeypatch.setattr(abc_chunk, "WHOLE_PRECISIONS", EVERY_PRECISION)
    for kernel in abc_chunk.SUB_WARPS:  # at most DIAG_3D_MAX numbers a tile
        assert abc_chunk._diag3(kernel, 64, 16) == diag3 and not abc_chunk._diag3(kernel, 65, 16)
    check_launch_choices(37, (16, 32), [0, 1, 20, 45])


def check_launch_choices(T: int, chunks: tuple[int, ...], bounds: list[int], *, every_input: bool = True):
    """The kernels as abc_chunk is set now against the float64 reference: fp32 inputs of T
    tokens in chunks of each of `chunks`, and in the last of them (every_input) bf16 inputs,
    logits of 1e3 (37 tokens: longer, float32's rounding of log_z ~ 1e3 alone misses ds by
    more than 1e-4), and sequences packed at `bounds`."""
    xs = make_inputs(T=T)
    want = run(abc_reference, xs, torch.float64)
    for chunk in chunks:
        assert_all_close(run(abc_chunk_triton, xs, torch.float32, chunk_size=chunk), want, **F32)
    if every_input:
        xs = make_inputs(T=T, dtype=torch.bfloat16)
        assert_all_close(run(abc_chunk_triton, xs, torch.bfloat16, chunk_size=chunks[-1]),
                         run(abc_reference, xs, torch.float64), **HALF)
        xs = make_inputs(B=1, T=37, s_scale=1e3)
        assert_all_close(run(abc_chunk_triton, xs, torch.float32, chunk_size=chunks[-1]),
                         run(abc_reference, xs, torch.float64), atol=1e-4, rtol=1e-4)
    xs = make_inputs(B=1, T=bounds[-1], N=len(bounds) - 1, M=6)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    assert_all_close(run(abc_chunk_triton, xs, torch.float32, cu_seqlens=cu,
                         chunk_size=chunks[-1]),
                     run(abc_varlen, xs, torch.float64, cu_seqlens=cu.long()), **F32)


@pytest.mark.parametrize("rows, diag3", [
    ({"_fwd_output": 32, "_bwd_dq": 32, "_bwd_dkv": 32}, False),
    ({"_fwd_output": 32, "_bwd_dq": 32, "_bwd_dkv": 32}, True),
    ({"_fwd_output": 16, "_bwd_dq": 32, "_bwd_dkv": 16}, True)])
def test_sub_blocks_of_32_rows(monkeypatch, rows, diag3):
    """SUB_ROWS: sub-blocks of 32 rows (every chunk in sub-blocks), in every sub-block kernel
    or in some (each kernel splits the chunk its own way), their diagonal blocks as loops or
    in one step (DIAG_3D_MAX raised to hold [32, 32, 16]); chunks of 32 (one sub-block) and
    64 (two), lengths that are not multiples of 32 (75; packed 1, 39 and 67), fp32, and where
    the diagonal blocks are taken in one step also bf16 and logits of 1e3 (the loops' slow
    interpretation takes those at 16 rows, test_kernel_variants)."""
    monkeypatch.setattr(abc_chunk, "SUB_ROWS", rows)
    monkeypatch.setattr(abc_chunk, "WHOLE_CHUNKS", ())
    monkeypatch.setattr(abc_chunk, "DIAG_3D", tuple(rows) if diag3 else ())
    monkeypatch.setattr(abc_chunk, "DIAG_3D_MAX", 32 * 32 * 16)
    assert abc_chunk._rows("_fwd_output", 16) == 16  # never more than the chunk
    check_launch_choices(75, (32, 64), [0, 1, 40, 107], every_input=diag3)


def test_large_logits():
    """s and log_z0 of ±1e3: every weight is a product of factors ≤ 1, nothing overflows."""
    xs = make_inputs(B=1, T=37, s_scale=1e3)
    got = run(abc_chunk_triton, xs, torch.float32, chunk_size=32)
    want = run(abc_reference, xs, torch.float64)
    assert_all_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("diag3", [False, True])
def test_whole_chunks_where_factors_are_exact_sub_blocks_elsewhere(monkeypatch, diag3):
    """Chunks of 64 with logits rising by δ a token, so that log_z grows by about 63 δ over a
    chunk and 15 δ over a sub-block of 16: δ = 1 in the first chunk (about 63, under the limit
    of 80, each factor within e^±32 about the midway r: one program takes the chunk whole, its
    own block as dots of the factors u = exp(s - r), v = exp(r - a)), 4.5 in the second (about
    284 over the chunk, 68 over each sub-block: sub-blocks, each as factors), 7 in the third
    (105 a sub-block: token by token, or in one step), against the float64 reference with
    every gradient. The whole-chunk launch alone writes the first chunk only, the sub-blocks'
    launch the others only (buffers start as NaN). With the limit lifted the whole-chunk
    launch takes every chunk and the factors of the second and third overflow float32: the
    limit is what keeps them exact."""
    monkeypatch.setattr(abc_chunk, "DIAG_3D", tuple(abc_chunk.SUB_ROWS) if diag3 else ())
    monkeypatch.setattr(abc_chunk, "WHOLE_PRECISIONS", EVERY_PRECISION)
    xs = make_inputs(B=1, T=192, H=1, M=4)
    rise = torch.cat([torch.full((64,), d) for d in (1.0, 4.5, 7.0)]).double().to(DEVICE)
    xs[3] = (torch.cumsum(rise, 0)[None, :, None, None] + 0.1 * xs[3]).float().double()
    want = run(abc_reference, xs, torch.float64)
    assert_all_close(run(abc_chunk_triton, xs, torch.float32, chunk_size=64), want,
                     atol=1e-4, rtol=1e-4)

    def output():
        return abc_chunk_triton(*(x.float() for x in xs[:4]), chunk_size=64,
                                initial_state=ABCState(*(x.float() for x in xs[4:])))[0]

    launches = abc_chunk._sub_launches
    for units, written in (("whole", slice(0, 64)), ("rest", slice(64, 192))):
        monkeypatch.setattr(abc_chunk, "_sub_launches", lambda *a, units=units: [
            (idx, kw) for idx, kw in launches(*a) if kw["UNITS"] == units])
        o = output().double()
        torch.testing.assert_close(o[:, written], want[0][:, written], atol=1e-4, rtol=1e-4)
        assert o.isnan().sum() == o.numel() - o[:, written].numel()
    monkeypatch.setattr(abc_chunk, "_sub_launches", launches)

    monkeypatch.setattr(abc_chunk, "_FACTOR_SPAN", abc_chunk.tl.constexpr(1e4))
    o = output()
    assert torch.isfinite(o[:, :64]).all() and not torch.isfinite(o[:, 64:]).any()


def test_whole_chunks_for_half_inputs_only():
    """The sub-block kernels launch over whole chunks, then the rest, for bf16 and fp16 dots;
    over every sub-block for fp32 inputs (WHOLE_PRECISIONS)."""
    for precision, units in (("bf16", ["whole", "rest"]), ("fp16", ["whole", "rest"]),
                             ("ieee", ["sub"]), ("tf32", ["sub"])):
        plan = abc_chunk._plan([0, 100], 64, 0.25, precision, torch.device(DEVICE))
        for kernel in abc_chunk.WHOLE_CHUNKS:
            got = [kw["UNITS"] for _, kw in abc_chunk._sub_launches(kernel, plan, 16, 16, 8)]
            assert got == units, (precision, kernel)


def test_factor_forms_lose_no_more_than_token_by_token_in_bf16(monkeypatch):
    """bf16 inputs: the own blocks as dots of their factors (whole chunks, and sub-blocks) are
    within 1.5x of the token-by-token form's error against the float64 reference, in o and in
    every gradient (relative L2 error). The factors reach e^±40 and their products are weights:
    with bf16 operands they were 1.6-1.8x in o, dq and dk (`abc_chunk._factor_dot`)."""
    xs = make_inputs(B=1, T=128, H=2, K=32, V=32, M=16, dtype=torch.bfloat16, seed=7)
    xs[0] = (xs[0] * 2).to(torch.bfloat16).double()  # larger scores
    want = run(abc_reference, xs, torch.float64, with_state=False)

    def errors(whole, factors):
        monkeypatch.setattr(abc_chunk, "WHOLE_CHUNKS", whole)
        monkeypatch.setattr(abc_chunk, "FACTOR_DIAG", factors)
        got = run(abc_chunk_triton, xs, torch.bfloat16, with_state=False, chunk_size=64)
        return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want)]

    defaults = abc_chunk.WHOLE_CHUNKS, abc_chunk.FACTOR_DIAG
    tokens = errors((), ())
    for whole, factors in (defaults, ((), defaults[1])):
        for name, e, e0 in zip(NAMES, errors(whole, factors), tokens):
            assert e <= 1.5 * e0, (name, e, e0, whole)


def test_varlen_matches_each_sequence():
    """Three packed sequences (1, 19 and 25 tokens), each from its own initial state."""
    bounds = [0, 1, 20, 45]
    xs = make_inputs(B=1, T=45, N=3, M=6)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    got = run(abc_attention, xs, torch.float32, cu_seqlens=cu, backend="triton")
    want = run(abc_varlen, xs, torch.float64, cu_seqlens=cu.long())
    assert_all_close(got, want, **F32)

    assert_packed_is_each_sequence(want, abc_reference, xs, bounds, ABCState)  # the torch packed form itself


def test_varlen_scans_walk_chunk_counts_that_differ():
    """Chunks of 16 over packed sequences of 1, 4 and 2 chunks (5, 53 and 17 tokens): the
    chunks' own parts are computed all at once and the short scans walk each sequence's
    count, each from its own initial state, with every gradient."""
    bounds = [0, 5, 58, 75]
    xs = make_inputs(B=1, T=75, N=3, K=16, V=8, M=5)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    got = run(abc_chunk_triton, xs, torch.float32, cu_seqlens=cu, chunk_size=16)
    want = run(abc_varlen, xs, torch.float64, cu_seqlens=cu.long())
    assert_all_close(got, want, **F32)


def test_dot_precision_follows_the_inputs(monkeypatch):
    f32, bf16, f16 = (torch.zeros(1, dtype=d) for d in (torch.float32, torch.bfloat16,
                                                        torch.float16))
    assert abc_chunk._precision(f32, f32) == "ieee"
    assert abc_chunk._precision(bf16, bf16) == "bf16"
    assert abc_chunk._precision(f16, f16) == "fp16"
    assert abc_chunk._precision(bf16, f32) == abc_chunk._precision(bf16, f16) == "tf32"
    monkeypatch.setattr(abc_chunk, "HALF_DOTS", False)
    assert abc_chunk._precision(bf16, bf16) == "tf32"


@pytest.mark.parametrize("half_dots", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(monkeypatch, dtype, half_dots):
    """fp16 / bf16 inputs (fp32 accumulation) against the float64 reference of the same
    rounded inputs, with matmul operands in the input dtype or in fp32 (TF32); o and the
    gradients come back in the input dtype."""
    monkeypatch.setattr(abc_chunk, "HALF_DOTS", half_dots)
    xs = make_inputs(T=21, dtype=dtype)
    q = xs[0].to(dtype)
    o, state = abc_chunk_triton(q, *(x.to(dtype) for x in xs[1:4]), output_final_state=True,
                                chunk_size=16)
    assert o.dtype == dtype and all(t.dtype == torch.float32 for t in state)
    got = run(abc_chunk_triton, xs, dtype, chunk_size=16)
    want = run(abc_reference, xs, torch.float64)
    assert_all_close(got, want, **HALF)


def test_varlen_torch_fallback():
    """abc_attention(cu_seqlens=..., backend="torch") is abc_varlen: per-sequence chunked calls."""
    bounds = [0, 1, 8, 20]
    xs = make_inputs(B=1, T=20, N=3, device="cpu")
    state = ABCState(*xs[4:])
    o, final = abc_attention(*xs[:4], cu_seqlens=torch.tensor(bounds), initial_state=state,
                             output_final_state=True, backend="torch")
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        o_n, st_n = abc_chunked(*(x[:, a:b] for x in xs[:4]),
                                initial_state=ABCState(*(t[n:n + 1] for t in state)),
                                output_final_state=True)
        torch.testing.assert_close(o[:, a:b], o_n)
        for t, t_n in zip(final, st_n):
            torch.testing.assert_close(t[n:n + 1], t_n)


@pytest.mark.parametrize(("cu", "kw", "match"), [
    ([1, 5, 20], {}, "start at 0"),
    ([0, 12, 12, 20], {}, "strictly increasing"),
    ([0, 12, 5, 20], {}, "strictly increasing"),
    ([0, 5, 19], {}, "end at the packed length 20"),
    ([0, 5, 20], {"B": 2}, "batch 1"),
    ([0, 5, 20], {"N": 3}, "initial_state.log_z"),
    ([0.0, 5.0, 20.0], {}, "integer"),
])
def test_varlen_errors(cu, kw, match):
    B, N = kw.get("B", 1), kw.get("N", len(cu) - 1)
    xs = make_inputs(B=B, T=20, N=N, device="cpu")
    for backend in ("torch", "triton"):
        with pytest.raises(ShapeError, match=match):
            abc_attention(*xs[:4], cu_seqlens=torch.tensor(cu), initial_state=ABCState(*xs[4:]),
                          backend=backend)


def test_backend_errors():
    xs = make_inputs(B=1, T=5)  # on the kernels' device: the device check passes
    with pytest.raises(ConfigError, match="^backend: expected one of"):
        abc_attention(*xs[:4], backend="cuda")
    with pytest.raises(ConfigError, match="causal=False"):
        abc_attention(*xs[:4], causal=False, backend="triton")
    with pytest.raises(ConfigError, match="causal=True only"):
        abc_attention(*xs[:4], causal=False, cu_seqlens=torch.tensor([0, 5], device=DEVICE))
    with pytest.raises(ConfigError, match="mode"):
        abc_attention(*xs[:4], mode="reference", backend="triton")
    with pytest.raises(ConfigError, match="chunk_size"):
        abc_chunk_triton(*xs[:4], chunk_size=8)
    with pytest.raises(ShapeError, match="float64"):
        abc_chunk_triton(*xs[:4])


def test_auto_stays_on_torch_on_cpu(monkeypatch):
    """backend="auto" never takes the kernels for CPU tensors, interpreter or not."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU tensors with backend='auto'")
    monkeypatch.setattr(abc_chunk, "abc_chunk_triton", refuse)
    xs = make_inputs(B=1, T=9, device="cpu")
    q, k, v, s = (x.float() for x in xs[:4])
    o, _ = abc_attention(q, k, v, s)
    torch.testing.assert_close(o, abc_chunked(q, k, v, s)[0])
    abc_attention(q, k, v, s, cu_seqlens=torch.tensor([0, 4, 9]))


def test_kernels_supported(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels_supported(x, None)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not kernels_supported(x)
    assert kernels_supported()
