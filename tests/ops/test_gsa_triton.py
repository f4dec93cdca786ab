"""memattn.kernels.gsa_chunk (gsa_chunk_triton, gated_slot_attention(backend="triton")) and
the fused decoding step (abc_decode.gsa_step_triton): outputs, final states and every gradient
against the float64 reference (memattn.ops.gsa.reference), packed sequences against each
sequence alone.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes are tiny; test_on_gpu repeats the checks with larger ones.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_named_close, assert_packed_is_each_sequence, outputs_and_grads

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from memattn.errors import ConfigError, ShapeError
from memattn.kernels import abc_chunk, gsa_chunk
from memattn.kernels.gsa_chunk import gsa_chunk_triton
from memattn.ops.gsa import (
    GSAState,
    gated_slot_attention,
    gated_slot_attention_step,
    gsa_chunked,
    gsa_reference,
    gsa_varlen,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set: the kernels cannot run",
                allow_module_level=True)

# Every buffer the kernels fill starts as NaN: a read before a write shows.
pytestmark = pytest.mark.usefixtures("nan_empty")

F32 = {"atol": 2e-5, "rtol": 2e-5}
HALF = {"atol": 4e-2, "rtol": 4e-2}
NAMES = ["o", "k", "v", "dq", "dk", "dv", "dg", "dk0", "dv0"]


def make_inputs(B=2, T=7, H=2, K=16, V=8, M=5, *, N=None, gate_scale=2.0, dtype=torch.float32,
                seed=0, device=DEVICE):
    """q [B, T, H, K], k [B, T, H, K], v [B, T, H, V], log forget gates g = log σ(z)
    [B, T, H, M] (z of std gate_scale) and a GSAState of batch N (default B), rounded to
    `dtype` and held in float64 (leaves for the reference)."""
    gen = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, M), (N, H, M, K), (N, H, M, V)]
    xs = [torch.randn(*sh, generator=gen, dtype=torch.float64) for sh in shapes]
    xs[3] = torch.nn.functional.logsigmoid(gate_scale * xs[3])
    return [x.to(dtype).to(device=device, dtype=torch.float64) for x in xs]


def run(fn, xs, dtype, *, with_state=True, **kw):
    return outputs_and_grads(fn, xs, dtype, GSAState, with_state=with_state, **kw)


def assert_all_close(got, want, names=NAMES, **tol):
    assert_named_close(got, want, names, **tol)


# The GPU test first: a run cut short on a GPU machine gets to it before the rest.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu():
    """Larger shapes on the GPU: several chunks of 64, K, V, M not powers of two, the layer's
    gates (log σ / 8, near 1), varlen, bf16; a CUDA decoding step of the op takes the kernel."""
    xs = make_inputs(B=2, T=300, H=3, K=72, V=40, M=24, seed=1)
    want = run(gsa_reference, xs, torch.float64)
    assert_all_close(run(gsa_chunk_triton, xs, torch.float32), want, atol=1e-4, rtol=1e-4)
    assert_all_close(run(gsa_chunk_triton, xs, torch.bfloat16), want, atol=6e-2, rtol=6e-2)
    xs[3] = xs[3] / 8
    assert_all_close(run(gsa_chunk_triton, xs, torch.float32),
                     run(gsa_reference, xs, torch.float64), atol=1e-4, rtol=1e-4)

    bounds = [0, 1, 130, 131, 400]
    xs = make_inputs(B=1, T=400, H=2, K=64, V=32, M=20, N=4, seed=3)
    cu = torch.tensor(bounds, device=DEVICE)
    assert_all_close(run(gated_slot_attention, xs, torch.float32, cu_seqlens=cu),
                     run(gsa_varlen, xs, torch.float64, cu_seqlens=cu), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("T", "chunk"), [(1, 16), (63, 16), (63, 32)])
def test_matches_reference(T, chunk):
    """Odd lengths, several chunks (16), several sub-blocks in a chunk (32), K ≠ V, M = 5,
    an initial state, losses on o and on the final state."""
    xs = make_inputs(T=T)
    got = run(gsa_chunk_triton, xs, torch.float32, chunk_size=chunk)
    want = run(gsa_reference, xs, torch.float64)
    assert_all_close(got, want, **F32)


def test_backend_triton_without_state():
    """gated_slot_attention(backend="triton"): empty memories to start, a loss on o only."""
    xs = make_inputs(B=1, T=20, H=3, K=16, V=16, M=16)
    q, k, v, g = (x.float().requires_grad_() for x in xs[:4])
    o, state = gated_slot_attention(q, k, v, g, backend="triton")
    assert state is None
    do = torch.randn_like(o)
    got = [o, *torch.autograd.grad(o, (q, k, v, g), do)]
    o_ref, _ = gsa_reference(*(x.requires_grad_() for x in xs[:4]))
    want = [o_ref, *torch.autograd.grad(o_ref, xs[:4], do.double())]
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), got, want):
        torch.testing.assert_close(a.double(), b, **F32, msg=lambda m, n=name: f"{n}: {m}")


def test_gradients_through_the_final_state_only():
    """A loss on the final state alone (o unused): gradients of k, v, g and the initial state."""
    xs = make_inputs(B=1, T=40)
    grads = []
    for fn, dt, kw in ((gsa_chunk_triton, torch.float32, {"chunk_size": 16}),
                       (gsa_reference, torch.float64, {})):
        leaves = [x.to(dt).requires_grad_() for x in xs[:4]]
        state = [x.to(dt).requires_grad_() for x in xs[4:]]
        _, final = fn(*leaves, initial_state=GSAState(*state), output_final_state=True, **kw)
        loss = (final.k * 0.5).sum() - (final.v ** 2).sum()
        grads.append(torch.autograd.grad(loss, leaves[1:] + state))
    for name, a, b in zip(("dk", "dv", "dg", "dk0", "dv0"), *grads, strict=True):
        torch.testing.assert_close(a.double(), b, **F32, msg=lambda m, n=name: f"{n}: {m}")


def test_extreme_gates():
    """Gates of exactly 0 (α = 1: no write, whole chunks of them), -1e-7, and far below
    GATE_FLOOR (-50, -1e3: the slot forgets everything; counted as GATE_FLOOR, which float32
    cannot tell apart): the write weights' floor keeps g's gradient exact at α = 1."""
    xs = make_inputs(B=1, T=50, M=6)
    g = xs[3]
    g[:, :20, :, 0] = 0.0  # one slot that nothing is written to over the first chunk
    g[:, :, :, 1] = -1e-7
    g[:, ::3, :, 2] = -50.0
    g[:, 5::7, :, 3] = -1e3
    g[:, 30:, :, 4] = 0.0
    got = run(gsa_chunk_triton, xs, torch.float32, chunk_size=16)
    want = run(gsa_reference, xs, torch.float64)
    # gates of -1e3 and -50 have gradients of e^-50 and below: 0 in both
    assert_all_close(got, want, atol=5e-5, rtol=5e-5)


def test_gate_logits_and_their_gradient_against_float64():
    """The kernels between the log gates and ABC's logits: s = log(1 - α) - ΔG and g's gradient
    from that of s, against the closed form in float64 over the same float32 gates: gates
    near 0 (where 1 - exp(g) cancels in float32), both sides of the series' edge at -0.35, at
    and below GATE_FLOOR (no gradient below it), over chunks of 16 with a partial last one;
    a NaN gate stays NaN in s and in the gradient."""
    values = torch.tensor([-1e-8, -3e-7, -1e-4, -0.01, -0.3, -0.3499, -0.3501, -0.5, -2.0,
                           -19.9, -20.0, -25.0])
    gen = torch.Generator().manual_seed(0)
    T, H, M, C = 37, 2, 12, 16
    g = values[torch.randint(len(values), (T, H, M), generator=gen)].to(DEVICE)
    ds = torch.randn(T, H, M, generator=gen, dtype=torch.float64).float().to(DEVICE)
    plan = abc_chunk._plan([0, T], C, 1.0, "ieee", g.device)

    g64 = g.double().clamp_min(gsa_chunk.GATE_FLOOR)
    w = (-torch.expm1(g64)).clamp_min(gsa_chunk.WRITE_FLOOR)
    starts = torch.arange(T, device=g.device) // C * C
    cum = torch.stack([g64[starts[t]:t + 1].sum(0) for t in range(T)])
    rev = torch.stack([ds.double()[t:min(starts[t] + C, T)].sum(0) for t in range(T)])
    want_s = torch.log(w) - cum
    want_dg = torch.where(g >= gsa_chunk.GATE_FLOOR, -ds * torch.exp(g64) / w - rev, 0.0)
    torch.testing.assert_close(gsa_chunk.gate_logits(g, plan).double(), want_s, rtol=4e-6, atol=1e-6)
    torch.testing.assert_close(gsa_chunk.gate_grads(g, ds, plan).double(), want_dg, rtol=1e-5, atol=1e-6)

    g[5, 1, 3] = float("nan")
    assert torch.isnan(gsa_chunk.gate_logits(g, plan)[5:C, 1, 3]).all()
    assert torch.isnan(gsa_chunk.gate_grads(g, ds, plan)[5, 1, 3])


def test_logits_of_a_chunk_of_strong_gates():
    """Every gate at GATE_FLOOR over a chunk of 64: the logits reach 64 · 20, where float32
    rounds them by about 1e-4, which is the tolerance."""
    xs = make_inputs(B=1, T=70, H=1, M=4)
    xs[3][:] = gsa_chunk.GATE_FLOOR * torch.rand(xs[3].shape, dtype=torch.float64).to(DEVICE)
    got = run(gsa_chunk_triton, xs, torch.float32, chunk_size=64)
    want = run(gsa_reference, xs, torch.float64)
    assert_all_close(got, want, atol=3e-4, rtol=3e-4)


def test_varlen_matches_each_sequence():
    """Three packed sequences (1, 19 and 25 tokens), each from its own initial state, through
    the kernels and through gsa_varlen; gsa_varlen against each sequence alone."""
    bounds = [0, 1, 20, 45]
    xs = make_inputs(B=1, T=45, N=3, M=6)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    got = run(gated_slot_attention, xs, torch.float32, cu_seqlens=cu, backend="triton")
    want = run(gsa_varlen, xs, torch.float64, cu_seqlens=cu.long())
    assert_all_close(got, want, **F32)

    assert_packed_is_each_sequence(want, gsa_reference, xs, bounds, GSAState)  # the torch packed form itself


def test_varlen_scans_walk_chunk_counts_that_differ():
    """Chunks of 16 over packed sequences of 1, 4 and 2 chunks (5, 53 and 17 tokens): the
    log-normaliser restarts at every chunk while the short scans walk each sequence's count."""
    bounds = [0, 5, 58, 75]
    xs = make_inputs(B=1, T=75, N=3, M=6)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    got = run(gsa_chunk_triton, xs, torch.float32, cu_seqlens=cu, chunk_size=16)
    want = run(gsa_varlen, xs, torch.float64, cu_seqlens=cu.long())
    assert_all_close(got, want, **F32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    """fp16 / bf16 inputs (fp32 accumulation, matmul operands in the input dtype) against the
    float64 reference of the same rounded inputs; o and the gradients in the input dtype."""
    xs = make_inputs(T=21, dtype=dtype)
    o, state = gsa_chunk_triton(*(x.to(dtype) for x in xs[:4]), output_final_state=True,
                                chunk_size=16)
    assert o.dtype == dtype and all(t.dtype == torch.float32 for t in state)
    got = run(gsa_chunk_triton, xs, dtype, chunk_size=16)
    want = run(gsa_reference, xs, torch.float64)
    assert_all_close(got, want, **HALF)


def test_backward_variants(monkeypatch):
    """abc_chunk's other backward forms under RESET: dk / dv / ds in two launches and the
    diagonal blocks in one step."""
    monkeypatch.setattr(abc_chunk, "DIAG_3D", tuple(abc_chunk.SUB_WARPS))
    monkeypatch.setattr(abc_chunk, "SPLIT_DKV", True)
    xs = make_inputs(T=37)
    assert_all_close(run(gsa_chunk_triton, xs, torch.float32, chunk_size=32),
                     run(gsa_reference, xs, torch.float64), **F32)


def test_errors():
    xs = make_inputs(B=1, T=5)  # on the kernels' device: the device check passes
    q, k, v, g = (x.float() for x in xs[:4])
    with pytest.raises(ConfigError, match="causal=False"):
        gated_slot_attention(q, k, v, g, causal=False, backend="triton")
    with pytest.raises(ConfigError, match="mode='reference'"):
        gated_slot_attention(q, k, v, g, mode="reference", backend="triton")
    with pytest.raises(ConfigError, match="causal=True only"):
        gated_slot_attention(q, k, v, g, causal=False, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ConfigError, match="^chunk_size"):
        gsa_chunk_triton(q, k, v, g, chunk_size=8)
    with pytest.raises(ShapeError, match="^q: backend='triton' takes float32"):
        gsa_chunk_triton(*xs[:4])
    with pytest.raises(ShapeError, match="^g: expected finite log forget gates"):
        gsa_chunk_triton(q, k, v, -g)
    with pytest.raises(ShapeError, match="^initial_state.k"):  # a state of batch 2 for 1
        gated_slot_attention(q, k, v, g, cu_seqlens=torch.tensor([0, 5], device=DEVICE),
                             initial_state=GSAState(*(t.float() for t in make_inputs(N=2)[4:])),
                             backend="triton")


def test_auto_stays_on_torch_on_cpu(monkeypatch):
    """backend="auto" never takes the kernels for CPU tensors, interpreter or not; packed
    sequences then take gsa_varlen."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU tensors with backend='auto'")
    monkeypatch.setattr(gsa_chunk, "gsa_chunk_triton", refuse)
    q, k, v, g = (x.float() for x in make_inputs(B=1, T=9, device="cpu")[:4])
    o, _ = gated_slot_attention(q, k, v, g)
    torch.testing.assert_close(o, gsa_chunked(q, k, v, g)[0])
    o, _ = gated_slot_attention(q, k, v, g, cu_seqlens=torch.tensor([0, 4, 9]))
    torch.testing.assert_close(o[:, 4:], gsa_chunked(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:])[0])


# --- the decoding step -------------------------------------------------------------------

def run_steps(q, k, v, g, state=None, **kwargs):
    """All T tokens through gated_slot_attention_step; (o [B, T, H, V], final state)."""
    outs = []
    for t in range(q.shape[1]):
        o, state = gated_slot_attention_step(q[:, t], k[:, t], v[:, t], g[:, t], state, **kwargs)
        outs.append(o)
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("inplace", [False, True])
def test_kernel_steps_match_reference(inplace):
    """Twenty fused steps from an initial state (copied: in place overwrites it), gates of
    exactly 0 and of -1e3 among them, K ≠ V, M = 5."""
    xs = make_inputs(T=20, gate_scale=4.0)
    xs[3][:, 3, :, 0] = 0.0
    xs[3][:, 5, :, 1] = -1e3
    q, k, v, g = (x.float() for x in xs[:4])
    state = GSAState(*(t.float().clone() for t in xs[4:]))
    with torch.no_grad():
        o, final = run_steps(q, k, v, g, state, backend="triton", inplace=inplace)
    if inplace:
        assert final.k is state.k and final.v is state.v
    o_ref, final_ref = gsa_reference(*xs[:4], initial_state=GSAState(*xs[4:]),
                                     output_final_state=True)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(final, final_ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_kernel_step_bf16_and_from_no_state():
    """bf16 inputs (an fp32 state), the first step from no state, through the op's decoding
    path (one causal token continuing a state)."""
    xs = make_inputs(B=2, T=6, dtype=torch.bfloat16)
    q, k, v, g = (x.to(torch.bfloat16) for x in xs[:4])
    with torch.no_grad():
        o0, state = gated_slot_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], backend="triton")
        outs = [o0[:, None]]
        for t in range(1, 6):
            o, state = gated_slot_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                            g[:, t:t + 1], initial_state=state,
                                            output_final_state=True, backend="triton")
            outs.append(o)
    assert o.dtype == torch.bfloat16 and state.k.dtype == torch.float32
    o_ref, final_ref = gsa_reference(*xs[:4], output_final_state=True)
    torch.testing.assert_close(torch.cat(outs, dim=1).double(), o_ref, atol=2e-2, rtol=2e-2)
    for a, b in zip(state, final_ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_kernel_step_refuses_gradients():
    q, k, v, g = (x.float().requires_grad_() for x in make_inputs(B=1, T=1)[:4])
    with pytest.raises(ConfigError, match="has no backward"):
        gated_slot_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], backend="triton")
