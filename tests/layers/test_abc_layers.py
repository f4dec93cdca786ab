"""The ABC layers (memattn.layers.abc) against hand-written computations: the op's reference
loops given the layer's own projections, explicit prefix-normalised memories for abc-mlp,
and an explicit sliding-window softmax for abc-window."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError, ShapeError
from memattn.layers import LayerSpec, build_attention, mechanisms
from memattn.layers.abc import random_slots
from memattn.layers.base import parse_options
from memattn.layers.positions import Rotary
from memattn.models import CausalLM
from memattn.ops.abc import abc_reference, bounded_memory_reference

F64 = torch.float64
D_MODEL, HEADS = 16, 2
HEAD = D_MODEL // HEADS
CAUSAL_ABC = ["abc-mlp", "abc-window", "abc-linformer", "abc-random", "abc-meanpool"]


def layer(name, *, causal=True, positions="none", max_len=64, **options):
    spec = LayerSpec(D_MODEL, HEADS, causal=causal, positions=positions, max_len=max_len)
    m = build_attention(name, options, spec).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m


def projections(m, x, positions="none"):
    """q, k, v [B, T, H, D] from the layer's weights, by hand (rotated when asked)."""
    B, T, _ = x.shape
    W, b = m.qkv.weight, m.qkv.bias
    qkv = x @ W.T + (0 if b is None else b)
    q, k, v = (t.reshape(B, T, HEADS, HEAD) for t in qkv.split(D_MODEL, dim=-1))
    if positions == "rotary":
        rot = Rotary(HEAD)
        q, k = rot(q), rot(k)
    return q, k, v


def output(m, o):
    """o [B, T, H, D] -> y [B, T, d] through the layer's output projection, by hand."""
    B, T = o.shape[:2]
    b = m.out.bias
    return o.reshape(B, T, D_MODEL) @ m.out.weight.T + (0 if b is None else b)


def read(q, mem_k, mem_v):
    """q [B, H, K], memories [B, H, M, K/V] -> [B, H, V]: softmax over the slots."""
    p = torch.softmax(torch.einsum("bhk,bhmk->bhm", q, mem_k) * HEAD ** -0.5, dim=-1)
    return torch.einsum("bhm,bhmv->bhv", p, mem_v)


def normalised_alpha_reference(q, k, v, alpha, causal):
    """ABC_MLP with α given directly: K̃_t = Σ_{i≤t} α_i k_i / Σ_{i≤t} α_i per slot."""
    T = q.shape[1]
    o = torch.empty_like(v)
    for t in range(T):
        n = t + 1 if causal else T
        a = alpha[:, :n]  # [B, n, H, M]
        z = a.sum(1)  # [B, H, M]
        mem_k = torch.einsum("bnhm,bnhk->bhmk", a, k[:, :n]) / z[..., None]
        mem_v = torch.einsum("bnhm,bnhv->bhmv", a, v[:, :n]) / z[..., None]
        o[:, t] = read(q[:, t], mem_k, mem_v)
    return o


# ------------------------------------------------------------------------- abc-mlp


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("activation", ["exp", "relu", "sigmoid"])
@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_abc_mlp_equals_prefix_normalised_memory(causal, activation, positions):
    m = layer("abc-mlp", causal=causal, positions=positions, activation=activation,
              num_slots=5, bias=True)
    x = torch.randn(2, 11, D_MODEL, dtype=F64)
    q, k, v = projections(m, x, positions)
    z = (x @ m.phi.weight.T + m.phi.bias).reshape(2, 11, HEADS, 5)
    if activation == "exp":
        alpha = z.exp()
    elif activation == "sigmoid":
        alpha = torch.sigmoid(z)
    else:  # zero α floored at 1e-12 (documented): a slot with only zeros averages uniformly
        alpha = F.relu(z).clamp_min(1e-12)
    want = output(m, normalised_alpha_reference(q, k, v, alpha, causal))
    got, _ = m(x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_abc_mlp_recency_weighs_each_token_by_its_slots_rate(positions):
    """α_i = exp(W_φ x_i + β_m·i): the paper's memory with each slot's logits tilted by its
    rate, so at step t token i's share against token t's shrinks by e^(-β_m (t - i))."""
    m = layer("abc-mlp", positions=positions, num_slots=5, recency=True)
    T = 13
    x = torch.randn(2, T, D_MODEL, dtype=F64)
    q, k, v = projections(m, x, positions)
    z = (x @ m.phi.weight.T).reshape(2, T, HEADS, 5)
    rate = m.rate.reshape(HEADS, 5)
    assert rate.abs().min() > 0  # the helper drew every rate away from 0
    alpha = (z + torch.arange(T, dtype=F64)[:, None, None] * rate).exp()
    want = output(m, normalised_alpha_reference(q, k, v, alpha, True))
    got, _ = m(x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("options", [{"recency": True}, {"forget": True}, {"recency": True, "forget": True}])
def test_abc_mlp_decays_count_real_tokens_only(options):
    """A left-padded row, prefilled then decoded, equals the row alone: the rates tilt by the
    real tokens written, whatever the padding before them (padding forgets nothing)."""
    m = layer("abc-mlp", positions="rotary", num_slots=4, **options)
    x = torch.randn(2, 12, D_MODEL, dtype=F64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False
    state = m.init_state(2)
    with torch.no_grad():  # decoding writes the memory in place
        got = [m(x[:, :7], memory_state=state, attention_mask=mask[:, :7],
                 positions=(mask.cumsum(1) - 1).clamp_min(0)[:, :7])[0]]
        got += [m(x[:, t:t + 1], memory_state=state, positions=(mask.cumsum(1) - 1)[:, t:t + 1])[0]
                for t in range(7, 12)]
        alone, _ = m(x[1:, 4:])
    torch.testing.assert_close(torch.cat(got, 1)[1, 4:], alone[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_abc_mlp_recency_streams_far_past_its_training_length(sign):
    """The state keeps its logits relative to the next token: 3,000 single steps at rates
    of ±(0.1 to 0.5) give the one-pass forward, and with recency (β > 0) the normaliser stays
    near the newest tokens' logits instead of growing with the position."""
    m = layer("abc-mlp", num_slots=4, recency=True)
    with torch.no_grad():
        m.rate.copy_(sign * (0.1 + 0.4 * torch.rand_like(m.rate)))
    x = torch.randn(1, 3000, D_MODEL, dtype=F64)
    state = m.init_state(1)
    with torch.no_grad():
        full, _ = m(x)
        steps = torch.cat([m(x[:, t:t + 1], memory_state=state)[0] for t in range(3000)], 1)
    if sign > 0:
        assert state.inner.log_z.abs().max() < 50  # not the hundreds β·3,000 would be
    torch.testing.assert_close(steps, full, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("recency,piece", [(False, 1024), (True, 1024), (True, 4)])
def test_abc_mlp_forget_weighs_each_token_by_the_rates_of_the_tokens_after_it(recency, piece, monkeypatch):
    """α_i = exp(W_φ x_i + Σ_{j≤i} λ_j (+ β_m·i)), λ = softplus(W_f x + b_f): at step t token
    i's share against token t's shrinks by e^(-Σ_{i<j≤t} λ_j), each token setting its own rate;
    a call longer than PIECE tokens is read in pieces with the same result."""
    import memattn.layers.abc.mlp as mlp

    monkeypatch.setattr(mlp, "PIECE", piece)
    m = layer("abc-mlp", positions="rotary", num_slots=5, forget=True, recency=recency)
    T = 13
    x = torch.randn(2, T, D_MODEL, dtype=F64)
    q, k, v = projections(m, x, "rotary")
    z = (x @ m.phi.weight.T).reshape(2, T, HEADS, 5)
    lam = F.softplus(x @ m.forget.weight.T + m.forget.bias).reshape(2, T, HEADS, 5)
    tilt = lam.cumsum(1)
    if recency:
        tilt = tilt + torch.arange(T, dtype=F64)[:, None, None] * m.rate.reshape(HEADS, 5)
    want = output(m, normalised_alpha_reference(q, k, v, (z + tilt).exp(), True))
    got, _ = m(x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    params = [p for p in m.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(got.square().sum(), params),
                    torch.autograd.grad(want.square().sum(), params, allow_unused=True)):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-8, atol=1e-9)


def test_abc_mlp_forget_starts_with_a_long_horizon():
    """W_f = 0 and b_f = -5 at init: every token forgets softplus(-5) ≈ 0.0067 of the past."""
    m = build_attention("abc-mlp", {"forget": True}, LayerSpec(D_MODEL, HEADS))
    assert not m.forget.weight.any() and torch.all(m.forget.bias == -5.0)


def test_abc_mlp_forget_streams_a_million_tokens_with_a_bounded_state():
    """1,000,000 tokens read in calls of 50,000, the state carried, in float32 beside float64:
    the decays summed over the stream run to tens of thousands, yet the normaliser stays near
    the newest logits, the state finite, and the last call's output is float64's."""
    torch.manual_seed(0)
    m = build_attention("abc-mlp", {"num_slots": 4, "forget": True}, LayerSpec(8, 1)).eval()
    with torch.no_grad():
        m.forget.weight.normal_(0, 0.5)
        m.forget.bias.fill_(-2.0)  # λ around 0.1 a token
    m64 = copy.deepcopy(m).double()
    state, state64, total = m.init_state(1), m64.init_state(1), 0.0
    with torch.no_grad():
        for _ in range(20):
            x = torch.randn(1, 50_000, 8)
            total += m.slot_logits(x)[1].min().item()
            y, _ = m(x, memory_state=state)
            y64, _ = m64(x.double(), memory_state=state64)
    assert total > 10_000 and all(torch.isfinite(t).all() for t in state.tensors())
    assert state.inner.log_z.abs().max() < 100
    torch.testing.assert_close(y.double(), y64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flag", ["recency", "forget"])
def test_abc_mlp_decays_are_refused_without_causal_attention(flag):
    with pytest.raises(ConfigError, match=rf"attention\.{flag}"):
        layer("abc-mlp", causal=False, **{flag: True})


def test_abc_mlp_padding_writes_nothing():
    m = layer("abc-mlp", causal=False, num_slots=4)
    x = torch.randn(2, 9, D_MODEL, dtype=F64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    y, _ = m(x, attention_mask=mask)
    alone, _ = m(x[1:, :6])
    torch.testing.assert_close(y[1, :6], alone[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(y[0], m(x[:1])[0][0], rtol=1e-9, atol=1e-9)


def test_abc_mlp_decoding_state_wraps_the_ops_memory():
    m = layer("abc-mlp", num_slots=6)
    state = m.init_state(3)
    assert state.fixed_size and state.seen == 0
    assert [tuple(t.shape) for t in state.tensors()] == [(3, HEADS, 6), (3, HEADS, 6, HEAD),
                                                         (3, HEADS, 6, HEAD)]
    assert all(t.dtype == F64 for t in state.tensors())
    m(torch.randn(3, 4, D_MODEL, dtype=F64), memory_state=state)
    assert state.seen == 4


def test_tie_phi_shares_one_projection_across_layers():
    def lm(tie):
        cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS, ff_mult=2,
                          max_len=32, attention=AttentionConfig(
                              "abc-mlp", {"num_slots": 4, "tie_phi": tie}))
        return CausalLM(cfg)

    tied, untied = lm(True), lm(False)
    a, b = tied.blocks[0].attn.phi, tied.blocks[1].attn.phi
    assert a is b and a.weight is b.weight
    assert untied.blocks[0].attn.phi is not untied.blocks[1].attn.phi
    assert untied.num_parameters() - tied.num_parameters() == D_MODEL * HEADS * 4
    # one tensor: a gradient from either layer lands on it
    tied(torch.randint(0, 11, (1, 5))).sum().backward()
    assert a.weight.grad is not None and a.weight.grad.abs().sum() > 0


def test_cross_slots_defaults_to_num_slots():
    assert parse_options("abc-mlp", {"num_slots": 7}).cross_slots == 7
    assert parse_options("abc-mlp", {"num_slots": 7, "cross_slots": 3}).cross_slots == 3


# ------------------------------------------------------------------------- abc-window


def window_reference(q, k, v, n, causal):
    """Explicit softmax over the window of n tokens: causal t-n+1..t, bidirectional
    t - n // 2 .. t + (n - 1) // 2."""
    T = q.shape[1]
    o = torch.empty_like(v)
    for t in range(T):
        lo, hi = (max(0, t - n + 1), t + 1) if causal else (max(0, t - n // 2),
                                                             min(T, t + (n - 1) // 2 + 1))
        o[:, t] = read(q[:, t], k[:, lo:hi].transpose(1, 2), v[:, lo:hi].transpose(1, 2))
    return o


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("positions", ["none", "rotary"])
@pytest.mark.parametrize("window", [1, 4, 5, 13])  # < T: in blocks; T itself: one pass
def test_abc_window_equals_softmax_over_the_last_n_tokens(causal, positions, window):
    m = layer("abc-window", causal=causal, positions=positions, window=window)
    x = torch.randn(2, 13, D_MODEL, dtype=F64)
    q, k, v = projections(m, x, positions)
    want = output(m, window_reference(q, k, v, window, causal))
    torch.testing.assert_close(m(x)[0], want, rtol=1e-9, atol=1e-9)


def test_abc_window_is_the_fifo_memory_of_the_paper():
    """The shift-matrix control K̃_t = U K̃_{t-1} + e_n ⊗ k_t, simulated slot by slot, holds
    the same memory the layer reads (empty slots are left out of the softmax)."""
    n = 3
    m = layer("abc-window", window=n)
    x = torch.randn(1, 8, D_MODEL, dtype=F64)
    q, k, v = projections(m, x)
    mem_k = torch.zeros(1, HEADS, n, HEAD, dtype=F64)
    mem_v = torch.zeros_like(mem_k)
    o = torch.empty_like(v)
    for t in range(8):
        mem_k = torch.cat([mem_k[:, :, 1:], k[:, t, :, None]], 2)  # U K̃ + e_n ⊗ k_t
        mem_v = torch.cat([mem_v[:, :, 1:], v[:, t, :, None]], 2)
        used = min(t + 1, n)
        o[:, t] = read(q[:, t], mem_k[:, :, n - used:], mem_v[:, :, n - used:])
    torch.testing.assert_close(m(x)[0], output(m, o), rtol=1e-9, atol=1e-9)


def test_abc_window_padding_is_masked():
    m = layer("abc-window", causal=False, window=6)
    x = torch.randn(2, 9, D_MODEL, dtype=F64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    y, _ = m(x, attention_mask=mask)
    torch.testing.assert_close(y[1, :5], m(x[1:, :5])[0][0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name,options", [("abc-window", {}), ("abc-dilated", {"dilation": 2})])
def test_causal_window_queues_never_read_left_padding(name, options):
    m = layer(name, window=3, **options)
    x = torch.randn(2, 10, D_MODEL, dtype=F64)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :4] = False
    y, _ = m(x, attention_mask=mask)
    torch.testing.assert_close(y[1, 4:], m(x[1:, 4:])[0][0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("positions", ["none", "rotary"])
@pytest.mark.parametrize("n,d", [(3, 2), (2, 5), (4, 1), (20, 3)])  # T = 15 > n: in blocks
def test_abc_dilated_reads_the_local_and_the_strided_queue(positions, n, d):
    """Memory of token t: the last n tokens and the last n tokens at multiples of d, a
    token in both held twice (so it weighs twice in the softmax)."""
    T = 15
    m = layer("abc-dilated", positions=positions, window=n, dilation=d)
    x = torch.randn(2, T, D_MODEL, dtype=F64)
    q, k, v = projections(m, x, positions)
    o = torch.empty_like(v)
    for t in range(T):
        slots = list(range(max(0, t - n + 1), t + 1)) + list(range(0, t + 1, d))[-n:]
        o[:, t] = read(q[:, t], k[:, slots].transpose(1, 2), v[:, slots].transpose(1, 2))
    torch.testing.assert_close(m(x)[0], output(m, o), rtol=1e-9, atol=1e-9)
    with pytest.raises(ConfigError, match="causal only"):
        build_attention("abc-dilated", {}, LayerSpec(D_MODEL, HEADS, causal=False))


# ------------------------------------------------------------------ given-φ strategies


@pytest.mark.parametrize("causal", [True, False])
def test_abc_linformer_equals_bounded_memory_with_learned_columns(causal):
    m = layer("abc-linformer", causal=causal, max_len=20, num_slots=5)
    x = torch.randn(2, 12, D_MODEL, dtype=F64)
    q, k, v = projections(m, x)
    phi = torch.log1p(torch.exp(m.columns[:12]))[None, :, None, :].expand(2, 12, HEADS, 5)
    o, _ = bounded_memory_reference(q, k, v, phi.contiguous(), causal=causal)
    torch.testing.assert_close(m(x)[0], output(m, o), rtol=1e-9, atol=1e-9)


def test_abc_linformer_rejects_a_longer_sequence_than_it_was_built_for():
    m = layer("abc-linformer", max_len=8, num_slots=3)
    m(torch.randn(1, 8, D_MODEL, dtype=F64))
    with pytest.raises(ShapeError, match="longer sequence than it was built for.*max_len=8"):
        m(torch.randn(1, 9, D_MODEL, dtype=F64))
    state = m.init_state(1)
    m(torch.randn(1, 8, D_MODEL, dtype=F64), memory_state=state)
    with pytest.raises(ShapeError, match="longer sequence than it was built for"):
        m(torch.randn(1, 1, D_MODEL, dtype=F64), memory_state=state)


@pytest.mark.parametrize("causal", [True, False])
def test_abc_meanpool_slots_hold_block_means(causal):
    c, M, T = 3, 5, 13
    m = layer("abc-meanpool", causal=causal, pool=c, num_slots=M)
    x = torch.randn(2, T, D_MODEL, dtype=F64)
    q, k, v = projections(m, x)
    phi = torch.zeros(2, T, HEADS, M, dtype=F64)
    for t in range(T):
        phi[:, t, :, t // c] = 1.0 / c
    o, _ = bounded_memory_reference(q, k, v, phi, causal=causal)
    torch.testing.assert_close(m(x)[0], output(m, o), rtol=1e-9, atol=1e-9)
    # not causal, a full block's slot is the plain mean of its keys
    if not causal:
        full_k = torch.einsum("bthm,bthk->bhmk", phi, k)
        torch.testing.assert_close(full_k[:, :, 1], k[:, 3:6].mean(1))


def test_abc_meanpool_past_its_capacity_is_a_clear_error():
    m = layer("abc-meanpool", pool=2, num_slots=3)
    with pytest.raises(ShapeError, match=r"num_slots \* attention.pool = 3 \* 2 = 6"):
        m(torch.randn(1, 7, D_MODEL, dtype=F64))


@pytest.mark.parametrize("causal", [True, False])
def test_abc_random_writes_each_token_to_one_hashed_slot(causal):
    M, T = 4, 10
    m = layer("abc-random", causal=causal, num_slots=M, seed=3)
    x = torch.randn(2, T, D_MODEL, dtype=F64)
    q, k, v = projections(m, x)
    ids = random_slots(torch.arange(T), HEADS, M, 3)
    phi = torch.zeros(2, T, HEADS, M, dtype=F64)
    for t in range(T):
        for h in range(HEADS):
            phi[:, t, h, ids[t, h]] = 1.0
    o, _ = bounded_memory_reference(q, k, v, phi, causal=causal)
    torch.testing.assert_close(m(x)[0], output(m, o), rtol=1e-9, atol=1e-9)


def test_random_slots_are_fixed_by_position_and_spread_evenly():
    pos = torch.arange(6400)
    ids = random_slots(pos, 3, 32, 0)
    assert torch.equal(random_slots(pos[100:110], 3, 32, 0), ids[100:110])  # decoding agrees
    assert ids.min() >= 0 and ids.max() < 32
    counts = torch.bincount(ids[:, 0], minlength=32)
    assert counts.min() > 120 and counts.max() < 280  # 200 expected per slot
    assert not torch.equal(ids[:, 0], ids[:, 1])  # heads differ
    assert not torch.equal(random_slots(pos, 3, 32, 1), ids)  # the seed matters


def test_abc_l2g_memory_is_the_global_tokens():
    c, M, T = 3, 5, 14
    m = layer("abc-l2g", every=c, num_slots=M)
    x = torch.randn(2, T, D_MODEL, dtype=F64)
    q, k, v = projections(m, x)
    # slot j = token jc; the empty slots score 0 and read 0 (a softmax over all M slots)
    phi = torch.zeros(2, T, HEADS, M, dtype=F64)
    for j in range(0, T, c):
        phi[:, j, :, j // c] = 1.0
    ref, _ = bounded_memory_reference(q, k, v, phi)
    got, _ = m(x)
    torch.testing.assert_close(got, output(m, ref), rtol=1e-9, atol=1e-9)
    # once all M slots are written, the read is exactly softmax over the global tokens
    m2 = layer("abc-l2g", every=c, num_slots=3)
    x2 = torch.randn(1, 9, D_MODEL, dtype=F64)
    q2, k2, v2 = projections(m2, x2)
    want = read(q2[:, 8], k2[:, [0, 3, 6]].transpose(1, 2), v2[:, [0, 3, 6]].transpose(1, 2))
    torch.testing.assert_close(m2(x2)[0][:, 8], output(m2, want[:, None])[:, 0],
                               rtol=1e-9, atol=1e-9)
    with pytest.raises(ShapeError, match=r"num_slots \* attention.every = 3 \* 3 = 9"):
        m2(torch.randn(1, 10, D_MODEL, dtype=F64))
    with pytest.raises(ConfigError, match="causal only"):
        build_attention("abc-l2g", {}, LayerSpec(D_MODEL, HEADS, causal=False))


def test_abc_workspace_reads_the_previous_layers_memory():
    M = 4
    shared = {}
    layers = []
    for i in range(2):
        spec = LayerSpec(D_MODEL, HEADS, causal=False, positions="none", layer_idx=i,
                         n_layers=2, shared=shared)
        layers.append(build_attention("abc-workspace", {"num_slots": M}, spec).double())
    assert layers[0].workspace is layers[1].workspace
    x0, x1 = torch.randn(2, 2, 9, D_MODEL, dtype=F64)
    passed = {}  # one forward pass's layer outputs, given explicitly
    y0, _ = layers[0](x0, layer_outputs=passed)
    y1, _ = layers[1](x1, layer_outputs=passed)
    assert sorted(passed) == [0, 1]
    again, _ = layers[1](x1, layer_outputs=passed)  # recomputed: the same input, the same output
    torch.testing.assert_close(again, y1, rtol=0, atol=0)
    # by hand: logits k_i · P_m / √D, memory normalised over the sequence per slot
    q, k, v = projections(layers[0], x0)
    P0 = layers[0].workspace.initial
    s0 = torch.einsum("bthd,hmd->bthm", k, P0) / HEAD ** 0.5
    o0, st = abc_reference(q, k, v, s0, causal=False, output_final_state=True)
    alpha = s0.exp()
    mem_k = torch.einsum("bthm,bthd->bhmd", alpha, k) / alpha.sum(1)[..., None]
    torch.testing.assert_close(st.k, mem_k)
    torch.testing.assert_close(y0, output(layers[0], o0), rtol=1e-9, atol=1e-9)
    q, k, v = projections(layers[1], x1)
    s1 = torch.einsum("bthd,bhmd->bthm", k, mem_k) / HEAD ** 0.5
    o1, _ = abc_reference(q, k, v, s1, causal=False)
    torch.testing.assert_close(y1, output(layers[1], o1), rtol=1e-9, atol=1e-9)
    y1.sum().backward()  # the second layer's output depends on the first's memory
    assert P0.grad is not None and P0.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="bidirectional only"):
        build_attention("abc-workspace", {}, LayerSpec(D_MODEL, HEADS, causal=True))


# ---------------------------------------------------------------- decoding, all layers


@pytest.mark.parametrize("name,options", [
    ("abc-mlp", {"num_slots": 3}), ("abc-mlp", {"num_slots": 3, "activation": "relu"}),
    ("abc-mlp", {"num_slots": 3, "recency": True}), ("abc-mlp", {"num_slots": 3, "forget": True}),
    ("abc-window", {"window": 4}), ("abc-linformer", {"num_slots": 3}),
    ("abc-random", {"num_slots": 3}), ("abc-meanpool", {"num_slots": 8, "pool": 3}),
    ("abc-l2g", {"num_slots": 8, "every": 3}),
    ("abc-dilated", {"window": 3, "dilation": 2}), ("abc-dilated", {"window": 2, "dilation": 4}),
    ("abc-cluster", {"num_clusters": 3}),
])
def test_decoding_in_pieces_equals_the_full_forward(name, options):
    """Rotary, a window / memory smaller than the sequence, prefill then single tokens."""
    m = layer(name, positions="rotary", **options)
    x = torch.randn(2, 19, D_MODEL, dtype=F64)
    full, _ = m(x)
    state = m.init_state(2)
    pieces = [m(x[:, :5], memory_state=state)[0], m(x[:, 5:11], memory_state=state)[0]]
    pieces += [m(x[:, t:t + 1], memory_state=state)[0] for t in range(11, 19)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-9, atol=1e-9)
    assert state.seen == 19


@pytest.mark.parametrize("name,options", [
    ("abc-mlp", {"num_slots": 4}), ("abc-window", {"window": 8}),
    ("abc-linformer", {"num_slots": 4}), ("abc-random", {"num_slots": 4}),
    ("abc-meanpool", {"num_slots": 4, "pool": 2600}),
    ("abc-l2g", {"num_slots": 4, "every": 2600}),
    ("abc-dilated", {"window": 4, "dilation": 3}), ("abc-cluster", {"num_clusters": 4}),
])
def test_decoding_state_does_not_grow(name, options):
    spec = LayerSpec(D_MODEL, HEADS, causal=True, positions="rotary", max_len=10_001)
    m = build_attention(name, options, spec).eval()
    state = m.init_state(1)
    assert state.fixed_size

    def size():
        return state.nbytes(), [tuple(t.shape) for t in state.tensors()]

    xs = torch.randn(10_000, 1, 1, D_MODEL)
    with torch.no_grad():
        for t in range(100):
            m(xs[t], memory_state=state)
        at_100 = size()
        for t in range(100, 10_000):
            m(xs[t], memory_state=state)
    assert state.seen == 10_000
    assert size() == at_100 and at_100[0] > 0
    assert all(torch.isfinite(t.float()).all() for t in state.tensors())


@pytest.mark.parametrize("name,options", [
    ("abc-mlp", {"activation": "exp"}), ("abc-mlp", {"activation": "relu"}),
    ("abc-mlp", {"activation": "sigmoid"}), ("abc-mlp", {"recency": True}), ("abc-mlp", {"forget": True}),
    ("abc-window", {"window": 3}), ("abc-dilated", {"window": 3}), ("abc-linformer", {}), ("abc-random", {}),
    ("abc-meanpool", {}), ("abc-l2g", {"every": 2}), ("abc-cluster", {"num_clusters": 3}),
])
def test_gradients_reach_every_parameter_and_stay_finite(name, options):
    spec = LayerSpec(D_MODEL, HEADS, causal=True, positions="rotary", max_len=32)
    m = build_attention(name, options, spec)
    x = torch.randn(2, 12, D_MODEL, requires_grad=True)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False  # left padding: the first queries of row 1 see no real token
    y, _ = m(x, attention_mask=mask)
    y[mask].pow(2).sum().backward()
    assert torch.isfinite(y[mask]).all()
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert torch.isfinite(x.grad).all()


# ------------------------------------------------------------------ options, registry


@pytest.mark.parametrize("name,options,named", [
    ("abc-mlp", {"num_slots": 0}, "num_slots"),
    ("abc-mlp", {"cross_slots": 0}, "cross_slots"),
    ("abc-mlp", {"activation": "tanh"}, "activation"),
    ("abc-mlp", {"tie_phi": "yes"}, "tie_phi"), ("abc-mlp", {"recency": "yes"}, "recency"),
    ("abc-mlp", {"forget": "yes"}, "forget"),
    ("abc-window", {"window": 0}, "window"),
    ("abc-linformer", {"num_slots": -1}, "num_slots"),
    ("abc-random", {"num_slots": 0}, "num_slots"),
    ("abc-meanpool", {"pool": 0}, "pool"),
    ("abc-meanpool", {"slots": 4}, "slots"),
    ("abc-l2g", {"every": 0}, "every"),
    ("abc-dilated", {"dilation": 0}, "dilation"),
    ("abc-dilated", {"window": 0}, "window"),
    ("abc-workspace", {"num_slots": 0}, "num_slots"),
    ("abc-cluster", {"num_clusters": 0}, "num_clusters"), ("abc-cluster", {"iters": 0}, "iters"),
    ("abc-cluster", {"decay": 1.0}, "decay"),
])
def test_bad_options_are_config_errors_naming_the_option(name, options, named):
    with pytest.raises(ConfigError, match=rf"attention\.{named}"):
        AttentionConfig(name, options)


def test_the_abc_layers_are_registered_for_causal_and_bidirectional_models():
    known = mechanisms()
    for name in CAUSAL_ABC:
        assert known[name].causal and known[name].bidirectional, name
    for name in ("abc-l2g", "abc-dilated"):
        assert known[name].causal and not known[name].bidirectional, name
    assert known["abc-workspace"].bidirectional and not known["abc-workspace"].causal


def kmeans_by_hand(keys, n, iters):
    """keys [T, D] -> cluster of each key [T]: initial centres at ranks ⌊jT/n⌋, Lloyd by loops."""
    T = keys.shape[0]
    centres = [keys[j * T // n].clone() for j in range(n)]

    def assign():
        return [min(range(n), key=lambda j: (float(((keys[t] - centres[j]) ** 2).sum()), j))
                for t in range(T)]

    for _ in range(iters):
        c = assign()
        for j in range(n):
            members = [keys[t] for t in range(T) if c[t] == j]
            if members:
                centres[j] = torch.stack(members).mean(0)
    return assign()


@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_abc_cluster_slots_hold_cluster_means(positions):
    n, iters = 3, 2
    m = layer("abc-cluster", causal=False, positions=positions, num_clusters=n, iters=iters)
    x = torch.randn(2, 9, D_MODEL, dtype=F64)
    q, k, v = projections(m, x, positions)
    o = torch.zeros_like(q)
    for b in range(2):
        for h in range(HEADS):
            c = kmeans_by_hand(k[b, :, h].detach(), n, iters)
            assert len(set(c)) > 1  # the keys do fall into several clusters
            mem_k = torch.zeros(n, HEAD, dtype=F64)
            mem_v = torch.zeros(n, HEAD, dtype=F64)
            for j in range(n):
                idx = [t for t in range(9) if c[t] == j]
                if idx:
                    mem_k[j], mem_v[j] = k[b, idx, h].mean(0), v[b, idx, h].mean(0)
            for t in range(9):
                p = torch.softmax(mem_k @ q[b, t, h] / HEAD ** 0.5, -1)
                o[b, t, h] = p @ mem_v
    torch.testing.assert_close(m(x)[0], output(m, o))


def test_abc_cluster_padding_writes_nothing_and_bidirectional_has_no_decoding_state():
    m = layer("abc-cluster", causal=False, num_clusters=4)
    x = torch.randn(1, 10, D_MODEL, dtype=F64)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 6:] = False
    y = m(x, attention_mask=mask)[0]
    torch.testing.assert_close(y[:, :6], m(x[:, :6])[0])
    with pytest.raises(ConfigError, match="no decoding state"):
        m.init_state(1)


@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_causal_abc_cluster_slots_hold_prefix_means_of_the_nearest_centre(positions):
    n = 3
    m = layer("abc-cluster", positions=positions, num_clusters=n)
    x = torch.randn(2, 11, D_MODEL, dtype=F64)
    q, k, v = projections(m, x, positions)
    centres = m.centres.double()
    o = torch.zeros_like(q)
    for b in range(2):
        for h in range(HEADS):
            kk = k[b, :, h].detach()
            cos = [[float(kk[t] @ centres[h, j] / kk[t].norm()) for j in range(n)]
                   for t in range(11)]
            c = [max(range(n), key=lambda j: cos[t][j]) for t in range(11)]
            assert len(set(c)) > 1
            for t in range(11):
                mem_k = torch.zeros(n, HEAD, dtype=F64)
                mem_v = torch.zeros(n, HEAD, dtype=F64)
                for j in range(n):
                    idx = [i for i in range(t + 1) if c[i] == j] or list(range(t + 1))
                    mem_k[j], mem_v[j] = k[b, idx, h].mean(0), v[b, idx, h].mean(0)
                p = torch.softmax(mem_k @ q[b, t, h] / HEAD ** 0.5, -1)
                o[b, t, h] = p @ mem_v
    torch.testing.assert_close(m(x)[0], output(m, o))


def test_causal_abc_cluster_centres_follow_the_keys_in_training_only():
    m = layer("abc-cluster", num_clusters=2, decay=0.5)
    x = torch.randn(1, 8, D_MODEL, dtype=F64)
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, 5:] = False
    before = m.centres.clone()
    m(x, attention_mask=mask)
    torch.testing.assert_close(m.centres, before)  # eval: fixed
    m.train()
    m(x, attention_mask=mask)
    _, k, _ = projections(m, x)
    unit = F.normalize(k[0, :5], dim=-1)  # real tokens only
    for h in range(HEADS):
        c = (unit[:, h] @ before[h].double().T).argmax(-1)
        for j in range(2):
            if (c == j).any():
                want = F.normalize(0.5 * before[h, j].double() + 0.5 * unit[c == j, h].mean(0),
                                   dim=0)
            else:
                want = before[h, j].double()
            torch.testing.assert_close(m.centres[h, j].double(), want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(m.centres, before)


def test_phi_init_std_sets_w_phi_alone_and_survives_the_model_init():
    from memattn.models import CausalLM, EncoderDecoder

    def model(cls=CausalLM, **options):
        torch.manual_seed(0)
        return cls(ModelConfig(vocab_size=11, d_model=64, n_layers=2, n_heads=4, init_std=0.02,
                               attention=AttentionConfig("abc-mlp", {"num_slots": 32, **options})))

    default, plain, wide = model(), model(phi_init_std=0), model(phi_init_std=0.5)
    for a, b, c in zip(default.blocks, plain.blocks, wide.blocks):
        assert a.attn.phi.weight.std().item() == pytest.approx((8 / 64) ** 0.5, rel=0.05)
        assert b.attn.phi.weight.std().item() == pytest.approx(0.02, rel=0.05)  # the model's init
        assert c.attn.phi.weight.std().item() == pytest.approx(0.5, rel=0.05)
        assert a.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)  # the rest as before
    for block in model(EncoderDecoder, phi_init_std=0.5).decoder.blocks:  # cross attention too
        assert block.cross.phi.weight.std().item() == pytest.approx(0.5, rel=0.05)
        assert block.attn.phi.weight.std().item() == pytest.approx(0.5, rel=0.05)
    with pytest.raises(ConfigError, match="phi_init_std"):
        AttentionConfig("abc-mlp", {"phi_init_std": -1.0})


@pytest.mark.parametrize("first", [2, 4, 9])
def test_abc_window_continues_a_long_chunk_in_blocks(first):
    """A chunk longer than the window after a prefix (a held queue partly or wholly full)
    equals the full pass, through the blocked path rather than a [T, T + n] count."""
    m = layer("abc-window", positions="rotary", window=4)
    x = torch.randn(2, first + 23, D_MODEL, dtype=F64)
    state = m.init_state(2, dtype=F64)
    a, state = m(x[:, :first], memory_state=state)
    b, state = m(x[:, first:], memory_state=state)
    torch.testing.assert_close(torch.cat([a, b], 1), m(x)[0], rtol=1e-9, atol=1e-9)
    c, _ = m(x[:, :3], memory_state=state)  # and goes on decoding from the queue it left
    full = m(torch.cat([x, x[:, :3]], 1))[0]
    torch.testing.assert_close(c, full[:, -3:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", sorted(mechanisms()))
def test_every_layer_refuses_heads_that_do_not_divide_the_width(name):
    with pytest.raises(ConfigError, match=r"model.d_model: 10 is not divisible by model.n_heads=3"):
        build_attention(name, {}, LayerSpec(10, 3))
