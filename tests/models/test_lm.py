"""memattn.models.CausalLM: cache equivalence, causality, positions, state accounting."""


import pytest
import torch
from conftest import registered

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError, ShapeError
from memattn.generate import generate
from memattn.layers import get_mechanism
from memattn.models import CausalLM, Compressor


def small(name="softmax", **kw):
    """A small float64 LM of mechanism `name` with its registration's test options."""
    base = dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=64,
                attention=AttentionConfig(name, get_mechanism(name).test_options))
    base.update(kw)
    return CausalLM(ModelConfig(**base)).double().eval()


CAUSAL = registered("causal")


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("positions", ["rotary", "learned", "none"])
def test_token_by_token_decoding_equals_full_forward(name, positions):
    model = small(name, positions=positions)
    idx = torch.randint(0, 37, (3, 23))
    full = model(idx)
    cache = model.init_cache(3)
    steps = [model(idx[:, t:t + 1], cache=cache) for t in range(idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
    assert cache.position == 23


@pytest.mark.parametrize("name,options", [*((n, {}) for n in CAUSAL), ("abc-mlp", {"recency": True})])
def test_bf16_autocast_stays_close_to_float32(name, options):
    """Under CPU autocast to bf16 every mechanism runs (the ABC ops turn it off inside, where
    their fp32 parts would meet autocast's bf16 ones) and stays near the float32 logits."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=64,
                                 attention=AttentionConfig(name, options))).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("attn.rate"):
                p.normal_(0, 0.3)  # recency rates, 0 at init: tilt the write logits
        idx = torch.randint(0, 37, (2, 60))
        want = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(idx)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.05)


@pytest.mark.parametrize("name", CAUSAL)
def test_prefill_then_decode_equals_full_forward(name):
    model = small(name)
    idx = torch.randint(0, 37, (2, 30))
    full = model(idx)
    cache = model.init_cache(2)
    a = model(idx[:, :17], cache=cache)
    b = model(idx[:, 17:25], cache=cache)  # a multi-token continuation
    c = torch.cat([model(idx[:, t:t + 1], cache=cache) for t in range(25, 30)], 1)
    torch.testing.assert_close(torch.cat([a, b, c], 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", CAUSAL)
def test_future_tokens_do_not_change_past_logits(name):
    model = small(name)
    idx = torch.randint(0, 37, (1, 20))
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 37
    torch.testing.assert_close(model(idx)[:, :12], model(changed)[:, :12], rtol=0, atol=1e-12)
    assert not torch.allclose(model(idx)[:, 12:], model(changed)[:, 12:])


def test_kv_cache_grows_by_one_key_and_value_per_token():
    model = small("softmax")
    cache = model.init_cache(1)
    model(torch.zeros(1, 10, dtype=torch.long), cache=cache)
    before = cache.nbytes()
    model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    # 2 layers x (key + value) x d_model doubles per token
    assert cache.nbytes() - before == 2 * 2 * 32 * 8
    assert not cache.fixed_size


def test_tied_embeddings_share_one_tensor():
    model = small()
    assert model.head.weight is model.embed.weight
    untied = small(tie_embeddings=False)
    assert untied.num_parameters() == model.num_parameters() + 37 * 32


@pytest.mark.parametrize("std", [0.02, 0.125])
def test_weights_start_at_the_configured_scale(std):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=500, d_model=64, n_layers=3, n_heads=4, init_std=std))
    # N(0, std) everywhere, residual output projections N(0, std / √(2·layers)), biases 0
    assert model.embed.weight.std().item() == pytest.approx(std, rel=0.03)
    block = model.blocks[1]
    assert block.ff.up.weight.std().item() == pytest.approx(std, rel=0.03)
    for out in (block.attn.out.weight, block.ff.down.weight):
        assert out.std().item() == pytest.approx(std / 6 ** 0.5, rel=0.05)
    compressor = Compressor(ModelConfig(vocab_size=500, d_model=64, n_layers=3, n_heads=4, init_std=std,
                                        attention=AttentionConfig("gmat", {"num_memory": 4})),
                            n_compress=1, n_decompress=1)
    assert compressor.embed.weight.std().item() == pytest.approx(std, rel=0.03)
    assert compressor.memory_blocks[0].attn.out.weight.std().item() == pytest.approx(std / 6 ** 0.5, rel=0.05)
    with pytest.raises(ConfigError, match="model.init_std"):
        ModelConfig(init_std=0.0)


def test_learned_positions_reject_sequences_past_max_len():
    model = small(positions="learned", max_len=16)
    with pytest.raises(ShapeError, match=r"exceed model\.max_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    rotary = small(positions="rotary", max_len=16)
    assert rotary(torch.zeros(1, 40, dtype=torch.long)).shape == (1, 40, 37)


def test_bad_token_ids_shape_is_a_clear_error():
    with pytest.raises(ShapeError, match=r"idx: expected integer token ids \[B, T\]"):
        small()(torch.zeros(5, dtype=torch.long))


def test_generate_greedy_matches_argmax_of_full_forward():
    model = small()
    prompt = torch.randint(0, 37, (2, 5))
    tokens = torch.stack(list(generate(model, prompt, 8, temperature=0)), 1)
    seq = prompt
    for _ in range(8):  # no cache: recompute everything each step
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, seq[:, 5:])


def test_generate_is_reproducible_with_a_seed():
    model = small()
    prompt = torch.randint(0, 37, (1, 3))
    a = torch.stack(list(generate(model, prompt, 10, seed=3)))
    b = torch.stack(list(generate(model, prompt, 10, seed=3)))
    assert torch.equal(a, b)
