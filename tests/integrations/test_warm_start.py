"""Starting a run from another model (train.init_from), and `memattn export-hf`."""

import dataclasses
import json

import pytest
import torch

from memattn.checkpoint import CheckpointError
from memattn.cli import main
from memattn.config import AttentionConfig, ModelConfig
from memattn.data.vocab import Vocab
from memattn.models import CausalLM, Encoder
from memattn.train import model_from_checkpoint
from memattn.warmstart import HF_VOCAB, Source, distill_loss, read_source, warm_start

from conftest import tiny_overrides


def lm(name, options=None, **kw):
    base = dict(vocab_size=30, d_model=16, n_layers=2, n_heads=2, ff_mult=2,
                attention=AttentionConfig(name, dict(options or {})))
    return CausalLM(ModelConfig(**{**base, **kw}))


def test_a_softmax_model_starts_abc_mlp_with_everything_but_phi():
    torch.manual_seed(0)
    soft = lm("softmax")
    torch.manual_seed(1)
    abc = lm("abc-mlp", {"num_slots": 4})
    phi_before = {k: t.clone() for k, t in abc.state_dict().items() if ".phi" in k}
    report = warm_start(abc, Source("soft", soft.state_dict(), None))
    mine, theirs = abc.state_dict(), soft.state_dict()
    assert report["copied"] == sorted(theirs) and report["dropped"] == []
    assert report["new"] == sorted(phi_before) and phi_before  # only φ is new
    for k in theirs:
        assert torch.equal(mine[k], theirs[k]), k
    for k, t in phi_before.items():
        assert torch.equal(mine[k], t), k


def test_a_model_of_another_shape_is_refused():
    with pytest.raises(CheckpointError, match=r"does not fit this model: embed.weight: \(30, 16\) in the source"):
        warm_start(lm("softmax", d_model=24), Source("x", lm("softmax").state_dict(), None))
    with pytest.raises(CheckpointError, match="lacks blocks.2.ff.down.weight, .* outside the attention layers"):
        warm_start(lm("softmax", n_layers=3), Source("x", lm("softmax").state_dict(), None))


@pytest.mark.parametrize("positions", ["split", "learned"])
def test_a_longer_model_grows_the_shorter_ones_position_tables(positions):
    """A larger model.max_len starts from a shorter model: the position tables begin with its rows;
    a split table's new blocks copy its last block, a learned table's new rows keep their init."""
    torch.manual_seed(0)
    short = Encoder(ModelConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=2, positions=positions, max_len=600,
                                attention=AttentionConfig("gmat", {"num_memory": 4, "chunk_size": 32})), n_tags=2)
    torch.manual_seed(1)
    long = Encoder(dataclasses.replace(short.cfg, max_len=2048), n_tags=2)
    before = {k: t.clone() for k, t in long.state_dict().items()}
    report = warm_start(long, Source("short", short.state_dict(), None))
    mine, theirs = long.state_dict(), short.state_dict()
    if positions == "split":  # low: 512 rows in both; high: 2 blocks -> 4
        assert report["grown"] == ["pos.high.weight"]
        assert torch.equal(mine["pos.high.weight"], torch.cat([theirs["pos.high.weight"],
                                                               theirs["pos.high.weight"][-1:].expand(2, -1)]))
    else:
        assert report["grown"] == ["pos.weight"]
        assert torch.equal(mine["pos.weight"][:600], theirs["pos.weight"])
        assert torch.equal(mine["pos.weight"][600:], before["pos.weight"][600:])
    assert report["new"] == [] and sorted(theirs) == report["copied"]
    assert all(torch.equal(mine[k], t) for k, t in theirs.items() if k not in report["grown"])
    # a shorter table in the model than in the source is not grown: refused
    with pytest.raises(CheckpointError, match="does not fit this model: pos"):
        warm_start(short, Source("long", long.state_dict(), None))


def test_export_hf_then_warm_start_abc_mlp_from_it(text_file, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import memattn.integrations.hf  # noqa: F401  (registers the Auto classes)

    over = tiny_overrides(text_file, tmp_path, "train.steps=4")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    net, _, vocab = model_from_checkpoint(tmp_path / "run")
    assert main(["export-hf", str(tmp_path / "run"), "-o", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, net.cfg.vocab_size, (2, 12))
    assert torch.equal(hf(ids, use_cache=False).logits, net(ids).float())
    assert json.loads((tmp_path / "hf" / "memattn_vocab.json").read_text()) == vocab
    # the tokenizer beside it: transformers' greedy generate from text gives memattn's greedy
    # continuation, recomputed here from whole forward passes
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    chars = Vocab.from_json(vocab)
    ids = tok("The king", return_tensors="pt", add_special_tokens=False).input_ids
    seq = chars.encode("The king").tolist()
    assert ids[0].tolist() == seq
    for _ in range(12):
        seq.append(int(net(torch.tensor([seq]))[0, -1].argmax()))
    out = hf.generate(ids, max_new_tokens=12, do_sample=False)[0]
    assert out.tolist() == seq and tok.decode(out) == chars.decode(seq)

    second = tiny_overrides(text_file, tmp_path / "abc", "train.steps=4", "attention=abc-mlp",
                            "attention.num_slots=4", f"train.init_from={tmp_path / 'hf'}", "train.lr=1e-9")
    assert main(["train", "--config", "tiny", "--quiet", *second]) == 0
    warm, _, _ = model_from_checkpoint(tmp_path / "abc" / "run")
    for k, t in net.state_dict().items():  # a learning rate of 1e-9: four steps move nothing visible
        torch.testing.assert_close(warm.state_dict()[k], t, atol=1e-6, rtol=0)
    assert main(["export-hf", str(tmp_path / "run"), "-o", str(tmp_path / "hf")]) == 2  # not empty


@pytest.mark.parametrize("corpus", ["text as bytes", "text8"])
def test_export_hf_pads_batched_prompts(text_file, tmp_path, corpus):
    """Its tokenizer pads on the left (bytes with byte 0; text8's characters, a vocabulary
    without an unknown symbol, with a pad id past the vocabulary), the exported config
    carries that pad, and generate reads each padded prompt as if alone."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import memattn.integrations.hf  # noqa: F401  (registers the Auto classes)

    if corpus == "text8":  # lower-case letters and spaces, as the real one
        (tmp_path / "text8").write_text(" ".join(text_file.read_text().lower().replace(".", "").split()))
        data = ["data.corpus=text8", f"data.path={tmp_path / 'text8'}"]
    else:
        data = ["data.level=byte"]
    over = tiny_overrides(text_file, tmp_path, "train.steps=1", *data)
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    assert main(["export-hf", str(tmp_path / "run"), "-o", str(tmp_path / "hf")]) == 0
    hf, tok = AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(tmp_path / "hf")
    pad = 0 if corpus == "text as bytes" else hf.config.vocab_size
    batch = tok(["the king", "a"], padding=True, return_tensors="pt", add_special_tokens=False)
    assert batch.input_ids[1].tolist()[:-1] == [pad] * 7 and tok.pad_token_id == pad
    vocab = Vocab.from_json(json.loads((tmp_path / "hf" / HF_VOCAB).read_text()))
    assert batch.input_ids[1, -1] == int(vocab.encode("a")[0]) == (ord("a") if corpus == "text as bytes" else 1)
    assert hf.config.pad_token_id == hf.generation_config.pad_token_id == pad
    out = hf.generate(**batch, max_new_tokens=4, do_sample=False)
    alone = hf.generate(**tok(["a"], return_tensors="pt", add_special_tokens=False), max_new_tokens=4,
                        do_sample=False)
    assert out[1, -4:].tolist() == alone[0, -4:].tolist()


def test_export_hf_of_a_masked_lm_run(text_file, tmp_path):
    """An encoder run exports as AutoModelForMaskedLM with its logits, and its tokenizer
    reads the mask token as the id after the vocabulary."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    import memattn.integrations.hf  # noqa: F401  (registers the Auto classes)

    over = tiny_overrides(text_file, tmp_path, "train.steps=2", "task=mlm")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    net, _, vocab = model_from_checkpoint(tmp_path / "run")
    assert main(["export-hf", str(tmp_path / "run"), "-o", str(tmp_path / "hf")]) == 0
    hf, tok = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok("The <mask>ing", return_tensors="pt", add_special_tokens=False).input_ids
    assert ids[0, 4] == tok.mask_token_id == vocab["size"] == net.cfg.vocab_size - 1
    torch.testing.assert_close(hf(ids).logits, net.mlm_logits(net(ids)).float())
    # and it starts an abc-mlp encoder: everything but φ copied (the tied head saved once)
    torch.manual_seed(0)
    abc = Encoder(dataclasses.replace(net.cfg, attention=AttentionConfig("abc-mlp", {"num_slots": 4})))
    report = warm_start(abc, read_source(tmp_path / "hf"))
    assert report["new"] and all(".phi" in k for k in report["new"]) and report["dropped"] == []
    for k, t in net.state_dict().items():
        assert torch.equal(abc.state_dict()[k], t), k


def test_distill_loss_is_the_kl_from_teacher_to_student():
    s, t = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    p_t = t.softmax(-1)
    want = (p_t * (p_t.log() - s.log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(distill_loss(s, t), want)
    assert distill_loss(t, t).abs() < 1e-6


def test_uptraining_with_a_distillation_term(text_file, tmp_path):
    """The teacher is the init_from model: a student that starts as a copy of it is at KL 0,
    a converted one is not; resuming keeps the teacher."""
    first = tiny_overrides(text_file, tmp_path, "train.steps=3", "model.init_std=0.5")  # a peaked teacher
    assert main(["train", "--config", "tiny", "--quiet", *first]) == 0
    kls = {}
    for name in ("softmax", "abc-mlp"):
        over = tiny_overrides(text_file, tmp_path / name, "train.steps=2", "train.log_every=1", f"attention={name}",
                              f"train.init_from={tmp_path / 'run'}", "train.distill_weight=0.5", "train.lr=1e-9",
                              "model.init_std=0.5")
        assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
        log = [json.loads(line) for line in (tmp_path / name / "run" / "log.jsonl").read_text().splitlines()]
        kls[name] = [r["distill"] for r in log if "distill" in r]
        assert len(kls[name]) == 2
        resumed = [o for o in over if not o.startswith("train.steps")] + ["train.steps=3"]
        assert main(["train", "--config", "tiny", "--quiet", "--resume", *resumed]) == 0
    assert kls["softmax"][0] < 1e-6 and kls["abc-mlp"][0] > 1e-3, kls


def test_distillation_needs_its_teacher():
    from memattn.config import TrainConfig
    from memattn.errors import ConfigError

    with pytest.raises(ConfigError, match="the teacher is the train.init_from model"):
        TrainConfig(distill_weight=1.0)
