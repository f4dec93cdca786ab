"""memattn.ops.abc: abc_attention / bounded_memory_attention, their three forms and steps.

Every fast form is held to the reference (reference.py, the equations as written) or to a
closed form written out here: outputs, final states and gradients.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memattn.errors import ConfigError, ShapeError
from memattn.ops.abc import (
    ABCState,
    BoundedMemoryState,
    abc_attention,
    abc_attention_step,
    abc_chunked,
    abc_recurrent,
    abc_reference,
    bounded_memory_attention,
    bounded_memory_attention_step,
    bounded_memory_chunked,
    bounded_memory_recurrent,
    bounded_memory_reference,
)
from memattn.ops.abc.recurrent import memory_step_

F64 = {"atol": 1e-9, "rtol": 1e-9}


def inputs(B=2, T=7, H=2, K=5, V=3, M=4, *, Tq=None, dtype=torch.float64, s_scale=1.0,
           seed=0, grad=False):
    """Random q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V], s [B, T, H, M]."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Tq or T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, M)]
    q, k, v, s = (torch.randn(*sh, generator=g, dtype=torch.float64) for sh in shapes)
    out = [q, k, v, s * s_scale]
    return [x.to(dtype).requires_grad_(grad) for x in out]


def abc_state(B=2, H=2, K=5, V=3, M=4, *, seed=1, grad=False, log_z_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    state = ABCState(torch.randn(B, H, M, generator=g, dtype=torch.float64) * log_z_scale,
                     torch.randn(B, H, M, K, generator=g, dtype=torch.float64),
                     torch.randn(B, H, M, V, generator=g, dtype=torch.float64))
    return ABCState(*(t.requires_grad_(grad) for t in state))


def bounded_state(B=2, H=2, K=5, V=3, M=4, *, seed=1, grad=False):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, H, M, D, generator=g, dtype=torch.float64) for D in (K, V))
    return BoundedMemoryState(k.requires_grad_(grad), v.requires_grad_(grad))


def run_with_grads(fn, q, k, v, w, state, **kw):
    """Outputs, final state and the gradients of a fixed random functional of both (its
    weights drawn in float64, so that runs in different dtypes share it)."""
    o, final = fn(q, k, v, w, initial_state=state, output_final_state=True, **kw)
    g = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum()
    for t in final:
        loss = loss + (t * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)).sum()
    leaves = [q, k, v, w, *(state or ())]
    grads = torch.autograd.grad(loss, leaves)
    return o.detach(), [t.detach() for t in final], grads


def assert_same(got, want, **tol):
    o, st_, gr = got
    o_ref, st_ref, gr_ref = want
    torch.testing.assert_close(o, o_ref, **tol)
    for a, b in zip(st_, st_ref, strict=True):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(gr, gr_ref, strict=True):
        torch.testing.assert_close(a, b, **tol)


ABC_FORMS = {
    "recurrent": abc_recurrent,
    "chunked64": abc_chunked,
    "chunked16": functools.partial(abc_chunked, chunk_size=16),
    "chunked4": functools.partial(abc_chunked, chunk_size=4),
}
BOUNDED_FORMS = {
    "recurrent": bounded_memory_recurrent,
    "chunked64": bounded_memory_chunked,
    "chunked16": functools.partial(bounded_memory_chunked, chunk_size=16),
}


# --------------------------------------------------------------------------------------
# Three forms, one answer
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 7, 63, 130])
def test_abc_forms_match_reference(T, with_state):
    q, k, v, s = inputs(T=T, s_scale=2.0, grad=True)
    state = abc_state(grad=True) if with_state else None
    want = run_with_grads(abc_reference, q, k, v, s, state)
    for name, form in ABC_FORMS.items():
        assert_same(run_with_grads(form, q, k, v, s, state), want, **F64), name


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 7, 63, 130])
def test_bounded_forms_match_reference(T, with_state):
    q, k, v, s = inputs(T=T, seed=2)
    phi = torch.rand_like(s).requires_grad_()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    state = bounded_state(grad=True) if with_state else None
    want = run_with_grads(bounded_memory_reference, q, k, v, phi, state)
    for name, form in BOUNDED_FORMS.items():
        assert_same(run_with_grads(form, q, k, v, phi, state), want, **F64), name


@pytest.mark.parametrize("split", [1, 37, 64, 99])
def test_abc_split_sequence_continues(split):
    q, k, v, s = inputs(T=100, s_scale=3.0)
    o_all, st_all = abc_attention(q, k, v, s, output_final_state=True)
    o_a, st_a = abc_attention(q[:, :split], k[:, :split], v[:, :split], s[:, :split],
                              output_final_state=True)
    o_b, st_b = abc_attention(q[:, split:], k[:, split:], v[:, split:], s[:, split:],
                              initial_state=st_a, output_final_state=True)
    torch.testing.assert_close(torch.cat([o_a, o_b], dim=1), o_all, **F64)
    for a, b in zip(st_b, st_all, strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("split", [1, 50])
def test_bounded_split_sequence_continues(split):
    q, k, v, s = inputs(T=90, seed=3)
    phi = s.exp()
    o_all, st_all = bounded_memory_attention(q, k, v, phi, output_final_state=True)
    o_a, st_a = bounded_memory_attention(q[:, :split], k[:, :split], v[:, :split],
                                         phi[:, :split], output_final_state=True)
    o_b, st_b = bounded_memory_attention(q[:, split:], k[:, split:], v[:, split:],
                                         phi[:, split:], initial_state=st_a,
                                         output_final_state=True)
    torch.testing.assert_close(torch.cat([o_a, o_b], dim=1), o_all, **F64)
    for a, b in zip(st_b, st_all, strict=True):
        torch.testing.assert_close(a, b, **F64)


def test_token_by_token_decoding_equals_one_pass():
    q, k, v, s = inputs(T=20, s_scale=3.0)
    phi = s.exp()
    o_abc, _ = abc_attention(q, k, v, s)
    o_bm, _ = bounded_memory_attention(q, k, v, phi)
    state_abc = state_bm = None
    for t in range(20):
        sl = slice(t, t + 1)
        o_t, state_abc = abc_attention(q[:, sl], k[:, sl], v[:, sl], s[:, sl],
                                       initial_state=state_abc, output_final_state=True)
        torch.testing.assert_close(o_t, o_abc[:, sl], **F64)
        o_t, state_bm = bounded_memory_attention(q[:, sl], k[:, sl], v[:, sl], phi[:, sl],
                                                 initial_state=state_bm, output_final_state=True)
        torch.testing.assert_close(o_t, o_bm[:, sl], **F64)
    # The decoding state never grows.
    assert [tuple(t.shape) for t in state_abc] == [(2, 2, 4), (2, 2, 4, 5), (2, 2, 4, 3)]
    assert [tuple(t.shape) for t in state_bm] == [(2, 2, 4, 5), (2, 2, 4, 3)]


def test_step_functions_match_reference():
    q, k, v, s = inputs(T=9, s_scale=2.0)
    phi = s.exp()
    forms = [(abc_attention_step, abc_reference, s, ABCState),
             (bounded_memory_attention_step, bounded_memory_reference, phi, BoundedMemoryState)]
    for step, reference, w, state_type in forms:
        o_ref, st_ref = reference(q, k, v, w, output_final_state=True)
        state = None
        for t in range(9):
            o_t, state = step(q[:, t], k[:, t], v[:, t], w[:, t], state)
            torch.testing.assert_close(o_t, o_ref[:, t], **F64)
        for a, b in zip(state, st_ref, strict=True):
            torch.testing.assert_close(a, b, **F64)
        # the unchecked in-place step of the layers, on the same tokens
        state = state_type.empty(2, 2, 4, 5, 3, dtype=torch.float64)
        given = list(state)
        for t in range(9):
            torch.testing.assert_close(memory_step_(q[:, t], k[:, t], v[:, t], w[:, t], state),
                                       o_ref[:, t], **F64)
        assert all(a is b for a, b in zip(state, given))
        for a, b in zip(state, st_ref, strict=True):
            torch.testing.assert_close(a, b, **F64)


def by_hand(q, k, v, w, *, normalise: bool):
    """Causal ABC, one query at a time in plain sums: slot j at step t holds
    Σ_{i≤t} α_ij k_i (/ Σ_{i≤t} α_ij when normalise), α = w; the query reads
    softmax_j(K̃_j · q / √K) Ṽ_j. Independent of the package's forms."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        a = w[:, :t + 1].double()  # [B, t+1, H, M]
        mem_k = torch.einsum("bihm,bihk->bhmk", a, k[:, :t + 1].double())
        mem_v = torch.einsum("bihm,bihv->bhmv", a, v[:, :t + 1].double())
        if normalise:
            z = a.sum(1)[..., None]  # [B, H, M, 1]
            mem_k, mem_v = mem_k / z, mem_v / z
        p = torch.softmax(torch.einsum("bhmk,bhk->bhm", mem_k, q[:, t].double()) / math.sqrt(K), -1)
        o[:, t] = torch.einsum("bhm,bhmv->bhv", p, mem_v)
    return o


def test_empty_state_equals_no_state():
    q, k, v, s = inputs(T=70, grad=True)
    empty = ABCState.empty(2, 2, 4, 5, 3, dtype=torch.float64)
    want = by_hand(q.detach(), k.detach(), v.detach(), s.detach().exp(), normalise=True)
    for form in (abc_chunked, abc_recurrent, abc_reference):
        o1, st1 = form(q, k, v, s, output_final_state=True)
        o2, st2 = form(q, k, v, s, initial_state=empty, output_final_state=True)
        torch.testing.assert_close(o1, want, **F64)
        torch.testing.assert_close(o2, want, **F64)
        for a, b in zip(st1, st2, strict=True):
            torch.testing.assert_close(a, b, **F64)
        grads = torch.autograd.grad(o2.sum(), [q, k, v, s])
        assert all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize("mode", ["auto", "chunked", "recurrent", "reference"])
def test_modes_agree(mode):
    """Every mode, the reference included, against the sums written out by hand."""
    q, k, v, s = inputs(T=11)
    got, state = abc_attention(q, k, v, s, mode=mode)
    assert state is None
    torch.testing.assert_close(got, by_hand(q, k, v, s.exp(), normalise=True), **F64)
    got, _ = bounded_memory_attention(q, k, v, s.exp(), mode=mode)
    torch.testing.assert_close(got, by_hand(q, k, v, s.exp(), normalise=False), **F64)


# --------------------------------------------------------------------------------------
# Closed forms written out by hand
# --------------------------------------------------------------------------------------

def _read(q, mem_k, mem_v, scale):
    """q [B, Tq, H, K], mem_k [B, H, M, K], mem_v [B, H, M, V] -> [B, Tq, H, V]."""
    p = torch.softmax(scale * torch.einsum("bqhk,bhmk->bqhm", q, mem_k), dim=-1)
    return torch.einsum("bqhm,bhmv->bqhv", p, mem_v)


def test_noncausal_cross_attention_closed_form():
    q, k, v, s = inputs(T=9, Tq=5, s_scale=3.0)
    phi = s.exp() / s.exp().sum(1, keepdim=True)  # α_i / Σ_j α_j over the whole sequence
    mem_k = torch.einsum("bthm,bthk->bhmk", phi, k)
    mem_v = torch.einsum("bthm,bthv->bhmv", phi, v)
    want = _read(q, mem_k, mem_v, 0.5)
    for mode in ("auto", "reference"):
        o, st_ = abc_attention(q, k, v, s, causal=False, scale=0.5, mode=mode,
                               output_final_state=True)
        torch.testing.assert_close(o, want, **F64)
        torch.testing.assert_close(st_.k, mem_k, **F64)
        torch.testing.assert_close(st_.log_z, torch.logsumexp(s, dim=1), **F64)
    w = s.abs()
    mem_k = torch.einsum("bthm,bthk->bhmk", w, k)
    mem_v = torch.einsum("bthm,bthv->bhmv", w, v)
    want = _read(q, mem_k, mem_v, 5 ** -0.5)
    for mode in ("auto", "reference"):
        o, _ = bounded_memory_attention(q, k, v, w, causal=False, mode=mode)
        torch.testing.assert_close(o, want, **F64)


def test_noncausal_with_state_reads_prefix_and_sequence():
    q, k, v, s = inputs(T=12, Tq=4, s_scale=2.0)
    _, prefix = abc_attention(torch.zeros_like(k[:, :5]), k[:, :5], v[:, :5], s[:, :5],
                              output_final_state=True)
    want, st_want = abc_attention(q, k, v, s, causal=False, output_final_state=True)
    got, st_got = abc_attention(q, k[:, 5:], v[:, 5:], s[:, 5:], causal=False,
                                initial_state=prefix, output_final_state=True)
    torch.testing.assert_close(got, want, **F64)
    for a, b in zip(st_got, st_want, strict=True):
        torch.testing.assert_close(a, b, **F64)


def test_single_slot_is_running_average_of_values():
    # With M = 1 the softmax over slots is 1: o_t = Ṽ_t = Σ_{i≤t} α_i v_i / Σ_{i≤t} α_i.
    q, k, v, s = inputs(T=45, M=1, s_scale=4.0)
    alpha = s.exp()  # [B, T, H, 1]
    want = torch.cumsum(alpha * v, dim=1) / torch.cumsum(alpha, dim=1)
    for mode in ("chunked", "recurrent", "reference"):
        o, _ = abc_attention(q, k, v, s, mode=mode)
        torch.testing.assert_close(o, want, **F64)
    # General ABC, no normalisation: o_t = Σ_{i≤t} φ_i v_i.
    o, _ = bounded_memory_attention(q, k, v, alpha)
    torch.testing.assert_close(o, torch.cumsum(alpha * v, dim=1), **F64)


def test_hand_checked_two_tokens():
    # s = (0, log 3): at step 2 the slot weighs the tokens 1/4 and 3/4.
    v = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 2.0]]]], dtype=torch.float64).transpose(0, 1)
    s = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64).view(1, 2, 1, 1)
    q = k = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    o, _ = abc_attention(q, k, v, s)
    torch.testing.assert_close(o[0, :, 0], torch.tensor([[1.0, 0.0], [0.25, 1.5]],
                                                        dtype=torch.float64))


def test_first_step_reads_first_value():
    # After one token every slot holds k_1, v_1, so any mix of slots gives v_1.
    q, k, v, s = inputs(T=30, M=6, s_scale=10.0)
    for mode in ("chunked", "recurrent", "reference"):
        o, _ = abc_attention(q, k, v, s, mode=mode)
        torch.testing.assert_close(o[:, 0], v[:, 0], **F64)


def test_empty_slot_scores_zero():
    # Slot 1 is never written: K̃ = 0 there, so it enters the softmax with score 0.
    q, k, v, _ = inputs(T=10, M=2)
    phi = torch.zeros(2, 10, 2, 2, dtype=torch.float64)
    phi[..., 0] = 1.0
    mem_k, mem_v = torch.cumsum(k, 1), torch.cumsum(v, 1)  # slot 0: [B, T, H, K], [B, T, H, V]
    score0 = (q * mem_k).sum(-1) * 5 ** -0.5
    p0 = torch.sigmoid(score0)  # softmax([score0, 0])[0]
    want = p0[..., None] * mem_v
    o, _ = bounded_memory_attention(q, k, v, phi)
    torch.testing.assert_close(o, want, **F64)


# --------------------------------------------------------------------------------------
# Stability and precision
# --------------------------------------------------------------------------------------

def _huge_logits(B, T, H, M, seed):
    """Slot logits of size 1e4, both signs, jumping inside chunks."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([-1e4, -5e3, -40.0, 0.0, 35.0, 5e3, 1e4], dtype=torch.float64)
    idx = torch.randint(0, len(levels), (B, T, H, M), generator=g)
    return levels[idx] + torch.randn(B, T, H, M, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("T,chunk", [(100, 32), (130, 64)])
def test_abc_stable_for_huge_logits(T, chunk):
    q, k, v, _ = inputs(T=T, dtype=torch.float32, seed=4)
    s = _huge_logits(2, T, 2, 4, seed=5).float()
    state = abc_state(log_z_scale=1e4)
    state = ABCState(*(t.float() for t in state))
    f64 = [x.double() for x in (q, k, v, s)]
    want, st_want = abc_reference(*f64, initial_state=ABCState(*(t.double() for t in state)),
                                  output_final_state=True)
    for form in (abc_recurrent, functools.partial(abc_chunked, chunk_size=chunk)):
        o, st_ = form(q, k, v, s, initial_state=state, output_final_state=True)
        assert o.isfinite().all()
        # float32 resolves s ≈ 1e4 to 1e-3, so the weights carry that relative error.
        torch.testing.assert_close(o.double(), want, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(st_.k.double(), st_want.k, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(st_.log_z.double(), st_want.log_z, atol=1e-2, rtol=1e-6)
    # Float64 all the way: the chunked form is the reference, gradients included.
    f64 = [x.requires_grad_() for x in f64]
    want = run_with_grads(abc_reference, *f64, None)
    got = run_with_grads(functools.partial(abc_chunked, chunk_size=chunk), *f64, None)
    assert_same(got, want, **F64)
    # Float32 gradients stay finite.
    q, k, v, s = (x.detach().float().requires_grad_() for x in f64)
    o, _ = abc_chunked(q, k, v, s, chunk_size=chunk)
    assert all(g.isfinite().all() for g in torch.autograd.grad(o.sum(), [q, k, v, s]))


@pytest.mark.parametrize("where,value", [(70, 300.0), (64, 300.0), (0, -100.0)])
def test_abc_one_jump_among_calm_chunks(where, value):
    # Calm chunks take the fast path, a chunk with a jump of its normaliser inside is redone
    # exactly; a jump between chunks or from the very first token changes how the memories
    # at the chunk boundaries are summed (chunks of 32: token 64 opens one).
    q, k, v, s = inputs(B=1, T=200, H=1, grad=True)
    s = s.detach().clone()
    s[0, where, 0, 1] = value
    s[0, 150:, 0, 2] -= 20.0
    s.requires_grad_()
    want = run_with_grads(abc_reference, q, k, v, s, None)
    got = run_with_grads(functools.partial(abc_chunked, chunk_size=32), q, k, v, s, None)
    assert_same(got, want, **F64)


@pytest.mark.parametrize("drift, exact", [(1.5, False), (6.0, True)])
def test_drifting_logits_halve_the_chunks(monkeypatch, drift, exact):
    """Logits growing `drift` a token, as a trained recency rate makes them: over a chunk of
    64 tokens the normaliser grows by more than 80 (the exact path's threshold), over one of 32
    it does not at 1.5 a token, and over one of 16 it still does at 6. The op halves its chunks
    (down to 16) and takes the exact path only where that is not enough; both match the
    float64 reference (outputs, final state, gradients)."""
    import memattn.ops.abc.chunked as chunked

    taken, real_exact = [], chunked._Exact
    monkeypatch.setattr(chunked, "_Exact", lambda q, *a: taken.append(q.shape[1]) or
                        real_exact(q, *a))
    q, k, v, s = inputs(T=150, M=3, seed=4)
    s = (s + drift * torch.arange(150, dtype=s.dtype)[:, None, None]).requires_grad_()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    state = abc_state(M=3, grad=True)
    want = run_with_grads(abc_reference, q, k, v, s, state)
    assert_same(run_with_grads(abc_chunked, q, k, v, s, state, chunk_size=64), want, **F64)
    assert taken == ([16] if exact else [])  # the exact path, on chunks of 16, or none


@pytest.mark.parametrize("first_half", [0.5, 0.85])
def test_float32_gradients_at_the_fast_paths_edge(monkeypatch, first_half):
    """Logits drifting so that the normaliser grows by just under the fast path's threshold over
    a chunk, a share `first_half` of it in the chunk's first half (0.85: 66 of 78, more than a
    threshold of 40 on each side of the middle token would allow): every chunk of 64 takes the
    fast path (none the exact path, no halving), where 1 / z reaches nearly e^threshold and its
    gradient, −1 / z², must stay inside float32. Outputs, final state and gradients in float32
    are within 1e-3 of the float64 reference (relative to each tensor's largest entry; the
    recurrent form's error here is 1e-4); a threshold of e^60 fails here (1 / z² overflows)."""
    import memattn.ops.abc.chunked as chunked

    taken, real_exact = [], chunked._Exact
    monkeypatch.setattr(chunked, "_Exact", lambda q, *a: taken.append(q.shape[1]) or
                        real_exact(q, *a))
    monkeypatch.setattr(chunked, "_HALVE_DOWN_TO", 64)
    T, C = 192, 64
    growth = -2 * math.log(chunked._MIN_Z) - 2.0  # from a chunk's first token to its last
    half = (torch.arange(T) - 1) % C < C // 2  # the steps into tokens 1 .. C / 2 of a chunk
    step = torch.where(half, first_half * growth / (C // 2), (1 - first_half) * growth / (C // 2 - 1))
    q, k, v, s = inputs(T=T, M=3, seed=9)
    s = s * 0.1 + step.to(s.dtype).cumsum(0)[:, None, None]
    want = run_with_grads(abc_reference, *(x.requires_grad_() for x in (q, k, v, s)), None)
    o, final, grads = run_with_grads(functools.partial(abc_chunked, chunk_size=C),
                                     *(x.detach().float().requires_grad_() for x in (q, k, v, s)), None)
    assert taken == []
    for a, b in zip((o, *final, *grads), (want[0], *want[1], *want[2]), strict=True):
        assert a.isfinite().all()
        assert (a.double() - b).abs().max() <= 1e-3 * b.abs().max()


def test_float32_close_to_float64_reference():
    q, k, v, s = inputs(T=300, s_scale=3.0, seed=7)
    state = abc_state(seed=8)
    want, st_want = abc_reference(q, k, v, s, initial_state=state, output_final_state=True)
    f32 = [x.float() for x in (q, k, v, s)]
    for mode in ("chunked", "recurrent"):
        o, st_ = abc_attention(*f32, initial_state=ABCState(*(t.float() for t in state)),
                               output_final_state=True, mode=mode)
        torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)
        for a, b in zip(st_, st_want, strict=True):
            torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_low_precision_inputs(dtype, tol):
    q, k, v, s = inputs(T=80, dtype=torch.float32, s_scale=3.0, seed=6)
    low = [x.to(dtype) for x in (q, k, v, s)]
    want, _ = abc_attention(*[x.float() for x in low])
    for mode in ("chunked", "recurrent"):
        o, st_ = abc_attention(*low, mode=mode, output_final_state=True)
        assert o.dtype == dtype and o.isfinite().all()
        assert all(t.dtype == torch.float32 for t in st_)
        torch.testing.assert_close(o.float(), want, atol=tol, rtol=tol)
    phi = low[3].float().exp().to(dtype)
    want, _ = bounded_memory_attention(*[x.float() for x in low[:3]], phi.float())
    o, _ = bounded_memory_attention(*low[:3], phi)
    assert o.dtype == dtype
    torch.testing.assert_close(o.float(), want, atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 40), H=st.integers(1, 2), K=st.integers(1, 6),
       V=st.integers(1, 5), M=st.integers(1, 5), chunk=st.sampled_from([1, 2, 4, 8, 16, 64]),
       with_state=st.booleans(), s_scale=st.sampled_from([0.1, 1.0, 30.0, 1e4]),
       seed=st.integers(0, 1000))
def test_chunked_matches_reference_any_shape(B, T, H, K, V, M, chunk, with_state, s_scale, seed):
    q, k, v, s = inputs(B, T, H, K, V, M, s_scale=s_scale, seed=seed)
    state = abc_state(B, H, K, V, M, seed=seed + 1) if with_state else None
    want, st_want = abc_reference(q, k, v, s, initial_state=state, output_final_state=True)
    got, st_got = abc_chunked(q, k, v, s, initial_state=state, output_final_state=True,
                              chunk_size=chunk)
    torch.testing.assert_close(got, want, **F64)
    for a, b in zip(st_got, st_want, strict=True):
        torch.testing.assert_close(a, b, **F64)
    phi = torch.rand_like(s)
    state = bounded_state(B, H, K, V, M, seed=seed + 1) if with_state else None
    want, _ = bounded_memory_reference(q, k, v, phi, initial_state=state)
    got, _ = bounded_memory_chunked(q, k, v, phi, initial_state=state, chunk_size=chunk)
    torch.testing.assert_close(got, want, **F64)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------

def _bad_calls():
    q, k, v, s = inputs(T=6)
    good = {"q": q, "k": k, "v": v, "s": s}
    wrong_m = ABCState(torch.zeros(2, 2, 3), torch.zeros(2, 2, 3, 5), torch.zeros(2, 2, 3, 3))
    return [
        ("q", dict(good, q=q[0])),
        ("k", dict(good, k=k[:1])),
        ("k", dict(good, k=k[..., :4])),
        ("v", dict(good, v=v[:, :5])),
        ("s", dict(good, s=s[:, :, :1])),
        ("s", dict(good, s=s[..., :0])),
        ("q", dict(good, q=q[:, :4])),  # causal needs Tq = T
        ("initial_state.log_z", dict(good, initial_state=wrong_m)),
        ("initial_state", dict(good, initial_state=(torch.zeros(2, 2, 4),))),
        ("initial_state.v", dict(good, initial_state=abc_state(V=2))),
    ]


@pytest.mark.parametrize("mode", ["auto", "chunked", "recurrent", "reference"])
def test_abc_bad_input_names_the_argument(mode):
    for name, kw in _bad_calls():
        with pytest.raises(ShapeError, match=rf"^{name}: expected"):
            abc_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("s"), mode=mode, **kw)


@pytest.mark.parametrize("mode", ["auto", "chunked", "recurrent", "reference"])
def test_bounded_bad_input_names_the_argument(mode):
    q, k, v, s = inputs(T=6)
    with pytest.raises(ShapeError, match=r"^phi: expected non-negative"):
        bounded_memory_attention(q, k, v, s, mode=mode)
    with pytest.raises(ShapeError, match=r"^phi: expected 4 dims"):
        bounded_memory_attention(q, k, v, s.exp()[0], mode=mode)
    with pytest.raises(ShapeError, match=r"^initial_state.k: expected"):
        bounded_memory_attention(q, k, v, s.exp(), mode=mode,
                                 initial_state=bounded_state(K=4))
    with pytest.raises(ShapeError, match=r"^initial_state: expected a BoundedMemoryState"):
        bounded_memory_attention(q, k, v, s.exp(), mode=mode, initial_state=abc_state())
    # One causal token continuing a state takes the step path; it checks the same way.
    with pytest.raises(ShapeError, match=r"^phi: expected non-negative"):
        bounded_memory_attention(q[:, :1], k[:, :1], v[:, :1], s[:, :1], mode=mode,
                                 initial_state=bounded_state())


def test_step_bad_input_and_options():
    q, k, v, s = inputs(T=1)
    with pytest.raises(ShapeError, match=r"^q: expected 3 dims"):
        abc_attention_step(q, k[:, 0], v[:, 0], s[:, 0])
    with pytest.raises(ShapeError, match=r"^s: expected \[B, H, M\] with dim 1"):
        abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0, :1])
    with pytest.raises(ShapeError, match=r"^state.k: expected"):
        abc_attention_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0], abc_state(K=2))
    with pytest.raises(ShapeError, match=r"^phi: expected non-negative"):
        bounded_memory_attention_step(q[:, 0], k[:, 0], v[:, 0], -s[:, 0].abs() - 1)
    with pytest.raises(ConfigError, match=r"^chunk_size: expected a power of two"):
        abc_chunked(q, k, v, s, chunk_size=48)
    with pytest.raises(ConfigError, match=r"^mode: expected one of"):
        abc_attention(q, k, v, s, mode="fast")
    with pytest.raises(ConfigError, match=r"^mode: 'recurrent' is a causal form"):
        abc_attention(q, k, v, s, causal=False, mode="recurrent")


@pytest.mark.parametrize("where", ["k", "v", "s"])
def test_a_non_finite_input_spoils_nothing_before_it(where):
    """The chunked forms mix a chunk's steps in one product; with a NaN or an infinity at step
    t the op takes the step-by-step form, so every output before t is the reference's."""
    q, k, v, s = inputs(T=150, M=4)
    bad = {"k": k, "v": v, "s": s}[where]
    bad[0, 131, 1, 0] = float("nan") if where != "s" else float("inf")
    for op, ref, w in ((abc_attention, abc_reference, s), (bounded_memory_attention, bounded_memory_reference, s.exp())):
        got, _ = op(q, k, v, w)
        want, _ = ref(q, k, v, w)
        torch.testing.assert_close(got[:, :131], want[:, :131], **F64)
        assert torch.isfinite(got[:, :131]).all()
