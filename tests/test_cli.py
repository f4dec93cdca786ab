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
    """The demo trains softmax, starts gsa from it, and shows the decoding state: growing
    with the context for softmax, fixed for gsa, and the test bpc over the first tokens
    of the longest context shown (evaluate_by_length: softmax as a window, gsa streamed).
    Run again into the same folder, it is refused; with --overwrite it trains anew."""
    import torch
    import torch.nn.functional as F

    from memattn.config import load_config
    from memattn.train import load_run_corpus

    over = [o for o in tiny_overrides(text_file, tmp_path) if not o.startswith("train.out_dir")]
    argv = ["demo", "--config", "tiny", *over, "train.steps=3", "train.eval_every=3", "train.save_every=3",
            "--out-dir", str(tmp_path / "demo"), "--warm-steps", "2", "--contexts", "16", "64"]
    assert main(argv) == 0
    first = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert all(d["ms_per_token_compiled"] > 0 for r in first for d in r["decoding"].values())
    assert "ms/token @64 eager/compiled" in capsys.readouterr().out
    assert main(argv) == 2 and "holds an earlier demo" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--no-compile"]) == 0
    soft, abc = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert (soft["attention"], abc["attention"]) == ("softmax", "gsa")
    assert abc["trained"] == "from softmax, +2 steps"
    state = {r["attention"]: [r["decoding"][c]["state_bytes"] for c in ("16", "64")] for r in (soft, abc)}
    assert state["softmax"][1] == 4 * state["softmax"][0]  # one key and value per token
    assert state["gsa"][0] == state["gsa"][1] > 0  # a fixed-size memory
    assert (tmp_path / "demo" / "decoding.png").exists()
    head = [line for line in capsys.readouterr().out.splitlines() if line.startswith("attention ")][-1]
    assert "bpc @64" in head  # the table's column
    test = torch.as_tensor(load_run_corpus(load_config("tiny", over)).test.astype("int64"))
    for r, read in ((soft, "window"), (abc, "stream")):
        model, _, _ = model_from_checkpoint(tmp_path / "demo" / r["attention"])
        with torch.no_grad():  # one forward pass over the first 64 tokens
            want = F.cross_entropy(model(test[None, :64])[0], test[1:65]).item() / math.log(2)
        assert r["long_bpc"]["length"] == 64 and r["long_bpc"]["read"] == read
        assert r["long_bpc"]["bpc"] == pytest.approx(want, abs=1e-5)


def test_eval_by_length_table_json_plot_and_refusals(text_file, tmp_path, capsys):
    """`memattn eval RUN --lengths`: the JSON figures are the by-hand bucketing of one forward
    pass over each test document; the table, the plot and the one-line refusals."""
    import torch
    import torch.nn.functional as F

    from memattn.evaluate import as_tensor
    from memattn.train import checkpoint_split

    over = tiny_overrides(text_file, tmp_path, "attention=abc-mlp", "attention.num_slots=4", "train.steps=2",
                          "train.eval_every=2", "train.save_every=2", "train.seq_len=16")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    run_dir = str(tmp_path / "run")
    plot = tmp_path / "by_length.png"
    capsys.readouterr()
    assert main(["eval", run_dir, "--lengths", "64,16", "--streams", "2", "--plot", str(plot), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, cfg, vocab = model_from_checkpoint(run_dir)
    ids = as_tensor(checkpoint_split(run_dir, cfg, vocab, "test")[0])
    losses = []
    with torch.no_grad():
        for d in range(2):
            doc = ids[d * 64:(d + 1) * 64 + 1]
            losses.append(F.cross_entropy(model(doc[None, :-1])[0], doc[1:], reduction="none"))
    losses = torch.stack(losses)  # [2, 64] nats
    assert (result["read"], result["documents"], result["train_len"]) == ("stream", 2, 16)
    assert [(b["start"], b["end"]) for b in result["buckets"]] == [(0, 16), (16, 32), (32, 64)]
    for b in result["buckets"]:
        want = losses[:, b["start"]:b["end"]].mean().item() / math.log(2)
        assert b["read"] == "stream" and b["bpc"] == pytest.approx(want, abs=1e-5)
    assert [n["length"] for n in result["lengths"]] == [16, 64]
    assert result["lengths"][1]["bpc"] == pytest.approx(losses.mean().item() / math.log(2), abs=1e-5)
    assert result["state_bytes"] == model.init_cache(2).nbytes()

    assert main(["eval", run_dir, "--lengths", "16,64"]) == 0
    out, err = capsys.readouterr()
    assert "by length" in err  # progress on stderr
    lines = out.splitlines()
    assert "1 document(s) of 64 tokens, streamed in chunks of 16 tokens" in lines[0]
    assert lines[1].split() == ["positions", "bpc", "read"]
    assert lines[2].startswith("[0, 16)") and lines[2].split()[-1] == "stream"
    assert [line.split()[0] for line in lines[lines.index(next(x for x in lines if x.startswith("first n"))) + 1:]] \
        == ["16", "64"]
    assert main(["eval", run_dir, "--lengths", "16", "--quiet"]) == 0
    assert capsys.readouterr().err == ""

    for argv, message in [(["--lengths", "16,x"], "--lengths: expected positive numbers of tokens"),
                          (["--lengths", "0"], "--lengths: expected positive numbers of tokens"),
                          (["--lengths", "16", "--seq-len", "8"], "not with --context, --stream or --seq-len"),
                          (["--lengths", "16", "--stream"], "not with --context, --stream or --seq-len"),
                          (["--plot", "x.png"], "--plot: options of --lengths"),
                          (["--lengths", "1000000"], "needs 1,000,001 tokens of the split")]:
        assert main(["eval", run_dir, *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err


def test_eval_by_length_is_refused_for_a_masked_lm(text_file, tmp_path, capsys):
    over = tiny_overrides(text_file, tmp_path, "task=mlm", "train.steps=2", "train.eval_every=2",
                          "train.save_every=2")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--lengths", "64"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"memattn eval: error: --lengths: measures memattn's causal language models; " \
                          f"{tmp_path / 'run'} is a mlm run"
