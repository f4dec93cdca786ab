"""The gsa layer (memattn.layers.abc.gated) against the recurrence written out with its own
projections: gates α = σ(W_g x + b_g)^(1/τ), slots K̃_t = α_t K̃_{t-1} + (1 - α_t) k_t."""

from __future__ import annotations

import pytest
import torch

from memattn.config import AttentionConfig
from memattn.errors import ConfigError
from memattn.layers import LayerSpec, build_attention, mechanisms
from memattn.layers.positions import Rotary
from memattn.ops.gsa import GSAState

F64 = torch.float64
D_MODEL, HEADS = 16, 2
HEAD = D_MODEL // HEADS


def layer(*, causal=True, positions="none", **options):
    spec = LayerSpec(D_MODEL, HEADS, causal=causal, positions=positions)
    m = build_attention("gsa", options, spec).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m


def by_hand(m, x, causal, positions="none", mask=None):
    """The layer's output from its weights: projections, gates, the slot recurrence over the
    real tokens, a softmax read per query and the output projection."""
    B, T, _ = x.shape
    qkv = x @ m.qkv.weight.T + (0 if m.qkv.bias is None else m.qkv.bias)
    q, k, v = (t.reshape(B, T, HEADS, HEAD) for t in qkv.split(D_MODEL, dim=-1))
    if positions == "rotary":
        rot = Rotary(HEAD)
        q, k = rot(q), rot(k)
    z = x @ m.gate.weight.T + (0 if m.gate.bias is None else m.gate.bias)
    alpha = torch.sigmoid(z).view(B, T, HEADS, -1) ** (1 / m.options.gate_logit_normalizer)
    M = alpha.shape[-1]
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    o = torch.zeros(B, T, HEADS, HEAD, dtype=F64)
    for b in range(B):
        for h in range(HEADS):
            mem_k, mem_v, mems = torch.zeros(M, HEAD, dtype=F64), torch.zeros(M, HEAD, dtype=F64), []
            for t in range(T):
                if real[b, t]:
                    a = alpha[b, t, h][:, None]
                    mem_k, mem_v = a * mem_k + (1 - a) * k[b, t, h], a * mem_v + (1 - a) * v[b, t, h]
                mems.append((mem_k, mem_v))
            for t in range(T):
                mk, mv = mems[t] if causal else mems[-1]
                o[b, t, h] = torch.softmax(mk @ q[b, t, h] / HEAD ** 0.5, 0) @ mv
    return o.reshape(B, T, D_MODEL) @ m.out.weight.T + (0 if m.out.bias is None else m.out.bias)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_gsa_equals_the_gated_slot_recurrence(causal, positions):
    m = layer(causal=causal, positions=positions, num_slots=5, bias=True, gate_logit_normalizer=2.0)
    x = torch.randn(2, 11, D_MODEL, dtype=F64)
    torch.testing.assert_close(m(x)[0], by_hand(m, x, causal, positions), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal", [True, False])
def test_padding_writes_nothing(causal):
    m = layer(causal=causal, num_slots=4)
    x = torch.randn(2, 9, D_MODEL, dtype=F64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[1, 7] = False  # and a hole
    y, _ = m(x, attention_mask=mask)
    want = by_hand(m, x, causal, mask=mask)
    torch.testing.assert_close(y[mask], want[mask], rtol=1e-9, atol=1e-9)
    alone, _ = m(x[1:, mask[1]])
    torch.testing.assert_close(y[1, mask[1]], alone[0], rtol=1e-9, atol=1e-9)


def test_decoding_in_pieces_equals_the_full_forward_and_the_state_is_fixed():
    m = layer(positions="rotary", num_slots=3)
    x = torch.randn(2, 19, D_MODEL, dtype=F64)
    full, _ = m(x)
    state = m.init_state(2)
    assert state.fixed_size and isinstance(state.inner, GSAState)
    shapes = [tuple(t.shape) for t in state.tensors()]
    assert shapes == [(2, HEADS, 3, HEAD)] * 2 and all(t.dtype == F64 for t in state.tensors())
    pieces = [m(x[:, :5], memory_state=state)[0], m(x[:, 5:11], memory_state=state)[0]]
    with torch.no_grad():  # decoding without autograd writes the memory in place
        pieces += [m(x[:, t:t + 1], memory_state=state)[0] for t in range(11, 19)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-9, atol=1e-9)
    assert state.seen == 19 and [tuple(t.shape) for t in state.tensors()] == shapes


def test_gates_start_near_one_and_gradients_reach_every_parameter():
    spec = LayerSpec(D_MODEL, HEADS, causal=True, positions="rotary")
    m = build_attention("gsa", {"num_slots": 4, "bias": True}, spec)
    torch.nn.init.zeros_(m.gate.weight)
    torch.nn.init.zeros_(m.gate.bias)
    x = torch.randn(2, 12, D_MODEL, requires_grad=True)
    alpha = torch.sigmoid(m.gate(x)) ** (1 / 8)  # W_g x = 0: α = 0.5^(1/8) ≈ 0.917
    torch.testing.assert_close(alpha, torch.full_like(alpha, 0.5 ** 0.125))
    torch.nn.init.normal_(m.gate.weight, std=0.3)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False
    y, _ = m(x, attention_mask=mask)
    y[mask].pow(2).sum().backward()
    assert torch.isfinite(y).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("options,named", [
    ({"num_slots": 0}, "num_slots"), ({"cross_slots": 0}, "cross_slots"),
    ({"gate_logit_normalizer": 0}, "gate_logit_normalizer"),
    ({"gate_logit_normalizer": -8.0}, "gate_logit_normalizer"),
    ({"gate_logit_normalizer": float("nan")}, "gate_logit_normalizer"),
    ({"read": "linear"}, "read"), ({"bias": "yes"}, "bias"), ({"slots": 4}, "slots"),
])
def test_bad_options_are_config_errors_naming_the_option(options, named):
    with pytest.raises(ConfigError, match=rf"attention\.{named}"):
        AttentionConfig("gsa", options)


def test_gsa_is_registered_causal_bidirectional_streaming_and_cross():
    gsa = mechanisms()["gsa"]
    assert gsa.causal and gsa.bidirectional and gsa.streams(gsa.options()) and gsa.cross is not None
    options = AttentionConfig("gsa", {"num_slots": 7}).typed
    assert (options.num_slots, options.cross_slots, options.gate_logit_normalizer, options.read) == \
        (7, 7, 8.0, "softmax")
