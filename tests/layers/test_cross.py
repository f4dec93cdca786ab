"""Cross attention (memattn.layers.cross) against hand-written memories and softmax reads."""

from __future__ import annotations

import pytest
import torch

from memattn.errors import ConfigError, ShapeError
from memattn.layers import LayerSpec, mechanisms
from memattn.layers.cross import (ABCCrossAttention, SoftmaxCrossAttention,
                                  build_cross_attention, cross_mechanisms)

F64 = torch.float64
D_MODEL, HEADS = 16, 2
HEAD = D_MODEL // HEADS


def cross(name, **options):
    m = build_cross_attention(name, options, LayerSpec(D_MODEL, HEADS, causal=True)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m


def by_hand(m, x, src, mask=None):
    """The layer's output written out: memory from the source, softmax read per query."""
    B, S, _ = src.shape
    T = x.shape[1]
    q = (x @ m.q.weight.T).view(B, T, HEADS, HEAD)
    k, v = (t.view(B, S, HEADS, HEAD) for t in (src @ m.kv.weight.T).chunk(2, -1))
    real = torch.ones(B, S, dtype=torch.bool) if mask is None else mask
    o = torch.zeros(B, T, HEADS, HEAD, dtype=F64)
    for b in range(B):
        idx = real[b].nonzero().squeeze(1)
        for h in range(HEADS):
            if isinstance(m, ABCCrossAttention):
                M = m.options.cross_slots
                a = (src[b, idx] @ m.phi.weight.T).view(-1, HEADS, M)[:, h].exp()  # α [S', M]
                phi = a / a.sum(0)  # normalised over the real source tokens, per slot
                mem_k, mem_v = phi.T @ k[b, idx, h], phi.T @ v[b, idx, h]
            else:
                mem_k, mem_v = k[b, idx, h], v[b, idx, h]
            p = torch.softmax(q[b, :, h] @ mem_k.T / HEAD ** 0.5, -1)
            o[b, :, h] = p @ mem_v
    return o.reshape(B, T, D_MODEL) @ m.out.weight.T


@pytest.mark.parametrize("name", ["softmax", "abc-mlp"])
def test_cross_attention_reads_the_source_memory(name):
    m = cross(name, cross_slots=3) if name == "abc-mlp" else cross(name)
    x, src = torch.randn(2, 5, D_MODEL, dtype=F64), torch.randn(2, 9, D_MODEL, dtype=F64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    torch.testing.assert_close(m(x, m.memory(src, mask)), by_hand(m, x, src, mask))
    # padding writes nothing: the same as the source without it
    torch.testing.assert_close(m(x[1:], m.memory(src[1:, :6])), m(x, m.memory(src, mask))[1:])


def test_abc_cross_memory_has_cross_slots_and_a_fixed_size():
    m = cross("abc-mlp", num_slots=7, cross_slots=3)
    assert isinstance(m, ABCCrossAttention)
    short = m.memory(torch.randn(2, 4, D_MODEL, dtype=F64))
    long = m.memory(torch.randn(2, 400, D_MODEL, dtype=F64))
    assert [tuple(t.shape) for t in short] == [tuple(t.shape) for t in long] == \
        [(2, HEADS, 3), (2, HEADS, 3, HEAD), (2, HEADS, 3, HEAD)]
    soft = cross("softmax")
    assert soft.memory(torch.randn(2, 400, D_MODEL, dtype=F64)).k.shape[1] == 400


def test_cross_attention_comes_from_the_registry_and_is_refused_where_there_is_none():
    assert cross_mechanisms() == ["abc-mlp", "softmax"]
    assert isinstance(build_cross_attention("softmax", {}, LayerSpec(D_MODEL, HEADS)), SoftmaxCrossAttention)
    for name in [n for n in mechanisms() if n not in cross_mechanisms()]:
        with pytest.raises(ConfigError, match="cannot serve as cross attention.*abc-mlp, softmax"):
            build_cross_attention(name, {}, LayerSpec(D_MODEL, HEADS))


def test_an_encoder_decoder_picks_its_cross_attention_apart():
    from memattn.config import AttentionConfig, ModelConfig, load_config
    from memattn.models import EncoderDecoder

    cfg = ModelConfig(vocab_size=20, d_model=D_MODEL, n_layers=1, n_heads=HEADS,
                      attention=AttentionConfig("abc-window", {"window": 4}))
    with pytest.raises(ConfigError, match="'abc-window' cannot serve as cross attention"):
        EncoderDecoder(cfg)
    cfg.cross_attention = AttentionConfig("abc-mlp", {"cross_slots": 3})
    model = EncoderDecoder(cfg)
    assert isinstance(model.decoder.blocks[0].cross, ABCCrossAttention)
    assert model.encode(torch.randint(0, 20, (2, 9)))[0].k.shape == (2, HEADS, 3, HEAD)
    run = load_config(None, ["model.cross_attention.name=abc-mlp", "model.cross_attention.cross_slots=5"])
    assert run.model.cross_attention.options == {"cross_slots": 5}


def test_bad_inputs_name_the_argument():
    m = cross("abc-mlp")
    with pytest.raises(ShapeError, match="src"):
        m.memory(torch.randn(2, 5, D_MODEL + 1, dtype=F64))
    with pytest.raises(ShapeError, match="src_mask"):
        m.memory(torch.randn(2, 5, D_MODEL, dtype=F64), torch.ones(2, 4, dtype=torch.bool))
    memory = m.memory(torch.randn(2, 5, D_MODEL, dtype=F64))
    with pytest.raises(ShapeError, match="x"):
        m(torch.randn(3, 1, D_MODEL, dtype=F64), memory)
