"""The task registry (memattn.tasks): a task registered from outside the package trains
through the one loop, checkpoints, resumes exactly and loads back, like the built-in ones;
the commands (memattn.cli) ask its class what it does."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import train_crashing_at

from memattn.config import load_config
from memattn.data import Vocab
from memattn.errors import ConfigError
from memattn.tasks import TASKS, StepLoss, Task, register_task, task_class
from memattn.train import model_from_checkpoint, train


class Batch(SimpleNamespace):
    def to(self, device):
        return Batch(x=self.x.to(device))


class SuccessorTask(Task):
    """Read random ids and give, at each position, the id after the one read (mod 8)."""

    logged = ("loss",)

    @classmethod
    def build_model(cls, cfg):
        from memattn.models import CausalLM

        return CausalLM(cfg.model)

    @classmethod
    def prepare(cls, cfg, ddp, resume, source):
        import dataclasses

        vocab = Vocab.from_text("abcdefgh", unk=False)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab.size))
        return cls(cfg, SimpleNamespace(vocab=vocab, name="successor"))

    def __init__(self, cfg, corpus):
        self.cfg, self.corpus = cfg, corpus

    def sequences(self, seed: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.corpus.vocab.size, (n, 16), generator=g)

    def batch(self, step, rank, world):
        return Batch(x=self.sequences(step, self.cfg.train.batch_size).chunk(world)[rank])

    def tokens(self, batch):
        return batch.x.numel()

    def loss(self, model, batch):
        logits, target = model(batch.x), (batch.x + 1) % self.corpus.vocab.size
        return StepLoss(F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"), target.numel())

    @torch.no_grad()
    def evaluate(self, model, device):
        batch = Batch(x=self.sequences(-1, 32)).to(device)
        total, scored, _ = self.loss(model, batch)
        return {"loss": total.item() / scored}


@pytest.fixture
def successor_task(monkeypatch):
    """SuccessorTask registered as task=successor from a module outside the package."""
    module = types.ModuleType("successor_task")
    module.SuccessorTask = SuccessorTask
    monkeypatch.setitem(sys.modules, "successor_task", module)
    register_task("successor", "the successor of each id", "successor_task:SuccessorTask")
    yield
    del TASKS["successor"]


def settings(root, *extra):
    return [f"train.out_dir={root}", "task=successor", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
            "train.batch_size=16", "train.lr=0.01", "train.warmup=5", "train.log_every=10",
            "train.eval_every=30", "train.save_every=15", "train.threads=1", *extra]


def test_a_registered_task_trains_resumes_and_loads(successor_task, tmp_path):
    cfg = load_config("tiny", settings(tmp_path / "whole", "train.steps=60"))
    whole = train(cfg, progress=False)
    first = whole["val"]["loss"]
    log = [json.loads(line) for line in (tmp_path / "whole" / "log.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in log if "val_loss" in r]
    assert len(evals) == 2 and evals[-1] == first
    assert first < 0.5 * torch.log(torch.tensor(8.0)).item()  # well below chance: it learned the task
    # the same run stopped after step 40 (last saved at 30) and resumed: the same log and weights
    cut = load_config("tiny", settings(tmp_path / "cut", "train.steps=60"))
    train_crashing_at(cut, 40)
    train(cut, resume=True, progress=False)

    def figures(run):
        return [(r["step"], r["loss"], r.get("val_loss"))
                for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())]
    assert figures(tmp_path / "cut") == figures(tmp_path / "whole")
    a, cfg_a, vocab = model_from_checkpoint(tmp_path / "whole")
    b, _, _ = model_from_checkpoint(tmp_path / "cut")
    assert cfg_a.task == "successor" and list(Vocab.from_json(vocab).symbols) == list("abcdefgh")
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name


def test_an_unknown_task_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"task: expected one of lm, mlm, translation.*got 'nope'"):
        load_config("tiny", [f"train.out_dir={tmp_path}", "task=nope"])
    with pytest.raises(ConfigError, match="task: expected one of"):
        task_class("nope")


def test_the_commands_ask_the_task_what_it_does(successor_task, tmp_path, capsys, monkeypatch):
    """memattn eval, generate and translate read what the task class declares (generates,
    translates, evaluate_checkpoint), never its name."""
    from memattn.cli import main

    train(load_config("tiny", settings(tmp_path / "run", "train.steps=2")), progress=False)
    run, sentences = str(tmp_path / "run"), tmp_path / "in.txt"
    sentences.write_text("abc\n")
    for argv, message in [(["eval", run], f"{run}: a successor run; its task has no evaluation of a checkpoint"),
                          (["eval", run, "--lengths", "16"], f"causal language models; {run} is a successor run"),
                          (["generate", run, "--prompt", "abc"], f"{run}: a successor run; memattn generate"),
                          (["translate", run, "--input", str(sentences)], "needs a translation run")]:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    monkeypatch.setattr(SuccessorTask, "generates", True)
    monkeypatch.setattr(SuccessorTask, "evaluate_checkpoint", classmethod(
        lambda cls, model, cfg, vocab, options: ({"split": options.split}, f"{options.split}: evaluated")))
    assert main(["generate", run, "--prompt", "abc", "--tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("abc")
    assert main(["eval", run, "--lengths", "16"]) == 2
    assert "a successor run; its task has no evaluation by length" in capsys.readouterr().err
    assert main(["eval", run, "--split", "val"]) == 0
    assert main(["eval", run, "--split", "val", "--json"]) == 0
    assert capsys.readouterr().out == 'val: evaluated\n{"split": "val"}\n'


def test_a_task_reads_its_own_options_from_the_config(monkeypatch):
    """task_options.KEY=VALUE is read as the task class's Options dataclass, each key and type
    checked and named; a task without options refuses them; --resume holds them."""
    import dataclasses

    from memattn.config import to_dict
    from memattn.errors import CheckpointError
    from memattn.train import check_resumable

    @dataclasses.dataclass
    class Modulus:
        modulus: int = 8

    module = types.ModuleType("modulus_task")
    module.ModulusTask = type("ModulusTask", (SuccessorTask,), {"Options": Modulus})
    monkeypatch.setitem(sys.modules, "modulus_task", module)
    monkeypatch.setitem(TASKS, "modulus", TASKS.get("lm").__class__("modulus", "ids mod n", "modulus_task:ModulusTask"))
    cfg = load_config("tiny", ["task=modulus", "task_options.modulus=5"])
    assert cfg.task_settings == Modulus(5) and load_config("tiny", ["task=modulus"]).task_settings == Modulus(8)
    with pytest.raises(ConfigError, match=r"^task_options.nope: unknown key of task_options \(known: modulus\)"):
        load_config("tiny", ["task=modulus", "task_options.nope=1"])
    with pytest.raises(ConfigError, match="^task_options.modulus: expected an integer, got 'x'"):
        load_config("tiny", ["task=modulus", "task_options.modulus=x"])
    with pytest.raises(ConfigError, match="^task_options: task=lm has no options of its own, got modulus"):
        load_config("tiny", ["task_options.modulus=5"])
    with pytest.raises(CheckpointError, match="task_options.modulus=5, this run has 6"):
        check_resumable(to_dict(cfg), load_config("tiny", ["task=modulus", "task_options.modulus=6"]))


SCRIPT = {10: 0.5, 20: 0.7, 30: 0.72, 40: 0.6, 50: 0.9, 60: 0.8, 70: 0.91, 80: 0.5, 90: 0.95, 100: 0.99}


class ScriptedTask(SuccessorTask):
    """SuccessorTask whose evaluation at step s says SCRIPT[s] (negated when lower is better)
    and keeps a copy of the weights it was shown, by step."""

    selects = ("score", "higher")
    logged = ("score",)
    shown: dict[int, dict[str, torch.Tensor]] = {}

    def batch(self, step, rank, world):
        self.step = step
        return super().batch(step, rank, world)

    def evaluate(self, model, device):
        done = self.step + 1
        ScriptedTask.shown[done] = {k: t.clone() for k, t in model.state_dict().items()}
        return {"score": SCRIPT[done] if self.selects[1] == "higher" else -SCRIPT[done]}


@pytest.fixture
def scripted_task(monkeypatch):
    module = types.ModuleType("scripted_task")
    module.ScriptedTask = ScriptedTask
    monkeypatch.setitem(sys.modules, "scripted_task", module)
    monkeypatch.setattr(ScriptedTask, "shown", {})
    register_task("scripted", "SCRIPT's figures", "scripted_task:ScriptedTask")
    yield
    del TASKS["scripted"]


@pytest.mark.parametrize("direction", ["higher", "lower"])
def test_early_stopping_stops_after_patience_evaluations_and_keeps_the_best_weights(
        scripted_task, tmp_path, monkeypatch, direction):
    from memattn.train import run_weights

    monkeypatch.setattr(ScriptedTask, "selects", ("score", direction))
    early = ["task=scripted", "train.steps=100", "train.eval_every=10", "train.save_every=20", "train.patience=3",
             "train.min_delta=0.05"]
    summary = train(load_config("tiny", settings(tmp_path / "whole", *early)), progress=False)
    # by hand: 0.72 (step 30) is a best that beats 0.7 by less than min_delta, so the count goes on
    # (1); 0.6 (2); 0.9 resets it; 0.8 (1); 0.91 is the best, by too little (2); 0.5 (3): stop at 80
    sign = 1 if direction == "higher" else -1
    assert (summary["steps"], summary["best_step"], summary["stopped"]) == (80, 70, True)
    assert summary["val"] == {"score": sign * 0.91}
    log = [json.loads(line) for line in (tmp_path / "whole" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_score" in r] == [10, 20, 30, 40, 50, 60, 70, 80]
    assert run_weights(tmp_path / "whole") == tmp_path / "whole" / "best.safetensors"
    best, _, _ = model_from_checkpoint(tmp_path / "whole")  # a run folder's model: the weights it ends with
    for name, t in best.state_dict().items():
        assert torch.equal(t, ScriptedTask.shown[70][name]), name
    assert any(not torch.equal(t, ScriptedTask.shown[80][n]) for n, t in best.state_dict().items())
    whole_weights = {n: t.clone() for n, t in best.state_dict().items()}

    # stopped after step 70 was logged (last checkpoint at 60, best then 50): resumed, it stops
    # at the same step with the same best weights and log
    cut = load_config("tiny", settings(tmp_path / "cut", *early))
    train_crashing_at(cut, 70)
    ScriptedTask.shown.clear()
    resumed = train(cut, resume=True, progress=False)
    assert (resumed["steps"], resumed["best_step"], resumed["val"]) == (80, 70, summary["val"])
    assert min(ScriptedTask.shown) == 70  # it went on from the checkpoint of step 60

    def figures(run):
        return [(r["step"], r.get("loss"), r.get("val_score"))
                for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())]
    assert figures(tmp_path / "cut") == figures(tmp_path / "whole")
    again, _, _ = model_from_checkpoint(tmp_path / "cut")
    for name, t in again.state_dict().items():
        assert torch.equal(t, whole_weights[name]), name
    # a stopped run is complete: resumed again it trains nothing
    assert train(cut, resume=True, progress=False)["complete"] is True


def test_early_stopping_settings_are_checked(successor_task, scripted_task, tmp_path):
    with pytest.raises(ConfigError, match=r"^train.patience: task=successor names no evaluation figure to stop on"):
        load_config("tiny", settings(tmp_path, "train.patience=2"))
    with pytest.raises(ConfigError, match=r"^train.min_delta: the improvement early stopping asks for"):
        load_config("tiny", settings(tmp_path, "task=scripted", "train.min_delta=0.1"))
    with pytest.raises(ConfigError, match=r"^train.patience: expected a non-negative number, got -1"):
        load_config("tiny", settings(tmp_path, "task=scripted", "train.patience=-1"))
    with pytest.raises(ConfigError, match=r"^train.patience: not with train.parallel=fsdp"):
        load_config("tiny", settings(tmp_path, "task=scripted", "train.patience=2", "train.parallel=fsdp"))
