"""The `linear` and `gated-linear` layers (memattn.layers.linear) against hand-written
closed forms: explicit score matrices, the op's reference loop, and the paper's f fᵀ."""

from __future__ import annotations

import pytest
import torch

from memattn.config import AttentionConfig
from memattn.errors import ConfigError, ShapeError
from memattn.layers import LayerSpec, build_attention, mechanisms
from memattn.layers.linear import GatedLinearOptions, LinearOptions, LinearState
from memattn.ops.linear import linear_attention_reference

F64 = torch.float64
D_MODEL, HEADS = 12, 3
HEAD = D_MODEL // HEADS


def layer(name="linear", *, causal=True, positions="none", **options):
    spec = LayerSpec(D_MODEL, HEADS, causal=causal, positions=positions)
    m = build_attention(name, options, spec).double().eval()
    with torch.no_grad():  # non-zero biases, so the gate bias matters in the checks
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m


def projections(m, x):
    """q, k, v [B, T, H, D] from the layer's own weights, by hand."""
    B, T, _ = x.shape
    W = m.qkv.weight
    b = m.qkv.bias if m.qkv.bias is not None else torch.zeros(3 * D_MODEL, dtype=F64)
    qkv = x @ W.T + b
    q, k, v = qkv.split(D_MODEL, dim=-1)
    return (t.reshape(B, T, HEADS, HEAD) for t in (q, k, v))


def elu1(x):
    return torch.where(x > 0, x + 1, torch.exp(x))


def rotate(x, offset=0, base=10000.0):
    """Rotary by hand: channel pair (j, j + D/2) turned by angle position · base^(-2j/D)."""
    T, D = x.shape[1], x.shape[3]
    half = D // 2
    out = torch.empty_like(x)
    for t in range(T):
        for j in range(half):
            angle = torch.tensor((offset + t) * base ** (-2 * j / D), dtype=F64)
            a, b = x[:, t, :, j], x[:, t, :, j + half]
            out[:, t, :, j] = a * angle.cos() - b * angle.sin()
            out[:, t, :, j + half] = b * angle.cos() + a * angle.sin()
    return out


def output(m, o):
    """o [B, T, H, D] -> the layer's output projection."""
    B, T = o.shape[:2]
    y = o.reshape(B, T, D_MODEL) @ m.out.weight.T
    return y if m.out.bias is None else y + m.out.bias


def test_both_layers_are_registered_for_decoders_and_encoders():
    for name in ("linear", "gated-linear"):
        assert mechanisms()[name].causal and mechanisms()[name].bidirectional


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("positions", ["none", "rotary"])
def test_normalised_linear_layer_is_a_weighted_average_of_values(causal, positions):
    """Default options: o_t = Σ_i w_ti v_i / Σ_i w'_ti with w = φ(q_t)ᵀ R φ(k_i), φ = elu + 1."""
    m = layer(causal=causal, positions=positions, bias=True)
    x = torch.randn(2, 9, D_MODEL, dtype=F64)
    q, k, v = projections(m, x)
    q, k = elu1(q), elu1(k)
    qr, kr = (rotate(q), rotate(k)) if positions == "rotary" else (q, k)
    num_scores = torch.einsum("bthd,bshd->bhts", qr, kr)
    den_scores = torch.einsum("bthd,bshd->bhts", q, k)
    if causal:
        future = torch.ones(9, 9, dtype=torch.bool).triu(1)
        num_scores = num_scores.masked_fill(future, 0)
        den_scores = den_scores.masked_fill(future, 0)
    o = torch.einsum("bhts,bshd->bthd", num_scores, v) / den_scores.sum(-1).transpose(1, 2)[..., None]
    y, _ = m(x)
    torch.testing.assert_close(y, output(m, o), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_paper_form_is_the_op_reference_on_the_projections(causal):
    """feature_map=identity, normalize=false: o = C q with C = Σ v kᵀ, the paper's read."""
    m = layer(causal=causal, feature_map="identity", normalize=False)
    x = torch.randn(2, 11, D_MODEL, dtype=F64)
    q, k, v = projections(m, x)
    o, _ = linear_attention_reference(q, k, v, causal=causal)
    torch.testing.assert_close(m(x)[0], output(m, o), rtol=1e-10, atol=1e-10)


def test_gated_layer_gates_keys_and_values():
    """gated-linear, paper form: o_t = Σ_{i≤t} (g_i ⊙ v_i) ((g_i ⊙ k_i) · q_t), g = σ(W_g x + b_g)."""
    m = layer("gated-linear", feature_map="identity", normalize=False)
    x = torch.randn(2, 8, D_MODEL, dtype=F64)
    q, k, v = projections(m, x)
    g = torch.sigmoid(x @ m.gate.weight.T + m.gate.bias).reshape(2, 8, HEADS, HEAD)
    o = torch.zeros_like(q)
    for t in range(8):
        for i in range(t + 1):
            weight = ((g[:, i] * k[:, i]) * q[:, t]).sum(-1, keepdim=True)  # [B, H, 1]
            o[:, t] += weight * g[:, i] * v[:, i]
    torch.testing.assert_close(m(x)[0], output(m, o), rtol=1e-10, atol=1e-10)


def test_gated_memory_is_the_papers_f_f_transpose_when_keys_are_values():
    """With W_k = W_v (k = v = h) the memory is Σ f fᵀ, f = σ(W h + b) ⊙ h: symmetric."""
    m = layer("gated-linear", feature_map="identity", normalize=False)
    with torch.no_grad():
        m.qkv.weight[2 * D_MODEL:] = m.qkv.weight[D_MODEL:2 * D_MODEL]
    x = torch.randn(1, 10, D_MODEL, dtype=F64)
    state = m.init_state(1)
    m(x, memory_state=state)
    _, h, _ = projections(m, x)
    f = torch.sigmoid(x @ m.gate.weight.T + m.gate.bias).reshape(1, 10, HEADS, HEAD) * h
    for head in range(HEADS):
        C = sum(torch.outer(f[0, t, head], f[0, t, head]) for t in range(10))
        torch.testing.assert_close(state.memory[0, head], C, rtol=1e-10, atol=1e-10)
    assert state.seen == 10


def test_decay_gate_forgets_geometrically():
    """decay=true: memory = Σ_i (Π_{j>i} α_j) k_i v_iᵀ, α_t = σ(w_α·x_t + b_α) per head."""
    m = layer("gated-linear", feature_map="identity", normalize=False, decay=True)
    x = torch.randn(2, 7, D_MODEL, dtype=F64)
    state = m.init_state(2)
    m(x, memory_state=state)
    _, k, v = projections(m, x)
    g = torch.sigmoid(x @ m.gate.weight.T + m.gate.bias).reshape(2, 7, HEADS, HEAD)
    k, v = g * k, g * v
    alpha = torch.sigmoid(x @ m.decay_proj.weight.T + m.decay_bias)  # [B, T, H]
    want = torch.zeros(2, HEADS, HEAD, HEAD, dtype=F64)
    for i in range(7):
        later = alpha[:, i + 1:].prod(1)  # [B, H]
        want += later[..., None, None] * torch.einsum("bhk,bhv->bhkv", k[:, i], v[:, i])
    torch.testing.assert_close(state.memory, want, rtol=1e-10, atol=1e-10)


def test_decay_starts_near_its_initial_value_after_model_init():
    m = build_attention("gated-linear", {"decay": True, "decay_init": 0.9}, LayerSpec(D_MODEL, HEADS))
    torch.testing.assert_close(torch.sigmoid(m.decay_bias), torch.full((HEADS,), 0.9))


@pytest.mark.parametrize("name, options", [
    ("linear", {}),
    ("linear", {"feature_map": "identity", "normalize": False}),
    ("gated-linear", {}),
    ("gated-linear", {"decay": True}),
    ("gated-linear", {"decay": True, "feature_map": "identity", "normalize": False}),
])
@pytest.mark.parametrize("positions", ["none", "rotary"])
@pytest.mark.parametrize("grad", [True, False])  # without autograd a token is written in place
def test_decoding_in_pieces_equals_one_pass(name, options, positions, grad):
    m = layer(name, positions=positions, **options)
    x = torch.randn(2, 13, D_MODEL, dtype=F64)
    full, _ = m(x)
    state = m.init_state(2)
    with torch.set_grad_enabled(grad):
        pieces = [m(x[:, a:b], memory_state=state)[0] for a, b in ((0, 5), (5, 6), (6, 7), (7, 13))]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)
    assert state.seen == 13


@pytest.mark.parametrize("name, options", [("linear", {}), ("gated-linear", {"decay": True}),
                                           ("linear", {"normalize": False})])
def test_state_has_the_same_bytes_after_100_and_10000_positions(name, options):
    m = layer(name, positions="rotary", **options)
    state = m.init_state(2)
    assert isinstance(state, LinearState) and state.fixed_size
    at_start = state.nbytes()
    with torch.no_grad():
        for _ in range(100):  # token by token
            m(torch.randn(2, 1, D_MODEL, dtype=F64), memory_state=state)
        after_100 = state.nbytes()
        for _ in range(99):  # and the rest in blocks of 100
            m(torch.randn(2, 100, D_MODEL, dtype=F64), memory_state=state)
    assert state.seen == 10_000
    assert at_start == after_100 == state.nbytes()
    per_head = HEAD * HEAD + (HEAD if options.get("normalize", True) else 0)
    assert state.nbytes() == 2 * HEADS * per_head * 8  # fp64 numbers, nothing per token


@pytest.mark.parametrize("name, options", [("linear", {}), ("gated-linear", {"decay": True}),
                                           ("linear", {"feature_map": "identity",
                                                       "normalize": False})])
@pytest.mark.parametrize("causal", [True, False])
def test_padding_writes_nothing(name, options, causal):
    """Masked tokens (anywhere, not only at the end) leave outputs and memory as if absent."""
    m = layer(name, causal=causal, **options)
    x = torch.randn(1, 10, D_MODEL, dtype=F64)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, [0, 3, 6, 9]] = False
    state = m.init_state(1)
    y, _ = m(x, memory_state=state, attention_mask=mask)
    alone = m.init_state(1)
    y_real, _ = m(x[:, mask[0]], memory_state=alone)
    torch.testing.assert_close(y[:, mask[0]], y_real, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.memory, alone.memory, rtol=1e-10, atol=1e-10)


def test_init_state_follows_the_parameters():
    m = layer("linear")  # fp64 parameters
    state = m.init_state(3)
    assert state.memory.shape == (3, HEADS, HEAD, HEAD) and state.memory.dtype == F64
    assert state.normalizer.shape == (3, HEADS, HEAD, 1)
    assert layer("linear", normalize=False).init_state(1).normalizer is None
    assert m.init_state(1, dtype=torch.bfloat16).memory.dtype == torch.float32  # fp32 accumulation


def test_float32_layer_trains():
    spec = LayerSpec(D_MODEL, HEADS, causal=True)
    m = build_attention("gated-linear", {"decay": True}, spec)
    x = torch.randn(2, 70, D_MODEL, requires_grad=True)
    y, _ = m(x)
    y.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert torch.isfinite(x.grad).all()


def test_bad_options_and_inputs_are_clear_errors():
    with pytest.raises(ConfigError, match="normalize: true needs a positive feature map"):
        AttentionConfig("linear", {"feature_map": "identity"})
    with pytest.raises(ConfigError, match="decay_init: expected a value in"):
        GatedLinearOptions(decay_init=1.0)
    with pytest.raises(ConfigError, match="not an option of 'linear'"):
        AttentionConfig("linear", {"decay": True})
    with pytest.raises(ConfigError, match="feature_map"):
        AttentionConfig("linear", {"feature_map": "relu"})
    assert LinearOptions().feature_map == "elu+1" and LinearOptions().normalize
    m = layer("linear")
    x = torch.randn(2, 4, D_MODEL, dtype=F64)
    with pytest.raises(ShapeError, match=r"attention_mask: expected dtype torch.bool"):
        m(x, attention_mask=torch.ones(2, 4))
    with pytest.raises(ShapeError, match=r"attention_mask: expected \[B, T\]"):
        m(x, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ShapeError, match=r"x: expected \[B, T, d\] with dim 2 = 12"):
        m(torch.randn(2, 4, 8, dtype=F64))
