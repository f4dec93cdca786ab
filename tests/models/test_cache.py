"""memattn.models.ModelCache over every registered causal mechanism: reorder (beam search),
batch_select, to, crop, nbytes and fixed_size, each checked against full forward passes."""

import pytest
import torch
from conftest import registered

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError
from memattn.layers.base import get_mechanism, parse_options
from memattn.models import CausalLM

CAUSAL = registered("causal")


def small(name):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=31, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=64,
                      attention=AttentionConfig(name, get_mechanism(name).test_options))
    return CausalLM(cfg).double().eval()


@pytest.mark.parametrize("name", CAUSAL)
def test_reordered_rows_decode_as_their_parents(name):
    model = small(name)
    idx = torch.randint(0, 31, (3, 14))
    cache = model.init_cache(3)
    model(idx[:, :10], cache=cache)
    order = torch.tensor([2, 0, 0, 1])  # beams: a row repeated, rows swapped, one more row
    cache.reorder(order)
    steps = torch.cat([model(idx[order, t:t + 1], cache=cache) for t in range(10, 14)], 1)
    torch.testing.assert_close(steps, model(idx[order])[:, 10:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", CAUSAL)
def test_batch_select_keeps_the_chosen_rows(name):
    model = small(name)
    idx = torch.randint(0, 31, (3, 12))
    cache = model.init_cache(3)
    model(idx[:, :8], cache=cache)
    cache.batch_select(torch.tensor([1]))
    steps = torch.cat([model(idx[1:2, t:t + 1], cache=cache) for t in range(8, 12)], 1)
    torch.testing.assert_close(steps, model(idx[1:2])[:, 8:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", CAUSAL)
def test_to_moves_floating_tensors_only(name):
    model = small(name)
    cache = model.init_cache(2)
    model(torch.randint(0, 31, (2, 9)), cache=cache)
    kinds = [t.dtype for s in cache.states for t in s.tensors()]
    cache.to("cpu", torch.float32)
    after = [t.dtype for s in cache.states for t in s.tensors()]
    assert after == [torch.float32 if k.is_floating_point else k for k in kinds]


@pytest.mark.parametrize("name", CAUSAL)
def test_crop_undoes_the_last_tokens_or_refuses_untouched(name):
    model = small(name)
    idx = torch.randint(0, 31, (2, 12))
    cache = model.init_cache(2)
    model(idx, cache=cache)
    if all(s.can_crop for s in cache.states):
        cache.crop(7)
        steps = torch.cat([model(idx[:, t:t + 1], cache=cache) for t in range(7, 12)], 1)
        torch.testing.assert_close(steps, model(idx)[:, 7:], rtol=1e-9, atol=1e-9)
    else:
        before = [t.clone() for s in cache.states for t in s.tensors()]
        with pytest.raises(ConfigError, match="cannot forget the last ones"):
            cache.crop(7)
        assert cache.position == 12
        for a, b in zip(before, [t for s in cache.states for t in s.tensors()]):
            assert torch.equal(a, b)


# A state that grows keeps every past key and value: 2 layers x (key + value) x 4 heads x 8
# dims x 8 bytes (float64) a token.
KV_PER_TOKEN = 2 * 2 * 4 * 8 * 8


@pytest.mark.parametrize("name", CAUSAL)
def test_the_state_keeps_its_bytes_as_its_registration_declares(name):
    mech = get_mechanism(name)
    fixed = mech.fixed_size(parse_options(name, mech.test_options))
    model = small(name)
    cache = model.init_cache(1)
    model(torch.randint(0, 31, (1, 10)), cache=cache)
    early = cache.nbytes()
    for _ in range(30):
        model(torch.randint(0, 31, (1, 1)), cache=cache)
    per_token = 0 if fixed else KV_PER_TOKEN
    if per_token:
        assert early == 10 * per_token
    assert early > 0 and cache.nbytes() == early + 30 * per_token
    assert cache.fixed_size is fixed


def test_a_declared_fixed_state_follows_its_options():
    """persistent memory's context cache grows unless a window or an adaptive span bounds it."""
    mech = get_mechanism("persistent")
    assert not mech.fixed_size(parse_options("persistent", {}))
    assert mech.fixed_size(parse_options("persistent", {"context": "window", "window": 4}))
    assert mech.fixed_size(parse_options("persistent", {"adaptive_span": True, "span_max": 8}))
