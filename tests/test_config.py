"""memattn.config: presets, typed key=value overrides and their errors."""

import pytest

from memattn.config import (
    PRESET_DIR,
    AttentionConfig,
    ModelConfig,
    RunConfig,
    from_dict,
    load_config,
    to_dict,
)
from memattn.errors import ConfigError


def test_overrides_are_typed_and_reach_nested_fields():
    cfg = load_config("tiny", ["model.d_model=64", "train.lr=1e-3", "train.betas=[0.8, 0.9]",
                               "attention=softmax", "attention.bias=true", "model.tie_embeddings=false"])
    assert cfg.model.d_model == 64 and isinstance(cfg.train.lr, float) and cfg.train.lr == 1e-3
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.model.attention == AttentionConfig("softmax", {"bias": True})
    assert cfg.model.tie_embeddings is False
    assert cfg.train.steps == 20  # from the preset


def test_naming_a_mechanism_starts_its_options_anew_and_refuses_to_drop_given_ones():
    base = {"model": {"attention": {"name": "abc-window", "window": 8}}}
    cfg = load_config(None, ["attention=abc-mlp", "attention.num_slots=8"], base=base)
    assert cfg.model.attention == AttentionConfig("abc-mlp", {"num_slots": 8})  # no window
    same = load_config(None, ["attention=abc-mlp", "attention.num_slots=8", "attention=abc-mlp"])
    assert same.model.attention.options == {"num_slots": 8}
    with pytest.raises(ConfigError, match=r"attention\.num_slots=8: an attention option before attention=abc-mlp.*would be dropped"):
        load_config(None, ["attention.num_slots=8", "attention=abc-mlp"])


def test_int_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0
    with pytest.raises(ConfigError, match=r"model\.d_model: expected an integer, got 1\.5"):
        load_config(None, ["model.d_model=1.5"])


@pytest.mark.parametrize("override, message", [
    ("model.d_modl=3", r"model\.d_modl: unknown key"),
    ("train.steps=many", r"train\.steps: expected an integer, got 'many'"),
    ("model.positions=sinusoid", r"expected one of rotary, learned, none, split, got 'sinusoid'"),
    ("attention=nope", r"unknown mechanism 'nope'"),
    ("attention.window=3", r"attention\.window: not an option of 'softmax'"),
    ("model.n_heads=5", r"model\.d_model: 256 is not divisible by model\.n_heads=5"),
    ("train.steps=0", r"train\.steps: expected a positive number"),
    ("model.dropout=1.5", r"model\.dropout"),
    ("tie_embeddings", r"expected key=value"),
    ("data.corpus=text", r"data\.path: corpus 'text' needs a path"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match=r"'nope' is an unknown preset \(presets: .*demo.*tiny"):
        load_config("nope")


def test_a_folder_is_not_read_as_a_config(tmp_path, monkeypatch):
    """A folder named like a preset (a run called 'tiny') leaves the preset as it is; any
    other folder is refused by name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert load_config("tiny") == load_config(str(PRESET_DIR / "tiny.yaml"))
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match=r"'runs' is a folder, not a YAML file, and not a preset"):
        load_config("runs")


def test_round_trip_through_dict():
    cfg = load_config("demo", ["attention.bias=true"])
    assert from_dict(RunConfig, to_dict(cfg)) == cfg


def test_dataclass_validation_applies_to_direct_construction():
    with pytest.raises(ConfigError, match="model.n_layers"):
        ModelConfig(n_layers=0)
