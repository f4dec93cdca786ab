"""memattn.checkpoint: safetensors + JSON, atomic writes, clear errors."""

import pytest
import torch
from safetensors.torch import save_file

import memattn.checkpoint as ckpt_mod
from memattn.checkpoint import load_checkpoint, restore, save_checkpoint
from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import CheckpointError
from memattn.models import CausalLM


def model(d=32):
    return CausalLM(ModelConfig(vocab_size=11, d_model=d, n_layers=1, n_heads=2, ff_mult=1,
                                attention=AttentionConfig("softmax")))


def test_round_trip_model_and_optimizer(tmp_path):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c.safetensors", m, step=7, meta={"note": "x"}, optimizer=opt)
    ck = load_checkpoint(tmp_path / "c.safetensors")
    assert ck.step == 7 and ck.meta["note"] == "x"
    assert "model.head.weight" not in ck.tensors  # tied: stored once
    m2 = model()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    restore(ck, m2, opt2)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert m2.head.weight is m2.embed.weight
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg_sq"], s2[i]["exp_avg_sq"]) for i in s1)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model(), step=1, meta={})

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "save_file", crash)
    with pytest.raises(CheckpointError, match=r"could not be written \(disk full\); the previous checkpoint"):
        save_checkpoint(path, model(), step=2, meta={})
    assert load_checkpoint(path).step == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary left


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model(), step=1, meta={})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(path)
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(path)


def test_foreign_safetensors_file_is_rejected(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="not a memattn checkpoint"):
        load_checkpoint(path)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_mismatched_model_names_the_tensor(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model(32), step=1, meta={})
    with pytest.raises(CheckpointError, match=r"does not fit this model: .*embed\.weight: checkpoint \(11, 32\) vs model \(11, 64\)"):
        restore(load_checkpoint(path), model(64))
