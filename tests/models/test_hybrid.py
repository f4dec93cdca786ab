"""Hybrid causal LMs (`model.attention_layers`): a mechanism per layer, the cache, `memattn
info`'s state per layer, `evaluate_by_length`'s reading and the warm start from softmax."""

import json

import pytest
import torch

from memattn.config import AttentionConfig, ModelConfig, RunConfig, from_dict, load_config, to_dict
from memattn.errors import ConfigError
from memattn.evaluate import evaluate_by_length
from memattn.layers.abc.mlp import ABCMLPAttention
from memattn.layers.abc.window import ABCWindowAttention
from memattn.layers.persistent import PersistentAttention
from memattn.layers.softmax import SoftmaxAttention
from memattn.models import CausalLM
from memattn.warmstart import Source, warm_start

LAYERS = {"0": "softmax", "2": {"name": "abc-window", "window": 5}}


def hybrid(layers=LAYERS, **kw):
    base = dict(vocab_size=37, d_model=32, n_layers=3, n_heads=4, ff_mult=2, max_len=64,
                attention=AttentionConfig("abc-mlp", {"num_slots": 4}), attention_layers=layers)
    base.update(kw)
    return CausalLM(ModelConfig(**base)).double().eval()


def test_each_layer_has_the_mechanism_configured_for_it():
    model = hybrid()
    kinds = [type(b.attn) for b in model.blocks]
    assert kinds == [SoftmaxAttention, ABCMLPAttention, ABCWindowAttention]
    assert model.blocks[2].attn.options.window == 5 and model.blocks[1].attn.options.num_slots == 4
    # a mechanism that replaces the feed-forward sublayer does so in its own layer only
    mixed = hybrid({"1": {"name": "persistent", "n_persistent": 4}})
    assert isinstance(mixed.blocks[1].attn, PersistentAttention) and mixed.blocks[1].ff is None
    assert mixed.blocks[0].ff is not None and mixed.blocks[2].ff is not None


def test_layer_mechanisms_read_from_overrides_and_survive_a_checkpoints_json():
    cfg = load_config("tiny", ["attention=abc-mlp", "attention.num_slots=4", "model.attention_layers.1=softmax",
                               "model.attention_layers.0={name: abc-window, window: 8}"])
    assert cfg.model.layer_attention(0) == AttentionConfig("abc-window", {"window": 8})
    assert cfg.model.layer_attention(1).name == "softmax"
    assert list(cfg.model.attention_layers) == ["0", "1"]
    saved = json.loads(json.dumps(to_dict(cfg)))  # what a checkpoint's metadata holds
    assert to_dict(from_dict(RunConfig, saved)) == saved


@pytest.mark.parametrize("override, message", [
    ("model.attention_layers.2=softmax", r"model.attention_layers.2: expected a layer number in 0 .. 1"),
    ("model.attention_layers.0=nothing", r"model.attention_layers.0: attention: unknown mechanism 'nothing'"),
    ("model.attention_layers.0={name: abc-mlp, slots: 3}", r"model.attention_layers.0: attention.slots: not an option"),
    ("model.attention_layers.0=gmat", r"model.attention_layers: 'gmat' places memory tokens"),
])
def test_a_bad_layer_mechanism_is_refused_naming_it(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [override])


def test_decoding_with_the_cache_equals_the_full_forward():
    model = hybrid()
    idx = torch.randint(0, 37, (3, 23))
    full = model(idx)
    cache = model.init_cache(3)
    steps = [model(idx[:, t:t + 1], cache=cache) for t in range(idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
    cache = model.init_cache(3)  # a prompt, a multi-token continuation, then one token at a time
    parts = [model(idx[:, :9], cache=cache), model(idx[:, 9:16], cache=cache),
             *(model(idx[:, t:t + 1], cache=cache) for t in range(16, 23))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)
    assert not cache.fixed_size and [s.fixed_size for s in cache.states] == [False, True, True]


def test_info_reports_each_layers_state(capsys):
    from memattn.cli import main

    over = ["attention=abc-mlp", "attention.num_slots=4", "model.n_layers=3", "model.attention_layers.0=softmax",
            "model.attention_layers.2={name: abc-window, window: 8}"]
    assert main(["info", "--config", "tiny", *over, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    cfg = load_config("tiny", over)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**{**cfg.model.__dict__, "vocab_size": 256}))
    layers = info["state_by_layer"]
    assert [layer["attention"] for layer in layers] == ["softmax", "abc-mlp", "abc-window"]
    for layer, block in zip(layers, model.blocks):
        state = block.attn.init_state(1)
        assert layer["fixed_bytes"] == state.nbytes() and layer["fixed_size"] == state.fixed_size
        assert (layer["bytes_per_token"] == 0) == state.fixed_size
    assert layers[0]["bytes_per_token"] == 2 * 32 * 4  # a key and a value of d_model floats a token
    assert info["state_fixed_bytes"] == sum(layer["fixed_bytes"] for layer in layers)
    assert info["state_bytes_per_token"] == layers[0]["bytes_per_token"]
    assert main(["info", "--config", "tiny", *over]) == 0
    assert "layer 0       softmax: 0 bytes fixed + 256 per token" in capsys.readouterr().out


@pytest.mark.parametrize("layers, read", [(LAYERS, "window"), ({"2": {"name": "abc-window", "window": 5}}, "stream")])
def test_reading_by_length_streams_only_when_every_layer_is_bounded(layers, read):
    model = hybrid(layers).float()
    ids = torch.randint(0, 37, (400,))
    result = evaluate_by_length(model, ids, lengths=[64], train_len=16, streams=2)
    assert result["read"] == read
    assert all(b["read"] == read for b in result["buckets"] if b["bpc"] is not None)


def test_a_softmax_model_starts_both_kinds_of_layer():
    torch.manual_seed(0)
    soft = CausalLM(ModelConfig(vocab_size=37, d_model=32, n_layers=3, n_heads=4, ff_mult=2, max_len=64))
    model = hybrid().float()
    report = warm_start(model, Source("soft", soft.state_dict(), None))
    assert report["new"] == ["blocks.1.attn.phi.weight"] and report["dropped"] == []
    mine = model.state_dict()
    for k, t in soft.state_dict().items():  # the softmax layer, the window's projections, the trunk
        assert torch.equal(mine[k], t), k
    idx = torch.randint(0, 37, (2, 12))
    with torch.no_grad():  # the softmax layer reads as the source's first layer does
        a, b = [], []
        soft.hidden(idx, layer_inputs=a)
        model.hidden(idx, layer_inputs=b)
    torch.testing.assert_close(a[1], b[1])
