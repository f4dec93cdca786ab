"""The `memattn` command line: help texts, one-line errors, train -> eval -> generate -> info."""

import json
import math
import subprocess
import sys

import pytest
from conftest import tiny_overrides

from memattn.cli import build_parser, main
from memattn.train import model_from_checkpoint

COMMANDS = ["train", "eval", "generate", "info", "demo", "experiment", "export-hf", "convert",
            "compress", "decompress", "bench", "translate"]


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "memattn", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_every_command_has_complete_help(capsys):
    subcommands = build_parser()._subparsers._group_actions[0].choices
    assert sorted(subcommands) == sorted(COMMANDS)
    for cmd in [None, *COMMANDS]:
        with pytest.raises(SystemExit) as exit_:
            main([cmd, "--help"] if cmd else ["--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: memattn")
        if cmd is None:
            assert all(c in out for c in COMMANDS)
            continue
        for action in subcommands[cmd]._actions:
            assert action.help, f"memattn {cmd}: {action.dest} has no help text"
            for flag in action.option_strings:
                assert flag in out


@pytest.mark.parametrize("override, message", [
    ("model.d_modle=3", "model.d_modle: unknown key"),
    ("train.steps=lots", "train.steps: expected an integer, got 'lots'"),
    ("attention=nonexistent", "unknown mechanism 'nonexistent'"),
])
def test_bad_override_is_one_line_without_traceback(override, message):
    done = run("train", "--config", "tiny", override)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memattn train: error: ") and message in lines[0]


def test_corrupt_checkpoint_is_one_line(tmp_path):
    bad = tmp_path / "checkpoint.safetensors"
    bad.write_bytes(b"\x00" * 64)
    done = run("eval", str(bad))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("memattn eval: error: checkpoint")


def test_train_eval_generate_info_end_to_end(text_file, tmp_path, capsys):
    over = tiny_overrides(text_file, tmp_path, "train.steps=10")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    run_dir = tmp_path / "run"
    done = run("eval", str(run_dir), "--split", "val", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    _, cfg, _ = model_from_checkpoint(run_dir)
    # 10 steps from a uniform start: below log2(vocabulary) bits, the cost of guessing blindly
    assert result["split"] == "val" and 0 < result["bpc"] < math.log2(cfg.model.vocab_size)
    done = run("generate", str(run_dir), "--prompt", "The king", "--tokens", "40", "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The king") and len(done.stdout.rstrip("\n")) >= len("The king") + 30
    assert "tokens/s" in done.stderr
    done = run("info", "--checkpoint", str(run_dir), "--json")
    info = json.loads(done.stdout)
    # softmax: a KV cache of 2 x d_model floats per layer per token, nothing fixed
    assert info["state_bytes_per_token"] == 2 * 2 * 32 * 4 and info["state_fixed_bytes"] == 0
    assert info["parameters"] > 0
    capsys.readouterr()
    assert main(["info", str(run_dir), "--json"]) == 0  # the run folder named without --checkpoint
    assert json.loads(capsys.readouterr().out) == info
    assert main(["info", str(run_dir), "model.d_model=64"]) == 2  # a checkpoint is as saved
    assert "model.d_model=64: a checkpoint is described as it was saved" in capsys.readouterr().err


def test_info_lists_every_mechanism_with_its_options(capsys):
    import dataclasses

    from memattn.layers import mechanisms

    assert main(["info", "--mechanisms", "--config", "tiny"]) == 0
    out = capsys.readouterr().out
    for name, mech in mechanisms().items():
        assert f"\n{name} (" in out
        for f in dataclasses.fields(mech.options):
            assert f"attention.{f.name}: " in out
    assert "attention.activation: exp | relu | sigmoid = 'exp'" in out
    assert "softmax (causal, encoder, cross; not shown to stream" in out and "abc-workspace (encoder)" in out
    # what streams is read from the registry's declarations, options included
    assert "abc-window (causal, encoder, cross; streams past its training length)" in out
    assert "abc-mlp (causal, encoder, cross; streams past its training length with the options" in out


def test_demo_compares_a_memory_mechanism_and_runs_twice_into_the_same_folder(text_file, tmp_path, capsys):
    """The demo trains softmax, starts abc-mlp from it, and shows the decoding state: growing
    with the context for softmax, fixed for abc-mlp, and the test bpc over the first tokens
    of the longest context shown (evaluate_by_length: softmax as a window, abc-mlp streamed).
    Run again, it trains anew."""
    import torch
    import torch.nn.functional as F

    from memattn.config import load_config
    from memattn.train import load_run_corpus

    over = [o for o in tiny_overrides(text_file, tmp_path) if not o.startswith("train.out_dir")]
    argv = ["demo", "--config", "tiny", *over, "train.steps=3", "train.eval_every=3", "train.save_every=3",
            "--out-dir", str(tmp_path / "demo"), "--warm-steps", "2", "--contexts", "16", "64"]
    assert main(argv) == 0 and main(argv) == 0
    soft, abc = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert (soft["attention"], abc["attention"]) == ("softmax", "abc-mlp")
    assert abc["trained"] == "from softmax, +2 steps"
    state = {r["attention"]: [r["decoding"][c]["state_bytes"] for c in ("16", "64")] for r in (soft, abc)}
    assert state["softmax"][1] == 4 * state["softmax"][0]  # one key and value per token
    assert state["abc-mlp"][0] == state["abc-mlp"][1] > 0  # a fixed-size memory
    assert (tmp_path / "demo" / "decoding.png").exists()
