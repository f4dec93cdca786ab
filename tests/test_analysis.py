"""memattn.analysis: slot statistics on memories whose values are known in closed form."""

import math

import pytest
import torch

from memattn.analysis import abc_slot_usage, learned_spans, set_learned_spans, slot_statistics
from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError
from memattn.models import CausalLM


def test_identical_slots_are_plain_means_read_uniformly():
    B, T, H, M, D = 2, 12, 3, 5, 8
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    stats = slot_statistics(torch.zeros(B, T, H, M), q, k)
    assert stats["write_spread"] == pytest.approx(1.0)
    assert stats["key_cosine"] == pytest.approx(1.0)
    assert stats["slots_read"] == pytest.approx(M)
    assert stats["read_spread"] == pytest.approx(M)
    assert stats["write_age"] == pytest.approx(1.0)  # a plain prefix mean


@pytest.mark.parametrize("c", [0.3, -0.7])
def test_write_age_of_geometric_write_weights(c):
    """Logits c·i weigh token i ≤ t by r^i (r = e^c): the held tokens' mean age at step t is
    t − Σ i r^i / Σ r^i, summed here term by term."""
    B, T, H, M, D = 1, 9, 1, 2, 4
    s = torch.zeros(B, T, H, M, dtype=torch.float64)
    s[..., 0] = c * torch.arange(T, dtype=s.dtype).view(1, T, 1)  # slot 1 stays a plain mean (ratio 1)
    ratios = []
    for t in range(1, T):
        w = [math.exp(c * i) for i in range(t + 1)]
        ratios.append((t - sum(i * x for i, x in enumerate(w)) / sum(w)) / (t / 2))
    expected = (sum(ratios) / len(ratios) + 1.0) / 2
    stats = slot_statistics(s, torch.randn(B, T, H, D), torch.randn(B, T, H, D))
    assert stats["write_age"] == pytest.approx(expected, rel=1e-9)
    assert (stats["write_age"] < 1) == (c > 0)


def test_write_age_ends_newest_first_and_oldest_first():
    T = 7
    newest = slot_statistics(60.0 * torch.arange(T).view(1, T, 1, 1), torch.randn(1, T, 1, 4),
                             torch.randn(1, T, 1, 4))
    oldest = slot_statistics(-60.0 * torch.arange(T).view(1, T, 1, 1), torch.randn(1, T, 1, 4),
                             torch.randn(1, T, 1, 4))
    assert newest["write_age"] == pytest.approx(0.0, abs=1e-12)
    assert oldest["write_age"] == pytest.approx(2.0, rel=1e-12)


def test_slots_that_each_hold_one_orthogonal_key_are_parted():
    T, M, D = 8, 4, 8
    s = torch.full((1, T, 1, M), -60.0)
    for j in range(M):
        s[0, 2 * j, 0, j] = 60.0  # slot j holds token 2j alone
    k = torch.zeros(1, T, 1, D)
    k[0, torch.arange(T), 0, torch.arange(T)] = 1.0  # orthogonal keys
    q = torch.zeros(1, T, 1, D)
    q[0, -1, 0, 6] = 1.0  # irrelevant to the write statistics and the last-step keys
    stats = slot_statistics(s, q, k)
    assert stats["write_spread"] == pytest.approx(1 / T, rel=1e-6)
    assert stats["key_cosine"] == pytest.approx(0.0, abs=1e-12)


def test_one_slot_taking_every_read():
    T, M, D = 6, 3, 4
    k = torch.zeros(1, T, 1, D)
    k[..., 0] = 1.0
    s = torch.full((1, T, 1, M), -60.0)
    s[..., 0] = 0.0  # slot 0 holds the keys; the others write token 0 only (60 above the rest)
    s[:, 0, :, 1:] = 0.0
    k[:, 0] = 0.0
    q = torch.zeros(1, T, 1, D)
    q[..., 0] = 200.0  # a query that picks slot 0 whenever its key is non-zero
    stats = slot_statistics(s, q, k, scale=1.0)
    # query 0 sees all-zero keys (uniform read over 3); the other 5 read slot 0 only
    expected = (1 * 3 + 5 * 1) / T
    assert stats["read_spread"] == pytest.approx(expected, rel=1e-6)


def test_model_usage_has_a_row_per_abc_mlp_layer():
    cfg = ModelConfig(vocab_size=20, d_model=16, n_layers=3, n_heads=2, ff_mult=2, max_len=32,
                      attention=AttentionConfig("abc-mlp", {"num_slots": 4}))
    model = CausalLM(cfg)
    stats = abc_slot_usage(model, torch.randint(0, 20, (2, 10)))
    assert len(stats) == 3
    for layer in stats:
        assert 0 < layer["write_spread"] <= 1 and 1 <= layer["slots_read"] <= 4
    with torch.no_grad():
        for block in model.blocks:
            block.attn.phi.weight.zero_()
    assert abc_slot_usage(model, torch.randint(0, 20, (2, 10)))[0]["key_cosine"] == pytest.approx(1.0)
    softmax = CausalLM(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_len=32))
    assert abc_slot_usage(softmax, torch.randint(0, 20, (1, 5))) == []


def test_spans_given_to_a_model_set_how_many_past_tokens_its_cache_keeps():
    """Spans z per head set in tokens: decoding keeps the last ⌈max z + R⌉ tokens of each layer,
    the farthest any head's soft mask reaches."""
    options = {"n_persistent": 4, "adaptive_span": True, "span_max": 64, "span_ramp": 4,
               "relative_positions": True}
    model = CausalLM(ModelConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, positions="none",
                                 attention=AttentionConfig("persistent", options))).eval()
    spans = [[3.5, 20.25], [4.0, 1.0]]
    set_learned_spans(model, spans)
    assert learned_spans(model) == spans
    cache = model.init_cache(batch_size=1)
    with torch.no_grad():
        model(torch.randint(0, 20, (1, 40)), cache=cache)
    assert [state.past()[0].shape[1] for state in cache.states] == [math.ceil(20.25 + 4), math.ceil(4.0 + 4)]
    with pytest.raises(ConfigError, match=r"\[3, 2\] heads per layer given to a model that learns \[2, 2\]"):
        set_learned_spans(model, [[1.0, 2.0, 3.0], [1.0, 2.0]])
    softmax = CausalLM(ModelConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, max_len=32))
    set_learned_spans(softmax, [])  # learns none: nothing to set
    with pytest.raises(ConfigError, match="learns none"):
        set_learned_spans(softmax, spans)
