"""memattn works without transformers; the integration says what to install."""

import subprocess
import sys

import pytest

BLOCK = "import sys; sys.modules['transformers'] = None; "


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_the_library_imports_and_runs_without_transformers():
    out = run("import torch; import memattn.cli, memattn.layers, memattn.train; "
              "from memattn.models import CausalLM; from memattn.config import ModelConfig; "
              "m = CausalLM(ModelConfig(vocab_size=5, d_model=8, n_layers=1, n_heads=2)); "
              "print(m(torch.zeros(1, 3, dtype=torch.long)).shape)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch.Size([1, 3, 5])"


def test_the_integration_names_the_extra_to_install():
    out = run("import memattn.integrations.hf")
    assert out.returncode != 0
    assert "memattn.integrations.hf needs transformers 5: pip install 'memattn[hf]'" in out.stderr


def test_the_entry_points_are_at_the_top_and_convert_names_the_extra():
    out = run("import torch, memattn; "
              "layer = memattn.attention_layer('abc-mlp', 16, 2, num_slots=4); "
              "print(layer(torch.zeros(1, 3, 16))[0].shape); memattn.convert")
    assert out.returncode != 0 and out.stdout.strip() == "torch.Size([1, 3, 16])"
    assert "memattn.integrations.convert needs transformers 5: pip install 'memattn[hf]'" in out.stderr


def test_each_entry_point_is_the_object_its_module_defines():
    import importlib

    import memattn

    for name, module in memattn.ENTRY_POINTS.items():
        assert getattr(memattn, name) is getattr(importlib.import_module(module), name)
        assert name in dir(memattn) and name in memattn.__all__
    assert memattn.convert.__module__ == "memattn.integrations.convert"
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        memattn.no_such_thing
