"""memattn models inside Hugging Face transformers: Auto classes, save / load, generate."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memattn.config import AttentionConfig, ModelConfig  # noqa: E402
from memattn.integrations.hf import (MemattnCache, MemattnConfig, MemattnForCausalLM,  # noqa: E402
                                     MemattnForMaskedLM)
from memattn.layers import mechanisms  # noqa: E402
from memattn.models import CausalLM, Encoder  # noqa: E402

VOCAB = 23
CAUSAL = [n for n, m in mechanisms().items() if m.causal]


def memattn_lm(name="abc-mlp", options=None, **kw):
    torch.manual_seed(0)
    base = dict(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, ff_mult=2, max_len=256,
                init_std=0.3, attention=AttentionConfig(name, dict(options or {})))
    base.update(kw)
    return CausalLM(ModelConfig(**base)).eval()


def greedy_by_hand(net, prompt, steps):
    """Greedy continuation with memattn's own cache, one token at a time."""
    cache = net.init_cache(1)
    logits = net(prompt[None], cache=cache)
    out = []
    for _ in range(steps):
        token = logits[0, -1].argmax()
        out.append(int(token))
        logits = net(token.view(1, 1), cache=cache)
    return out


def test_auto_classes_round_trip_bit_exact(tmp_path):
    net = memattn_lm()
    model = MemattnForCausalLM.from_memattn(net)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is MemattnForCausalLM
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.model.net.head.weight is loaded.model.net.embed.weight  # tied again
    ids = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(loaded(ids, use_cache=False).logits, net(ids).float())
    base = transformers.AutoModel.from_pretrained(tmp_path)
    torch.testing.assert_close(base(ids).last_hidden_state, net.hidden(ids))


@pytest.mark.parametrize("name", CAUSAL)
def test_greedy_generate_is_memattn_decoding(name):
    """generate's greedy tokens are those of memattn's own token-by-token decoding."""
    net = memattn_lm(name)
    model = MemattnForCausalLM.from_memattn(net)
    prompt = torch.randint(0, VOCAB, (7,))
    out = model.generate(prompt[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out[0, 7:].tolist() == greedy_by_hand(net, prompt, 6)


@pytest.mark.parametrize("name", [n for n in CAUSAL if n != "gmat"])
def test_left_padded_batch_generates_each_prompt_alone(name):
    net = memattn_lm(name)
    model = MemattnForCausalLM.from_memattn(net)
    long, short = torch.randint(1, VOCAB, (8,)), torch.randint(1, VOCAB, (4,))
    ids = torch.stack([long, torch.cat([torch.zeros(4, dtype=torch.long), short])])  # 4: abc-dilated's stride
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out[0, 8:].tolist() == greedy_by_hand(net, long, 5)
    assert out[1, 8:].tolist() == greedy_by_hand(net, short, 5)


@pytest.mark.parametrize("name", ["softmax", "abc-mlp", "persistent", "gated-linear"])
def test_beam_search_with_cache_equals_beam_search_without(name):
    """Beams reorder every layer's state: the cached search finds what recomputing each
    prefix from scratch finds."""
    model = MemattnForCausalLM.from_memattn(memattn_lm(name))
    prompt = torch.randint(0, VOCAB, (2, 6))
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0, num_return_sequences=2)
    cached = model.generate(prompt, **kw)
    recomputed = model.generate(prompt, use_cache=False, **kw)
    assert torch.equal(cached, recomputed)


def test_bounded_state_stays_fixed_under_generate():
    model = MemattnForCausalLM.from_memattn(memattn_lm("abc-mlp", n_layers=1, max_len=4096))
    prompt = torch.randint(0, VOCAB, (1, 4))
    sizes = []
    for steps in (100, 2000):
        cache = MemattnCache(n_layers=1)
        model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       pad_token_id=0, past_key_values=cache)
        assert cache.get_seq_length() == 4 + steps - 1
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] > 0


def top_k_probs(logits, k):
    """softmax over the k largest of logits [V], zero elsewhere: what top-k sampling draws from."""
    top = logits.double().topk(k)
    return torch.zeros(logits.shape[-1], dtype=torch.float64).scatter(0, top.indices, top.values.softmax(-1))


def test_sampling_draws_from_the_top_k_of_the_logits_and_is_seeded():
    """4,000 rows of one prompt sample two tokens each: the first tokens' frequencies are the
    top-5 probabilities of memattn's logits after the prompt, and, among the rows that drew the
    commonest first token, the second tokens' are those after the prompt and that token (the
    second step reads the cache). Greedy decoding would put every row on one token."""
    net = memattn_lm("abc-window")
    model = MemattnForCausalLM.from_memattn(net)
    prompt = torch.randint(0, VOCAB, (4,))
    torch.manual_seed(3)
    out = model.generate(prompt.expand(4000, -1), max_new_tokens=2, do_sample=True, top_k=5, pad_token_id=0)
    with torch.no_grad():
        first = top_k_probs(net(prompt[None])[0, -1], 5)
        seen = torch.bincount(out[:, 4], minlength=VOCAB) / 4000
        assert first.max() < 0.5 and (seen - first).abs().sum() / 2 < 0.03  # total variation
        common = seen.argmax()
        rows = out[out[:, 4] == common, 5]
        second = top_k_probs(net(torch.cat([prompt, common.view(1)])[None])[0, -1], 5)
        seen = torch.bincount(rows, minlength=VOCAB) / len(rows)
        assert second.max() < 0.5 and (seen - second).abs().sum() / 2 < 0.05
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(model.generate(prompt[None], max_new_tokens=8, do_sample=True, top_k=5, pad_token_id=0))
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (1, 12)


def test_labels_give_the_shifted_cross_entropy():
    net = memattn_lm("linear")
    model = MemattnForCausalLM.from_memattn(net)
    ids = torch.randint(0, VOCAB, (2, 10))
    want = torch.nn.functional.cross_entropy(net(ids)[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    torch.testing.assert_close(model(ids, labels=ids).loss, want)


def test_masked_lm_round_trip(tmp_path):
    torch.manual_seed(0)
    enc = Encoder(ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, ff_mult=2,
                              attention=AttentionConfig("abc-mlp", {"num_slots": 4}))).eval()
    model = MemattnForMaskedLM.from_memattn(enc)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    want = enc.mlm_logits(enc(ids, attention_mask=mask.bool()))
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, want.float())


def test_what_cannot_work_is_refused():
    model = MemattnForCausalLM.from_memattn(memattn_lm())
    with pytest.raises(ValueError, match="inputs_embeds is not supported"):
        model(inputs_embeds=torch.randn(1, 3, 16))
    full = transformers.DynamicCache()
    full.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)
    with pytest.raises(ValueError, match="cannot continue a memattn model"):
        model(torch.randint(0, VOCAB, (1, 2)), past_key_values=full)
    with pytest.raises(ValueError, match="expected architecture='causal-lm'"):
        MemattnForCausalLM(MemattnConfig.from_model_config(model.model.net.cfg, architecture="encoder"))


TEXT = "Héllo wörld!\n\tthe king <s> 😀 speaks."


def vocabularies():
    """One memattn vocabulary of each kind, and a text each encodes without unknowns."""
    from memattn.data.bpe import BPEVocab
    from memattn.data.pretrained import PretrainedVocab
    from memattn.data.vocab import Vocab

    bpe = BPEVocab.train([TEXT * 3, "the king and the queen"], size=290)
    return {"char": Vocab.from_text(TEXT), "char without unknown": Vocab.from_text(TEXT, unk=False),
            "byte": Vocab.of_bytes(), "bpe": bpe, "pretrained": PretrainedVocab(bpe.tokenizer_json, "local")}


@pytest.mark.parametrize("kind", list(vocabularies()))
def test_the_exported_tokenizer_has_the_vocabularys_ids(kind, tmp_path):
    """Saved and read back by AutoTokenizer: the ids of memattn's encode, decoded back to
    the text (an unseen character, where the vocabulary has an unknown symbol, as it)."""
    from memattn.integrations.hf import tokenizer_of

    vocab = vocabularies()[kind]
    tokenizer_of(vocab).save_pretrained(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert ids == vocab.encode(TEXT).tolist() and len(ids) > 1
    assert tok.decode(ids) == vocab.decode(ids) == TEXT
    if kind == "char":
        assert tok("kingZ", add_special_tokens=False).input_ids == vocab.encode("kingZ").tolist()
        assert vocab.encode("Z").tolist() == [vocab.unk_id]


def test_a_masked_lm_tokenizer_has_the_mask_token_after_the_vocabulary():
    from memattn.data.vocab import Vocab
    from memattn.integrations.hf import tokenizer_of

    vocab = Vocab.from_text(TEXT)
    tok = tokenizer_of(vocab, masked=True)
    assert tok.mask_token_id == vocab.size
    assert tok("ki<mask>g", add_special_tokens=False).input_ids == [*vocab.encode("ki").tolist(), vocab.size,
                                                                   *vocab.encode("g").tolist()]


def test_byte_chars_is_the_byte_level_pre_tokenizers_table():
    """Each byte's character as ByteLevel writes it: every ASCII byte alone, the bytes of
    multi-byte characters in text; 256 distinct characters, ByteLevel's alphabet."""
    from tokenizers import pre_tokenizers

    from memattn.integrations.hf import byte_chars

    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = byte_chars()
    for text in [chr(b) for b in range(128)] + ["é", "😀", "\u00ff\u0100"]:
        assert level.pre_tokenize_str(text)[0][0] == "".join(chars[b] for b in text.encode("utf-8"))
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet()) and len(set(chars)) == 256


@pytest.mark.parametrize("kind", list(vocabularies()))
def test_prompts_of_two_lengths_pad_on_the_left_and_generate_as_each_alone(kind):
    """tokenizer(texts, padding=True) then generate: each row continues its own prompt, as
    memattn's decoding of that prompt alone; the pad token is one the model can read."""
    from memattn.integrations.hf import tokenizer_of

    vocab = vocabularies()[kind]
    tok = tokenizer_of(vocab)
    pads = {"char": 0, "byte": 0, "bpe": 0, "char without unknown": vocab.size, "pretrained": None}
    assert tok.pad_token_id == pads[kind] and tok.padding_side == "left"
    if kind == "char":
        assert vocab.unk_id == 0
    masked = tokenizer_of(vocab, masked=True)
    assert masked.padding_side == "right" and masked.mask_token_id == vocab.size
    if kind == "char without unknown":  # the pad token follows the mask token
        assert masked.pad_token_id == vocab.size + 1
    if tok.pad_token_id is None:
        return
    net = memattn_lm("abc-mlp", {"num_slots": 4}, vocab_size=vocab.size)
    model = MemattnForCausalLM.from_memattn(net)
    texts = ["the king speaks", "king"]  # characters of every vocabulary
    batch = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    width = batch.input_ids.shape[1]
    assert batch.attention_mask[1].tolist() == [0] * (width - len(vocab.encode("king"))) + [1] * len(vocab.encode("king"))
    out = model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    for row, text in zip(out, texts):
        assert row[width:].tolist() == greedy_by_hand(net, torch.tensor(vocab.encode(text).tolist()), 5)
    assert tok.decode(out[1], skip_special_tokens=True).startswith("king")
