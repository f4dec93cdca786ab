"""memattn.ops.gmat: gmat_attention's sparse and causal forms held to the dense masked
reference (outputs and every gradient), to softmax attention where they coincide, and to
the definitions of the patterns; bad input raises errors that name the argument."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memattn.errors import ConfigError, ShapeError
from memattn.ops.gmat import (bidirectional_mask, causal_mask, gmat_attention,
                              gmat_attention_reference, lsh_buckets)
from memattn.ops.softmax import softmax_attention

F64 = torch.float64


def make(B=2, T=26, H=2, K=4, V=3, *, n_buckets=4, mask=False, untied=False, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    inputs = dict(q=rand(B, T, H, K), k=rand(B, T, H, K), v=rand(B, T, H, V))
    if untied:
        inputs.update(memory_k=rand(B, T, H, K), memory_v=rand(B, T, H, V))
    if mask:
        m = torch.rand(B, T, generator=g) > 0.25
        m[:, 0] = True
        inputs["attention_mask"] = m
    rotations = torch.randn(H, K, n_buckets // 2, generator=g, dtype=F64)
    return inputs, rotations


def with_grads(fn, inputs, **kw):
    """Output and the gradient of a random linear loss w.r.t. every float input."""
    leaves = {n: (t.detach().clone().requires_grad_() if t.is_floating_point() else t)
              for n, t in inputs.items()}
    o = fn(**leaves, **kw)
    o = o[0] if isinstance(o, tuple) else o  # the op gives (o, None), the reference o
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=o.dtype)
    floats = [n for n, t in leaves.items() if t.is_floating_point()]
    grads = torch.autograd.grad((o * do).sum(), [leaves[n] for n in floats], allow_unused=True,
                                materialize_grads=True)
    return {"o": o, **{f"d{n}": g for n, g in zip(floats, grads)}}


def assert_same(fast, ref, tol=1e-10):
    assert fast.keys() == ref.keys()
    for name in fast:
        torch.testing.assert_close(fast[name], ref[name], rtol=tol, atol=tol, msg=name)


BIDIRECTIONAL = [("chunked", {}), ("window", {}), ("lsh", {}), ("full", {})]


@pytest.mark.parametrize("pattern", ["chunked", "window", "lsh", "full"])
@pytest.mark.parametrize("M, L", [(0, 23), (3, 23), (4, 63), (2, 1)])
@pytest.mark.parametrize("mask, untied", [(False, False), (True, True)])
def test_bidirectional_forms_equal_the_dense_masked_reference(pattern, M, L, mask, untied):
    inputs, rot = make(T=M + L, mask=mask, untied=untied)
    kw = dict(num_memory=M, pattern=pattern, chunk_size=5, window=3, lsh_rotations=rot, causal=False)
    assert_same(with_grads(gmat_attention, inputs, **kw),
                with_grads(gmat_attention_reference, inputs, **kw))


@pytest.mark.parametrize("pattern", ["chunked", "window"])
@pytest.mark.parametrize("M, C", [(0, 4), (3, 5), (2, 1)])
@pytest.mark.parametrize("Tq", [None, 9, 1])
def test_causal_forms_equal_the_dense_masked_reference(pattern, M, C, Tq):
    T = 41  # not a multiple of any block size above
    inputs, _ = make(T=T, mask=Tq == 9, untied=Tq == 1)
    if Tq is not None:  # the last Tq rows continue a prefix: queries of a decoder
        inputs["q"] = inputs["q"][:, T - Tq:]
    kw = dict(num_memory=M, pattern=pattern, chunk_size=C, window=min(C, 3), causal=True)
    assert_same(with_grads(gmat_attention, inputs, **kw),
                with_grads(gmat_attention_reference, inputs, **kw))


@pytest.mark.parametrize("pattern", ["chunked", "window"])
@pytest.mark.parametrize("M, C", [(0, 4), (3, 5), (2, 1)])
@pytest.mark.parametrize("mask", [False, True])
def test_one_query_row_at_every_offset_of_a_block_equals_the_reference(pattern, M, C, mask):
    """A decoding step (a main row reads only the rows its pattern reaches), at each offset of
    the first and third block, memory rows included."""
    S = M + C
    for T in [*range(1, S + 1), *range(2 * S + 1, 3 * S + 1)]:
        inputs, _ = make(T=T, mask=mask, untied=True, seed=T)
        inputs["q"] = inputs["q"][:, T - 1:]
        kw = dict(num_memory=M, pattern=pattern, chunk_size=C, window=min(C, 3), causal=True)
        assert_same(with_grads(gmat_attention, inputs, **kw),
                    with_grads(gmat_attention_reference, inputs, **kw))


def test_the_reference_masks_follow_the_definitions():
    M, L = 2, 7
    chunked = bidirectional_mask(M, L, "chunked", chunk_size=3)
    assert chunked[:M].all() and chunked[:, :M].all()  # memory rows and columns are dense
    main = chunked[M:, M:]
    assert main[0, :3].all() and not main[0, 3:].any() and main[6, 6] and not main[6, :6].any()
    window = bidirectional_mask(M, L, "window", window=1)[M:, M:]
    assert window.sum().item() == 7 + 2 * 6  # the diagonal and both neighbours
    causal = causal_mask(1, 2, 9, "chunked")  # blocks [m, x, x]
    # the memory slot of block 1 (row 3) reads block 0 whole and itself; not chunk 1
    assert causal[3].tolist() == [True, True, True, True, False, False, False, False, False]
    # main token 3 (row 5) reads its block's memory, chunk 1 up to itself: rows 3, 4, 5
    assert causal[5].nonzero().flatten().tolist() == [3, 4, 5]


def test_memory_rows_are_dense_softmax_over_everything():
    M, L = 3, 40
    inputs, _ = make(T=M + L)
    o, _ = gmat_attention(**inputs, num_memory=M, causal=False, pattern="chunked", chunk_size=4)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    dense, _ = softmax_attention(q[:, :M], k, v, causal=False)
    torch.testing.assert_close(o[:, :M], dense, rtol=1e-12, atol=1e-12)
    changed = v.clone()
    changed[:, -1] += 1  # the last main token is far from every chunk but its own
    o2, _ = gmat_attention(q, k, changed, num_memory=M, causal=False, pattern="chunked", chunk_size=4)
    assert (o2[:, :M] - o[:, :M]).abs().amin() > 0  # every memory row moved
    torch.testing.assert_close(o2[:, M:M + 36], o[:, M:M + 36], rtol=0, atol=0)  # other chunks did not


@pytest.mark.parametrize("pattern, kw", [("chunked", {"chunk_size": 64}), ("window", {"window": 64}),
                                         ("full", {})])
def test_patterns_covering_everything_are_softmax_attention(pattern, kw):
    M, L = 3, 29
    inputs, _ = make(T=M + L, mask=True)
    o, _ = gmat_attention(**inputs, num_memory=M, causal=False, pattern=pattern, **kw)
    dense, _ = softmax_attention(inputs["q"], inputs["k"], inputs["v"], causal=False,
                              attention_mask=inputs["attention_mask"])
    torch.testing.assert_close(o, dense, rtol=1e-12, atol=1e-12)


def test_a_row_with_nothing_visible_is_zero_without_nan():
    inputs, _ = make(T=12)
    inputs["attention_mask"] = torch.ones(2, 12, dtype=torch.bool)
    inputs["attention_mask"][:, 4:8] = False  # the whole second chunk is padding
    out = with_grads(gmat_attention, inputs, num_memory=0, causal=False, pattern="chunked", chunk_size=4)
    assert out["o"][:, 4:8].abs().max() == 0
    assert all(torch.isfinite(t).all() for t in out.values())


def test_lsh_buckets_group_keys_by_direction():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 1, 1, 8, generator=g, dtype=F64)
    k = torch.cat((base, 3 * base, -base), dim=1)  # same direction twice, then its opposite
    rotations = torch.randn(1, 8, 4, generator=g, dtype=F64)
    b = lsh_buckets(k, rotations)[0, 0]
    assert b[0] == b[1] and b[0] != b[2] and (b[2] - b[0]).abs() == 4  # argmax of [xR; -xR]


def test_lsh_reads_tokens_of_its_bucket_only():
    M, L = 2, 30
    inputs, rot = make(T=M + L, H=1, n_buckets=4)
    o, _ = gmat_attention(**inputs, num_memory=M, causal=False, pattern="lsh", chunk_size=64,
                          lsh_rotations=rot)
    buckets = lsh_buckets(inputs["k"][:, M:], rot)[:, 0]  # [B, L]; one chunk holds all
    for b in range(2):
        for i in (0, 17):
            same = torch.cat((torch.ones(M, dtype=torch.bool), buckets[b] == buckets[b, i]))
            keys = inputs["k"][b:b + 1, same]
            values = inputs["v"][b:b + 1, same]
            expect, _ = softmax_attention(inputs["q"][b:b + 1, M + i:M + i + 1], keys, values, causal=False)
            torch.testing.assert_close(o[b:b + 1, M + i:M + i + 1], expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_compute_in_fp32_and_keep_their_dtype(dtype):
    inputs, _ = make(T=20, dtype=dtype)
    o, _ = gmat_attention(**inputs, num_memory=2, causal=False, pattern="window", window=2)
    assert o.dtype == dtype
    ref = gmat_attention_reference(**{n: t.double() for n, t in inputs.items()}, num_memory=2,
                                   causal=False, pattern="window", window=2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.double(), ref, rtol=tol, atol=tol)


@settings(max_examples=25, deadline=None)
@given(M=st.integers(0, 3), L=st.integers(1, 20), C=st.integers(1, 6), w=st.integers(1, 6),
       pattern=st.sampled_from(["chunked", "window", "lsh", "full"]), causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_property_any_sizes_match_the_reference(M, L, C, w, pattern, causal, seed):
    if causal:
        pattern = "chunked" if pattern in ("lsh", "full") else pattern
        w = min(w, C)
    inputs, rot = make(B=1, T=M + L, mask=True, seed=seed)
    kw = dict(num_memory=M, pattern=pattern, chunk_size=C, window=w, lsh_rotations=rot, causal=causal)
    torch.testing.assert_close(gmat_attention(**inputs, **kw)[0], gmat_attention_reference(**inputs, **kw),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("change, error, message", [
    (dict(num_memory=-1), ConfigError, r"num_memory: expected a non-negative int, got -1"),
    (dict(chunk_size=0), ConfigError, r"chunk_size: expected a positive int, got 0"),
    (dict(window=-2), ConfigError, r"window: expected a positive int, got -2"),
    (dict(pattern="dilated"), ConfigError, r"pattern: expected one of chunked, window, lsh, full, got 'dilated'"),
    (dict(pattern="lsh"), ShapeError, r"lsh_rotations: the lsh pattern needs random rotations"),
    (dict(pattern="lsh", causal=True), ConfigError, r"pattern: causal GMAT supports chunked, window, got 'lsh'"),
    (dict(pattern="window", causal=True, window=9, chunk_size=4), ConfigError,
     r"window: a causal window must fit"),
    (dict(num_memory=30), ShapeError, r"k: expected at least num_memory = 30 positions"),
    (dict(output_final_state=True), ConfigError, r"output_final_state: gmat_attention keeps no state"),
    (dict(backend="triton"), ConfigError, r"backend: no Triton kernel exists for gmat_attention"),
])
def test_bad_arguments_are_errors_naming_them(change, error, message):
    inputs, _ = make(T=10)
    kw = dict(num_memory=2, causal=False, pattern="chunked", chunk_size=4)
    kw.update(change)
    with pytest.raises(error, match=message):
        gmat_attention(**inputs, **kw)


def test_causal_is_a_required_keyword():
    inputs, _ = make(T=10)
    with pytest.raises(TypeError, match="causal"):
        gmat_attention(**inputs, num_memory=2)


def test_bad_tensors_are_errors_naming_them():
    inputs, rot = make(T=10)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    with pytest.raises(ShapeError, match=r"attention_mask: expected dtype torch.bool"):
        gmat_attention(q, k, v, num_memory=2, causal=False, attention_mask=torch.ones(2, 10))
    with pytest.raises(ShapeError, match=r"attention_mask: expected \[B, T\] with dim 1 = 10"):
        gmat_attention(q, k, v, num_memory=2, causal=False, attention_mask=torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(ShapeError, match=r"q: bidirectional GMAT has one query a position"):
        gmat_attention(q[:, :4], k, v, num_memory=2, causal=False)
    with pytest.raises(ShapeError, match=r"memory_k, memory_v: give both"):
        gmat_attention(q, k, v, num_memory=2, causal=False, memory_k=k)
    with pytest.raises(ShapeError, match=r"lsh_rotations: expected \[H, K, n_buckets / 2\] with dim 1 = 4"):
        gmat_attention(q, k, v, num_memory=2, causal=False, pattern="lsh", lsh_rotations=torch.randn(2, 5, 2))
    with pytest.raises(ShapeError, match=r"v: expected \[B, T, H, V\] with dim 1 = 10"):
        gmat_attention(q, k, v[:, :9], num_memory=2, causal=False)
