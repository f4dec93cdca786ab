"""memattn.models.compressor: GMAT sequence compression (L tokens -> M vectors -> L tokens),
its checkpoints and compressed files, and `memattn compress` / `memattn decompress`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from memattn.checkpoint import save_checkpoint
from memattn.cli import main
from memattn.config import AttentionConfig, ModelConfig
from memattn.data import Vocab
from memattn.errors import CheckpointError, ConfigError, ShapeError
from memattn.models import CausalLM, Compressor
from memattn.models.compressor import (compress_ids, decompress_ids, fingerprint, load_compressed,
                                       load_compressor, save_compressed, save_compressor)

TEXT = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 3


def config(vocab_size=30, **kw):
    base = dict(vocab_size=vocab_size, d_model=32, n_layers=4, n_heads=4, ff_mult=2, max_len=64,
                positions="learned", attention=AttentionConfig("gmat", {"num_memory": 4, "chunk_size": 8}))
    base.update(kw)
    return ModelConfig(**base)


def compressor(**kw):
    torch.manual_seed(0)
    return Compressor(config(**kw), n_compress=2, n_decompress=1).eval()


@pytest.fixture
def saved(tmp_path):
    """A compressor checkpoint with a character vocabulary of TEXT (weights at init)."""
    vocab = Vocab.from_text(TEXT)
    model = compressor(vocab_size=vocab.size)
    path = tmp_path / "compressor.safetensors"
    save_compressor(path, model, vocab=vocab.to_json(), seq_len=24)
    return path, model, vocab


def test_shapes_and_the_three_stages():
    model = compressor()
    assert (len(model.compress_blocks), len(model.memory_blocks), len(model.decompress_blocks)) == (2, 1, 1)
    idx = torch.randint(0, 30, (3, 21))
    memory = model.compress(idx)
    assert memory.shape == (3, 4, 32)
    assert model.decompress(memory, 21).shape == (3, 21, 32)
    assert model(idx).shape == (3, 21, 30)
    torch.testing.assert_close(model(idx), model.logits(model.decompress(memory, 21)))


def test_decompression_reads_only_the_memory():
    model = compressor()
    idx = torch.randint(0, 30, (1, 16))
    other = torch.randint(0, 30, (1, 16))
    memory = model.compress(idx)
    # the same memory rebuilds the same sequence whatever the tokens were
    torch.testing.assert_close(model.decompress(memory, 16), model.decompress(memory.clone(), 16))
    assert not torch.allclose(model.compress(other), memory)
    # every position depends on the memory
    h = model.decompress(memory, 16)
    h2 = model.decompress(memory + 0.1 * torch.randn_like(memory), 16)
    assert (h2 - h).abs().amax(-1).amin() > 0


def test_padding_is_as_if_absent():
    model = compressor()
    idx = torch.randint(0, 30, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False
    memory = model.compress(idx, mask)
    torch.testing.assert_close(memory[1:], model.compress(idx[1:, :13]), rtol=1e-5, atol=1e-6)
    h = model.decompress(memory, 20, mask)
    torch.testing.assert_close(h[1:, :13], model.decompress(memory[1:], 13), rtol=1e-5, atol=1e-6)


def test_round_trip_through_a_file_rebuilds_what_the_model_predicts(saved, tmp_path):
    path, model, vocab = saved
    ids = vocab.encode(TEXT)
    memory, lengths = compress_ids(model, ids, seq_len=24, batch_size=3)
    assert lengths.tolist() == [24] * (len(ids) // 24) + [len(ids) % 24]
    file = tmp_path / "text.safetensors"
    save_compressed(file, memory, lengths, model_fingerprint=fingerprint(model), seq_len=24)
    back = load_compressed(file)
    assert torch.equal(back.memory, memory) and torch.equal(back.lengths, lengths)
    rebuilt = decompress_ids(model, back.memory, back.lengths, n_symbols=vocab.size, batch_size=2)
    # the direct path: every sequence through the whole model, one at a time
    expect = [model(torch.as_tensor(ids[s:s + 24], dtype=torch.long)[None])[0].argmax(-1).numpy()
              for s in range(0, len(ids), 24)]
    assert np.array_equal(rebuilt, np.concatenate(expect)) and len(rebuilt) == len(ids)


def test_cli_compress_then_decompress(saved, tmp_path, capsys):
    path, model, vocab = saved
    source = tmp_path / "play.txt"
    source.write_text(TEXT)
    packed = tmp_path / "play.safetensors"
    assert main(["compress", str(path), str(source), "-o", str(packed)]) == 0
    n = -(-len(TEXT) // 24)
    assert f"{len(TEXT)} characters -> {n} sequences x 4 vectors x 32" in capsys.readouterr().out
    out = tmp_path / "back.txt"
    assert main(["decompress", str(packed), "--checkpoint", str(path), "-o", str(out)]) == 0
    ids = vocab.encode(TEXT)
    memory, lengths = compress_ids(model, ids, seq_len=24)
    assert out.read_text() == vocab.decode(decompress_ids(model, memory, lengths, n_symbols=vocab.size))
    assert len(out.read_text()) == len(TEXT)
    meta = load_compressed(packed).meta
    assert meta["characters"] == len(TEXT) and meta["seq_len"] == 24 and meta["num_memory"] == 4


def test_cli_errors_are_one_line(saved, tmp_path, capsys):
    path, model, _ = saved
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign))
    truncated = tmp_path / "truncated.safetensors"
    save_compressed(truncated, torch.zeros(2, 4, 32), torch.tensor([3, 3]), model_fingerprint="x")
    truncated.write_bytes(truncated.read_bytes()[:-50])
    other = tmp_path / "other.safetensors"
    save_compressed(other, torch.zeros(2, 4, 32), torch.tensor([3, 3]), model_fingerprint="not this model")
    cases = [
        (["decompress", str(foreign), "--checkpoint", str(path)], "a safetensors file, but not a memattn compressed file"),
        (["decompress", str(truncated), "--checkpoint", str(path)], "not a readable safetensors file"),
        (["decompress", str(other), "--checkpoint", str(path)], "was made by another model"),
        (["decompress", str(tmp_path / "none"), "--checkpoint", str(path)], "no such file"),
        (["compress", str(path), str(tmp_path / "missing.txt"), "-o", str(other)], "input: no such file"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"memattn {argv[0]}: error: ") and message in err[0], err


def test_a_language_model_checkpoint_is_not_a_compressor(tmp_path):
    lm = CausalLM(ModelConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=2))
    path = tmp_path / "lm.safetensors"
    save_checkpoint(path, lm, step=0, meta={"config": {}})
    with pytest.raises(CheckpointError, match="not a compressor checkpoint"):
        load_compressor(path)


def test_checkpoint_round_trip_keeps_the_model(saved):
    path, model, _ = saved
    loaded, meta = load_compressor(path)
    assert fingerprint(loaded) == fingerprint(model) and meta["seq_len"] == 24
    assert loaded.head.weight is loaded.embed.weight


@pytest.mark.parametrize("change, message", [
    (dict(attention=AttentionConfig("softmax")), r"'softmax' with these options has none"),
    (dict(attention=AttentionConfig("gmat", {"num_memory": 0})), r"has none \(use attention=gmat"),
])
def test_bad_models_are_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        Compressor(config(**change), n_compress=2, n_decompress=1)


@pytest.mark.parametrize("positions", ["rotary", "none"])
def test_without_an_absolute_table_the_queries_have_their_own(positions):
    model = compressor(positions=positions)
    assert model.pos is None and model.queries.high.num_embeddings == 1
    h = model.decompress(model.compress(torch.randint(0, 30, (2, 20))), 20)
    assert h.shape == (2, 20, 32) and (h[:, 0] - h[:, 1]).abs().amax() > 0  # positions tell them apart


def test_bad_splits_and_inputs_are_errors():
    with pytest.raises(ConfigError, match=r"n_compress \+ n_decompress <= model.n_layers = 4"):
        Compressor(config(), n_compress=3, n_decompress=2)
    with pytest.raises(ConfigError, match=r"expected n_compress >= 1"):
        Compressor(config(), n_compress=0, n_decompress=2)
    model = compressor()
    with pytest.raises(ShapeError, match=r"memory: expected \[B, M=4, d=32\]"):
        model.decompress(torch.zeros(1, 5, 32), 10)
    with pytest.raises(ShapeError, match=r"length: positions up to 65 exceed model.max_len=64"):
        model.decompress(torch.zeros(1, 4, 32), 65)
    with pytest.raises(ConfigError, match=r"seq_len: expected 1 <= seq_len <= model.max_len = 64"):
        compress_ids(model, np.zeros(10, dtype=np.int64), seq_len=100)
    with pytest.raises(ShapeError, match=r"memory, lengths: expected \[N, M, d\] and \[N\]"):
        save_compressed("unused.safetensors", torch.zeros(2, 4, 32), torch.zeros(3), model_fingerprint="x")


def test_compressed_file_metadata_is_json_with_the_format(saved, tmp_path):
    _, model, _ = saved
    file = tmp_path / "m.safetensors"
    save_compressed(file, torch.zeros(1, 4, 32), torch.tensor([5]), model_fingerprint=fingerprint(model))
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        meta = json.loads(f.metadata()["memattn"])
    assert meta["format"] == "memattn-compressed/1" and meta["model"] == fingerprint(model)


@pytest.mark.parametrize("tamper,message", [
    (lambda memory, lengths: (memory, lengths.index_fill(0, torch.tensor([0]), 2 ** 40)), "lengths must lie in 1 .. 24"),
    (lambda memory, lengths: (memory, lengths.index_fill(0, torch.tensor([1]), -3)), "lengths must lie in 1 .. 24"),
    (lambda memory, lengths: (memory.fill_(float("nan")), lengths), "not all finite"),
    (lambda memory, lengths: (memory[:, :3], lengths), "do not fit the model's"),
    (lambda memory, lengths: (memory, lengths.index_fill(0, torch.tensor([0]), 23)), "its lengths sum to"),
])
def test_decompress_checks_every_field_before_decoding(saved, tmp_path, capsys, tamper, message):
    path, model, vocab = saved
    source, packed = tmp_path / "play.txt", tmp_path / "play.safetensors"
    source.write_text(TEXT)
    assert main(["compress", str(path), str(source), "-o", str(packed)]) == 0
    good = load_compressed(packed)
    memory, lengths = tamper(good.memory.clone(), good.lengths.clone())
    meta = {k: v for k, v in good.meta.items() if k not in ("format", "model")}
    save_compressed(packed, memory, lengths, model_fingerprint=good.meta["model"], **meta)
    capsys.readouterr()
    assert main(["decompress", str(packed), "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_compress_refuses_a_binary_file(saved, tmp_path, capsys):
    path, _, _ = saved
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["compress", str(path), str(binary), "-o", str(tmp_path / "x.safetensors")]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
