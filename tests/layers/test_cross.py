"""Cross attention (memattn.layers.cross and each mechanism's cross layer) against hand-written
memories and softmax reads."""

from __future__ import annotations

import pytest
import torch

from memattn.errors import ConfigError, ShapeError
from memattn.layers import LayerSpec, mechanisms
from memattn.layers.abc import random_slots
from memattn.layers.abc.mlp import ABCCrossAttention
from memattn.layers.cross import build_cross_attention, cross_mechanisms
from memattn.layers.softmax import SoftmaxCrossAttention

F64 = torch.float64
D_MODEL, HEADS = 16, 2
HEAD = D_MODEL // HEADS


def cross(name, **options):
    m = build_cross_attention(name, options, LayerSpec(D_MODEL, HEADS, causal=True)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m


def phi_by_hand(m, name, h_src, k):
    """The write weights φ [S', M] of one head over the real source tokens h_src [S', d]
    (keys k [S', D]), as each strategy defines them; None for the memories of tokens."""
    S = h_src.shape[0]
    pos = torch.arange(S)
    o = m.options
    if name == "abc-mlp":
        z = (h_src @ m.phi.weight.T).view(S, HEADS, -1)[:, m._head]
        a = {"exp": z.exp(), "relu": z.relu().clamp_min(1e-12), "sigmoid": z.sigmoid()}[o.activation]
        return a / a.sum(0)  # normalised over the real source tokens, per slot
    if name == "gsa":  # α_s = σ(W_g h_s)^(1/τ); φ_s = (1 - α_s) Π_{j>s} α_j: what is left of token s
        a = torch.sigmoid(h_src @ m.gate.weight.T).view(S, HEADS, -1)[:, m._head] ** (1 / o.gate_logit_normalizer)
        return torch.stack([(1 - a[s]) * a[s + 1:].prod(0) for s in range(S)])
    if name == "abc-linformer":
        return torch.nn.functional.softplus(m.columns[:S])
    if name == "abc-random":
        return torch.nn.functional.one_hot(random_slots(pos, HEADS, o.num_slots, o.seed)[:, m._head],
                                           o.num_slots).double()
    if name == "abc-meanpool":
        return torch.stack([(pos // o.pool == j).double() / o.pool for j in range(o.num_slots)], 1)
    if name == "abc-l2g":
        return torch.stack([(pos == j * o.every).double() for j in range(o.num_slots)], 1)
    if name == "abc-cluster":  # Lloyd's k-means from the keys of ranks ⌊jS/n⌋, written out
        n = o.num_clusters
        centres = k[[j * S // n for j in range(n)]]
        for _ in range(o.iters + 1):
            assign = torch.cdist(k, centres).argmin(1)
            member = torch.nn.functional.one_hot(assign, n).double()
            centres = torch.where(member.sum(0)[:, None] > 0, member.T @ k / member.sum(0).clamp(min=1)[:, None],
                                  centres)
        return member / member.sum(0).clamp(min=1)
    return None


def by_hand(m, name, x, src, mask=None):
    """The layer's output written out: memory from the real source tokens, read per query."""
    B, S, _ = src.shape
    T = x.shape[1]
    q = (x @ m.q.weight.T).view(B, T, HEADS, HEAD)
    k, v = (t.view(B, S, HEADS, HEAD) for t in (src @ m.kv.weight.T).chunk(2, -1))
    real = torch.ones(B, S, dtype=torch.bool) if mask is None else mask
    o = torch.zeros(B, T, HEADS, HEAD, dtype=F64)
    for b in range(B):
        idx = real[b].nonzero().squeeze(1)
        for h in range(HEADS):
            kb, vb = k[b, idx, h], v[b, idx, h]
            if name in ("linear", "gated-linear"):
                fk, fq = (torch.nn.functional.elu(t) + 1 for t in (kb, q[b, :, h]))
                if name == "gated-linear":
                    g = torch.sigmoid(src[b, idx] @ m.gate.weight.T + m.gate.bias).view(-1, HEADS, HEAD)[:, h]
                    fk, vb = g * fk, g * vb
                o[b, :, h] = (fq @ fk.T @ vb) / (fq @ fk.sum(0))[:, None]
                continue
            m._head = h
            phi = phi_by_hand(m, name, src[b, idx], kb)
            if phi is not None:
                kb, vb = phi.T @ kb, phi.T @ vb
            elif name == "abc-window":
                kb, vb = kb[-m.options.window:], vb[-m.options.window:]
            p = torch.softmax(q[b, :, h] @ kb.T / HEAD ** 0.5, -1)
            o[b, :, h] = p @ vb
    return o.reshape(B, T, D_MODEL) @ m.out.weight.T


CROSS = {"softmax": {}, "abc-window": {"window": 4}, "abc-mlp": {"cross_slots": 3},
         "abc-mlp-relu": {"cross_slots": 3, "activation": "relu"},
         "abc-mlp-sigmoid": {"cross_slots": 3, "activation": "sigmoid"},
         "abc-linformer": {"num_slots": 3}, "abc-random": {"num_slots": 3, "seed": 5},
         "abc-meanpool": {"num_slots": 5, "pool": 2}, "abc-l2g": {"num_slots": 5, "every": 2},
         "abc-cluster": {"num_clusters": 3, "iters": 2}, "linear": {}, "gated-linear": {},
         "gsa": {"num_slots": 7, "cross_slots": 3, "gate_logit_normalizer": 2.0}}


@pytest.mark.parametrize("case", list(CROSS))
def test_cross_attention_reads_the_source_memory(case):
    name = case.split("-relu")[0].split("-sigmoid")[0]
    m = cross(name, **CROSS[case])
    x, src = torch.randn(2, 5, D_MODEL, dtype=F64), torch.randn(2, 9, D_MODEL, dtype=F64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding: the real tokens count their positions from 0
    torch.testing.assert_close(m(x, m.memory(src, mask)), by_hand(m, name, x, src, mask))
    # padding writes nothing: the same as the source without it
    torch.testing.assert_close(m(x[1:], m.memory(src[1:, 3:])), m(x, m.memory(src, mask))[1:])


def test_gsa_cross_memory_has_cross_slots_and_a_fixed_size():
    m = cross("gsa", num_slots=7, cross_slots=3)
    assert type(m).__name__ == "GSACrossAttention"
    short = m.memory(torch.randn(2, 4, D_MODEL, dtype=F64))
    long = m.memory(torch.randn(2, 400, D_MODEL, dtype=F64))
    assert [tuple(t.shape) for t in short] == [tuple(t.shape) for t in long] == [(2, HEADS, 3, HEAD)] * 2


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
    assert sorted(cross_mechanisms()) == sorted(n for n in CROSS if "-relu" not in n and "-sigmoid" not in n)
    assert isinstance(build_cross_attention("softmax", {}, LayerSpec(D_MODEL, HEADS)), SoftmaxCrossAttention)
    for name in [n for n in mechanisms() if n not in cross_mechanisms()]:
        with pytest.raises(ConfigError, match="cannot serve as cross attention.*abc-cluster, .*softmax"):
            build_cross_attention(name, {}, LayerSpec(D_MODEL, HEADS))


def test_an_encoder_decoder_picks_its_cross_attention_apart():
    from memattn.config import AttentionConfig, ModelConfig, load_config
    from memattn.models import EncoderDecoder

    cfg = ModelConfig(vocab_size=20, d_model=D_MODEL, n_layers=1, n_heads=HEADS,
                      attention=AttentionConfig("persistent", {}))
    with pytest.raises(ConfigError, match="'persistent' cannot serve as cross attention"):
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
