"""The `persistent` layer: options and their errors, initialisation, the variants' wiring,
decoding with the cache, adaptive span, and segment-level caching."""

import math

import pytest
import torch

from memattn.config import AttentionConfig, ModelConfig
from memattn.train import project_parameters
from memattn.errors import ConfigError
from memattn.layers import LayerSpec, build_attention, get_mechanism
from memattn.layers.base import KVCache
from memattn.layers.persistent import PersistentMemory, SoftmaxFeedForward
from memattn.models import CausalLM, Encoder
from memattn.ops.persistent import persistent_attention_reference

F64 = torch.float64


def model(options=None, *, cls=CausalLM, **kw):
    base = dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=64,
                attention=AttentionConfig("persistent", dict(options or {})))
    base.update(kw)
    return cls(ModelConfig(**base)).double().eval()


def layer(options=None, *, causal=True, positions="none", n_heads=4, d_model=32):
    spec = LayerSpec(d_model, n_heads, causal=causal, positions=positions, max_len=64)
    return build_attention("persistent", dict(options or {}), spec).double().eval()


# -- options ---------------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"n_persistent": -1}, r"attention\.n_persistent: expected a number of persistent vectors N >= 0, got -1"),
    ({"adaptive_span": True}, r"attention\.span_max: adaptive_span needs a maximum span .*got 0"),
    ({"variant": "both"}, r"attention\.variant: expected one of all-attn, attn-split, head-split, single-head, ff-attn, got 'both'"),
    ({"context": "window"}, r"attention\.window: context 'window' needs the number of tokens a query sees \(>= 1\), got 0"),
    ({"window": 8}, r"attention\.window: only read with attention\.context=window"),
    ({"variant": "head-split", "n_persistent": 0}, r"variant 'head-split' needs N >= 1"),
    ({"variant": "ff-attn", "n_persistent": 0}, r"variant 'ff-attn' needs N >= 1"),
    ({"span_ramp": 0}, r"attention\.span_ramp: expected a ramp of >= 1 tokens, got 0"),
    ({"span_init": 1.5}, r"attention\.span_init: expected a fraction of span_max in \[0, 1\], got 1\.5"),
    ({"span_loss": -1.0}, r"attention\.span_loss: expected a coefficient >= 0"),
    ({"n_persistent": "many"}, r"attention\.n_persistent: expected an integer, got 'many'"),
])
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        AttentionConfig("persistent", options)


def test_head_split_with_an_odd_head_count_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"head-split .* needs an even model\.n_heads, got 3"):
        model({"variant": "head-split"}, n_heads=3, d_model=30, positions="none")


def test_registry_entry():
    mech = get_mechanism("persistent")
    assert mech.causal and mech.bidirectional and mech.replaces_feedforward


# -- initialisation --------------------------------------------------------------------------

def test_reparameterised_initialisation_has_unit_variance():
    torch.manual_seed(0)
    D, N, draws = 16, 64, 200
    keys, values, raw_k, raw_v = [], [], [], []
    for _ in range(draws):
        memory = PersistentMemory(2, N, D, D)
        k, v = memory()
        keys.append(k.detach().flatten()), values.append(v.detach().flatten())
        raw_k.append(memory.keys.detach().flatten()), raw_v.append(memory.values.detach().flatten())
    k, v, rk, rv = (torch.cat(x).double() for x in (keys, values, raw_k, raw_v))
    n = k.numel()  # 409,600 numbers: the standard error of a variance is about √(2/n) = 0.002
    assert abs(k.mean()) < 5 / math.sqrt(n) and abs(v.mean()) < 5 / math.sqrt(n)
    assert k.var().item() == pytest.approx(1.0, abs=0.01) and v.var().item() == pytest.approx(1.0, abs=0.01)
    assert rk.var().item() == pytest.approx(1 / D, rel=0.01)  # k′ ~ N(0, 1/d_h)
    assert rv.var().item() == pytest.approx(1 / N, rel=0.01)  # v′ ~ N(0, 1/N)


def test_the_model_initialisation_leaves_the_persistent_vectors_alone():
    torch.manual_seed(1)
    m = model({"n_persistent": 300})
    k, v = m.blocks[0].attn.persistent()
    assert k.var().item() == pytest.approx(1.0, abs=0.05) and v.var().item() == pytest.approx(1.0, abs=0.05)


# -- variants: structure and wiring -----------------------------------------------------------

def test_all_attention_blocks_have_no_feed_forward_and_ff_attn_has_its_own():
    assert all(b.ff is None and b.norm_ff is None for b in model().blocks)
    assert all(b.ff is None for b in model({"n_persistent": 0}).blocks)
    ff = model({"variant": "ff-attn", "n_persistent": 7})
    assert all(isinstance(b.ff, SoftmaxFeedForward) and b.norm_ff is not None for b in ff.blocks)
    assert all(b.attn.persistent is None for b in ff.blocks)  # its attention reads the context only


@pytest.mark.parametrize("variant, per_layer", [
    ("all-attn", 2 * 4 * 8 * 8),  # k and v: H·N·D each
    ("attn-split", 2 * 4 * 8 * 8),
    ("head-split", 2 * 2 * 8 * 8 - 2 * 32 * 16),  # persistent heads only; k, v of the context heads only
    ("single-head", 2 * 8 * 32),  # N vectors of size d
    ("ff-attn", 2 * 8 * 32 + 2 * 32),  # the FF sublayer's N vectors of size d and its norm
])
def test_parameter_counts(variant, per_layer):
    base = model({"n_persistent": 0}, positions="none").num_parameters()
    m = model({"variant": variant, "n_persistent": 8}, positions="none")
    assert m.num_parameters() - base == 2 * per_layer


def reference_layer_output(lay, x):
    """The layer's output recomputed from its parameters with the op's reference."""
    B, T, d = x.shape
    H, Hc, D = lay.spec.n_heads, lay.n_context_heads, lay.spec.head_dim
    q, k, v = lay.qkv(x).split([H * D, Hc * D, Hc * D], -1)  # q rows, then k, then v
    q, k, v = q.view(B, T, H, D), k.view(B, T, Hc, D), v.view(B, T, Hc, D)
    pk, pv = lay.persistent()
    o, _ = persistent_attention_reference(q, k, v, pk, pv, causal=lay.spec.causal, variant=lay.op_variant)
    return lay.out(o.reshape(B, T, d))


@pytest.mark.parametrize("variant", ["all-attn", "attn-split", "head-split"])
def test_layer_is_the_op_on_its_projections(variant):
    lay = layer({"variant": variant, "n_persistent": 6})
    x = torch.randn(2, 9, 32, dtype=F64)
    torch.testing.assert_close(lay(x)[0], reference_layer_output(lay, x))


def test_single_head_by_hand():
    """single-head: N vectors of size d; their score is the full-width q·k_n / √d, the same in
    every head, normalised jointly with each head's context scores; a head reads its slice
    of the values."""
    lay = layer({"variant": "single-head", "n_persistent": 5})
    x = torch.randn(1, 4, 32, dtype=F64)
    H, D, d = 4, 8, 32
    q, k, v = lay.qkv(x)[0].split(d, -1)  # [T, d] each
    k, v = k.view(4, H, D), v.view(4, H, D)
    pk, pv = (t[0] for t in lay.persistent())  # [N, d]
    o = torch.zeros(4, d, dtype=F64)
    for t in range(4):
        shared = pk @ q[t] / math.sqrt(d)  # [N]
        for h in range(H):
            heads = slice(h * D, (h + 1) * D)
            context = k[:t + 1, h] @ q[t, heads] / math.sqrt(D)  # [t + 1]
            a = torch.softmax(torch.cat([context, shared]), 0)
            o[t, heads] = a[:t + 1] @ v[:t + 1, h] + a[t + 1:] @ pv[:, heads]
    torch.testing.assert_close(lay(x)[0][0], lay.out(o))


def test_rotary_positions_leave_the_persistent_scores_position_free():
    """Under rotary positions the persistent vectors are read with the unrotated query, so a
    token's read of them does not depend on where it sits (attn-split isolates that read)."""
    lay = layer({"variant": "attn-split", "n_persistent": 4}, positions="rotary")
    lay.qkv.weight.data[64:].zero_()  # context values zero: the context read adds nothing
    x = torch.randn(1, 1, 32, dtype=F64)
    first, _ = lay(x, memory_state=lay.init_state(1))
    state = lay.init_state(1)
    lay(torch.randn(1, 5, 32, dtype=F64), memory_state=state)
    later, _ = lay(x, memory_state=state)  # the same token at position 5
    torch.testing.assert_close(first, later)


# -- decoding with the cache ------------------------------------------------------------------

DECODE_CASES = {
    "all-attn": {"n_persistent": 5},
    "attn-split": {"variant": "attn-split", "n_persistent": 5},
    "head-split": {"variant": "head-split", "n_persistent": 5},
    "single-head": {"variant": "single-head", "n_persistent": 5},
    "ff-attn": {"variant": "ff-attn", "n_persistent": 5},
    "N=0": {"n_persistent": 0},
    "window": {"context": "window", "window": 6},
    "relative": {"relative_positions": True, "max_distance": 9},
    "adaptive span": {"adaptive_span": True, "span_max": 12, "span_ramp": 3, "span_init": 0.3},
    "all options": {"variant": "head-split", "n_persistent": 3, "context": "window", "window": 8,
                    "relative_positions": True, "adaptive_span": True, "span_max": 10, "span_ramp": 2,
                    "span_init": 0.5},
}


@pytest.mark.parametrize("positions", ["rotary", "none"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decoding_equals_the_full_forward_pass(case, positions):
    m = model(DECODE_CASES[case], positions=positions)
    idx = torch.randint(0, 37, (2, 25))
    full = m(idx)
    cache = m.init_cache(2)
    parts = [m(idx[:, :11], cache=cache), m(idx[:, 11:15], cache=cache)]
    parts += [m(idx[:, t:t + 1], cache=cache) for t in range(15, 25)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case, kept", [
    ("all-attn", (30, 70)),  # grows with the context
    ("window", (5, 5)),  # window 6: the 5 tokens before the next query
    ("adaptive span", (7, 7)),  # z = 0.3 · 12 = 3.6, R = 3: ⌈z + R⌉ = 7 (< span_max - 1 = 11)
])
def test_cache_is_bounded_by_the_window_or_the_learned_span(case, kept):
    m = model(DECODE_CASES[case])
    cache = m.init_cache(1)
    for tokens, expected in zip((30, 40), kept):
        m(torch.zeros(1, tokens, dtype=torch.long), cache=cache)
        assert {s.past()[0].shape[1] for s in cache.states} == {expected}
    assert cache.fixed_size is (case != "all-attn")
    assert cache.nbytes() == 2 * 2 * kept[1] * 32 * 8  # layers x (k, v) x tokens x d x fp64


def test_adaptive_span_cache_keeps_span_max_in_training_and_the_learned_span_in_eval():
    lay = layer({"adaptive_span": True, "span_max": 20, "span_ramp": 4, "span_init": 0.25})
    assert lay.cache_tokens() == math.ceil(5 + 4)  # eval: ⌈max z + R⌉
    lay.span.data[1] = 0.5
    assert lay.cache_tokens() == 14
    lay.train()
    assert lay.cache_tokens() == 19  # training: every token a growing span may reach
    state = lay.init_state(1)
    assert state.fixed_size and state.limit == 19


# -- adaptive span ----------------------------------------------------------------------------

def test_span_loss_and_its_gradient():
    m = model({"adaptive_span": True, "span_max": 40, "span_loss": 0.01, "span_init": 0.5})
    spans = [b.attn.span for b in m.blocks]
    loss = m.aux_loss()
    torch.testing.assert_close(loss, torch.tensor(2 * 0.01 * 40 * 0.5, dtype=F64))  # λ · S · mean z/S per layer
    grads = torch.autograd.grad(loss, spans)
    for g in grads:
        torch.testing.assert_close(g, torch.full((4,), 0.01 * 40 / 4, dtype=F64))
    assert model().aux_loss() is None


def test_training_signal_reaches_the_spans():
    m = model({"adaptive_span": True, "span_max": 16, "span_ramp": 4, "span_init": 0.2})
    m.train()
    idx = torch.randint(0, 37, (2, 20))
    loss = torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
    grads = torch.autograd.grad(loss, [b.attn.span for b in m.blocks])
    assert all((g != 0).all() for g in grads)


# -- segment-level caching --------------------------------------------------------------------

SEGMENT_CASES = {
    "window": {"context": "window", "window": 9, "relative_positions": True},
    "adaptive span": {"adaptive_span": True, "span_max": 12, "span_ramp": 3, "span_init": 0.4,
                      "relative_positions": True},
}


@pytest.mark.parametrize("case", list(SEGMENT_CASES))
@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_consecutive_segments_with_the_cache_equal_one_pass_over_the_whole_sequence(case, positions):
    """Every token sees the same context however the sequence is cut: the cache carries the
    previous segment's keys and values, the window (or span) bounds what a query reads."""
    m = model(SEGMENT_CASES[case], positions=positions)
    idx = torch.randint(0, 37, (3, 40))
    whole = m(idx)
    cache = m.init_cache(3)
    segments = torch.cat([m(idx[:, s:s + 10], cache=cache) for s in range(0, 40, 10)], 1)
    torch.testing.assert_close(segments, whole, rtol=1e-9, atol=1e-9)


def test_segment_memory_is_detached_in_training():
    m = model(SEGMENT_CASES["window"], positions="none")
    m.train()
    cache = m.init_cache(2)
    first = m(torch.randint(0, 37, (2, 10)), cache=cache)
    first.sum().backward()  # frees the first segment's graph
    assert all(not t.requires_grad for s in cache.states for t in s.tensors())
    second = m(torch.randint(0, 37, (2, 10)), cache=cache)
    second.sum().backward()  # would fail if the memory still hung on the first graph
    assert all(s.past()[0].shape[1] == 8 for s in cache.states)  # window 9: 8 past tokens


def test_state_round_trips_through_its_state_dict():
    state = KVCache(limit=4)
    state.append(torch.randn(2, 6, 3, 5), torch.randn(2, 6, 3, 5))
    copy = KVCache(limit=4)
    copy.load_state_dict(state.state_dict(), state.seen)
    assert copy.seen == 6 and all(torch.equal(a, b) for a, b in zip(copy.tensors(), state.tensors()))
    assert state.past()[0].shape[1] == 4 and state.carries_segments


# -- encoder ----------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{"n_persistent": 3}, SEGMENT_CASES["window"],
                                     {"variant": "head-split", "n_persistent": 3, "relative_positions": True,
                                      "adaptive_span": True, "span_max": 6, "span_ramp": 2}])
def test_encoder_padding_does_not_reach_real_tokens(options):
    enc = model(options, cls=Encoder, positions="none")
    idx = torch.randint(0, 37, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    out = enc(idx, attention_mask=mask)
    torch.testing.assert_close(out[1, :7], enc(idx[1:, :7])[0])


def test_forward_leaves_the_span_alone_and_the_update_projects_it():
    """The learned span z / S lives in [0, 1]: forward reads it clamped without changing the
    parameter; the training loop's projection after each step puts it back in range."""
    m = model({"adaptive_span": True, "span_max": 16, "n_persistent": 4}).train()
    spans = [b.attn.span for b in m.blocks]
    with torch.no_grad():
        spans[0].copy_(torch.tensor([1.7, -0.3, 0.5, 0.2]))
        spans[1].fill_(0.4)
    m(torch.randint(0, 37, (1, 5)))
    assert spans[0].tolist() == pytest.approx([1.7, -0.3, 0.5, 0.2])
    assert m.blocks[0].attn.spans() == pytest.approx([16.0, 0.0, 8.0, 3.2])  # read clamped
    project_parameters(m)
    assert spans[0].tolist() == pytest.approx([1.0, 0.0, 0.5, 0.2])
    assert spans[1].tolist() == pytest.approx([0.4] * 4)
