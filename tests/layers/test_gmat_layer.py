"""memattn.layers.gmat: the `gmat` layer, its options, its memory layout and its decoding
state; and the models it plugs into (memory tokens in the trunk, causal memory, split
positions)."""

from __future__ import annotations

import pytest
import torch

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError, ShapeError
from memattn.layers import LayerSpec, build_attention, get_mechanism
from memattn.layers.base import MemoryLayout, memory_layout
from memattn.models import CausalLM, Encoder
from memattn.models.lm import SplitPositions, insert_memory
from memattn.ops.gmat import gmat_attention


def layer(causal=False, **options):
    spec = LayerSpec(d_model=16, n_heads=2, causal=causal, positions="none")
    return build_attention("gmat", options, spec).double()


def lm(opts, **kw):
    base = dict(vocab_size=23, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=128,
                attention=AttentionConfig("gmat", opts))
    base.update(kw)
    return CausalLM(ModelConfig(**base)).double().eval()


def encoder(opts, n_tags=0, **kw):
    base = dict(vocab_size=23, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=128,
                attention=AttentionConfig("gmat", opts))
    base.update(kw)
    return Encoder(ModelConfig(**base), n_tags=n_tags).double().eval()


def test_registered_for_encoders_and_decoders_with_its_memory_layout():
    mech = get_mechanism("gmat")
    assert mech.causal and mech.bidirectional and not mech.replaces_feedforward
    assert memory_layout("gmat", {"num_memory": 5}, causal=False) == MemoryLayout(5, 0)
    assert memory_layout("gmat", {"num_memory": 5, "chunk_size": 16}, causal=True) == MemoryLayout(5, 16)
    assert memory_layout("gmat", {"num_memory": 0}, causal=False) is None
    assert memory_layout("softmax", {}, causal=True) is None


@pytest.mark.parametrize("options, message", [
    ({"num_memory": -1}, r"num_memory: expected M >= 0 memory tokens, got -1"),
    ({"pattern": "strided"}, r"attention.pattern: expected one of chunked, window, lsh, full, got 'strided'"),
    ({"chunk_size": 0}, r"chunk_size: expected a positive int, got 0"),
    ({"n_buckets": 3}, r"n_buckets: expected an even number >= 2, got 3"),
    ({"window": "wide"}, r"attention.window: expected an integer, got 'wide'"),
    ({"memory": 4}, r"attention.memory: not an option of 'gmat'"),
])
def test_bad_options_are_config_errors_naming_them(options, message):
    with pytest.raises(ConfigError, match=message):
        AttentionConfig("gmat", options)


@pytest.mark.parametrize("options, message", [
    ({"pattern": "lsh"}, r"attention.pattern: a causal model supports gmat patterns chunked, window, got 'lsh'"),
    ({"pattern": "full"}, r"got 'full' \(lsh buckets mix past and future; full is softmax attention\)"),
    ({"pattern": "window", "window": 65}, r"attention.window: a causal window must fit in one chunk"),
])
def test_combinations_without_a_causal_meaning_are_refused_in_a_decoder(options, message):
    with pytest.raises(ConfigError, match=message):
        lm(options)
    encoder(options)  # the same options are fine bidirectionally


@pytest.mark.parametrize("untied", [False, True])
def test_layer_is_its_projections_around_the_op(untied):
    torch.manual_seed(0)
    att = layer(num_memory=3, pattern="window", window=2, untied_memory_projections=untied)
    x = torch.randn(2, 3 + 11, 16, dtype=torch.float64)
    y, state = att(x)
    q, k, v = att.qkv(x).view(2, 14, 3, 2, 8).unbind(2)
    kw = {}
    if untied:
        mq, mk, mv = att.memory_qkv(x).view(2, 14, 3, 2, 8).unbind(2)
        q = torch.cat((mq[:, :3], q[:, 3:]), 1)
        kw = dict(memory_k=mk, memory_v=mv)
    o, _ = gmat_attention(q, k, v, num_memory=3, causal=False, pattern="window", window=2, **kw)
    torch.testing.assert_close(y, att.out(o.reshape(2, 14, 16)), rtol=1e-12, atol=1e-12)
    assert state is None


def test_untied_memory_projections_change_only_the_memory_rows():
    torch.manual_seed(0)
    att = layer(num_memory=3, untied_memory_projections=True)
    x = torch.randn(1, 3 + 20, 16, dtype=torch.float64)
    before = att(x)[0]
    with torch.no_grad():
        att.memory_qkv.weight.add_(0.1)
    after = att(x)[0]
    assert (after[:, :3] - before[:, :3]).abs().amin() > 0
    torch.testing.assert_close(after[:, 3:], before[:, 3:], rtol=0, atol=0)


def test_bidirectional_layer_rejects_inputs_without_their_memory_rows():
    with pytest.raises(ShapeError, match=r"x: expected the 8 memory rows before the sequence"):
        layer(num_memory=8)(torch.zeros(1, 5, 16, dtype=torch.float64))


def test_insert_memory_prefix_and_periodic_blocks():
    x = torch.arange(1, 8, dtype=torch.float64)[None, :, None]  # tokens 1..7, d = 1
    memory = torch.tensor([[-1.0], [-2.0]], dtype=torch.float64)
    seq, _, index = insert_memory(x, memory, MemoryLayout(2, 0), offset=0)
    assert seq.flatten().tolist() == [-1, -2, 1, 2, 3, 4, 5, 6, 7] and index.tolist() == list(range(2, 9))
    seq, mask, index = insert_memory(x, memory, MemoryLayout(2, 3), offset=0,
                                     attention_mask=torch.ones(1, 7, dtype=torch.bool))
    assert seq.flatten().tolist() == [-1, -2, 1, 2, 3, -1, -2, 4, 5, 6, -1, -2, 7]
    assert torch.equal(seq[:, index], x) and mask.all() and mask.shape == (1, 13)
    seq, _, _ = insert_memory(x[:, :2], memory, MemoryLayout(2, 3), offset=5)  # tokens 5, 6
    assert seq.flatten().tolist() == [1, -1, -2, 2]  # a block before position 6 only
    seq, _, _ = insert_memory(x[:, :2], memory, MemoryLayout(2, 0), offset=5)
    assert seq.flatten().tolist() == [1, 2]  # the prefix came with position 0


def test_encoder_output_drops_the_memory_rows_and_the_heads_fit():
    model = encoder({"num_memory": 4, "chunk_size": 8}, n_tags=3)
    h = model(torch.randint(0, 23, (2, 21)))
    assert h.shape == (2, 21, 32)
    assert model.mlm_logits(h).shape == (2, 21, 23) and model.tag_logits(h).shape == (2, 21, 3)
    assert model.memory.weight.shape == (4, 32)


@pytest.mark.parametrize("pattern", ["chunked", "lsh"])
def test_without_memory_chunks_stay_apart_and_memory_joins_them(pattern):
    idx = torch.randint(0, 23, (1, 32))
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 23  # a token of the last chunk
    opts = {"chunk_size": 8, "pattern": pattern, "n_buckets": 2}
    if pattern == "chunked":  # with no memory, the first chunk never hears of the last one
        alone = encoder(dict(opts, num_memory=0), positions="learned")
        torch.testing.assert_close(alone(idx)[:, :8], alone(changed)[:, :8], rtol=0, atol=0)
    joined = encoder(dict(opts, num_memory=2), positions="learned")
    assert (joined(idx)[:, :8] - joined(changed)[:, :8]).abs().amin() > 0


def test_memory_embeddings_learn():
    model = encoder({"num_memory": 3, "chunk_size": 4}).train()
    h = model(torch.randint(0, 23, (2, 12)))
    model.mlm_logits(h).sum().backward()
    assert model.memory.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("opts", [
    {"num_memory": 2, "chunk_size": 4},
    {"num_memory": 3, "chunk_size": 5, "pattern": "window", "window": 3, "untied_memory_projections": True},
    {"num_memory": 0, "chunk_size": 3},
])
@pytest.mark.parametrize("positions", ["rotary", "split"])
def test_causal_decoding_across_memory_blocks_equals_the_full_forward(opts, positions):
    model = lm(opts, positions=positions)
    idx = torch.randint(0, 23, (2, 27))
    full = model(idx)
    cache = model.init_cache(2)
    steps = torch.cat([model(idx[:, t:t + 1], cache=cache) for t in range(27)], 1)
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-9)
    cache = model.init_cache(2)
    parts = [model(idx[:, a:b], cache=cache) for a, b in ((0, 6), (6, 15), (15, 16), (16, 27))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)
    assert cache.fixed_size


def test_causal_state_does_not_grow_with_the_context():
    model = lm({"num_memory": 2, "chunk_size": 4})
    cache = model.init_cache(1)
    sizes = []
    for t in range(40):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
        sizes.append(cache.nbytes())
    # two blocks of (2 + 4) keys and values, 2 layers, d_model fp64 numbers, and their mask
    assert set(sizes[8:]) == {2 * (2 * 2 * 6 * 32 * 8 + 2 * 6)}


def test_causal_memory_carries_the_previous_chunk_and_never_the_future():
    idx = torch.randint(0, 23, (1, 24))
    changed = idx.clone()
    changed[0, 2] = (changed[0, 2] + 1) % 23  # a token of chunk 0 (C = 6)
    with_memory = lm({"num_memory": 2, "chunk_size": 6})
    no_memory = lm({"num_memory": 0, "chunk_size": 6})
    # chunk 1 hears of chunk 0 only through its memory block (2 layers: write, then read)
    assert (with_memory(idx)[:, 6:12] - with_memory(changed)[:, 6:12]).abs().amin() > 0
    torch.testing.assert_close(no_memory(idx)[:, 6:], no_memory(changed)[:, 6:], rtol=0, atol=0)
    # and nothing earlier than the change moves
    torch.testing.assert_close(with_memory(idx)[:, :2], with_memory(changed)[:, :2], rtol=0, atol=0)


def test_split_positions_reach_32768_tokens_as_two_tables():
    pos = SplitPositions(32768, 8)
    assert pos.low.num_embeddings == 512 and pos.high.num_embeddings == 64
    p = torch.tensor([5, 517, 1029, 32767])
    e = pos(p)
    torch.testing.assert_close(e[1] - e[0], pos.high.weight[1] - pos.high.weight[0])
    torch.testing.assert_close(e[3], pos.low.weight[511] + pos.high.weight[63])


def test_an_encoder_with_split_positions_runs_past_512_and_refuses_past_max_len():
    model = encoder({"num_memory": 4, "chunk_size": 64}, positions="split", max_len=2048, d_model=16,
                    n_heads=2)
    idx = torch.randint(0, 23, (1, 1300))
    h = model(idx)
    assert h.shape == (1, 1300, 16) and torch.isfinite(h).all()
    # tokens from 1024 on read q = 2 of the high table, and only they (no memory to spread it)
    alone = encoder({"num_memory": 0, "chunk_size": 64}, positions="split", max_len=2048, d_model=16,
                    n_heads=2)
    h = alone(idx)
    with torch.no_grad():
        alone.pos.high.weight[2] += 1.0
    h2 = alone(idx)
    torch.testing.assert_close(h2[:, :1024], h[:, :1024], rtol=0, atol=0)
    assert (h2[:, 1024:] - h[:, 1024:]).abs().amax(-1).amin() > 0
    with pytest.raises(ShapeError, match=r"positions up to 2049 exceed model.max_len=2048"):
        model(torch.zeros(1, 2049, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"model.max_len: split positions cover at most 512 x 64 = 32768"):
        ModelConfig(positions="split", max_len=40000)
