"""A converted transformers model trained on with `memattn train train.init_from=FOLDER`: its
own tokenizer, the usual loop (resume), evaluation, and distillation from the original."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from conftest import tiny_overrides, train_crashing_at  # noqa: E402

from memattn.cli import main  # noqa: E402
from memattn.config import load_config  # noqa: E402
from memattn.integrations.convert import load_converted  # noqa: E402
from memattn.train import model_from_checkpoint, train  # noqa: E402


def pretrained(folder, text_file):
    """A tiny Llama and a BPE tokenizer trained on the corpus, saved as a pretrained folder."""
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
                                      max_position_embeddings=128)
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
