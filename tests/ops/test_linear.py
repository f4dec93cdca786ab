"""memattn.ops.linear: linear_attention and its reference, recurrent, chunked and
memory-light backward forms, held to the reference loop and to closed forms."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memattn.errors import ConfigError, ShapeError
from memattn.ops.linear import (ALPHA_MIN, LinearAttentionState, choose_state_mode, linear_attention,
                                linear_attention_autograd, linear_attention_chunked,
                                linear_attention_read, linear_attention_recurrent,
                                linear_attention_reference, linear_attention_step)

F64 = torch.float64


def make_inputs(B=2, T=7, H=2, K=5, V=4, *, Tq=None, gates=None, init=False, dtype=F64,
                seed=0, alpha_range=(0.9, 1.0)):
    """Random inputs as a dict of the op's arguments. gates: None, "beta" or "gated" (α and β)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    inputs = dict(q=rand(B, Tq or T, H, K), k=rand(B, T, H, K), v=rand(B, T, H, V),
                  alpha=None, beta=None,
                  initial_state=LinearAttentionState(rand(B, H, K, V)) if init else None)
    if gates in ("beta", "gated"):
        inputs["beta"] = (0.5 + torch.rand(B, T, H, generator=g, dtype=F64)).to(dtype)
    if gates == "gated":
        lo, hi = alpha_range
        inputs["alpha"] = (lo + (hi - lo) * torch.rand(B, T, H, generator=g, dtype=F64)).to(dtype)
    return inputs


def tensors(inputs, fn):
    """inputs with fn applied to every tensor (the state's kv included); None stays None."""
    return {n: None if t is None else LinearAttentionState(fn(t.kv)) if n == "initial_state"
            else fn(t) for n, t in inputs.items()}


def leaves(inputs):
    """Every given input as a fresh leaf that requires grad, and those leaves by name (the
    state's by its kv)."""
    args = tensors({n: t for n, t in inputs.items() if t is not None},
                   lambda t: t.detach().clone().requires_grad_())
    return args, {n: t.kv if n == "initial_state" else t for n, t in args.items()}


def run_with_grads(form, inputs, causal, seed=1):
    """o, final state and the gradient of a random linear loss w.r.t. every given input."""
    args, named = leaves(inputs)
    o, state = form(**args, causal=causal)
    state = state.kv
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype)
    dS = torch.randn(state.shape, generator=g, dtype=F64).to(state.dtype)
    loss = (o.float() * do).sum() + (state * dS).sum()
    grads = torch.autograd.grad(loss, list(named.values()), materialize_grads=True)
    return {"o": o, "state": state, **{f"d{n}": d for n, d in zip(named, grads)}}


def as_double(inputs):
    return tensors(inputs, torch.Tensor.double)


def assert_all_close(got, want, **tol):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], **tol, msg=lambda m, key=key: f"{key}: {m}")


REFERENCE = partial(linear_attention_reference, output_final_state=True)
RECURRENT = partial(linear_attention_recurrent, output_final_state=True)
PUBLIC = partial(linear_attention, output_final_state=True)


def chunked(chunk_size):
    return partial(linear_attention_chunked, chunk_size=chunk_size, output_final_state=True)


def function(chunk_size, state_mode="auto"):
    return partial(linear_attention_autograd, chunk_size=chunk_size, state_mode=state_mode)


LENGTHS_AND_CHUNKS = [(1, 1), (1, 4), (7, 7), (7, 4), (63, 21), (63, 16), (130, 13), (130, 64)]


@pytest.mark.parametrize("init", [False, True], ids=["no_init", "init"])
@pytest.mark.parametrize("gates", [None, "beta", "gated"])
@pytest.mark.parametrize("T,C", LENGTHS_AND_CHUNKS)
def test_causal_forms_match_reference(T, C, gates, init):
    inputs = make_inputs(T=T, gates=gates, init=init, seed=T + C)
    want = run_with_grads(REFERENCE, inputs, causal=True)
    forms = {"recurrent": RECURRENT, "chunked": chunked(C)}
    modes = ["invert", "checkpoint"] if gates == "gated" else ["auto"]
    forms.update({f"function[{m}]": function(C, m) for m in modes})
    for name, form in forms.items():
        got = run_with_grads(form, inputs, causal=True)
        try:
            assert_all_close(got, want, rtol=1e-9, atol=1e-9)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("gates", [None, "gated"])
@pytest.mark.parametrize("T,Tq,C", [(1, 3, 4), (7, 11, 4), (63, 5, 16), (130, 17, 64)])
def test_noncausal_forms_match_reference(T, Tq, C, gates):
    inputs = make_inputs(T=T, Tq=Tq, gates=gates, init=True, seed=T)
    want = run_with_grads(REFERENCE, inputs, causal=False)
    for name, form in {"recurrent": RECURRENT, "chunked": chunked(C),
                       "function": function(C), "public": PUBLIC}.items():
        got = run_with_grads(form, inputs, causal=False)
        try:
            assert_all_close(got, want, rtol=1e-9, atol=1e-9)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_public_op_float32_matches_float64_reference():
    inputs = make_inputs(B=2, T=130, H=3, K=16, V=8, gates="gated", init=True,
                         alpha_range=(0.8, 1.0))
    want = run_with_grads(REFERENCE, inputs, causal=True)
    got = run_with_grads(PUBLIC, tensors(inputs, torch.Tensor.float), causal=True)
    assert got["o"].dtype == torch.float32 and got["state"].dtype == torch.float32
    assert_all_close({n: t.double() for n, t in got.items()}, want, rtol=1e-4, atol=1e-4)


def test_zero_gates_give_exact_gradients_without_nan():
    """α = 0 forgets everything before it; log-space decays give 0, never NaN."""
    inputs = make_inputs(T=63, gates="gated", init=True, alpha_range=(0.0, 1.0))
    inputs["alpha"][:, [0, 5, 6, 40]] = 0.0
    inputs["alpha"][:, 20] = 1e-5
    assert choose_state_mode(inputs["alpha"], 16) == "checkpoint"
    for causal in (True, False):
        want = run_with_grads(REFERENCE, inputs, causal=causal)
        got = run_with_grads(function(16), inputs, causal=causal)
        assert_all_close(got, want, rtol=1e-9, atol=1e-9)
        assert all(torch.isfinite(t).all() for t in got.values())
        # Plain autograd through the chunked forward: finite, gradient 0 at the zero gates.
        plain = run_with_grads(chunked(16), inputs, causal=causal)
        assert all(torch.isfinite(t).all() for t in plain.values())
        assert_all_close({n: plain[n] for n in ("o", "state", "dq", "dk", "dv", "dbeta")},
                         {n: want[n] for n in ("o", "state", "dq", "dk", "dv", "dbeta")},
                         rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- closed forms


def test_basic_noncausal_is_values_t_keys_times_query():
    x = make_inputs(B=2, T=9, H=3, K=4, V=6, Tq=5)
    o, state = linear_attention(x["q"], x["k"], x["v"], causal=False, output_final_state=True)
    keys, values = x["k"].transpose(1, 2), x["v"].transpose(1, 2)  # [B, H, T, *]
    C = values.mT @ keys  # [B, H, V, K]: the paper's C = Σ v kᵀ
    want = (C[:, :, None] @ x["q"].transpose(1, 2)[..., None]).squeeze(-1)  # [B, H, Tq, V]
    torch.testing.assert_close(o, want.transpose(1, 2), rtol=1e-12, atol=1e-12)
    assert isinstance(state, LinearAttentionState)
    torch.testing.assert_close(state.kv, C.mT, rtol=1e-12, atol=1e-12)


def test_keys_equal_values_give_symmetric_gram_memory():
    """With k = v = h the memory is the paper's C = Σ h hᵀ = HᵀH, symmetric."""
    h = make_inputs(B=2, T=11, H=2, K=6, V=6)["k"]
    for causal in (True, False):
        C = linear_attention(h, h, h, causal=causal, output_final_state=True)[1].kv
        torch.testing.assert_close(C, C.mT, rtol=0, atol=1e-12)
        hh = h.transpose(1, 2)  # [B, H, T, K]
        torch.testing.assert_close(C, hh.mT @ hh, rtol=1e-12, atol=1e-12)
    # Causal: o_t = (Σ_{i≤t} h_i h_iᵀ) h_t, checked with the masked T×T Gram matrix.
    o, _ = linear_attention(h, h, h)
    gram = (hh @ hh.mT).tril()  # [B, H, T, T]
    torch.testing.assert_close(o, (gram @ hh).transpose(1, 2), rtol=1e-12, atol=1e-12)


def test_constant_gates_match_decayed_sum():
    """α_t = a, β_t = b: o_t = b Σ_{i≤t} a^{t-i} (q_t·k_i) v_i, as one T×T matmul."""
    x = make_inputs(B=1, T=40, H=2, K=3, V=5)
    a, b = 0.9, 0.7
    alpha = torch.full((1, 40, 2), a, dtype=F64)
    beta = torch.full((1, 40, 2), b, dtype=F64)
    o, _ = linear_attention(x["q"], x["k"], x["v"], alpha=alpha, beta=beta)
    t = torch.arange(40, dtype=F64)
    decay = (a ** (t[:, None] - t[None, :])).tril()  # [T, T]
    q, k, v = (x[n].transpose(1, 2) for n in "qkv")
    want = b * ((q @ k.mT) * decay) @ v
    torch.testing.assert_close(o, want.transpose(1, 2), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- memory of the backward


def saved_numbers(form, inputs, causal=True):
    """Total numel of everything autograd saves for backward during one training call."""
    args, _ = leaves(inputs)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, state = form(**args, causal=causal)
    (o.sum() + state.kv.sum()).backward()  # the saved tensors do serve a backward
    return sum(sizes)


B_MEM, T_MEM, H_MEM, K_MEM, V_MEM = 1, 256, 2, 32, 32
PER_HEAD_STEP = T_MEM * (K_MEM + V_MEM)  # one T·(K+V) per batch and head
NAIVE = B_MEM * H_MEM * T_MEM * K_MEM * V_MEM  # every C_t
STATE = B_MEM * H_MEM * K_MEM * V_MEM


def memory_inputs(**kw):
    return make_inputs(B=B_MEM, T=T_MEM, H=H_MEM, K=K_MEM, V=V_MEM, dtype=torch.float32, **kw)


def test_saved_numbers_measure_what_a_naive_backward_keeps():
    """The hook sees autograd's saves: through the reference loop they exceed T·K·V."""
    assert saved_numbers(REFERENCE, memory_inputs(gates="gated")) >= NAIVE


def test_basic_backward_saves_order_t_k():
    saved = saved_numbers(PUBLIC, memory_inputs(init=True))
    assert saved <= 2 * B_MEM * H_MEM * PER_HEAD_STEP + STATE
    assert saved * 8 < NAIVE


def test_gated_backward_by_inversion_saves_order_t_k():
    inputs = memory_inputs(gates="gated", init=True, alpha_range=(0.999, 1.0))
    assert choose_state_mode(inputs["alpha"]) == "invert"
    saved = saved_numbers(PUBLIC, inputs)
    assert saved <= B_MEM * H_MEM * (2 * PER_HEAD_STEP + 2 * T_MEM) + STATE
    assert saved * 8 < NAIVE


def test_small_gates_fall_back_to_chunk_checkpoints():
    """Gates below ALPHA_MIN: states kept at chunk starts, O((T/C)·K·V + T·(K+V)), exact."""
    inputs = memory_inputs(gates="gated", init=True, alpha_range=(0.999, 1.0))
    inverted = saved_numbers(PUBLIC, inputs)
    inputs["alpha"][:, 100] = 0.0
    inputs["alpha"][:, 200] = ALPHA_MIN / 2
    assert choose_state_mode(inputs["alpha"]) == "checkpoint"
    saved = saved_numbers(PUBLIC, inputs)
    n_chunks = math.ceil(T_MEM / 64)
    assert saved - inverted >= (n_chunks - 1) * STATE  # the checkpoints are really kept
    assert saved <= B_MEM * H_MEM * (2 * PER_HEAD_STEP + 2 * T_MEM) + n_chunks * STATE
    assert saved * 8 < NAIVE
    small = as_double(inputs)
    assert_all_close(run_with_grads(PUBLIC, small, causal=True),
                     run_with_grads(REFERENCE, small, causal=True), rtol=1e-9, atol=1e-9)


def test_choose_state_mode_follows_the_amplification_rule():
    alpha = torch.full((1, 256, 1), 0.999)
    assert choose_state_mode(alpha, 64) == "invert"  # 1 / 0.999^256 ≈ 1.3
    assert choose_state_mode(torch.full((1, 256, 1), 0.95), 64) == "checkpoint"  # ≈ 5e5
    assert choose_state_mode(torch.full((1, 256, 1), 0.95, dtype=F64), 64) == "invert"  # fp64
    assert choose_state_mode(torch.full((1, 256, 1), 0.9, dtype=F64), 64) == "checkpoint"  # ≈ 5e11
    late = torch.ones(1, 256, 1)
    late[0, 216:] = 0.85  # only the last 40 steps decay, by 1 / 0.85^40 ≈ 670 in all
    assert choose_state_mode(late, 64) == "checkpoint"
    # Growth (α > 1) after decay compensates when inverting back from the end; before it, not.
    mixed = torch.ones(1, 256, 1)
    mixed[0, :8], mixed[0, 64:72] = 0.5, 2.0
    assert choose_state_mode(mixed, 64) == "invert"
    mixed[0, :8], mixed[0, 64:72] = 2.0, 0.5
    assert choose_state_mode(mixed, 64) == "checkpoint"
    alpha[0, 3, 0] = ALPHA_MIN * 0.99
    assert choose_state_mode(alpha, 64) == "checkpoint"
    alpha[0, 4, 0] = 1 / (ALPHA_MIN * 0.99)  # the product is ~1 again; the small gate still counts
    assert choose_state_mode(alpha, 64) == "checkpoint"
    alpha[0, 3, 0] = ALPHA_MIN * 1.01
    alpha[0, 4, 0] = 1 / (ALPHA_MIN * 1.01)
    assert choose_state_mode(alpha, 64) == "invert"


def test_forced_inversion_shows_the_caveat_that_auto_avoids():
    """Inverting through small gates amplifies rounding by 1 / Π α; auto checkpoints instead."""
    inputs = make_inputs(T=64, gates="gated", init=True, dtype=torch.float32,
                         alpha_range=(0.9, 1.0))
    inputs["alpha"][:, 8:16] = 0.05  # 1 / Π α ≈ 3e10 across these steps
    want = run_with_grads(REFERENCE, as_double(inputs), causal=True)

    def error(got):
        return max(((got[n].double() - want[n]).abs().max() / want[n].abs().max()).item()
                   for n in want)

    assert error(run_with_grads(function(16, "invert"), inputs, causal=True)) > 1e-2
    assert error(run_with_grads(function(16, "auto"), inputs, causal=True)) < 1e-5


# ---------------------------------------------------------------- continuation and decoding


def slice_steps(inputs, steps):
    """q, k, v, alpha, beta cut to `steps` ([B, T, ...] -> [B, len(steps), ...])."""
    return {n: None if inputs[n] is None else inputs[n][:, steps]
            for n in ("q", "k", "v", "alpha", "beta")}


@pytest.mark.parametrize("split", [1, 30, 62])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_continuation_from_final_state_equals_whole(split, train):
    x = make_inputs(T=63, gates="gated", init=True)
    if train:
        x = tensors(x, lambda t: t.clone().requires_grad_())
    whole = linear_attention(**x, output_final_state=True)
    first = linear_attention(**slice_steps(x, slice(None, split)),
                             initial_state=x["initial_state"], output_final_state=True)
    rest = linear_attention(**slice_steps(x, slice(split, None)), initial_state=first[1],
                            output_final_state=True)
    torch.testing.assert_close(torch.cat([first[0], rest[0]], dim=1), whole[0],
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(rest[1], whole[1], rtol=1e-10, atol=1e-10)


def test_step_by_step_decoding_equals_one_pass():
    x = make_inputs(T=20, gates="gated", init=True, dtype=torch.float32)
    o, final = linear_attention(**x, output_final_state=True)
    state = x["initial_state"]
    for t in range(20):
        o_t, state = linear_attention_step(x["q"][:, t], x["k"][:, t], x["v"][:, t], state,
                                           x["alpha"][:, t], x["beta"][:, t])
        torch.testing.assert_close(o_t, o[:, t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)
    assert state.kv.shape == (2, 2, 5, 4)  # fixed size after any number of steps


def test_stored_memory_answers_any_number_of_queries():
    x = make_inputs(T=30, Tq=12, gates="gated")
    o, memory = linear_attention(**x, causal=False, output_final_state=True)
    torch.testing.assert_close(linear_attention_read(x["q"], memory), o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(linear_attention_read(x["q"][:, :3], memory), o[:, :3],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_float32(dtype):
    inputs = make_inputs(T=63, K=16, V=16, gates="gated", init=True, dtype=dtype)
    got = run_with_grads(PUBLIC, inputs, causal=True)
    want = run_with_grads(REFERENCE, as_double(inputs), causal=True)
    assert got["o"].dtype == dtype and got["state"].dtype == torch.float32
    for name in want:
        assert got[name].dtype == (torch.float32 if name == "state" else dtype), name
        assert torch.isfinite(got[name]).all(), name
        scale = want[name].abs().max()
        torch.testing.assert_close(got[name].double() / scale, want[name] / scale,
                                   rtol=0, atol=2e-2)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 40), chunk=st.integers(1, 17), data=st.data(),
       gated=st.booleans(), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_property_chunked_matches_reference_and_splits(T, chunk, data, gated, causal, seed):
    """Any length, chunk, split point and gates in [0, 1.2] with some exact zeros."""
    split = data.draw(st.integers(0, T), label="split")
    x = make_inputs(B=1, T=T, H=2, K=3, V=2, gates="gated" if gated else "beta", init=True,
                    seed=seed, alpha_range=(0.0, 1.2))
    if gated:
        x["alpha"][:, :: max(1, T // 3)] = 0.0
    want_o, want_S = linear_attention_reference(**x, causal=causal, output_final_state=True)
    o, S = linear_attention_chunked(**x, causal=causal, output_final_state=True, chunk_size=chunk)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, want_S, rtol=1e-10, atol=1e-10)
    assert_all_close(run_with_grads(function(chunk), x, causal),
                     run_with_grads(REFERENCE, x, causal), rtol=1e-9, atol=1e-9)
    if 0 < split < T:
        first = linear_attention_chunked(**slice_steps(x, slice(None, split)),
                                         initial_state=x["initial_state"],
                                         output_final_state=True, chunk_size=chunk)
        rest = linear_attention_chunked(**slice_steps(x, slice(split, None)),
                                        initial_state=first[1], output_final_state=True,
                                        chunk_size=chunk)
        torch.testing.assert_close(rest[1], want_S, rtol=1e-10, atol=1e-10)
        if causal:
            torch.testing.assert_close(torch.cat([first[0], rest[0]], 1), want_o,
                                       rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- bad input


def _bad(**changes):
    x = make_inputs(T=7, gates="gated", init=True)
    x.update(changes)
    return x


BAD_INPUTS = {
    "q_rank": (_bad(q=torch.zeros(2, 7, 5)), "q"),
    "k_dim": (_bad(k=torch.zeros(2, 7, 2, 6, dtype=F64)), "k"),
    "k_heads": (_bad(k=torch.zeros(2, 7, 3, 5, dtype=F64)), "k"),
    "v_length": (_bad(v=torch.zeros(2, 8, 2, 4, dtype=F64)), "v"),
    "v_dtype": (_bad(v=torch.zeros(2, 7, 2, 4, dtype=torch.float32)), "v"),
    "q_causal_length": (_bad(q=torch.zeros(2, 6, 2, 5, dtype=F64)), "q"),
    "alpha_rank": (_bad(alpha=torch.ones(2, 7, dtype=F64)), "alpha"),
    "alpha_length": (_bad(alpha=torch.ones(2, 6, 2, dtype=F64)), "alpha"),
    "beta_heads": (_bad(beta=torch.ones(2, 7, 3, dtype=F64)), "beta"),
    "state_tensor": (_bad(initial_state=torch.zeros(2, 2, 5, 4, dtype=F64)), "initial_state"),
    "state_rank": (_bad(initial_state=LinearAttentionState(torch.zeros(2, 2, 5, dtype=F64))),
                   r"initial_state\.kv"),
    "state_swapped": (_bad(initial_state=LinearAttentionState(torch.zeros(2, 2, 4, 5, dtype=F64))),
                      r"initial_state\.kv"),
}


@pytest.mark.parametrize("form", [linear_attention, linear_attention_reference,
                                  linear_attention_recurrent, linear_attention_chunked,
                                  linear_attention_autograd],
                         ids=["public", "reference", "recurrent", "chunked", "function"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_shapes_raise_shape_error_naming_the_argument(case, form):
    inputs, name = BAD_INPUTS[case]
    with pytest.raises(ShapeError, match=rf"^{name}:") as info:
        form(**inputs)
    assert isinstance(info.value, ValueError)


def test_negative_gates_and_bad_options_are_refused():
    x = _bad()
    x["alpha"][0, 3, 1] = -0.5
    with pytest.raises(ShapeError, match="^alpha:"):
        linear_attention(**x)
    with pytest.raises(ConfigError, match="^chunk_size:"):
        linear_attention_chunked(**_bad(), chunk_size=0)
    with pytest.raises(ConfigError, match="^state_mode:"):
        linear_attention_autograd(**_bad(), state_mode="store")


def test_step_checks_its_state():
    x = make_inputs(T=1)
    with pytest.raises(ShapeError, match="^state: expected a LinearAttentionState"):
        linear_attention_step(x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], torch.zeros(2, 2, 5, 4))
    with pytest.raises(ShapeError, match=r"^state\.kv:"):
        linear_attention_step(x["q"][:, 0], x["k"][:, 0], x["v"][:, 0],
                              LinearAttentionState(torch.zeros(2, 2, 4, 5)))
    with pytest.raises(ShapeError, match="^alpha_t:"):
        linear_attention_step(x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], None, torch.ones(2, 3))


def test_a_gate_that_is_not_a_number_is_not_read_as_a_reset():
    """A NaN α gives NaN from its step on in the chunked form, as in the reference, and the
    outputs before it are the reference's; α = 0 (a true reset) stays finite."""
    from memattn.ops.linear.chunked import linear_attention_chunked
    from memattn.ops.linear.reference import linear_attention_reference

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 40, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    alpha = torch.rand(1, 40, 2, generator=g, dtype=torch.float64)
    alpha[0, 20, 0] = float("nan")
    got, _ = linear_attention_chunked(q, k, v, alpha=alpha)
    want, _ = linear_attention_reference(q, k, v, alpha=alpha)
    assert torch.isnan(got[0, 20:, 0]).all() and torch.isnan(want[0, 20:, 0]).all()
    torch.testing.assert_close(got[:, :20], want[:, :20])
    torch.testing.assert_close(got[:, :, 1], want[:, :, 1])
    alpha[0, 20, 0] = 0.0
    assert torch.isfinite(linear_attention_chunked(q, k, v, alpha=alpha)[0]).all()


def test_a_non_finite_key_spoils_nothing_before_it():
    from memattn.ops import linear_attention
    from memattn.ops.linear.reference import linear_attention_reference

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 150, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 131, 0, 2] = float("nan")
    got, _ = linear_attention(q, k, v)
    want, _ = linear_attention_reference(q, k, v)
    torch.testing.assert_close(got[:, :131], want[:, :131])
    assert torch.isfinite(got[:, :131]).all() and torch.isnan(got[0, 131:, 0]).all()
