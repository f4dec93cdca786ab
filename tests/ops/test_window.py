"""memattn.ops.window: local_window_attention (in blocks) against local_window_reference (a
loop over queries), and counted_softmax against a softmax over repeated keys: outputs and
gradients, causal and bidirectional, odd lengths, padding, the dilated queue and the state."""

from __future__ import annotations

import pytest
import torch

from memattn.errors import ConfigError, ShapeError
from memattn.ops.window import (
    WindowState,
    counted_softmax,
    in_strided_queue,
    in_window,
    local_window_attention,
    local_window_reference,
)

F64 = {"atol": 1e-10, "rtol": 1e-10}


def inputs(B=2, T=13, H=2, D=4, V=3, *, seed=0, dtype=torch.float64, grad=False):
    """Random q, k [B, T, H, D], v [B, T, H, V]."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    return [x.to(dtype).requires_grad_(grad) for x in (q, k, v)]


def padding(B, T, *, seed=0):
    """A mask [B, T] with left padding in row 0, right padding in row 1 and holes elsewhere."""
    g = torch.Generator().manual_seed(seed)
    real = torch.rand(B, T, generator=g) > 0.3
    real[0, :3] = False
    real[0, 3:] = True
    if B > 1:
        real[1, :] = True
        real[1, T - 2:] = False
    return real


def both(fn_kwargs, q, k, v):
    return (local_window_attention(q, k, v, **fn_kwargs)[0],
            local_window_reference(q, k, v, **fn_kwargs))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 2, 7, 13])
@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 16])  # 16 > T: one block
def test_local_window_attention_equals_the_reference(causal, T, window):
    q, k, v = inputs(T=T)
    got, want = both({"window": window, "causal": causal}, q, k, v)
    torch.testing.assert_close(got, want, **F64)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 4, 6])
def test_padding_is_never_read(causal, window):
    q, k, v = inputs(B=3, T=11)
    mask = padding(3, 11)
    got, want = both({"window": window, "causal": causal, "attention_mask": mask}, q, k, v)
    torch.testing.assert_close(got, want, **F64)
    # a row's padded keys can hold anything: the real queries read the same
    k2, v2 = k.clone(), v.clone()
    k2[~mask], v2[~mask] = 1e3, -1e3
    moved, _ = local_window_attention(q, k2, v2, window=window, causal=causal, attention_mask=mask)
    torch.testing.assert_close(moved, got, **F64)


@pytest.mark.parametrize("causal", [True, False])
def test_a_query_with_no_real_key_reads_zeros(causal):
    q, k, v = inputs(B=1, T=9)
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, 6] = True  # causal: queries 0 .. 5 see nothing; bidirectional with n=3 most do not
    got, want = both({"window": 3, "causal": causal, "attention_mask": mask}, q, k, v)
    torch.testing.assert_close(got, want, **F64)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("window,dilation", [(1, 1), (3, 2), (2, 5), (4, 1), (4, 3), (20, 3), (5, 7)])
@pytest.mark.parametrize("T", [1, 6, 15, 17])
def test_the_dilated_queue_equals_the_reference(window, dilation, T):
    q, k, v = inputs(T=T)
    got, want = both({"window": window, "dilation": dilation}, q, k, v)
    torch.testing.assert_close(got, want, **F64)
    mask = padding(2, T)
    got, want = both({"window": window, "dilation": dilation, "attention_mask": mask}, q, k, v)
    torch.testing.assert_close(got, want, **F64)


def test_the_reference_counts_a_key_in_both_queues_twice():
    """Query 4 with n = 2, d = 2 reads keys 3, 4 (window) and 2, 4 (queue): key 4 twice."""
    q, k, v = inputs(B=1, T=5, H=1)
    o = local_window_reference(q, k, v, window=2, dilation=2)
    scores = torch.stack([q[0, 4, 0] @ k[0, j, 0] for j in (3, 4, 2, 4)]) * 4 ** -0.5
    p = torch.softmax(scores, 0)
    want = sum(p[i] * v[0, j, 0] for i, j in enumerate((3, 4, 2, 4)))
    torch.testing.assert_close(o[0, 4, 0], want, **F64)


@pytest.mark.parametrize("causal,dilation", [(True, 0), (False, 0), (True, 2)])
def test_gradients_equal_the_references(causal, dilation):
    q, k, v = inputs(T=14, grad=True)
    mask = padding(2, 14)
    kw = {"window": 4, "causal": causal, "dilation": dilation, "attention_mask": mask}
    w = torch.randn(2, 14, 2, 3, dtype=torch.float64)
    got = torch.autograd.grad((local_window_attention(q, k, v, **kw)[0] * w).sum(), (q, k, v))
    want = torch.autograd.grad((local_window_reference(q, k, v, **kw) * w).sum(), (q, k, v))
    for g, r in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, **F64)


@pytest.mark.parametrize("cut", [2, 9])  # before the window is full, and after
@pytest.mark.parametrize("masked", [False, True])
def test_a_continuation_from_the_state_equals_the_whole_sequence(cut, masked):
    """The state is the queue of the last n tokens: running x[:cut], then x[cut:] from its
    state, gives the outputs and the final state of running x whole."""
    n, T = 4, 20
    q, k, v = inputs(T=T)
    mask = padding(2, T) if masked else None
    full, final = local_window_attention(q, k, v, window=n, attention_mask=mask,
                                         output_final_state=True)
    first, mid = local_window_attention(q[:, :cut], k[:, :cut], v[:, :cut], window=n,
                                        attention_mask=None if mask is None else mask[:, :cut],
                                        output_final_state=True)
    rest, end = local_window_attention(q[:, cut:], k[:, cut:], v[:, cut:], window=n,
                                       attention_mask=None if mask is None else mask[:, cut:],
                                       initial_state=mid, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, **F64)
    assert isinstance(mid, WindowState) and mid.k.shape == (2, 2, n, 4) and mid.real.shape == (2, 2, n)
    assert mid.real[:, :, :max(0, n - cut)].logical_not().all()  # slots no token reached
    for got, want in zip(end, final):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(final.k, k[:, T - n:].transpose(1, 2), rtol=0, atol=0)


def test_a_state_is_the_queue_of_a_plain_causal_window_only():
    q, k, v = inputs(T=6)
    _, state = local_window_attention(q, k, v, window=3, output_final_state=True)
    with pytest.raises(ConfigError, match="output_final_state: local_window_attention keeps no state"):
        local_window_attention(q, k, v, window=3, causal=False, output_final_state=True)
    with pytest.raises(ConfigError, match="initial_state: local_window_attention keeps no state"):
        local_window_attention(q, k, v, window=3, dilation=2, initial_state=state)
    with pytest.raises(ShapeError, match=r"initial_state.k: expected \[B, H, n, K\] with dim 2 = 4"):
        local_window_attention(q, k, v, window=4, initial_state=state)
    with pytest.raises(ShapeError, match="initial_state: expected a WindowState"):
        local_window_attention(q, k, v, window=3, initial_state=(state.k, state.v))


def test_float32_and_scale():
    q, k, v = inputs(T=10, dtype=torch.float32)
    got, want = both({"window": 3, "causal": False, "scale": 0.3}, q, k, v)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_the_argument():
    q, k, v = inputs(T=6)
    with pytest.raises(ShapeError, match="attention_mask"):
        local_window_attention(q, k, v, window=2, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ShapeError, match="attention_mask: expected dtype torch.bool"):
        local_window_attention(q, k, v, window=2, attention_mask=torch.ones(2, 6))
    with pytest.raises(ShapeError, match="Tq = T"):
        local_window_attention(q[:, :3], k, v, window=2)
    with pytest.raises(ConfigError, match="window: expected a positive integer"):
        local_window_attention(q, k, v, window=0)
    with pytest.raises(ConfigError, match="dilation: the dilated queue is a causal"):
        local_window_attention(q, k, v, window=2, causal=False, dilation=2)


# ---------------------------------------------------------------------- counted_softmax


def repeated_keys_reference(q, k, v, count):
    """Key j listed count[b, i, j] times for query i, then a plain softmax over the list."""
    B, Tq, H, D = q.shape
    o = torch.zeros(B, Tq, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for i in range(Tq):
            keys = [j for j in range(k.shape[1]) for _ in range(int(count[b, i, j]))]
            if keys:
                p = torch.softmax(torch.einsum("hd,jhd->hj", q[b, i], k[b, keys]) * D ** -0.5, -1)
                o[b, i] = torch.einsum("hj,jhv->hv", p, v[b, keys])
    return o


def test_counted_softmax_weighs_a_key_by_its_count():
    q, _, _ = inputs(T=5, grad=True)
    _, k, v = inputs(T=8, seed=1, grad=True)
    g = torch.Generator().manual_seed(2)
    count = torch.randint(0, 3, (2, 5, 8), generator=g)
    count[1, 2] = 0  # an empty memory reads zeros
    got = counted_softmax(q, k, v, count)
    want = repeated_keys_reference(q, k, v, count)
    torch.testing.assert_close(got, want, **F64)
    assert torch.equal(got[1, 2], torch.zeros_like(got[1, 2]))
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    for g_got, g_want in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(g_got, g_want, **F64)


def test_the_membership_rules():
    pos = torch.arange(12)
    causal = in_window(pos[:, None], pos[None, :], 3, True)
    assert causal[5].nonzero().flatten().tolist() == [3, 4, 5]
    centred = in_window(pos[:, None], pos[None, :], 4, False)
    assert centred[5].nonzero().flatten().tolist() == [3, 4, 5, 6]  # n // 2 before, (n - 1) // 2 after
    strided = in_strided_queue(pos[:, None], pos[None, :], 2, 3)
    assert strided[10].nonzero().flatten().tolist() == [6, 9]
    assert strided[2].nonzero().flatten().tolist() == [0]
