"""A layer outside memattn's models: `attention_layer(name, d_model, n_heads, **options)`."""

import math

import pytest
import torch

from memattn.config import AttentionConfig
from memattn.errors import ConfigError
from memattn.layers import attention_layer, mechanisms


def test_softmax_layer_is_multi_head_attention_by_hand():
    """No rotary unless asked: the layer is causal multi-head attention on its projections."""
    torch.manual_seed(0)
    lay = attention_layer("softmax", 12, 3).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    W = lay.qkv.weight
    q, k, v = (x @ W[i * 12:(i + 1) * 12].T for i in range(3))  # [B, T, d] each
    want = torch.zeros_like(x)
    for b in range(2):
        for h in range(3):
            cols = slice(4 * h, 4 * h + 4)
            for t in range(5):
                s = k[b, :t + 1, cols] @ q[b, t, cols] / math.sqrt(4)
                want[b, t, cols] = torch.softmax(s, 0) @ v[b, :t + 1, cols]
    torch.testing.assert_close(lay(x)[0], lay.out(want))


@pytest.mark.parametrize("name", [n for n, m in mechanisms().items() if m.causal and n != "gmat"])
def test_every_causal_mechanism_builds_standalone_and_decodes_as_it_reads(name):
    """Built with keywords alone, each layer gives token by token what it gives at once,
    with and without autograd."""
    torch.manual_seed(0)
    lay = attention_layer(name, 16, 2, positions="rotary").double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    full, _ = lay(x)
    for grad in (True, False):  # decoding without autograd may take its own path (in place)
        state = lay.init_state(2, dtype=torch.float64)
        with torch.set_grad_enabled(grad):
            steps = [lay(x[:, t:t + 1], memory_state=state)[0] for t in range(7)]
        torch.testing.assert_close(torch.cat(steps, 1), full)


def test_options_are_keywords_and_checked():
    lay = attention_layer("abc-mlp", 16, 2, num_slots=5)
    assert lay.options.num_slots == 5
    with pytest.raises(ConfigError, match="attention.slots: not an option of 'abc-mlp'"):
        attention_layer("abc-mlp", 16, 2, slots=5)
    with pytest.raises(ConfigError, match="positions: a standalone layer takes 'rotary' or 'none'"):
        attention_layer("softmax", 16, 2, positions="learned")


def test_a_config_keeps_its_typed_options():
    cfg = AttentionConfig("abc-mlp", {"num_slots": 7})
    assert type(cfg.typed).__name__ == "ABCMLPOptions" and cfg.typed.num_slots == 7


@pytest.mark.parametrize("name, options", [("abc-window", {"window": 3}),
                                           ("abc-dilated", {"window": 3, "dilation": 2})])
def test_window_decoding_without_autograd_wraps_its_ring_buffers(name, options):
    """The window layers' in-place step: past n tokens each write replaces the one leaving
    its queue (the dilated queue: every d-th token); a left-padded row reads as alone."""
    torch.manual_seed(0)
    lay = attention_layer(name, 16, 2, positions="rotary", **options).double().eval()
    T = 20
    x = torch.randn(2, T, 16, dtype=torch.float64)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, :4] = False  # a multiple of the dilation
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    full, _ = lay(x, attention_mask=mask, positions=positions)
    state = lay.init_state(2, dtype=torch.float64)
    with torch.no_grad():
        steps = [lay(x[:, t:t + 1], memory_state=state, attention_mask=mask[:, t:t + 1],
                     positions=positions[:, t:t + 1])[0] for t in range(T)]
    got = torch.cat(steps, 1)
    torch.testing.assert_close(got[mask], full[mask])
    alone, _ = lay(x[1:, 4:])
    torch.testing.assert_close(got[1, 4:], alone[0])
