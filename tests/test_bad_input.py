"""Nothing lost, nothing silent: each bad input of the command line gets one clear line and
exit status 2, and nothing is lost or overwritten. One table of (command, status, message)."""

import json
import re

import pytest
import torch
from conftest import tiny_overrides

from memattn.checkpoint import load_checkpoint
from memattn.cli import main
from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ShapeError
from memattn.models import CausalLM
from memattn.ops import abc_attention


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 6-step run on a small corpus: (its folder, the overrides that made it)."""
    root = tmp_path_factory.mktemp("bad-input")
    text = root / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    over = tiny_overrides(text, root, "train.steps=6", "train.save_every=3", "train.eval_every=3")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    return root / "run", over


def one_line_error(capsys, argv, message):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and message in err[0], (argv, err)


CASES = [  # (command after the fixture's run folder or overrides is put in, message)
    (["eval", "{run}", "--seq-len", "-5"], "--seq-len: expected a number >= 1"),
    (["eval", "{run}", "--seq-len", "0"], "--seq-len: expected a number >= 1"),
    (["eval", "{run}", "--batch-size", "0"], "--batch-size: expected a number >= 1"),
    (["eval", "{run}", "--context", "-1"], "--context"),
    (["generate", "{run}", "--tokens", "-5"], "--tokens: expected a number of tokens >= 0"),
    (["generate", "{run}", "--top-k", "-3"], "--top-k: expected k >= 0"),
    (["generate", "{run}", "--temperature", "-1"], "--temperature: expected a finite number >= 0"),
    (["generate", "{run}", "--temperature", "nan"], "--temperature: expected a finite number >= 0"),
    (["train", "--config", "tiny", "{over}", "train.lr=inf"], "train.lr: expected a positive number"),
    (["train", "--config", "tiny", "{over}", "train.lr=nan"], "train.lr: expected a positive number"),
    (["train", "--config", "tiny", "{over}", "train.betas=[1.5,0.9]"], "train.betas: expected two values in [0, 1)"),
    (["train", "--config", "tiny", "{over}", "train.out_dir="], "train.out_dir: expected a folder"),
    (["train", "--config", "tiny", "{over}"], "holds a run already; continue it with --resume"),
    (["train", "--config", "tiny", "--resume", "--overwrite", "{over}"], "choose one"),
]


@pytest.mark.parametrize("argv,message", CASES)
def test_bad_input_is_one_clear_line(run, capsys, argv, message):
    folder, over = run
    argv = [a for x in argv for a in ([str(folder)] if x == "{run}" else over if x == "{over}" else [x])]
    before = (folder / "log.jsonl").read_text()
    one_line_error(capsys, argv, message)
    assert (folder / "log.jsonl").read_text() == before  # the run is untouched


def test_device_without_cuda(run, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    one_line_error(capsys, ["eval", str(run[0]), "--device", "cuda"], "no CUDA device is available")
    one_line_error(capsys, ["generate", str(run[0]), "--device", "cuda"], "no CUDA device is available")


def test_malformed_and_non_utf8_configs(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [1, 2\n")
    one_line_error(capsys, ["train", "--config", str(bad)], "is not valid YAML (line")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"model:\n  d_model: \xff\xfe\n")
    one_line_error(capsys, ["train", "--config", str(binary)], "is not UTF-8 text")


def test_resume_of_a_complete_run_says_so_and_keeps_its_summary(run, capsys):
    folder, over = run
    summary = (folder / "summary.json").read_text()
    assert main(["train", "--config", "tiny", "--resume", "--quiet", *over]) == 0
    assert "the run is complete at step 6" in capsys.readouterr().out
    assert (folder / "summary.json").read_text() == summary
    assert main(["train", "--config", "tiny", "--resume", "--quiet", *over, "train.steps=4"]) == 0
    assert "complete at step 6 (train.steps=4)" in capsys.readouterr().out
    assert (folder / "summary.json").read_text() == summary


def test_resume_cuts_a_torn_log_line(tmp_path, text_file):
    over = tiny_overrides(text_file, tmp_path, "train.steps=6", "train.save_every=3", "train.log_every=1")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    log = tmp_path / "run" / "log.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines) + '\n{"step": 7, "lo')  # a crash mid-write
    assert main(["train", "--config", "tiny", "--resume", "--quiet", *over, "train.steps=8"]) == 0
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_loss_that_stops_being_finite_stops_training_without_saving_it(tmp_path, text_file, capsys):
    over = tiny_overrides(text_file, tmp_path, "train.steps=30", "train.save_every=1", "train.log_every=1",
                          "train.lr=1e30", "train.warmup=0", "train.grad_clip=0")
    one_line_error(capsys, ["train", "--config", "tiny", "--quiet", *over], "(not finite)")
    path = tmp_path / "run" / "checkpoint.safetensors"
    if path.exists():  # whatever was saved holds finite weights only
        ckpt = load_checkpoint(path)
        assert all(torch.isfinite(t).all() for t in ckpt.model_state().values())


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path, text_file, capsys, monkeypatch):
    import errno

    import memattn.checkpoint as checkpoint

    over = tiny_overrides(text_file, tmp_path, "train.steps=6", "train.save_every=3")
    real, calls = checkpoint.save_file, []

    def full_after_one(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", full_after_one)
    one_line_error(capsys, ["train", "--config", "tiny", "--quiet", *over], "No space left on device")
    assert load_checkpoint(tmp_path / "run").step == 3


def test_a_corpus_too_short_for_an_evaluation_window_is_refused_before_training(tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("to be or not to be, that is the question\n" * 20)
    over = tiny_overrides(tiny, tmp_path, "train.seq_len=64")
    one_line_error(capsys, ["train", "--config", "tiny", "--quiet", *over], "fewer than one window")
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


def test_a_checkpoint_without_its_vocabulary(run, tmp_path, capsys):
    from safetensors.torch import save_file

    ckpt = load_checkpoint(run[0])
    meta = {k: v for k, v in ckpt.meta.items() if k != "vocab"}
    bare = tmp_path / "bare.safetensors"
    save_file(ckpt.tensors, str(bare), metadata={"memattn": json.dumps(meta)})
    one_line_error(capsys, ["eval", str(bare)], "its metadata lacks vocab")


def test_eval_after_the_text_changed_reads_it_with_the_checkpoints_vocabulary(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"{i % 7} abcdefg hijk lmnop\n" for i in range(600)))
    over = tiny_overrides(text, tmp_path, "train.steps=4", "train.eval_every=4", "train.save_every=4")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    text.write_text("".join(f"{i % 5} zz abcdefg\n" for i in range(600)))  # new characters, new vocab
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    captured = capsys.readouterr()
    assert "is not the one this checkpoint was trained with" in captured.err
    changed = json.loads(captured.out)
    assert changed["bpc"] != same["bpc"]


def test_generate_names_characters_the_model_does_not_know(run, capsys):
    assert main(["generate", str(run[0]), "--prompt", "fox§", "--tokens", "2"]) == 0
    assert "does not know '§'" in capsys.readouterr().err


def test_overrides_after_flags_are_read(run, capsys, tmp_path):
    folder, over = run
    assert main(["info", "--json", "--config", "tiny", "model.d_model=16"]) == 0
    assert json.loads(capsys.readouterr().out)["d_model"] == 16


@pytest.mark.parametrize("call,message", [
    (lambda m: m(torch.tensor([[1, 99]])), "token ids must lie in [0, 20)"),
    (lambda m: m(torch.zeros(0, 4, dtype=torch.long)), "at least one sequence of at least one token"),
    (lambda m: m(torch.zeros(2, 0, dtype=torch.long)), "at least one sequence of at least one token"),
    (lambda m: m(torch.zeros(1, 4)), "integer token ids"),
])
def test_model_inputs(call, message):
    model = CausalLM(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_len=32))
    with pytest.raises(ShapeError, match=re.escape(message)):
        call(model)


def test_gmat_mask_of_the_wrong_shape():
    model = CausalLM(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_len=32,
                                 attention=AttentionConfig("gmat")))
    with pytest.raises(ShapeError, match="attention_mask: expected"):
        model(torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.ones(1, 5, dtype=torch.bool))


def test_abc_attention_inputs():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ShapeError, match="key dimension K >= 1"):
        empty = torch.randn(1, 4, 2, 0)
        abc_attention(empty, empty, q, torch.randn(1, 4, 2, 3))
    with pytest.raises(ShapeError, match="initial_state: expected a ABCState"):
        abc_attention(q, q, q, torch.randn(1, 4, 2, 3), initial_state=torch.zeros(3))
