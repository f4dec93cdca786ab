"""Pretrained transformers models with their attention replaced by memattn mechanisms."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memattn.errors import ConfigError  # noqa: E402
from memattn.integrations.convert import (ConvertedAttention, convert, load_converted, save_converted,  # noqa: E402
                                          targets)
from memattn.layers import get_mechanism, mechanisms  # noqa: E402
from memattn.layers.base import mechanism_of  # noqa: E402

COMMON = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
              vocab_size=50, max_position_embeddings=128)


def tiny(family):
    """A small random model of each supported family, in eval mode, with eager attention."""
    torch.manual_seed(0)
    T = transformers
    configs = {
        "llama": lambda: (T.LlamaConfig(num_key_value_heads=2, **COMMON), T.LlamaForCausalLM),
        "mistral": lambda: (T.MistralConfig(num_key_value_heads=2, sliding_window=None, **COMMON), T.MistralForCausalLM),
        "qwen2": lambda: (T.Qwen2Config(num_key_value_heads=2, **COMMON), T.Qwen2ForCausalLM),
        "qwen3": lambda: (T.Qwen3Config(num_key_value_heads=2, head_dim=8, **COMMON), T.Qwen3ForCausalLM),
        "gpt2": lambda: (T.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=50, n_positions=128,
                                      bos_token_id=0, eos_token_id=0), T.GPT2LMHeadModel),
        "bert": lambda: (T.BertConfig(**COMMON), T.BertForMaskedLM),
        "roberta": lambda: (T.RobertaConfig(pad_token_id=1, **{**COMMON, "max_position_embeddings": 130}),
                            T.RobertaForMaskedLM),
    }
    config, cls = configs[family]()
    model = cls._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # biases away from zero (Qwen2's q/k/v, GPT-2's, BERT's)
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "bert", "roberta"]


def batch(family):
    torch.manual_seed(1)
    ids = torch.randint(2, 50, (2, 11))
    mask = torch.ones_like(ids)
    if family in ("bert", "roberta"):
        mask[1, 8:] = 0  # right padding in an encoder
    else:
        mask[1, :4] = 0  # left padding in a decoder
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_to_softmax_the_model_reads_as_before(family):
    """memattn's softmax layer with the copied weights is the model's own attention: grouped
    key/value heads, rotary base, q/k norms, biases and padding all carried over."""
    model = tiny(family)
    ids, mask = batch(family)
    want = model(ids, attention_mask=mask).logits
    before = {k: t.clone() for k, t in model.state_dict().items()}
    convert(model, "softmax")
    got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    after = model.state_dict()
    kept = [k for k in before if k in after]
    assert kept and all(torch.equal(before[k], after[k]) for k in kept)  # the rest untouched
    assert all("attn" in k or "attention" in k for k in set(before) - set(after))  # only attention


def greedy(model, ids, steps, **kw):
    kw.setdefault("min_new_tokens", steps)  # no early end of sequence: every row runs all steps
    return model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("attention", ["abc-mlp", "gated-linear", "abc-window"])
def test_converted_decoder_generates_with_its_state(family, attention):
    model = convert(tiny(family), attention)
    ids, mask = batch(family)
    cached = greedy(model, ids, 6, attention_mask=mask)
    assert torch.equal(cached, greedy(model, ids, 6, attention_mask=mask, use_cache=False))
    alone = greedy(model, ids[1:, 4:], 6)
    assert torch.equal(cached[1, 11:], alone[0, 7:])  # a left-padded row generates as alone
    beams = dict(num_beams=3, num_return_sequences=2)
    assert torch.equal(greedy(model, ids, 5, attention_mask=mask, **beams),
                       greedy(model, ids, 5, attention_mask=mask, use_cache=False, **beams))


def test_bounded_state_stays_fixed_and_hybrids_keep_softmax_layers():
    model = convert(tiny("llama"), "abc-mlp", {"num_slots": 4}, layers=[1])
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
    sizes = []
    for steps in (20, 200):
        cache = transformers.DynamicCache(config=model.config)
        greedy(model, torch.randint(2, 50, (1, 5)), steps, past_key_values=cache)
        state = cache.layers[1].state
        sizes.append(sum(t.numel() for t in state.tensors()))
        assert cache.layers[0].get_seq_length() == cache.layers[1].get_seq_length() == 5 + steps - 1
    assert sizes[0] == sizes[1]


def test_encoder_conversion_and_round_trip(tmp_path):
    model = convert(tiny("bert"), "abc-mlp", {"num_slots": 4})
    ids, mask = batch("bert")
    want = model(ids, attention_mask=mask).logits
    save_converted(model, tmp_path)
    loaded = load_converted(tmp_path, transformers.AutoModelForMaskedLM)
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, want)


@pytest.mark.parametrize("change, message", [
    (lambda m: convert(m, "gmat"), "memory tokens are placed in the sequence"),
    (lambda m: convert(m, "abc-mlp", layers=[5]), r"layers \[5\] do not exist"),
    (lambda m: convert(m, "abc-mlp", {"slots": 3}), "not an option of 'abc-mlp'"),
    (lambda m: convert(m, "persistent", {"variant": "ff-attn", "n_persistent": 4}), "its own feed-forward"),
    (lambda m: convert(convert(m, "abc-mlp", layers=[1]), "abc-mlp", layers=[0]), "converted already"),
])
def test_what_cannot_be_converted_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        change(tiny("llama"))


@pytest.mark.parametrize("name", sorted(mechanisms()))
def test_what_the_registry_declares_convertible_converts_and_the_rest_is_refused(name):
    """Each mechanism with its test options, in a decoder (an encoder when it is bidirectional
    only): its layers take the model's attention, or the conversion is refused untouched."""
    mech = get_mechanism(name)
    family = "llama" if mech.causal else "bert"
    model = tiny(family)
    if not mech.convertible:
        with pytest.raises(ConfigError, match="cannot replace one attention module: it needs memattn's own models"):
            convert(model, name, mech.test_options)
        assert name not in targets() and not any(isinstance(m, ConvertedAttention) for m in model.modules())
        return
    assert name in targets()
    convert(model, name, mech.test_options)
    layers = [m.layer for m in model.modules() if isinstance(m, ConvertedAttention)]
    assert len(layers) == 2 and all(mechanism_of(layer) is mech for layer in layers)
    ids, _ = batch(family)
    assert torch.isfinite(model(ids).logits).all()


def test_rotary_scaling_and_sliding_windows_are_refused():
    model = tiny("llama")
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="rotary scaling 'linear' is not supported"):
        convert(model, "softmax")
    model = tiny("mistral")
    model.config.sliding_window = 16
    with pytest.raises(ConfigError, match="sliding-window attention"):
        convert(model, "softmax")


def test_convert_command_round_trip(tmp_path):
    from memattn.cli import main

    original = tiny("qwen2")
    original.save_pretrained(tmp_path / "qwen")
    out = tmp_path / "abc"
    assert main(["convert", str(tmp_path / "qwen"), "--attention", "abc-mlp", "attention.num_slots=4",
                 "--layers", "0", "-o", str(out)]) == 0
    loaded = load_converted(out)
    assert type(loaded.model.layers[0].self_attn).__name__ == "ConvertedAttention"
    assert loaded.model.layers[0].self_attn.layer.options.num_slots == 4
    assert type(loaded.model.layers[1].self_attn).__name__ == "Qwen2Attention"
    assert torch.equal(loaded.model.embed_tokens.weight, original.model.embed_tokens.weight)
    assert main(["convert", str(tmp_path / "qwen"), "--attention", "abc-mlp", "num_slots=4",
                 "-o", str(tmp_path / "x")]) == 2
