"""A converted transformers model trained on with `memattn train train.init_from=FOLDER`: its
own tokenizer, the usual loop (resume), evaluation, distillation from the original, and
attention transfer (train.transfer_steps) with LoRA (train.lora_rank)."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from conftest import crash_in_transfer_and_resume, tiny_overrides, train_crashing_at  # noqa: E402

from memattn.cli import main  # noqa: E402
from memattn.config import load_config  # noqa: E402
from memattn.integrations.convert import load_converted  # noqa: E402
from memattn.train import model_from_checkpoint, train  # noqa: E402


def pretrained(folder, text_file, **config):
    """A tiny Llama (`config`: more of its settings) and a BPE tokenizer trained on the corpus,
    saved as a pretrained folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    tok.train([str(text_file)], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=64, vocab_size=len(fast),
                                      max_position_embeddings=128, **config)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return fast


def read_log(run):
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_converted_model_trains_resumes_and_evaluates_with_its_tokenizer(text_file, tmp_path, capsys):
    original = tmp_path / "llama"
    fast = pretrained(original, text_file)
    converted = tmp_path / "llama-abc"
    assert main(["convert", str(original), "--attention", "abc-mlp", "attention.num_slots=4",
                 "-o", str(converted)]) == 0
    assert (converted / "tokenizer.json").exists()  # the folder carries the tokenizer it reads with

    extra = ("train.steps=6", "train.log_every=1", "train.save_every=2", "train.eval_every=3",
             "train.seq_len=16", f"train.init_from={converted}")
    whole = load_config("tiny", tiny_overrides(text_file, tmp_path / "whole", *extra))
    summary = train(whole, progress=False)
    log = read_log(tmp_path / "whole" / "run")
    assert log[-1]["loss"] < log[0]["loss"]
    model, cfg, vocab = model_from_checkpoint(tmp_path / "whole" / "run")
    assert type(model.hf).__name__ == "MemattnLlamaForCausalLM" and summary["params"] == model.num_parameters()
    assert type(model.hf.model.layers[0].self_attn).__name__ == "ConvertedAttention"
    # the corpus was read with the converted folder's tokenizer
    text = "Good night sweet prince."
    assert cfg.data.tokenizer == str(converted)
    from memattn.data import Vocab

    assert Vocab.from_json(vocab).encode(text).tolist() == fast(text, add_special_tokens=False)["input_ids"]
    # the trained weights differ from the converted ones (it trained), the architecture is the same
    start = load_converted(converted)
    assert not torch.equal(model.hf.model.layers[0].self_attn.layer.phi.weight,
                           start.model.layers[0].self_attn.layer.phi.weight)

    cut = load_config("tiny", tiny_overrides(text_file, tmp_path / "cut", *extra))
    train_crashing_at(cut, 3)
    train(cut, resume=True, progress=False)
    assert [(r["step"], r.get("loss")) for r in read_log(tmp_path / "cut" / "run")] == \
        [(r["step"], r.get("loss")) for r in log]

    assert main(["eval", str(tmp_path / "whole" / "run"), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    # the converted model starts at the uniform guess over its vocabulary, ln V nats a token
    # (its first training loss); six steps take the test loss well below it
    uniform = math.log(len(fast))
    assert log[0]["loss"] == pytest.approx(uniform, abs=0.05)
    assert scores["loss"] < uniform - 0.3
    assert scores["bits_per_token"] == pytest.approx(scores["loss"] / math.log(2))

    # exported: the trained model as its converted family, with the run's tokenizer and length
    assert main(["export-hf", str(tmp_path / "whole" / "run"), "-o", str(tmp_path / "exported")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    ids = torch.tensor([fast(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, model.hf(ids).logits)
    assert exported.config.max_position_embeddings == 16  # train.seq_len
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "exported").model_max_length == 16
    assert "| training steps | 6 |" in (tmp_path / "exported" / "README.md").read_text()

    # uptraining towards the original: a KL term to the model the folder was converted from
    distil = load_config("tiny", tiny_overrides(text_file, tmp_path / "distil", *extra, "train.distill_weight=0.5"))
    train(distil, progress=False)
    records = [r for r in read_log(tmp_path / "distil" / "run") if "distill" in r]
    assert records and all(r["distill"] > 0 for r in records)


def llama_attention(attn, rotary, u):
    """The output of a Llama attention module on its (normed) input u [B, T, d], computed here
    by hand: rotary q and k, key/value heads repeated over their query heads, causal softmax."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, T, _ = u.shape
    D = attn.head_dim
    q, k, v = (proj(u).view(B, T, -1, D).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = apply_rotary_pos_emb(q, k, *rotary(u, torch.arange(T)[None]))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) / D ** 0.5).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf)
    return attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))


@torch.no_grad()
def layer_errors(original, converted, ids):
    """Per layer, the mean squared error of the converted layer's output against the original
    softmax layer's, both reading the original model's input of that layer (its norm applied)."""
    hidden = original(ids, output_hidden_states=True).hidden_states
    errors = []
    for layer, mine, h in zip(original.model.layers, converted.model.layers, hidden):
        u = layer.input_layernorm(h)
        errors.append(float(((mine.self_attn(u)[0] - llama_attention(layer.self_attn, original.model.rotary_emb, u)) ** 2).mean()))
    return errors


def converted_llama(tmp_path, text_file, *convert_args):
    """A tiny Llama (weights large enough that its attention outputs are not negligible) with
    its tokenizer, converted by `memattn convert` with convert_args: (original, converted) folders."""
    original, converted = tmp_path / "llama", tmp_path / "llama-converted"
    pretrained(original, text_file, initializer_range=0.2)
    assert main(["convert", str(original), *convert_args, "-o", str(converted)]) == 0
    return original, converted


@pytest.mark.slow
def test_transfer_fits_each_converted_layer_to_the_original_and_moves_nothing_else(text_file, tmp_path, capsys):
    original, converted = converted_llama(tmp_path, text_file, "--attention", "abc-mlp", "attention.num_slots=4")
    extra = ("train.seq_len=16", f"train.init_from={converted}", "train.transfer_steps=40",
             "train.transfer_lr=0.01", "train.steps=1", "train.log_every=10")
    cfg = load_config("tiny", tiny_overrides(text_file, tmp_path / "abc", *extra))
    train_crashing_at(cfg, 1)  # stopped at the first ordinary step: the checkpoint is the transfer's last
    after, run_cfg, _ = model_from_checkpoint(tmp_path / "abc" / "run")
    after = after.hf
    before = load_converted(converted)
    source = transformers.AutoModelForCausalLM.from_pretrained(original).eval()

    from memattn.evaluate import as_tensor
    from memattn.train import load_run_corpus

    ids = as_tensor(load_run_corpus(run_cfg).val)[:8 * 16].view(8, 16)  # text the transfer never read
    was, now = layer_errors(source, before, ids), layer_errors(source, after, ids)
    assert all(b < 0.7 * a for a, b in zip(was, now)), (was, now)

    new = {"model.layers.0.self_attn.layer.phi.weight", "model.layers.1.self_attn.layer.phi.weight"}
    mine, start, theirs = after.state_dict(), before.state_dict(), source.state_dict()
    for k in mine:
        if k in new:
            assert not torch.equal(mine[k], start[k]), k  # the mechanism's own parameters moved
        else:
            assert torch.equal(mine[k], start[k]), k  # every other one as converted
    for k, t in theirs.items():  # and outside attention, bit for bit the original's
        if ".self_attn." not in k:
            assert torch.equal(mine[k], t), k

    log = read_log(tmp_path / "abc" / "run")
    transfer = [r for r in log if r.get("phase") == "transfer"]
    assert [r["transfer_step"] for r in transfer] == [10, 20, 30, 40]
    assert set(transfer[0]["transfer_layers"]) == {"0", "1"}
    for layer in ("0", "1"):
        assert transfer[-1]["transfer_layers"][layer] < 0.7 * transfer[0]["transfer_layers"][layer]

    # the whole path on the command line: convert (above), transfer and train, then read it back
    run = tmp_path / "cli" / "run"
    assert main(["train", "--config", "tiny", "--quiet", *tiny_overrides(text_file, tmp_path / "cli", *extra[:2]),
                 "train.transfer_steps=4", "train.steps=3", "train.eval_every=3", "train.distill_weight=0.5"]) == 0
    log = read_log(run)
    assert [r.get("transfer_step") for r in log if r.get("phase") == "transfer"] == [4]
    assert log[-1]["step"] == 3 and log[-1]["distill"] > 0
    assert main(["eval", str(run), "--json"]) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out.splitlines()[-1])["loss"])
    assert main(["export-hf", str(run), "-o", str(tmp_path / "exported")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, model_from_checkpoint(run)[0].hf(ids).logits)


@pytest.mark.slow
def test_a_converted_hybrid_killed_in_transfer_resumes_as_an_uninterrupted_one(text_file, tmp_path):
    """A hybrid (layer 1 kept as the original's attention, so only layer 0 is transferred) with
    distillation and LoRA adapters in the ordinary steps, killed mid-transfer and at the first
    ordinary step: the logs and the final weights equal those of a run never stopped."""
    _, converted = converted_llama(tmp_path, text_file, "--attention", "gsa", "attention.num_slots=4",
                                   "--layers", "0")
    extra = ("train.seq_len=16", f"train.init_from={converted}", "train.transfer_steps=6", "train.steps=4",
             "train.log_every=1", "train.save_every=2", "train.eval_every=2", "train.distill_weight=0.5",
             "train.lora_rank=2")
    train(load_config("tiny", tiny_overrides(text_file, tmp_path / "whole", *extra)), progress=False)
    whole = read_log(tmp_path / "whole" / "run")
    assert [r["transfer_layers"] for r in whole if r.get("transfer_step") == 1][0].keys() == {"0"}
    model = model_from_checkpoint(tmp_path / "whole" / "run")[0].hf
    start = load_converted(converted).state_dict()
    # LoRA: the linear weights of both layers moved (saved merged), and gsa's own gate; embeddings
    # and norms did not
    for k, t in model.state_dict().items():
        moved = (k.endswith(("proj.weight", "qkv.weight", "out.weight")) and ".layers." in k
                 or k == "model.layers.0.self_attn.layer.gate.weight")
        assert torch.equal(t, start[k]) != moved, k

    records = [(r["step"], r.get("transfer_step"), r.get("transfer_loss"), r.get("loss"), r.get("val_loss"))
               for r in whole]
    for name, crash_at in (("mid", 5), ("end", None)):  # None: at the first ordinary step
        cfg = load_config("tiny", tiny_overrides(text_file, tmp_path / name, *extra))
        crash_in_transfer_and_resume(cfg, crash_at)
        cut = read_log(tmp_path / name / "run")
        assert [(r["step"], r.get("transfer_step"), r.get("transfer_loss"), r.get("loss"), r.get("val_loss"))
                for r in cut] == records, name
        other = model_from_checkpoint(tmp_path / name / "run")[0].hf
        for (k, p), q in zip(model.state_dict().items(), other.state_dict().values()):
            assert torch.equal(p, q), (name, k)


def test_lora_adapts_gpt2_conv1d_layers_and_merges_into_them():
    """LoRA on a converted GPT-2: its MLP's Conv1D layers (weight [in, out]) and the converted
    layers' q/k/v and output are adapted; the merged weights read as the hooked adapters."""
    from memattn.integrations.convert import ConvertedLM, convert
    from memattn.transfer import LoRA, own_parameters
    from memattn.warmstart import Source

    def gpt2():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=50, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        return ConvertedLM(convert(transformers.GPT2LMHeadModel(config).eval(), "gsa", {"num_slots": 4})).eval()

    model = gpt2()
    own = own_parameters(model, Source(None, {}, None, converted=True))
    assert own == [f"hf.transformer.h.{i}.attn.layer.gate.{p}" for i in range(2) for p in ("weight", "bias")]
    lora = LoRA(model, LoRA.targets_of(model, own), rank=2)
    assert lora.names == [f"hf.transformer.h.{i}.{m}" for i in range(2)
                          for m in ("attn.layer.qkv", "attn.layer.out", "mlp.c_fc", "mlp.c_proj")]
    with torch.no_grad():
        for b in lora.b:
            b.normal_()
    lora.attach()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        adapted = model(ids)
        merged = gpt2()
        merged.load_state_dict(lora.merged_state(model))
        assert not torch.allclose(merged(ids), gpt2()(ids))
        assert torch.allclose(merged(ids), adapted, atol=1e-5)


def test_transfer_to_a_converted_model_is_refused_where_it_cannot_apply(text_file, tmp_path):
    import shutil

    from memattn.errors import CheckpointError, ConfigError

    original, converted = converted_llama(tmp_path, text_file, "--attention", "abc-window", "attention.window=4")
    cfg = load_config("tiny", tiny_overrides(text_file, tmp_path / "w", "train.seq_len=16", "train.steps=1",
                                             f"train.init_from={converted}", "train.transfer_steps=3"))
    with pytest.raises(ConfigError, match=r"train.transfer_steps: attention 'abc-window' has no parameters of its own"):
        train(cfg, progress=False)
    # the teacher is the model the folder was converted from: without it, no transfer
    shutil.copytree(original, tmp_path / "kept")
    _, gsa = converted_llama(tmp_path / "again", text_file, "--attention", "gsa", "attention.num_slots=4")
    shutil.rmtree(tmp_path / "again" / "llama")
    cfg = load_config("tiny", tiny_overrides(text_file, tmp_path / "g", "train.seq_len=16", "train.steps=1",
                                             f"train.init_from={gsa}", "train.transfer_steps=3"))
    with pytest.raises(CheckpointError, match=r"train.transfer_steps: the teacher .* cannot be loaded"):
        train(cfg, progress=False)
