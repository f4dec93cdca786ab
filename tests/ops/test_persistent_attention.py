"""memattn.ops.persistent_attention: the fast form against the reference, and the reference
against the paper's formulas written out by hand."""

import math

import pytest
import torch

from memattn.errors import ConfigError, ShapeError
from memattn.ops import KVState, softmax_attention
from memattn.ops.persistent import (DistanceTerms, persistent_attention, persistent_attention_reference,
                                    persistent_attention_weights, span_mask)

F64 = torch.float64


def rand(*shape, grad=False):
    return torch.randn(*shape, dtype=F64, requires_grad=grad)


def inputs(B=2, Tq=7, Tk=7, H=4, K=8, V=6, N=5, variant="joint", grad=False):
    Hc = H // 2 if variant == "heads" else H
    Hp = H - Hc if variant == "heads" else H
    return (rand(B, Tq, H, K, grad=grad), rand(B, Tk, Hc, K, grad=grad), rand(B, Tk, Hc, V, grad=grad),
            rand(Hp, N, K, grad=grad), rand(Hp, N, V, grad=grad))


def by_hand(q, k, v, pk, pv):
    """All-attention as the paper writes it, one query and one head at a time, causal:
    a = softmax([q·k_1 .. q·k_t, q·p_1 .. q·p_N] / √K), o = Σ a v over [v_1 .. v_t, p^v_1 .. p^v_N]."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = torch.cat([k[b, :t + 1, h], pk[h]])  # context up to t, then the N vectors
                values = torch.cat([v[b, :t + 1, h], pv[h]])
                a = torch.softmax(keys @ q[b, t, h] / math.sqrt(K), 0)
                o[b, t, h] = a @ values
    return o


def test_joint_softmax_matches_the_formula_by_hand():
    q, k, v, pk, pv = inputs(Tq=6, Tk=6)
    expected = by_hand(q, k, v, pk, pv)
    torch.testing.assert_close(persistent_attention_reference(q, k, v, pk, pv)[0], expected)
    torch.testing.assert_close(persistent_attention(q, k, v, pk, pv)[0], expected)


def test_without_persistent_vectors_it_is_softmax_attention():
    q, k, v, pk, pv = inputs(Tq=5, Tk=9, N=0)
    for causal in (True, False):
        expected, _ = softmax_attention(q, k, v, causal=causal)
        torch.testing.assert_close(persistent_attention(q, k, v, pk, pv, causal=causal)[0], expected)
        torch.testing.assert_close(persistent_attention_reference(q, k, v, pk, pv, causal=causal)[0], expected)


OPTIONS = {
    "plain": {},
    "window": {"window": 4},
    "relative": {"rel": "rel"},
    "span": {"span": "span", "ramp": 3.0, "window": 20},
    "own query": {"pq": "pq"},
    "shared query": {"pq": "shared"},  # one query and key set for every head (single-head)
    "padding": {"attention_mask": "mask"},
    "everything": {"rel": "rel", "span": "span", "ramp": 2.0, "window": 9, "pq": "pq", "attention_mask": "mask"},
    "everything, shared query": {"rel": "rel", "span": "span", "ramp": 2.0, "window": 9, "pq": "shared",
                                 "attention_mask": "mask"},
}


def materialise(option, *, B, Tq, Tk, H, K, N, variant, causal, grad=False):
    Hc = H // 2 if variant == "heads" else H
    Hp = H - Hc if variant == "heads" else H
    out = dict(option)
    extra = {}
    if out.get("rel") == "rel":
        out["rel"] = rand(11 if causal else 21, K, grad=grad)
    if out.get("span") == "span":
        out["span"] = torch.linspace(0.5, 7.5, Hc, dtype=F64).requires_grad_(grad)
    if out.get("pq") == "pq":
        out["pq"] = rand(B, Tq, Hp, 3, grad=grad)
        extra["pk"] = rand(Hp, N, 3, grad=grad)
    if out.get("pq") == "shared":  # views broadcast over the heads, as the single-head variant reads
        extra["bases"] = [rand(B, Tq, 1, 3, grad=grad), rand(1, N, 3, grad=grad)]  # what gradients reach
        out["pq"], extra["pk"] = extra["bases"][0].expand(B, Tq, Hp, 3), extra["bases"][1].expand(Hp, N, 3)
    if out.get("attention_mask") == "mask":
        mask = torch.rand(B, Tk) > 0.3
        mask[:, -1] = True  # every query keeps one key
        out["attention_mask"] = mask
    return out, extra


@pytest.fixture(params=[64, 2], ids=["blocks of 64", "blocks of 2"])
def band_block(request, monkeypatch):
    """Queries per block of the fast form's banded reads: with 2, every causal query block
    longer than 2 with a window or span is read block by block over its band of keys."""
    monkeypatch.setattr("memattn.ops.persistent.sdpa.BAND_BLOCK", request.param)
    return request.param


@pytest.mark.parametrize("few_queries", [False, True])  # True: a decoding step, Tq ≪ Tk
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["joint", "split", "heads"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_fast_form_matches_reference_forward_and_gradients(variant, option, causal, few_queries, band_block):
    B, Tq, Tk, H, K, N = 2, 1 if few_queries else (5 if causal else 4), 13, 4, 6, 3
    q, k, v, pk, pv = inputs(B, Tq, Tk, H, K, 5, N, variant, grad=True)
    kwargs, extra = materialise(OPTIONS[option], B=B, Tq=Tq, Tk=Tk, H=H, K=K, N=N, variant=variant,
                                causal=causal, grad=True)
    pk = extra.get("pk", pk)
    leaves = [t for t in (q, k, v, pv, *extra.get("bases", [pk]), *kwargs.values())
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    fast, _ = persistent_attention(q, k, v, pk, pv, causal=causal, variant=variant, **with_distance(kwargs))
    ref, _ = persistent_attention_reference(q, k, v, pk, pv, causal=causal, variant=variant, **with_distance(kwargs))
    torch.testing.assert_close(fast, ref)
    w = torch.randn_like(ref)
    g_fast = torch.autograd.grad((fast * w).sum(), leaves)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b)


def with_distance(kw):
    """kw with rel / span / ramp / window gathered into the op's `distance` argument."""
    kw = dict(kw)
    terms = {n: kw.pop(n) for n in ("rel", "span", "ramp", "window") if n in kw}
    return {**kw, "distance": DistanceTerms(**terms)} if terms else kw


def test_odd_length_with_initial_state_and_final_state(band_block):
    B, T0, T, H, K = 1, 20, 63, 2, 4
    q, k, v, pk, pv = inputs(B, T, T, H, K, 4, 3, grad=True)
    k0, v0 = rand(B, T0, H, K, grad=True), rand(B, T0, H, 4, grad=True)
    rel = rand(40, K, grad=True)
    # z + R off the integers: at m = 0 exactly the mask has a kink, where the two forms take
    # different one-sided derivatives (the reference m · exp(s), the fast form log m)
    span = torch.tensor([9.3, 30.6], dtype=F64, requires_grad=True)
    terms = DistanceTerms(rel=rel, span=span, ramp=8.0, window=50)
    kw = dict(distance=terms, initial_state=KVState(k0.transpose(1, 2), v0.transpose(1, 2)),
              output_final_state=True)
    fast, state = persistent_attention(q, k, v, pk, pv, **kw)
    ref, ref_state = persistent_attention_reference(q, k, v, pk, pv, **kw)
    torch.testing.assert_close(fast, ref)
    assert isinstance(state, KVState) and isinstance(ref_state, KVState)
    assert torch.equal(state.k, torch.cat([k0, k], 1).transpose(1, 2))  # [B, H, T0 + T, K]
    assert torch.equal(state.v, torch.cat([v0, v], 1).transpose(1, 2))
    leaves = (q, k, v, pk, pv, k0, v0, rel, span)
    for a, b in zip(torch.autograd.grad(fast.sum(), leaves), torch.autograd.grad(ref.sum(), leaves)):
        torch.testing.assert_close(a, b)
    # the same queries over the whole sequence at once: the state is only where the keys start
    whole, _ = persistent_attention(q, torch.cat([k0, k], 1), torch.cat([v0, v], 1), pk, pv,
                                    distance=terms)
    torch.testing.assert_close(fast, whole)


@pytest.fixture
def flash_reads(monkeypatch):
    """The calls of the CPU flash joint read (memattn.ops.persistent.flash), counted."""
    from memattn.ops.persistent import flash

    calls = []
    read = flash.joint_read
    monkeypatch.setattr(flash, "joint_read", lambda *a, **kw: calls.append(a[0].shape) or read(*a, **kw))
    return calls


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("option", ["plain", "own query", "shared query"])
def test_cpu_flash_joint_read_matches_reference_forward_and_gradients(option, causal, flash_reads):
    """A causal block over its own keys (training) or every key seen goes through two flash
    kernel calls merged by log-sum-exp; values narrower than keys (K = 6, V = 5) and a
    persistent query of another width (3) are padded to the kernel's one head size."""
    B, T, H, K, V, N = 2, 70, 3, 6, 5, 9
    q, k, v, pk, pv = inputs(B, T, T, H, K, V, N, grad=True)
    kwargs, extra = materialise(OPTIONS[option], B=B, Tq=T, Tk=T, H=H, K=K, N=N, variant="joint",
                                causal=causal, grad=True)
    pk = extra.get("pk", pk)
    leaves = [t for t in (q, k, v, pv, *extra.get("bases", [pk]), *kwargs.values())
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    fast, _ = persistent_attention(q, k, v, pk, pv, causal=causal, **kwargs)
    assert len(flash_reads) == 1
    ref, _ = persistent_attention_reference(q, k, v, pk, pv, causal=causal, **kwargs)
    torch.testing.assert_close(fast, ref)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((fast * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shared", [False, True], ids=["per head", "shared query"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_flash_joint_read_in_low_precision_is_near_the_float64_reference(dtype, shared, flash_reads):
    """Far-apart scores (persistent keys 8x the context's) test the log-sum-exp merge: each
    part is normalised by its own maximum, the two joined in fp32."""
    B, T, H, K, N = 2, 40, 2, 16, 7
    q, k, v, pk, pv = inputs(B, T, T, H, K, K, N)
    pq, pk = (rand(B, T, 1, 5), rand(1, N, 5)) if shared else (None, pk)
    leaves = [t for t in (q, k, v, 8 * pk, pv, pq) if t is not None]

    def run(op, q, k, v, pk, pv, pq=None):  # pq and pk of one head: views over every head
        if pq is None:
            return op(q, k, v, pk, pv)[0]
        return op(q, k, v, pk.expand(H, N, 5), pv, pq=pq.expand(B, T, H, 5))[0]

    ref = run(persistent_attention_reference, *leaves)
    low = [t.to(dtype).requires_grad_() for t in leaves]
    fast = run(persistent_attention, *low)
    assert fast.dtype == dtype and len(flash_reads) == 1
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fast.double(), ref, atol=tol, rtol=tol)
    fast.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in low)


# -- masking, read off the reference's weights ---------------------------------------------

def weights(variant="joint", causal=True, **kw):
    q, k, _, pk, _ = inputs(2, 6, 6, 4, 8, 5, 4, variant)
    return persistent_attention_weights(q, k, pk, causal=causal, variant=variant, **with_distance(kw))


def test_joint_weights_sum_to_one_over_context_and_persistent_vectors_together():
    w_p, w_c = weights()
    torch.testing.assert_close((w_p.sum(-1) + w_c.sum(-1)), torch.ones(2, 4, 6, dtype=F64))
    assert (w_p > 0).all()  # every query reads every persistent vector
    past = torch.ones(6, 6, dtype=torch.bool).tril()
    assert (w_c[..., ~past] == 0).all() and (w_c[..., past] > 0).all()  # causal context


def test_attn_split_normalises_each_part_on_its_own():
    w_p, w_c = weights("split")
    torch.testing.assert_close(w_p.sum(-1), torch.ones(2, 4, 6, dtype=F64))
    torch.testing.assert_close(w_c.sum(-1), torch.ones(2, 4, 6, dtype=F64))


def test_head_split_gives_half_the_heads_to_each_part():
    w_p, w_c = weights("heads")
    assert (w_p[:, :2] == 0).all() and (w_c[:, 2:] == 0).all()
    torch.testing.assert_close(w_c[:, :2].sum(-1), torch.ones(2, 2, 6, dtype=F64))
    torch.testing.assert_close(w_p[:, 2:].sum(-1), torch.ones(2, 2, 6, dtype=F64))
    # and in the fast form: context heads ignore the persistent vectors, persistent heads the context
    q, k, v, pk, pv = inputs(2, 6, 6, 4, 8, 5, 4, "heads")
    o = persistent_attention(q, k, v, pk, pv, variant="heads")[0]
    o_other_pk = persistent_attention(q, k, v, pk + 1, pv + 1, variant="heads")[0]
    o_other_ctx = persistent_attention(q, k + 1, v + 1, pk, pv, variant="heads")[0]
    torch.testing.assert_close(o[:, :, :2], o_other_pk[:, :, :2])
    torch.testing.assert_close(o[:, :, 2:], o_other_ctx[:, :, 2:])


def test_window_hides_far_keys_but_never_the_persistent_vectors():
    w_p, w_c = weights(window=2)
    dist = torch.arange(6)[:, None] - torch.arange(6)[None, :]
    assert (w_c[..., (dist >= 2) | (dist < 0)] == 0).all() and (w_c[..., (dist >= 0) & (dist < 2)] > 0).all()
    assert (w_p > 0).all()


def test_soft_span_mask_values():
    z = torch.tensor([0.0, 2.5, 10.0], dtype=F64)
    dist = torch.arange(-3, 14)[None, :]
    m = span_mask(z, 4.0, dist)[:, 0]  # [3, 17], at |distance|
    x = dist[0].abs().to(F64)
    for h in range(3):  # m_z(x) = clamp((R + z - x) / R, 0, 1)
        expected = ((4.0 + z[h] - x) / 4.0).clamp(0, 1)
        torch.testing.assert_close(m[h], expected)
    assert m[0, 3] == 1 and m[0, 3 + 4] == 0 and m[1, 3 + 4] == pytest.approx(0.625)


def test_span_mask_renormalises_the_context_and_leaves_persistent_slots_unmasked():
    q, k, _, pk, _ = inputs(1, 8, 8, 2, 4, 3, 3)
    span = torch.tensor([0.0, 1.0], dtype=F64)
    w_p, w_c = persistent_attention_weights(q, k, pk, distance=DistanceTerms(span=span, ramp=2.0))
    plain_p, plain_c = persistent_attention_weights(q, k, pk)
    dist = torch.arange(8)[:, None] - torch.arange(8)[None, :]
    for h, z in enumerate(span.tolist()):
        m = ((2.0 + z - dist.abs()) / 2.0).clamp(0, 1) * (dist >= 0)
        # weights ∝ m · exp(s) on the context, exp(s) on the persistent vectors (mask padded with 1)
        e_c, e_p = plain_c[0, h] * m, plain_p[0, h]
        total = e_c.sum(-1, keepdim=True) + e_p.sum(-1, keepdim=True)
        torch.testing.assert_close(w_c[0, h], e_c / total)
        torch.testing.assert_close(w_p[0, h], e_p / total)
    assert (w_c[0, 0][dist >= 2] == 0).all()  # z = 0, R = 2: only distances 0 and 1 remain
    assert (w_p > 0).all()


def test_span_gradient_reaches_z_only_through_the_ramp():
    q, k, v, pk, pv = inputs(1, 10, 10, 2, 4, 4, 3)
    span = torch.tensor([2.0, 50.0], dtype=F64, requires_grad=True)  # head 1: ramp past every key
    o, _ = persistent_attention(q, k, v, pk, pv, distance=DistanceTerms(span=span, ramp=3.0))
    (g,) = torch.autograd.grad(o.square().sum(), span)
    assert g[0] != 0 and g[1] == 0


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("change, error, message", [
    (lambda a: a.update(variant="both"), ConfigError, r"variant: expected one of joint, split, heads, got 'both'"),
    (lambda a: a.update(backend="triton"), ConfigError, r"backend: no Triton kernel exists for persistent_attention"),
    (lambda a: a.update(q=a["q"].long()), ShapeError, r"q: expected a floating point tensor"),
    (lambda a: a.update(pk=torch.randn(3, 5, 8), pv=torch.randn(3, 5, 6)), ShapeError, r"pk: expected \[H, N, Kp\] with H = 4 heads"),
    (lambda a: a.update(pv=torch.randn(4, 2, 6)), ShapeError, r"pv: expected \[Hp, N, V\] with dim 1 = 5"),
    (lambda a: a.update(pk=torch.randn(4, 5, 3)), ShapeError, r"pk: without pq the persistent keys share the queries' dim K=8, got Kp=3"),
    (lambda a: a.update(variant="heads"), ShapeError, r"variant 'heads' splits the H=4 query heads"),
    (lambda a: a.update(span=torch.ones(4)), ConfigError, r"ramp: the soft span mask needs a ramp > 0, got None"),
    (lambda a: a.update(span=torch.ones(3), ramp=2.0), ShapeError, r"span: expected \[Hc\] with dim 0 = 4"),
    (lambda a: a.update(window=0), ConfigError, r"window: expected a number of tokens >= 1, got 0"),
    (lambda a: a.update(causal=False, rel=torch.randn(4, 8)), ShapeError, r"rel: not causal, expected 2R - 1 rows"),
    (lambda a: a.update(attention_mask=torch.ones(2, 7)), ShapeError, r"attention_mask: expected dtype torch.bool"),
    (lambda a: a.update(q=torch.randn(2, 9, 4, 8)), ShapeError, r"causal attention needs Tq <= Tk, got Tq=9, Tk=7"),
    (lambda a: a.update(initial_state=torch.randn(2, 3, 4, 8)), ShapeError, r"initial_state: expected a KVState \(k, v\), got Tensor"),
])
def test_bad_inputs_are_clear_errors(change, error, message):
    args = dict(zip("q k v pk pv".split(), (t.float() for t in inputs())))
    change(args)
    q, k, v, pk, pv = (args.pop(n) for n in "q k v pk pv".split())
    with pytest.raises(error, match=message):
        persistent_attention(q, k, v, pk, pv, **with_distance(args))
