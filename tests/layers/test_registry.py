"""The registry (memattn.layers.base): each mechanism's declared capabilities held to its
layer and to what its models do, and what `register` refuses."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import registered
from torch import nn

from memattn.config import AttentionConfig, ModelConfig
from memattn.layers import LayerSpec, StateSize, get_mechanism, mechanisms, register
from memattn.layers.base import attention_layers, mechanism_of
from memattn.layers.cross import build_cross_attention
from memattn.models import CausalLM

SIZED = [n for n in registered("causal") if get_mechanism(n).state_size and get_mechanism(n).state_size.option]


@pytest.mark.parametrize("name", registered())
def test_declared_hooks_are_methods_of_the_layer(name):
    mech = get_mechanism(name)
    assert hasattr(mech.layer, "aux_loss") is mech.aux_loss
    assert hasattr(mech.layer, "project_parameters") is mech.project_parameters
    assert ("layer_outputs" in inspect.signature(mech.layer.forward).parameters) is mech.reads_layer_outputs


@pytest.mark.parametrize("name", registered("cross"))
def test_a_declared_cross_attention_writes_a_batch_first_memory_and_reads_it(name):
    mech = get_mechanism(name)
    assert mech.cross.memory  # said in words, for `memattn info --mechanisms`
    m = build_cross_attention(name, mech.test_options, LayerSpec(16, 2)).double()
    memory = m.memory(torch.randn(3, 9, 16, dtype=torch.float64))
    assert all(t is None or t.shape[0] == 3 for t in memory)  # beam search reorders it by rows
    assert m(torch.randn(3, 2, 16, dtype=torch.float64), memory).shape == (3, 2, 16)


@pytest.mark.parametrize("name", SIZED)
def test_the_declared_size_option_sizes_a_fixed_state(name):
    """Twice the size option's value: a larger state, of one size whatever the tokens read."""
    size = get_mechanism(name).state_size
    held = []
    for value in (4, 8):
        torch.manual_seed(0)
        model = CausalLM(ModelConfig(vocab_size=13, d_model=16, n_layers=1, n_heads=2, max_len=64,
                                     attention=AttentionConfig(name, size.sized(value, 48)))).eval()
        cache = model.init_cache(1)
        with torch.no_grad():
            model(torch.randint(0, 13, (1, 40)), cache=cache)
            before = cache.nbytes()
            model(torch.randint(0, 13, (1, 8)), cache=cache)
        assert cache.fixed_size and cache.nbytes() == before
        held.append(before)
    assert held[0] < held[1]


def test_the_layers_of_a_model_are_found_with_their_mechanism():
    """A hybrid: abc-dilated's layer (a subclass of abc-window's) is found as abc-dilated."""
    cfg = ModelConfig(vocab_size=13, d_model=16, n_layers=3, n_heads=2, attention=AttentionConfig("softmax"),
                      attention_layers={"1": "abc-dilated", "2": {"name": "persistent", "adaptive_span": True,
                                                                "span_max": 8}})
    model = CausalLM(cfg)
    assert [mech.name for _, mech in attention_layers(model)] == ["softmax", "abc-dilated", "persistent"]
    assert mechanism_of(model.blocks[0].ff) is None
    # persistent declares an auxiliary loss: the span penalty, λ · S · mean z (z = 0 at init)
    with torch.no_grad():
        model.blocks[2].attn.span.fill_(0.5)
    assert model.aux_loss().item() == pytest.approx(2e-6 * 8 * 0.5)


class Layer(nn.Module):
    """A layer that is never built."""


@pytest.mark.parametrize("capabilities, error, message", [
    ({"stream": True}, TypeError, "stream is not a field of Mechanism"),
    ({"reads_layer_outputs": True}, ValueError, "needs memattn's own models"),
    ({"memory_layout": lambda options, causal: None}, ValueError, "needs memattn's own models"),
    ({"causal": False, "bidirectional": False}, ValueError, "causally, bidirectionally or both"),
    ({"streaming": True, "fixed_state": False}, ValueError, "streaming=True needs a decoding state"),
    ({"state_size": StateSize("window")}, ValueError, "window not among the options"),
    ({"test_options": {"num_slots": 4}}, ValueError, "num_slots not among the options"),
])
def test_register_refuses_a_declaration_that_cannot_hold(capabilities, error, message):
    before = mechanisms()
    with pytest.raises(error, match=message):
        register("contradiction", **capabilities)(Layer)
    assert mechanisms() == before


def test_a_memory_that_no_option_sizes_says_what_does():
    with pytest.raises(ValueError, match="say what sets its size"):
        StateSize()


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'softmax' is registered twice"):
        register("softmax")(Layer)
    assert get_mechanism("softmax").layer.__name__ == "SoftmaxAttention"
