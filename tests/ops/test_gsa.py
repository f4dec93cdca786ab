"""memattn.ops.gsa: gated_slot_attention, its three forms and its decoding step.

Every fast form is held to the reference (reference.py, the recurrence as written) in
float64 — outputs, final states and every gradient — or to closed forms written out here.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import memattn.ops.gsa.chunked as chunked_module
from memattn.errors import ConfigError, ShapeError
from memattn.ops import gated_slot_attention
from memattn.ops.gsa import (GSAState, gated_slot_attention_step, gsa_chunked, gsa_memory,
                             gsa_recurrent, gsa_reference)

F64 = {"atol": 1e-10, "rtol": 1e-10}


def inputs(B=2, T=7, H=2, K=5, V=3, M=4, *, Tq=None, dtype=torch.float64, seed=0, grad=False,
           gate_scale=3.0):
    """Random q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V] and log forget gates
    g = log σ(z) [B, T, H, M] (from near 0 to below -10 with gate_scale 3)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64)
               for shape in ((B, Tq or T, H, K), (B, T, H, K), (B, T, H, V)))
    z = gate_scale * torch.randn(B, T, H, M, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(z)
    return [x.to(dtype).requires_grad_(grad) for x in (q, k, v, g)]


def gsa_state(B=2, H=2, K=5, V=3, M=4, *, seed=1, grad=False):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, H, M, D, generator=gen, dtype=torch.float64) for D in (K, V))
    return GSAState(k.requires_grad_(grad), v.requires_grad_(grad))


def run_with_grads(fn, q, k, v, g, state, **kw):
    """Outputs, final state and the gradients (q, k, v, g, the state's tensors) of a fixed
    random functional of both."""
    o, final = fn(q, k, v, g, initial_state=state, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    for t in final:
        loss = loss + (t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum()
    grads = torch.autograd.grad(loss, [q, k, v, g, *(state or ())])
    return o.detach(), [t.detach() for t in final], grads


def assert_same(got, want, **tol):
    for a, b in zip((got[0], *got[1], *got[2]), (want[0], *want[1], *want[2]), strict=True):
        torch.testing.assert_close(a, b, **tol)


FORMS = {
    "recurrent": gsa_recurrent,
    "chunked16": gsa_chunked,
    "chunked5": functools.partial(gsa_chunked, chunk_size=5),
    "chunked64": functools.partial(gsa_chunked, chunk_size=64),
    "auto": gated_slot_attention,
}


# --------------------------------------------------------------------------------------
# Three forms, one answer
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 7, 63])
def test_forms_match_reference_with_gradients(T, with_state):
    q, k, v, g = inputs(T=T, grad=True)
    state = gsa_state(grad=True) if with_state else None
    want = run_with_grads(gsa_reference, q, k, v, g, state)
    for name, form in FORMS.items():
        assert_same(run_with_grads(form, q, k, v, g, state), want, **F64), name


@pytest.mark.parametrize("with_state", [False, True])
def test_not_causal_reads_the_memory_of_the_whole_sequence(with_state):
    q, k, v, g = inputs(T=63, Tq=10, grad=True)
    state = gsa_state(grad=True) if with_state else None
    want = run_with_grads(gsa_reference, q, k, v, g, state, causal=False)
    for form in (gsa_chunked, gated_slot_attention):
        assert_same(run_with_grads(form, q, k, v, g, state, causal=False), want, **F64)


@pytest.mark.parametrize("gate_scale,paths", [(0.3, {"factored"}), (10.0, {"factored", "exact"}),
                                              (30.0, {"exact"})])
def test_factored_and_exact_chunks_both_match_reference(gate_scale, paths, monkeypatch):
    """A group of chunks whose gates sum to at least -FACTORED_RANGE takes the factored
    matmuls, any other the exact weights; mild, mixed and strong gates, groups of 2 chunks,
    each way against the reference with every gradient."""
    monkeypatch.setattr(chunked_module, "GROUP_ELEMENTS", 2 * 2 * 2 * 8 * 8 * 4)
    taken = []
    for name in ("_chunk_group", "_chunk_group_factored"):
        real = getattr(chunked_module, name)
        monkeypatch.setattr(chunked_module, name, functools.partial(
            lambda real, name, *a: taken.append(name) or real(*a), real, name))
    q, k, v, g = inputs(T=63, grad=True, gate_scale=gate_scale, seed=3)
    state = gsa_state(grad=True)
    want = run_with_grads(gsa_reference, q, k, v, g, state)
    assert_same(run_with_grads(functools.partial(gsa_chunked, chunk_size=8), q, k, v, g, state), want, **F64)
    assert {"factored" if n.endswith("factored") else "exact" for n in taken} == paths


def test_chunks_computed_in_groups_match_reference(monkeypatch):
    """A long sequence computes its chunks in groups (the [C, C, M] weights of a group stay
    under GROUP_ELEMENTS): groups of 2 chunks here, the memory carried between them."""
    monkeypatch.setattr(chunked_module, "GROUP_ELEMENTS", 2 * 2 * 2 * 8 * 8 * 4)
    q, k, v, g = inputs(T=63, grad=True)
    state = gsa_state(grad=True)
    want = run_with_grads(gsa_reference, q, k, v, g, state)
    assert_same(run_with_grads(functools.partial(gsa_chunked, chunk_size=8), q, k, v, g, state), want, **F64)


@pytest.mark.parametrize("mode", ["auto", "chunked", "recurrent", "reference"])
def test_two_tokens_by_hand(mode):
    """K = V = 1, M = 2, scale 1: the memories after each token and the reads, written out."""
    k = torch.tensor([2.0, -1.0], dtype=torch.float64).view(1, 2, 1, 1)
    v = torch.tensor([1.0, 3.0], dtype=torch.float64).view(1, 2, 1, 1)
    q = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    alpha = torch.tensor([[0.5, 0.9], [0.25, 0.1]], dtype=torch.float64)  # [t, slot]
    g = alpha.log().view(1, 2, 1, 2)
    # slot 0: K̃ = 0.5·2 = 1, then 0.25·1 + 0.75·(-1) = -0.5; Ṽ = 0.5, then 0.25·0.5 + 0.75·3 = 2.375
    # slot 1: K̃ = 0.1·2 = 0.2, then 0.1·0.2 + 0.9·(-1) = -0.88; Ṽ = 0.1, then 0.01 + 2.7 = 2.71
    p1 = 1 / (1 + math.exp(0.2 - 1.0))  # softmax([1, 0.2])[0]
    p2 = 1 / (1 + math.exp(-0.88 + 0.5))  # softmax([-0.5, -0.88])[0]
    want = torch.tensor([p1 * 0.5 + (1 - p1) * 0.1, p2 * 2.375 + (1 - p2) * 2.71], dtype=torch.float64)
    o, state = gated_slot_attention(q, k, v, g, scale=1.0, mode=mode, output_final_state=True)
    torch.testing.assert_close(o.flatten(), want, **F64)
    torch.testing.assert_close(state.k.flatten(), torch.tensor([-0.5, -0.88], dtype=torch.float64), **F64)
    torch.testing.assert_close(state.v.flatten(), torch.tensor([2.375, 2.71], dtype=torch.float64), **F64)
    if mode != "recurrent":  # not causal: both queries read the memory after token 2
        o, _ = gated_slot_attention(q, k, v, g, scale=1.0, mode=mode, causal=False)
        torch.testing.assert_close(o.flatten(), torch.full((2,), float(want[1]), dtype=torch.float64), **F64)


def test_closed_form_of_constant_gates_and_tokens():
    """α and k constant (per slot): K̃_t = (1 - α^t) k, Ṽ_t = (1 - α^t) v; with an initial
    state the old memory keeps α^t of itself."""
    T, M = 50, 3
    alpha = torch.tensor([0.99, 0.5, 1e-3], dtype=torch.float64)
    k, v, q = (torch.randn(1, 1, 1, D, dtype=torch.float64).expand(1, T, 1, D) for D in (4, 2, 4))
    g = alpha.log().expand(1, T, 1, M)
    state = gsa_state(B=1, H=1, K=4, V=2, M=M)
    keep = alpha[:, None] ** torch.arange(1, T + 1, dtype=torch.float64)  # [M, T], α^t
    end = keep[:, -1:]  # [M, 1], α^T
    for form in (gsa_chunked, gsa_recurrent, gsa_reference):
        o, final = form(q, k, v, g, initial_state=state, output_final_state=True)
        torch.testing.assert_close(final.k[0, 0], end * state.k[0, 0] + (1 - end) * k[0, 0, 0], **F64)
        torch.testing.assert_close(final.v[0, 0], end * state.v[0, 0] + (1 - end) * v[0, 0, 0], **F64)
        o, _ = form(q, k, v, g)
        mem_k = (1 - keep.T)[:, :, None] * k[0, 0, 0]  # [T, M, K]
        mem_v = (1 - keep.T)[:, :, None] * v[0, 0, 0]
        p = torch.softmax((mem_k @ q[0, 0, 0]) / 2.0, dim=-1)  # [T, M], scale 4^-0.5
        torch.testing.assert_close(o[0, :, 0], (p[:, :, None] * mem_v).sum(1), **F64)


def test_a_gate_of_one_writes_nothing_and_a_gate_of_zero_replaces():
    """α = 1 (g = 0, padding) leaves the memory as it is; α → 0 (g far below the floor)
    replaces it with the token, in every form, with finite gradients."""
    q, k, v, g = inputs(T=20, grad=True)
    g = g.detach().clone()
    g[:, 5:9] = 0.0  # tokens 5..8 write nothing
    g[:, 12] = -1e6  # token 12 replaces every slot
    g.requires_grad_()
    want = run_with_grads(gsa_reference, q, k, v, g, None)
    for name, form in FORMS.items():
        got = run_with_grads(form, q, k, v, g, None)
        assert_same(got, want, **F64), name
        assert all(t.isfinite().all() for t in got[2])
    _, before = gsa_reference(q[:, :5], k[:, :5], v[:, :5], g[:, :5], output_final_state=True)
    _, after = gsa_reference(q[:, :9], k[:, :9], v[:, :9], g[:, :9], output_final_state=True)
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, **F64)
    o, st = gsa_chunked(q[:, :13], k[:, :13], v[:, :13], g[:, :13], output_final_state=True)
    torch.testing.assert_close(st.k, k[:, 12, :, None, :].expand_as(st.k), **F64)


@pytest.mark.parametrize("split", [1, 37, 64])
def test_split_sequence_continues(split):
    q, k, v, g = inputs(T=100)
    o_all, st_all = gsa_reference(q, k, v, g, output_final_state=True)
    o_a, st_a = gated_slot_attention(q[:, :split], k[:, :split], v[:, :split], g[:, :split],
                                     output_final_state=True)
    o_b, st_b = gated_slot_attention(q[:, split:], k[:, split:], v[:, split:], g[:, split:],
                                     initial_state=st_a, output_final_state=True)
    torch.testing.assert_close(torch.cat([o_a, o_b], dim=1), o_all, **F64)
    for a, b in zip(st_b, st_all, strict=True):
        torch.testing.assert_close(a, b, **F64)


def test_not_causal_with_state_reads_prefix_and_sequence():
    q, k, v, g = inputs(T=12, Tq=4)
    _, prefix = gated_slot_attention(k[:, :5], k[:, :5], v[:, :5], g[:, :5], output_final_state=True)
    want, st_want = gsa_reference(q, k, v, g, causal=False, output_final_state=True)
    got, st_got = gated_slot_attention(q, k[:, 5:], v[:, 5:], g[:, 5:], causal=False,
                                       initial_state=prefix, output_final_state=True)
    torch.testing.assert_close(got, want, **F64)
    for a, b in zip(st_got, st_want, strict=True):
        torch.testing.assert_close(a, b, **F64)
    mem = gsa_memory(k, v, g)  # the memory without queries: the same state
    for a, b in zip(mem, st_want, strict=True):
        torch.testing.assert_close(a, b, **F64)


def test_token_by_token_decoding_equals_one_pass():
    q, k, v, g = inputs(T=20)
    want, st_want = gsa_reference(q, k, v, g, output_final_state=True)
    state = None
    for t in range(20):
        sl = slice(t, t + 1)
        o_t, state = gated_slot_attention(q[:, sl], k[:, sl], v[:, sl], g[:, sl],
                                          initial_state=state, output_final_state=True)
        torch.testing.assert_close(o_t, want[:, sl], **F64)
    assert [tuple(t.shape) for t in state] == [(2, 2, 4, 5), (2, 2, 4, 3)]  # never grows
    for a, b in zip(state, st_want, strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("inplace", [False, True])
def test_step_matches_reference(inplace):
    q, k, v, g = inputs(T=9)
    want, st_want = gsa_reference(q, k, v, g, output_final_state=True)
    state = GSAState.empty(2, 2, 4, 5, 3, dtype=torch.float64)
    given = list(state)
    for t in range(9):
        o_t, state = gated_slot_attention_step(q[:, t], k[:, t], v[:, t], g[:, t], state, inplace=inplace)
        torch.testing.assert_close(o_t, want[:, t], **F64)
    assert all(a is b for a, b in zip(state, given)) == inplace
    for a, b in zip(state, st_want, strict=True):
        torch.testing.assert_close(a, b, **F64)


def test_empty_state_equals_no_state():
    q, k, v, g = inputs(T=40)
    empty = GSAState.empty(2, 2, 4, 5, 3, dtype=torch.float64)
    want, st_want = gsa_reference(q, k, v, g, output_final_state=True)
    for form in (gsa_chunked, gsa_recurrent, gsa_reference):
        o, st = form(q, k, v, g, initial_state=empty, output_final_state=True)
        torch.testing.assert_close(o, want, **F64)
        for a, b in zip(st, st_want, strict=True):
            torch.testing.assert_close(a, b, **F64)


# --------------------------------------------------------------------------------------
# Precision and long streams
# --------------------------------------------------------------------------------------

def test_float32_with_mixed_gates_is_close_to_float64_reference():
    """Gates near 1, near 0 and below the floor side by side in the same chunks."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, _ = inputs(T=300, M=6, seed=7)
    levels = torch.tensor([-1e-6, -1e-3, -0.1, -1.0, -5.0, -30.0, -2000.0], dtype=torch.float64)
    g = levels[torch.randint(0, len(levels), (2, 300, 2, 6), generator=gen)]
    state = gsa_state(M=6, seed=8)
    want, st_want = gsa_reference(q, k, v, g, initial_state=state, output_final_state=True)
    for mode in ("chunked", "recurrent"):
        o, st = gated_slot_attention(q.float(), k.float(), v.float(), g.float(), mode=mode,
                                     initial_state=GSAState(*(t.float() for t in state)),
                                     output_final_state=True)
        assert o.dtype == torch.float32 and all(t.dtype == torch.float32 for t in st)
        torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
        for a, b in zip(st, st_want, strict=True):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_computed_in_float32(dtype):
    """The states carry float32 accuracy on the rounded inputs; o is rounded to q's dtype."""
    q, k, v, g = (x.to(dtype) for x in inputs(T=80, seed=6))
    want, st_want = gsa_reference(*(x.double() for x in (q, k, v, g)), output_final_state=True)
    for mode in ("chunked", "recurrent"):
        o, st = gated_slot_attention(q, k, v, g, mode=mode, output_final_state=True)
        assert o.dtype == dtype and all(t.dtype == torch.float32 for t in st)
        for a, b in zip(st, st_want, strict=True):
            torch.testing.assert_close(a.double(), b, atol=2e-6, rtol=2e-6)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(o.double(), want, atol=2 * eps, rtol=eps)


def test_a_million_tokens_stay_finite_and_on_the_closed_form():
    """Constant k, v, q and constant gates per slot, from near 1 (α = 1 - 1e-7) to near 0
    (α = e^-30): K̃_t = (1 - α^t) k. The chunked form streams 1,000,000 tokens in 10 calls,
    the recurrent form 50,000 in 2 (a Python step a token: a million would take a minute);
    the float32 state stays finite and within 1e-3 of the closed form (float32 cannot move a
    state nearer its target than about half an ulp over 1 - α^C per update), and each call's
    last output is the closed form's read."""
    gates = torch.tensor([-1e-7, -1e-6, -1e-5, -1e-3, -0.5, -30.0])
    M = len(gates)
    kq, vq = torch.tensor([0.7, -0.2]), torch.tensor([-1.3, 0.4])

    def stream(mode, calls, T):
        k, q = kq.view(1, 1, 1, 2).expand(1, T, 1, 2), kq.flip(0).view(1, 1, 1, 2).expand(1, T, 1, 2)
        v, g = vq.view(1, 1, 1, 2).expand(1, T, 1, 2), gates.view(1, 1, 1, M).expand(1, T, 1, M)
        state, n = None, 0
        with torch.no_grad():
            for _ in range(calls):
                o, state = gated_slot_attention(q, k, v, g, initial_state=state, mode=mode,
                                                output_final_state=True)
                n += T
                fill = -torch.expm1(n * gates.double())  # 1 - α^n, [M]
                assert all(t.isfinite().all() for t in state)
                for got, token in ((state.k, kq), (state.v, vq)):
                    torch.testing.assert_close(got[0, 0].double(), fill[:, None] * token.double(),
                                               atol=1e-6, rtol=1e-3)
                p = torch.softmax(fill * (kq.double() @ kq.flip(0).double()) / math.sqrt(2), dim=0)
                torch.testing.assert_close(o[0, -1, 0].double(), (p * fill) @ vq.double()[None].expand(M, 2),
                                           atol=1e-6, rtol=1e-3)

    stream("chunked", 10, 100_000)
    stream("recurrent", 2, 25_000)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_a_non_finite_input_spoils_nothing_before_it(where):
    """The chunked form mixes a chunk's steps; with a NaN at step t the op goes step by step,
    so every output before t is the reference's."""
    q, k, v, g = inputs(T=70)
    {"q": q, "k": k, "v": v}[where][0, 50, 1, 0] = float("nan")
    got, _ = gated_slot_attention(q, k, v, g)
    want, _ = gsa_reference(q, k, v, g)
    torch.testing.assert_close(got[:, :50], want[:, :50], **F64)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------

def _bad_shapes():
    q, k, v, g = inputs(T=6)
    good = {"q": q, "k": k, "v": v, "g": g}
    return [
        ("q", dict(good, q=q[0])),
        ("k", dict(good, k=k[:1])),
        ("k", dict(good, k=k[..., :4])),
        ("v", dict(good, v=v[:, :5])),
        ("g", dict(good, g=g[:, :, :1])),
        ("g", dict(good, g=g[..., :0])),
        ("q", dict(good, q=q[:, :4])),  # causal needs Tq = T
        ("initial_state.k", dict(good, initial_state=gsa_state(M=3))),
        ("initial_state.v", dict(good, initial_state=gsa_state(V=2))),
        ("initial_state", dict(good, initial_state=(torch.zeros(2, 2, 4, 5),))),
    ]


@pytest.mark.parametrize("mode", ["auto", "chunked", "recurrent", "reference"])
def test_bad_shapes_name_the_argument(mode):
    for name, kw in _bad_shapes():
        with pytest.raises(ShapeError, match=rf"^{name}: expected"):
            gated_slot_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), mode=mode, **kw)


@pytest.mark.parametrize("value", [0.5, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", ["auto", "chunked", "recurrent", "reference"])
def test_bad_gates_name_g(mode, value):
    q, k, v, g = inputs(T=6)
    g[1, 3, 0, 2] = value
    with pytest.raises(ShapeError, match=r"^g: expected finite log forget gates ≤ 0"):
        gated_slot_attention(q, k, v, g, mode=mode)
    with pytest.raises(ShapeError, match=r"^g: expected finite log forget gates ≤ 0"):  # one decoding step
        gated_slot_attention(q[:, 3:4], k[:, 3:4], v[:, 3:4], g[:, 3:4], mode=mode,
                             initial_state=gsa_state())
    if mode != "recurrent":
        with pytest.raises(ShapeError, match=r"^g: expected finite log forget gates ≤ 0"):
            gated_slot_attention(q, k, v, g, causal=False, mode=mode)


def test_bad_options():
    q, k, v, g = inputs(T=3)
    with pytest.raises(ConfigError, match=r"^backend: 'triton' runs the causal chunked form"):
        gated_slot_attention(q, k, v, g, causal=False, backend="triton")
    with pytest.raises(ConfigError, match=r"^backend: expected one of auto, torch"):
        gated_slot_attention(q, k, v, g, backend="cuda")
    with pytest.raises(ConfigError, match=r"^mode: expected one of"):
        gated_slot_attention(q, k, v, g, mode="fast")
    with pytest.raises(ConfigError, match=r"^mode: 'recurrent' is a causal form"):
        gated_slot_attention(q, k, v, g, causal=False, mode="recurrent")
    for size in (0, 2.0, True):
        with pytest.raises(ConfigError, match=r"^chunk_size: expected a positive integer"):
            gsa_chunked(q, k, v, g, chunk_size=size)
    with pytest.raises(ShapeError, match=r"^g: expected \[B, H, M\] with dim 1"):
        gated_slot_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0, :1])
    with pytest.raises(ShapeError, match=r"^state.k: expected"):
        gated_slot_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], gsa_state(K=2))
    strided = GSAState(torch.zeros(2, 2, 5, 4, dtype=torch.float64).transpose(-1, -2), gsa_state().v)
    with pytest.raises(ShapeError, match=r"^state.k: inplace=True"):
        gated_slot_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], strided, inplace=True)
