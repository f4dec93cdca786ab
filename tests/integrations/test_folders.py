"""Every folder memattn writes says what it is and loads in transformers as memattn loads it:
its own model type, auto_map for trust_remote_code, its format, a model card, context length
and bos/eos; and the transformers features clients lean on (hidden states, position ids,
resizing, gradient checkpointing, PEFT LoRA, a static cache refused)."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_convert import FAMILIES, batch, tiny  # noqa: E402

from conftest import tiny_overrides  # noqa: E402
from memattn.checkpoint import CheckpointError  # noqa: E402
from memattn.cli import main  # noqa: E402
from memattn.errors import ConfigError  # noqa: E402
from memattn.integrations.convert import convert, load_converted, save_converted  # noqa: E402
from memattn.integrations.hf import DOC_TOKEN, MemattnForCausalLM  # noqa: E402

ENCODERS = ("bert", "roberta")


def word_tokenizer(family):
    """A tokenizer of the tiny models' 50 ids: words w0 .. w49, the specials among them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(50)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if family in ENCODERS:
        special = dict(pad_token="w1" if family == "roberta" else "w0", mask_token="w4", unk_token="w3")
    else:
        special = dict(bos_token="w0", eos_token="w2", pad_token="w1", unk_token="w3")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def converted_folder(family, folder, attention="abc-mlp", **kw):
    model = convert(tiny(family), attention, **kw)
    save_converted(model, folder)
    word_tokenizer(family).save_pretrained(folder)
    return model


def auto_of(family):
    return transformers.AutoModelForMaskedLM if family in ENCODERS else transformers.AutoModelForCausalLM


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_folder_loads_in_transformers_as_memattn_loads_it(family, tmp_path):
    model = converted_folder(family, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == f"memattn-{family}" and config["memattn_format"] == 1
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", auto_of(family).__name__}
    assert (tmp_path / "modeling_memattn.py").exists() and "abc-mlp" in (tmp_path / "README.md").read_text()
    ids, mask = batch(family)
    ours = load_converted(tmp_path)
    theirs = auto_of(family).from_pretrained(tmp_path)
    assert type(theirs) is type(ours) is type(model) and isinstance(theirs, type(tiny(family)))
    want = ours(ids, attention_mask=mask).logits
    assert torch.equal(theirs(ids, attention_mask=mask).logits, want)
    real = mask.bool()
    torch.testing.assert_close(want[real], model(ids, attention_mask=mask).logits[real], atol=0, rtol=0)
    tok = word_tokenizer(family)
    if family in ENCODERS:  # fill-mask: the top word is the loaded model's argmax
        pipe = transformers.pipeline("fill-mask", model=str(tmp_path), device="cpu")
        top = pipe("w7 w8 w4 w9", top_k=1)[0]["token"]
        logits = ours(**tok("w7 w8 w4 w9", return_tensors="pt")).logits
        assert top == int(logits[0, 2].argmax())
        return
    pipe = transformers.pipeline("text-generation", model=str(tmp_path), device="cpu")
    torch.testing.assert_close(pipe.model(ids, attention_mask=mask).logits, want, atol=0, rtol=0)
    got = pipe("w7 w8 w9", max_new_tokens=5, min_new_tokens=5, do_sample=False, return_tensors=True)
    prompt = tok("w7 w8 w9", return_tensors="pt").input_ids
    out = ours.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=1)
    assert list(got[0]["generated_token_ids"]) == out[0].tolist()


def test_save_pretrained_of_a_converted_model_writes_the_same_folder(tmp_path):
    """convert() makes the model its family's converted class: whatever saves it writes a folder
    that says what it is."""
    model = convert(tiny("gpt2"), "gated-linear", layers=[0])
    assert type(model).__name__ == "MemattnGPT2LMHeadModel" and model.config.model_type == "memattn-gpt2"
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, mask = batch("gpt2")
    want = load_converted(tmp_path)(ids, attention_mask=mask).logits
    assert torch.equal(loaded(ids, attention_mask=mask).logits, want)
    assert type(loaded.transformer.h[1].attn).__name__ == "GPT2Attention"  # the hybrid kept
    assert json.loads((tmp_path / "config.json").read_text())["memattn_conversion"]["layers"] == [0]


def exported_folder(text_file, tmp_path, *extra):
    over = tiny_overrides(text_file, tmp_path, "train.steps=2", "train.seq_len=24", "attention=abc-mlp",
                          "attention.num_slots=4", *extra)
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    assert main(["export-hf", str(tmp_path / "run"), "-o", str(tmp_path / "hf")]) == 0
    return tmp_path / "hf"


def test_an_exported_folder_says_what_it_is(text_file, tmp_path):
    from memattn.train import model_from_checkpoint

    folder = exported_folder(text_file, tmp_path)
    net, cfg, vocab = model_from_checkpoint(tmp_path / "run")
    config = json.loads((folder / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    newline = tok("\n", add_special_tokens=False).input_ids[0]
    assert config["model_type"] == "memattn" and config["memattn_format"] == 1
    assert "AutoModelForCausalLM" in config["auto_map"]
    assert config["max_position_embeddings"] == tok.model_max_length == 24  # the length it was trained at
    assert tok.bos_token == tok.eos_token == DOC_TOKEN and tok.bos_token_id >= net.cfg.vocab_size
    assert config["bos_token_id"] == config["eos_token_id"] == tok.bos_token_id
    assert config["separator_token_id"] == newline
    card = (folder / "README.md").read_text()
    for fact in ("abc-mlp", '"num_slots": 4', "per sequence, whatever the context length", "training steps | 2",
                 "corpus.txt", "val bpc", "24 tokens", "trust_remote_code=True"):
        assert fact in card, fact
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([tok("The king", add_special_tokens=False).input_ids])
    with torch.no_grad():  # bos reads as the newline between documents
        assert torch.equal(model(torch.cat([torch.tensor([[tok.bos_token_id]]), ids], 1), use_cache=False).logits,
                           net(torch.cat([torch.tensor([[newline]]), ids], 1)).float())
    pipe = transformers.pipeline("text-generation", model=str(folder))
    text = pipe("The king", max_new_tokens=30, do_sample=False)[0]["generated_text"]
    seq = ids[0].tolist()
    for _ in range(30):
        seq.append(int(net(torch.tensor([seq]))[0, -1].argmax()))
    assert text == tok.decode(seq)  # newlines kept: the separator is no text


SUBPROCESS = """
import sys, torch, transformers
folder, block = sys.argv[1], sys.argv[2] == "block"
if block:
    sys.modules["memattn"] = None  # as if memattn were not installed
try:
    transformers.AutoModelForCausalLM.from_pretrained(folder)
    print("loaded without remote code")
except ValueError:
    pass
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
except ImportError as e:
    print("ImportError:", e)
    raise SystemExit
with torch.no_grad():
    print("RESULT", type(model).__name__, float(model(torch.arange(2, 13)[None]).logits.double().sum()))
"""


def test_trust_remote_code_loads_a_folder_without_importing_memattn(text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    folders = {"exported": exported_folder(text_file, tmp_path / "e"), "converted": tmp_path / "c"}
    converted_folder("qwen3", folders["converted"], layers=[0])
    for name, folder in folders.items():
        auto = transformers.AutoModelForCausalLM
        ours = load_converted(folder) if name == "converted" else auto.from_pretrained(folder)
        with torch.no_grad():
            want = float(ours(torch.arange(2, 13)[None]).logits.double().sum())
        run = subprocess.run([sys.executable, "-c", SUBPROCESS, str(folder), "load"], capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "loaded without remote code" not in run.stdout  # unknown without memattn: never read as llama
        kind, total = run.stdout.split("RESULT")[1].split()
        assert kind == ("MemattnForCausalLM" if name == "exported" else "MemattnQwen3ForCausalLM")
        assert float(total) == pytest.approx(want, abs=1e-6)
    run = subprocess.run([sys.executable, "-c", SUBPROCESS, str(folders["exported"]), "block"], capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert "ImportError: this model folder was written by memattn" in run.stdout
    assert "memattn is not installed: pip install 'memattn[hf]'" in run.stdout


def edit(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(memattn_format=7), "written in memattn folder format 7, this memattn reads formats up to 1"),
    (lambda c: c.update(memattn_format="one"), "memattn_format is 'one', expected a format number"),
    (lambda c: c["memattn_conversion"].update(attention="no-such"), "memattn_conversion does not convert this model"),
    (lambda c: c["memattn_conversion"].update(layers="all"), "memattn_conversion.layers: expected a list"),
    (lambda c: c.pop("memattn_conversion"), "memattn_conversion is missing"),
])
def test_a_folder_of_another_format_or_edited_by_hand_is_refused_naming_its_file(tmp_path, change, message):
    converted_folder("llama", tmp_path)
    edit(tmp_path, change)
    with pytest.raises(ConfigError, match=message) as raised:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert str(raised.value).startswith(f"{tmp_path}/config.json: ") and "\n" not in str(raised.value)


def test_an_exported_folder_edited_by_hand_is_refused_naming_its_file(tmp_path):
    net = MemattnForCausalLM.from_memattn(__import__("test_hf").memattn_lm())
    net.save_pretrained(tmp_path)
    edit(tmp_path, lambda c: c["memattn"].update(n_layer=3))
    with pytest.raises(ConfigError, match=r"config.json: memattn.n_layer") as raised:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "\n" not in str(raised.value)


def test_convert_refuses_a_folder_memattn_wrote(tmp_path, capsys):
    converted_folder("llama", tmp_path / "abc", layers=[1])
    assert main(["convert", str(tmp_path / "abc"), "--attention", "softmax", "-o", str(tmp_path / "x")]) == 2
    assert "was converted by memattn already ('abc-mlp' in layers [1])" in capsys.readouterr().err
    edit(tmp_path / "abc", lambda c: c.update(model_type="llama"))  # as an earlier memattn wrote it
    assert main(["convert", str(tmp_path / "abc"), "--attention", "softmax", "-o", str(tmp_path / "x")]) == 2
    assert "converted by memattn already" in capsys.readouterr().err
    MemattnForCausalLM.from_memattn(__import__("test_hf").memattn_lm()).save_pretrained(tmp_path / "own")
    assert main(["convert", str(tmp_path / "own"), "--attention", "softmax", "-o", str(tmp_path / "x")]) == 2
    assert "is a memattn model already" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_convert_of_a_folder_without_a_tokenizer_says_so(tmp_path, capsys):
    tiny("gpt2").save_pretrained(tmp_path / "gpt2")
    assert main(["convert", str(tmp_path / "gpt2"), "--attention", "softmax", "-o", str(tmp_path / "out")]) == 0
    assert "without a tokenizer" in capsys.readouterr().err
    assert not any((tmp_path / "out" / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


def test_a_converted_encoder_cannot_start_a_causal_lm(tmp_path):
    from memattn.warmstart import read_source

    converted_folder("bert", tmp_path)
    with pytest.raises(CheckpointError, match="converts a bidirectional encoder .* learn to read the next token"):
        read_source(tmp_path)
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # nor does transformers read it causally


def clients_models():
    """An exported memattn model and a converted hybrid, each with what memattn's loader gives."""
    net = __import__("test_hf").memattn_lm("abc-mlp")
    return {"exported": (MemattnForCausalLM.from_memattn(net), lambda ids: net(ids).float()),
            "converted": (convert(tiny("llama"), "abc-mlp", layers=[1]), None)}


@pytest.mark.parametrize("kind", ["exported", "converted"])
def test_what_transformers_clients_lean_on(kind):
    model, memattn_logits = clients_models()[kind]
    ids = torch.randint(2, 20, (2, 9))
    out = model(ids, output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == 3 and out.hidden_states[0].shape == (2, 9, model.config.hidden_size)
    if memattn_logits is not None:
        assert torch.equal(out.logits, memattn_logits(ids))
    # position ids: memattn's own are taken, others refused
    positions = torch.arange(9).expand(2, 9)
    assert torch.equal(model(ids, position_ids=positions, use_cache=False).logits, out.logits)
    if kind == "exported":
        with pytest.raises(ConfigError, match="position_ids: memattn places each token by counting"):
            model(ids, position_ids=positions + 3)
    # a static cache is refused with the reason
    with pytest.raises(ConfigError, match="static .* cannot hold a memattn layer's state"):
        model.generate(ids, max_new_tokens=2, cache_implementation="static", pad_token_id=0)
    with pytest.raises(ConfigError, match="static .* cannot hold a memattn layer's state"):
        model(ids, past_key_values=transformers.StaticCache(config=model.config, max_cache_len=16))
    # gradient checkpointing: the same gradients
    model.train()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.gradient_checkpointing_disable()
    model.eval()
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-5)
    # resize_token_embeddings: the old ids read as before
    V = model.config.vocab_size
    want = model(ids, use_cache=False).logits
    model.resize_token_embeddings(V + 3)
    assert model.get_input_embeddings().weight.shape[0] == model.config.vocab_size == V + 3
    got = model(ids, use_cache=False).logits
    assert got.shape[-1] == V + 3
    torch.testing.assert_close(got[..., :V], want, atol=1e-5, rtol=1e-5)
    if kind == "exported":
        assert model.config.memattn["vocab_size"] == V + 3


@pytest.mark.parametrize("kind", ["exported", "converted"])
def test_peft_lora_finds_its_default_target_modules(kind, tmp_path):
    peft = pytest.importorskip("peft")
    model, _ = clients_models()[kind]
    ids = torch.randint(2, 20, (2, 9))
    want = model(ids, use_cache=False).logits
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2))
    adapted = {n.rsplit(".", 2)[-2] for n, _ in lora.named_modules() if n.endswith("lora_A")}
    assert adapted == ({"qkv"} if kind == "exported" else {"q_proj", "v_proj", "qkv"})
    torch.testing.assert_close(lora(ids, use_cache=False).logits, want)  # LoRA's B starts at zero
