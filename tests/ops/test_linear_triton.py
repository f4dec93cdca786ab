"""memattn.kernels.linear: linear_attention_triton (chunked causal forward and hand-written
backward with α / β gates) and linear_attention(backend=...), held to the reference loop:
outputs, final states and every gradient, including gates that are exactly 0.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), on tiny shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="linear_attention_triton is a Triton kernel")

from memattn.kernels.linear import linear_attention_triton
from memattn.errors import ConfigError, ShapeError
from memattn.ops.linear import LinearAttentionState, linear_attention, linear_attention_reference

F64 = torch.float64
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the kernel's own device; the CPU one under the interpreter
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the interpreter covers "
                                                 "the CPU runs)")


def make_inputs(B=2, T=37, H=2, K=16, V=8, *, gates="gated", init=True, zero_at=(),
                dtype=torch.float32, device=DEVICE, seed=0):
    """Random op arguments. gates: None, "beta" or "gated" (α in [0.5, 1] with α = 1e-6 at
    one step, β in [0, 1.5]); zero_at: time steps where α = 0 for every batch and head."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    inputs = dict(q=rand(B, T, H, K), k=rand(B, T, H, K), v=rand(B, T, H, V), alpha=None,
                  beta=None, initial_state=rand(B, H, K, V) if init else None)
    if gates in ("beta", "gated"):
        inputs["beta"] = 1.5 * torch.rand(B, T, H, generator=g, dtype=F64)
    if gates == "gated":
        alpha = 0.5 + 0.5 * torch.rand(B, T, H, generator=g, dtype=F64)
        alpha[0, T // 3, 0] = 1e-6
        alpha[:, list(zero_at)] = 0.0
        inputs["alpha"] = alpha
    if init:
        inputs["initial_state"] = LinearAttentionState(inputs["initial_state"])
    return tensors(inputs, lambda t: t.to(device=device, dtype=dtype))


def tensors(inputs, fn):
    """inputs with fn applied to every tensor (the state's kv included); None stays None."""
    return {n: None if t is None else LinearAttentionState(fn(t.kv)) if n == "initial_state"
            else fn(t) for n, t in inputs.items()}


def outputs_and_grads(form, inputs, seed=1, **kwargs):
    """o, the final state and the gradient of <o, do> + <S_T, dS> for random do, dS w.r.t.
    every given input."""
    args = tensors({n: t for n, t in inputs.items() if t is not None},
                   lambda t: t.detach().clone().requires_grad_())
    leaves = {n: t.kv if n == "initial_state" else t for n, t in args.items()}
    o, state = form(**args, output_final_state=True, **kwargs)
    state = state.kv
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g, dtype=F64).to(o)
    dS = torch.randn(state.shape, generator=g, dtype=F64).to(state)
    grads = torch.autograd.grad((o * do).sum() + (state * dS).sum(), list(leaves.values()))
    return {"o": o, "state": state, **{f"d{n}": d for n, d in zip(leaves, grads)}}


def assert_matches_reference(got, inputs, rtol=1e-4, **kwargs):
    """Compare with the float64 reference, each tensor to rtol of its largest entry."""
    want = outputs_and_grads(linear_attention_reference, tensors(inputs, torch.Tensor.double),
                             **kwargs)
    assert got.keys() == want.keys()
    for key, w in want.items():
        atol = rtol * max(1.0, w.abs().max().item())
        torch.testing.assert_close(got[key].double(), w, rtol=rtol, atol=atol,
                                   msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("case", [
    dict(gates="gated", init=True, zero_at=(0, 15, 16, 22)),  # resets at chunk edges
    dict(gates="beta", init=False, K=8, V=16),
    dict(gates=None, init=True, K=16, V=16),
    dict(gates="gated", init=False, T=9, K=8, V=8),  # one partial chunk
    dict(gates="gated", init=True, T=21, K=80, V=20, zero_at=(5,)),  # several K blocks
], ids=["gated-resets", "beta-only", "plain", "short", "wide-k"])
def test_forward_final_state_and_gradients_match_reference(case, nan_empty):
    inputs = make_inputs(**case)
    got = outputs_and_grads(linear_attention_triton, inputs, scale=0.7, chunk_size=16)
    assert all(torch.isfinite(t).all() for t in got.values())
    assert_matches_reference(got, inputs, scale=0.7)


def test_zero_gates_reset_the_memory_and_keep_their_gradient():
    inputs = make_inputs(T=20, zero_at=(7,))
    got = outputs_and_grads(linear_attention_triton, inputs, chunk_size=16)
    # After α = 0 nothing before step 7 is read: changing early keys leaves o[:, 7:] alone.
    changed = dict(inputs, k=inputs["k"].clone())
    changed["k"][:, :7] += 1.0
    o2, _ = linear_attention_triton(**changed, chunk_size=16)
    torch.testing.assert_close(o2[:, 7:], got["o"][:, 7:], rtol=0, atol=0)
    # dα at the reset is <G_7, S_6>, not 0.
    assert got["dalpha"][:, 7].abs().min() > 0
    assert_matches_reference(got, inputs)


def test_continuing_from_the_final_state_equals_the_whole_sequence():
    inputs = make_inputs(T=30, init=False)
    whole, state = linear_attention_triton(**inputs, output_final_state=True, chunk_size=16)
    first = {n: None if t is None else t[:, :13] for n, t in inputs.items()}
    o1, s1 = linear_attention_triton(**first, output_final_state=True, chunk_size=16)
    second = {n: None if t is None else t[:, 13:] for n, t in inputs.items()}
    second["initial_state"] = s1
    o2, s2 = linear_attention_triton(**second, output_final_state=True, chunk_size=16)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_float32(dtype, nan_empty):
    inputs = make_inputs(T=20, dtype=dtype)
    got = outputs_and_grads(linear_attention_triton, inputs, chunk_size=16)
    assert got["o"].dtype == dtype and got["state"].dtype == torch.float32
    assert got["dq"].dtype == dtype and got["dalpha"].dtype == dtype
    assert_matches_reference(got, inputs, rtol=2e-2)


def test_public_op_routes_by_backend(monkeypatch):
    inputs = make_inputs(T=20)
    tri = outputs_and_grads(linear_attention, inputs, backend="triton")
    ref = outputs_and_grads(linear_attention, inputs, backend="torch")
    for key in ref:
        torch.testing.assert_close(tri[key], ref[key], rtol=1e-4, atol=1e-4)

    import memattn.kernels.linear as kernel

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on the CPU under backend='auto'")

    monkeypatch.setattr(kernel, "linear_attention_triton", refuse)
    linear_attention(**make_inputs(T=20, device="cpu"))  # auto: torch on the CPU
    with pytest.raises(ConfigError, match="causal form"):
        linear_attention(**inputs, causal=False, backend="triton")
    with pytest.raises(ConfigError, match="backend: expected one of"):
        linear_attention(**inputs, backend="cuda")


def test_kernel_refuses_what_it_cannot_run():
    inputs = make_inputs(T=5)
    with pytest.raises(ShapeError, match="q: backend='triton' takes"):
        linear_attention_triton(**tensors(inputs, torch.Tensor.double))
    with pytest.raises(ConfigError, match="chunk_size"):
        linear_attention_triton(**inputs, chunk_size=24)
    if not CUDA:  # gate values are checked on the CPU only: on a GPU the check would synchronise
        with pytest.raises(ShapeError, match="alpha: expected gates >= 0"):
            linear_attention_triton(**dict(inputs, alpha=-inputs["alpha"]))


@needs_cuda
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_model_sizes_match_reference(dtype, rtol):
    inputs = make_inputs(B=2, T=300, H=4, K=64, V=128, zero_at=(64, 100), dtype=dtype,
                         device="cuda")
    got = outputs_and_grads(linear_attention_triton, inputs)
    assert_matches_reference(got, inputs, rtol=rtol)


@needs_cuda
@pytest.mark.parametrize("stages", [2, 3])
def test_cuda_pipelined_scans_match_reference(monkeypatch, stages):
    """The scans' `for` form (memattn.kernels.SCAN_STAGES > 0; the interpreter runs only the
    `while` form), with resets at and between chunk edges, fp32 and bf16."""
    import memattn.kernels

    monkeypatch.setattr(memattn.kernels, "SCAN_STAGES", stages)
    for dtype, rtol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        inputs = make_inputs(B=2, T=300, H=4, K=64, V=128, zero_at=(64, 100), dtype=dtype,
                             device="cuda")
        assert_matches_reference(outputs_and_grads(linear_attention_triton, inputs), inputs,
                                 rtol=rtol)


@needs_cuda
def test_cuda_auto_backend_takes_the_kernel():
    inputs = make_inputs(T=100, K=64, V=64, device="cuda")
    auto = outputs_and_grads(linear_attention, inputs)
    tri = outputs_and_grads(linear_attention_triton, inputs)
    for key in tri:
        torch.testing.assert_close(auto[key], tri[key], rtol=0, atol=0)
