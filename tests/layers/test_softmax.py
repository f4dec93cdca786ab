"""memattn.ops.softmax_attention and the `softmax` layer against an explicit reference."""

import math

import pytest
import torch

from memattn.errors import ShapeError
from memattn.layers import KVCache, LayerSpec, build_attention
from memattn.layers.positions import Rotary
from memattn.ops import KVState, softmax_attention


def reference(q, k, v, causal, mask=None):
    """o_t = Σ_j softmax_j(q_t·k_j / √K) v_j, query t at position Tk - Tq + t."""
    B, Tq, H, K = q.shape
    Tk = k.shape[1]
    scores = torch.einsum("bthk,bshk->bhts", q, k) / math.sqrt(K)
    if causal:
        pos = torch.arange(Tq)[:, None] + Tk - Tq
        scores = scores.masked_fill(torch.arange(Tk)[None, :] > pos, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhts,bshv->bthv", scores.softmax(-1), v)


@pytest.mark.parametrize("tq, tk", [(7, 7), (3, 11), (1, 9)])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference(tq, tk, causal):
    q, k = torch.randn(2, tq, 3, 8, dtype=torch.float64), torch.randn(2, tk, 3, 8, dtype=torch.float64)
    v = torch.randn(2, tk, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(softmax_attention(q, k, v, causal=causal)[0], reference(q, k, v, causal))


def test_key_padding_mask():
    q, k, v = (torch.randn(2, 6, 2, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    for causal in (True, False):
        torch.testing.assert_close(softmax_attention(q, k, v, causal=causal, attention_mask=mask)[0],
                                   reference(q, k, v, causal, mask))


@pytest.mark.parametrize("args, message", [
    ((torch.randn(2, 3, 4), torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)), r"q: expected 4 dims"),
    ((torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 4)), r"k: expected \[B, Tk, H, K\] with dim 3 = 4"),
    ((torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4), torch.randn(2, 2, 1, 4)), r"v: expected \[B, Tk, H, V\] with dim 1 = 3"),
    ((torch.randn(1, 5, 1, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)), r"causal attention needs Tq <= Tk"),
])
def test_bad_shapes(args, message):
    with pytest.raises(ShapeError, match=message):
        softmax_attention(*args)


def test_kv_cache_appends_and_keeps_content():
    cache = KVCache()
    ks = [torch.randn(1, n, 2, 3) for n in (2, 1, 5, 1)]
    for k in ks:
        out_k, out_v, mask = cache.update(k, -k)
        assert mask is None  # no padding given, none kept
    torch.testing.assert_close(out_k, torch.cat(ks, 1))
    torch.testing.assert_close(out_v, -torch.cat(ks, 1))
    assert cache.seen == 9 and cache.nbytes() == 2 * 9 * 2 * 3 * 4


def test_kv_cache_keeps_which_keys_were_padding():
    cache = KVCache()
    k = torch.randn(2, 3, 1, 2)
    _, _, mask = cache.update(k, k, torch.tensor([[False, True, True], [True, True, True]]))
    _, _, mask = cache.update(k[:, :1], k[:, :1])  # a step without a mask: its tokens are real
    assert mask.tolist() == [[False, True, True, True], [True, True, True, True]]


@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_layer_is_projections_around_the_reference(positions):
    """The `softmax` layer: q, k, v projections (rotated at their positions), the reference
    read per head, the output projection; and the same with a cache, step by step."""
    layer = build_attention("softmax", {}, LayerSpec(12, 3, positions=positions)).double().eval()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    q, k, v = layer.qkv(x).view(2, 7, 3, 3, 4).unbind(2)
    if positions == "rotary":
        q, k = Rotary(4)(q), Rotary(4)(k)
    want = layer.out(reference(q, k, v, causal=True).reshape(2, 7, 12))
    torch.testing.assert_close(layer(x)[0], want)
    state = layer.init_state(2)
    steps = torch.cat([layer(x[:, t:t + 1], memory_state=state)[0] for t in range(7)], 1)
    torch.testing.assert_close(steps, want)


def test_a_query_with_every_key_masked_reads_its_own():
    q, k, v = (torch.randn(1, 4, 1, 2, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[False, False, True, True]])  # left padding of two
    o, _ = softmax_attention(q, k, v, causal=True, attention_mask=mask)
    torch.testing.assert_close(o[:, :2], v[:, :2])  # the padding: its own value, not NaN
    torch.testing.assert_close(o[:, 2:], reference(q, k, v, True, mask)[:, 2:])


def test_initial_state_is_the_earlier_keys_and_values():
    q, k, v = (torch.randn(2, 9, 2, 4, dtype=torch.float64) for _ in range(3))
    whole, _ = softmax_attention(q, k, v)
    head, state = softmax_attention(q[:, :5], k[:, :5], v[:, :5], output_final_state=True)
    tail, final = softmax_attention(q[:, 5:], k[:, 5:], v[:, 5:], initial_state=state, output_final_state=True)
    torch.testing.assert_close(torch.cat([head, tail], 1), whole)
    assert isinstance(final, KVState)
    torch.testing.assert_close(final.k, k.transpose(1, 2))  # [B, H, T, K]
    torch.testing.assert_close(final.v, v.transpose(1, 2))
    assert softmax_attention(q, k, v)[1] is None
    with pytest.raises(ShapeError, match="initial_state: expected a KVState"):
        softmax_attention(q, k, v, initial_state=torch.zeros(2, 2, 1, 4))


def test_a_cache_read_under_gradient_keeps_the_new_tokens_gradient():
    """Training through a cache: the stored copies are detached, this chunk's keys are not."""
    layer = build_attention("softmax", {}, LayerSpec(8, 2)).double()
    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    (g_full,) = torch.autograd.grad(layer(x)[0][:, 3:].sum(), x)
    state = layer.init_state(1)
    with torch.no_grad():
        layer(x[:, :3], memory_state=state)
    tail = x[:, 3:].detach().requires_grad_()
    (g_tail,) = torch.autograd.grad(layer(tail, memory_state=state)[0].sum(), tail)
    torch.testing.assert_close(g_tail, g_full[:, 3:])
