"""memattn.kernels.abc_decode: the fused ABC decoding step (abc_step_triton,
bounded_memory_step_triton) and the `backend` / `inplace` options of abc_attention_step and
bounded_memory_attention_step, held to the torch step and to the reference.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py), on tiny shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused decoding step is a Triton kernel")

from memattn.errors import ConfigError, ShapeError
from memattn.ops.abc import (
    ABCState,
    BoundedMemoryState,
    abc_attention_step,
    abc_reference,
    bounded_memory_attention_step,
    bounded_memory_reference,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the kernel's own device; the CPU one under the interpreter
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the interpreter covers "
                                                 "the CPU runs)")


def sequence(B=2, T=20, H=2, K=16, V=16, M=8, *, dtype=torch.float32, device=DEVICE,
             s_scale=2.0, seed=0):
    """q, k [B, T, H, K], v [B, T, H, V], s [B, T, H, M] slot logits, φ [B, T, H, M] >= 0."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    phi = torch.rand(B, T, H, M, generator=g).to(device=device, dtype=dtype)
    return rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V), s_scale * rand(B, T, H, M), phi


def run_steps(step, q, k, v, w, state=None, **kwargs):
    """All T tokens through `step`; returns (o [B, T, H, V], per-step states, final state)."""
    outs, states = [], []
    for t in range(q.shape[1]):
        o, state = step(q[:, t], k[:, t], v[:, t], w[:, t], state, **kwargs)
        outs.append(o)
        states.append(state)
    return torch.stack(outs, dim=1), states, state


@pytest.mark.parametrize("K, V, M", [(16, 16, 8), (16, 8, 5)])
def test_twenty_kernel_steps_equal_torch_steps_and_reference(K, V, M, nan_empty):
    q, k, v, s, _ = sequence(K=K, V=V, M=M)
    o_tri, states_tri, final_tri = run_steps(abc_attention_step, q, k, v, s, backend="triton")
    o_pt, states_pt, _ = run_steps(abc_attention_step, q, k, v, s, backend="torch")
    for got, want in zip(states_tri, states_pt):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_tri, o_pt, rtol=1e-5, atol=1e-5)
    o_ref, final_ref = abc_reference(q, k, v, s, causal=True, output_final_state=True)
    torch.testing.assert_close(o_tri, o_ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(final_tri, final_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("K, V, M", [(16, 16, 8), (16, 8, 5)])
def test_bounded_kernel_steps_equal_torch_steps_and_reference(K, V, M, nan_empty):
    q, k, v, _, phi = sequence(K=K, V=V, M=M)
    o_tri, _, final_tri = run_steps(bounded_memory_attention_step, q, k, v, phi,
                                    backend="triton")
    o_pt, _, final_pt = run_steps(bounded_memory_attention_step, q, k, v, phi, backend="torch")
    torch.testing.assert_close(o_tri, o_pt, rtol=1e-5, atol=1e-5)
    o_ref, final_ref = bounded_memory_reference(q, k, v, phi, causal=True,
                                                output_final_state=True)
    torch.testing.assert_close(o_tri, o_ref, rtol=1e-4, atol=1e-5)
    for a, b, c in zip(final_tri, final_pt, final_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def test_kernel_continues_a_given_state_and_takes_a_scale():
    q, k, v, s, _ = sequence(T=6, K=16, V=8, M=5)
    _, _, state = run_steps(abc_attention_step, q[:, :3], k[:, :3], v[:, :3], s[:, :3],
                            backend="torch")
    rest = (q[:, 3:], k[:, 3:], v[:, 3:], s[:, 3:])
    o_tri, _, fin_tri = run_steps(abc_attention_step, *rest, state, scale=0.3, backend="triton")
    o_pt, _, fin_pt = run_steps(abc_attention_step, *rest, state, scale=0.3, backend="torch")
    torch.testing.assert_close(o_tri, o_pt, rtol=1e-5, atol=1e-5)
    for a, b in zip(fin_tri, fin_pt):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inplace_updates_the_given_tensors_and_equals_out_of_place(backend):
    q, k, v, s, phi = sequence(T=4, K=16, V=8, M=5)
    _, _, state = run_steps(abc_attention_step, q[:, :3], k[:, :3], v[:, :3], s[:, :3],
                            backend="torch")
    step = (q[:, 3], k[:, 3], v[:, 3], s[:, 3])
    o_out, new = abc_attention_step(*step, state, backend=backend)
    given = ABCState(*(t.clone() for t in state))
    o_in, updated = abc_attention_step(*step, given, inplace=True, backend=backend)
    assert all(a is b for a, b in zip(updated, given))
    torch.testing.assert_close(o_in, o_out, rtol=0, atol=0)
    for a, b in zip(given, new):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    bounded = BoundedMemoryState(state.k.clone(), state.v.clone())
    o_out, new = bounded_memory_attention_step(q[:, 3], k[:, 3], v[:, 3], phi[:, 3], bounded,
                                               backend=backend)
    o_in, updated = bounded_memory_attention_step(q[:, 3], k[:, 3], v[:, 3], phi[:, 3], bounded,
                                                  inplace=True, backend=backend)
    assert updated.k is bounded.k and updated.v is bounded.v
    torch.testing.assert_close(o_in, o_out, rtol=0, atol=0)
    torch.testing.assert_close(bounded.k, new.k, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inplace_refuses_states_it_cannot_overwrite(backend):
    q, k, v, s, _ = sequence(T=1, K=16, V=8, M=5)
    _, state = abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0], backend="torch")
    half = ABCState(state.log_z, state.k.half(), state.v)
    with pytest.raises(ShapeError, match="state.k: inplace=True"):
        abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0], half, inplace=True,
                           backend=backend)
    strided = ABCState(state.log_z, state.k, state.v.mT.contiguous().mT)
    with pytest.raises(ShapeError, match="state.v: .*non-contiguous"):
        abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0], strided, inplace=True,
                           backend=backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_close_to_float32_reference(dtype):
    q, k, v, s, _ = sequence(T=8, K=16, V=8, M=5)
    low = [t.to(dtype) for t in (q, k, v, s)]
    o, _, final = run_steps(abc_attention_step, *low, backend="triton")
    assert o.dtype == dtype and all(t.dtype == torch.float32 for t in final)
    o_ref, final_ref = abc_reference(*(t.float() for t in low), causal=True,
                                     output_final_state=True)
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(final, final_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_huge_logits_stay_finite():
    q, k, v, s, _ = sequence(T=6, K=16, V=8, M=5)
    s = torch.where(torch.rand_like(s) < 0.5, 1e4, -1e4)
    o_tri, _, final = run_steps(abc_attention_step, q, k, v, s, backend="triton")
    o_pt, _, _ = run_steps(abc_attention_step, q, k, v, s, backend="torch")
    assert torch.isfinite(o_tri).all() and all(torch.isfinite(t).all() for t in final)
    torch.testing.assert_close(o_tri, o_pt, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_inputs_that_need_a_gradient_or_float64():
    q, k, v, s, _ = sequence(T=1, K=16, V=8, M=5)
    with pytest.raises(ConfigError, match="^backend: the fused decoding step .* has no backward"):
        abc_attention_step(q[:, 0].requires_grad_(), k[:, 0], v[:, 0], s[:, 0],
                           backend="triton")
    with pytest.raises(ShapeError, match="^q: backend='triton' takes"):
        abc_attention_step(q[:, 0].double(), k[:, 0].double(), v[:, 0].double(),
                           s[:, 0].double(), backend="triton")
    with pytest.raises(ConfigError, match="^backend: expected one of"):
        abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0], backend="cuda")


def test_auto_backend_keeps_the_torch_step_on_the_cpu(monkeypatch):
    import memattn.kernels.abc_decode as decode

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton step ran on the CPU under backend='auto'")

    monkeypatch.setattr(decode, "abc_step_triton", refuse)
    monkeypatch.setattr(decode, "bounded_memory_step_triton", refuse)
    q, k, v, s, phi = sequence(T=1, K=16, V=8, M=5, device="cpu")
    abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0])
    bounded_memory_attention_step(q[:, 0], k[:, 0], v[:, 0], phi[:, 0])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_steps_match_torch_on_model_sizes(dtype):
    q, k, v, s, phi = sequence(B=4, T=50, H=8, K=64, V=128, M=64, dtype=dtype, device="cuda")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    o_tri, _, fin_tri = run_steps(abc_attention_step, q, k, v, s, backend="triton")
    o_pt, _, fin_pt = run_steps(abc_attention_step, q, k, v, s, backend="torch")
    torch.testing.assert_close(o_tri.float(), o_pt.float(), **tol)
    for a, b in zip(fin_tri, fin_pt):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    o_tri, _, _ = run_steps(bounded_memory_attention_step, q, k, v, phi, backend="triton")
    o_pt, _, _ = run_steps(bounded_memory_attention_step, q, k, v, phi, backend="torch")
    torch.testing.assert_close(o_tri.float(), o_pt.float(), **tol)


@needs_cuda
def test_cuda_auto_backend_takes_the_kernel(monkeypatch):
    import memattn.kernels.abc_decode as decode

    calls = []
    real = decode.abc_step_triton
    monkeypatch.setattr(decode, "abc_step_triton",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, s, _ = sequence(T=1, K=64, V=64, M=32, device="cuda")
    abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0])
    assert calls
