"""Hostile input, full disks and broken files: nothing lost, nothing silent, no traceback.

One table (`CASES`): each row is a command of `memattn.cli.main` (run in-process, stderr
captured) or a Python call, the exit status (or exception) it must end with, a phrase its
message must hold, and the files that must keep their bytes. A new command joins by adding
a row. Rows that need a full or read-only disk use small tmpfs mounts (root only: root
ignores chmod, so a read-only disk is a tmpfs remounted read-only); without them a full disk
is simulated in-process (memattn's temporaries cannot be made, fsync fails with ENOSPC) and
read-only rows are skipped, saying why.

Placeholders in a row's argv and paths: {run} a finished 6-step run, {root} the shared
folder, {tmp} the row's own folder, {corpus} the run's text, {nan} {negstep} {badvocab}
{vocabsize} {tampered} broken copies of the run's checkpoint, {comp} a compressor
checkpoint, {text} a text it reads, {full} {ro} folders on a full and a read-only disk, and
whatever a row's setup adds.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from memattn import ops
from memattn.layers import attention_layer

from memattn.cli import main
from memattn.errors import ConfigError, ShapeError

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400))
SHORT = ["train.steps=3", "train.save_every=3", "train.eval_every=3", "train.eval_batches=1", "train.log_every=1"]


# ---------------------------------------------------------------------------------------
# The world the rows act on


def run_overrides(root: Path, out: Path, corpus: Path | None = None, *extra: str) -> list[str]:
    return ["data.corpus=text", f"data.path={corpus or root / 'corpus.txt'}", f"data.cache_dir={root / 'cache'}",
            f"train.out_dir={out}", "train.threads=1", *extra]


def rewrite_checkpoint(src: Path, dst: Path, meta=None, tensors=None) -> None:
    """dst: the checkpoint src with its metadata and tensors changed (as a hand edit would)."""
    from safetensors.torch import save_file

    from memattn.checkpoint import load_checkpoint

    ckpt = load_checkpoint(src)
    m = dict(ckpt.meta)
    t = dict(ckpt.tensors)
    if meta:
        meta(m)
    if tensors:
        tensors(t)
    save_file(t, str(dst), metadata={"memattn": json.dumps(m)})


class Disks:
    """Small tmpfs mounts for a full disk and a read-only one (root only), unmounted at the end."""

    def __init__(self, root: Path) -> None:
        self.root, self.mounted, self.why = root, [], ""
        self.full, self.ro = root / "full", root / "ro"
        if os.geteuid() != 0 or not shutil.which("mount"):
            self.why = "mounting a tmpfs needs root"
            return
        for folder, size in ((self.full, "1m"), (self.ro, "4m")):
            folder.mkdir(parents=True)
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "memattn-test", str(folder)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                self.why = f"mount -t tmpfs is refused here ({done.stderr.strip()})"
                self.close()
                return
            self.mounted.append(folder)

    @property
    def real(self) -> bool:
        return not self.why

    def fill(self, leave_pages: int = 0) -> None:
        """Fill the full disk, leaving `leave_pages` pages of 4 KiB (what a command writes
        before its big file: a lock, a log, a config)."""
        gc.collect()  # pages of deleted files an earlier row still maps are freed first
        fd = os.open(self.full / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
            os.ftruncate(fd, max(0, os.fstat(fd).st_size // 4096 * 4096 - 4096 * leave_pages))
        finally:
            os.close(fd)

    def empty(self) -> None:
        for p in self.full.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def read_only(self, fill: Callable[[Path], None]) -> None:
        """Put what fill(folder) writes on the read-only disk, then make it read-only."""
        subprocess.run(["mount", "-o", "remount,rw", str(self.ro)], check=True)
        for p in self.ro.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        fill(self.ro)
        subprocess.run(["mount", "-o", "remount,ro", str(self.ro)], check=True)

    def close(self) -> None:
        for folder in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        self.mounted = []


class World:
    """What the rows read: a finished run, broken copies of its checkpoint, a compressor, a
    translation run and a small transformers model (the last two made when a row asks)."""

    def __init__(self, root: Path) -> None:
        from memattn.config import AttentionConfig, ModelConfig
        from memattn.data import Vocab
        from memattn.models import Compressor
        from memattn.models.compressor import save_compressor

        self.root = root
        (root / "corpus.txt").write_text(TEXT)
        self.over = run_overrides(root, root / "run")
        assert main(["train", "--config", "tiny", "--quiet", *self.over, "train.steps=6", "train.save_every=3",
                     "train.eval_every=3", "train.eval_batches=1"]) == 0
        run = root / "run" / "checkpoint.safetensors"

        def nan(t):
            name = next(k for k in sorted(t) if k.startswith("model.") and t[k].is_floating_point())
            t[name] = t[name].clone()
            t[name].view(-1)[0] = float("nan")

        def step(m):
            m["step"] = -5
            del m["checksum"]

        def badvocab(m):
            m["vocab"] = dict(m["vocab"], symbols=m["vocab"]["symbols"][:10])

        def vocabsize(m):
            m["vocab"] = dict(m["vocab"], symbols=m["vocab"]["symbols"][:10], size=10)

        def tampered(t):
            name = next(k for k in sorted(t) if k.startswith("model.") and t[k].is_floating_point())
            t[name] = t[name] * 1.01

        for name, meta, tensors in (("nan", lambda m: m.pop("checksum"), nan), ("negstep", step, None),
                                    ("badvocab", badvocab, None), ("vocabsize", vocabsize, None),
                                    ("tampered", None, tampered)):
            rewrite_checkpoint(run, root / f"{name}.safetensors", meta, tensors)
        vocab = Vocab.from_text(TEXT)
        cfg = ModelConfig(vocab_size=vocab.size, d_model=32, n_layers=4, n_heads=4, ff_mult=2, max_len=64,
                          positions="learned", attention=AttentionConfig("gmat", {"num_memory": 4, "chunk_size": 8}))
        torch.manual_seed(0)
        save_compressor(root / "comp.safetensors", Compressor(cfg, n_compress=2, n_decompress=1).eval(),
                        vocab=vocab.to_json(), seq_len=24)
        (root / "text.txt").write_text(TEXT[:300])
        (root / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
        self.disks = Disks(root / "disks")
        self._translation = self._hf = None
        with contextlib.suppress(ImportError):  # its log handler takes stderr now, not a row's capture
            import transformers

            transformers.logging.get_logger("transformers")

    def paths(self) -> dict[str, str]:
        r = self.root
        broken = ("nan", "negstep", "badvocab", "vocabsize", "tampered")
        return {"root": str(r), "run": str(r / "run"), "corpus": str(r / "corpus.txt"),
                "comp": str(r / "comp.safetensors"), "text": str(r / "text.txt"), "latin1": str(r / "latin1.txt"),
                "full": str(self.disks.full), "ro": str(self.disks.ro),
                **{n: str(r / f"{n}.safetensors") for n in broken}}

    def translation(self) -> Path:
        """A translation run trained one step (a few seconds, made once)."""
        if self._translation is None:
            pytest.importorskip("tokenizers")
            from research.experiments.abc_mt import quick_pairs

            root = self.root / "mt"
            data = quick_pairs(root / "pairs")
            over = ["task=translation", "data.corpus=parallel", "data.level=bpe", "data.bpe_size=300",
                    f"data.path={data}", f"data.cache_dir={root}/cache", "model.d_model=16", "model.n_layers=1",
                    "model.n_heads=2", "model.ff_mult=1", "model.max_len=32", "model.encoder_attention.name=softmax",
                    "attention=softmax", "train.batch_size=4", "train.steps=1", "train.eval_batches=1",
                    "train.eval_every=1", "train.save_every=1", f"train.out_dir={root}/run", "train.threads=1"]
            assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
            self._translation = root / "run"
        return self._translation

    def hf_model(self) -> Path:
        """A small random transformers Llama folder (made once)."""
        if self._hf is None:
            transformers = pytest.importorskip("transformers")
            torch.manual_seed(0)
            config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                              intermediate_size=64, vocab_size=50, max_position_embeddings=128,
                                              num_key_value_heads=2)
            model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
            model.save_pretrained(self.root / "llama")
            self._hf = self.root / "llama"
        return self._hf


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("hostile"))
    try:
        yield w
    finally:
        w.disks.close()


# ---------------------------------------------------------------------------------------
# The table


@dataclass
class Case:
    """One hostile input. argv: a command (placeholders filled in); call: or a Python call
    call(world, tmp, paths) -> anything. status: the exit status argv must return, or the
    exception class call must raise (None: it must return). phrase: what the message (stderr,
    or the exception) must hold. unchanged: paths whose bytes (every file under a folder) must
    be the same after. setup(world, tmp, paths, monkeypatch) -> more placeholders, run first;
    check(world, tmp, paths, captured) runs last. disk: "full" or "ro" when the row needs that
    disk (a full disk falls back to a simulated one; a read-only one is skipped without)."""

    id: str
    argv: list[str] | None = None
    call: Callable | None = None
    status: int | type[BaseException] | None = 2
    phrase: str = ""
    unchanged: tuple[str, ...] = ("{run}",)
    setup: Callable | None = None
    check: Callable | None = None
    disk: str = ""
    env: dict[str, str] = field(default_factory=dict)


def file_in_tmp(name: str, text: str, then: Callable | None = None) -> Callable:
    """A setup: `text` written to {tmp}/name, then the setup `then`, if any."""
    def setup(world, tmp, paths, mp):
        (tmp / name).write_text(text)
        return then(world, tmp, paths, mp) if then is not None else {}
    return setup


def copy_run(world, tmp, paths, mp=None, name="r"):
    shutil.copytree(world.root / "run", tmp / name, ignore=shutil.ignore_patterns(".lock"))
    return {name: str(tmp / name)}


def train_argv(out: str, *extra: str, corpus: str = "{corpus}") -> list[str]:
    return ["train", "--config", "tiny", "--quiet", "data.corpus=text", f"data.path={corpus}",
            "data.cache_dir={root}/cache", f"train.out_dir={out}", "train.threads=1", "train.steps=6",
            "train.save_every=3", "train.eval_every=3", "train.eval_batches=1", *extra]


def full_disk_run(world, tmp, paths, mp):
    """A copy of the run on the full disk (filled up after it but for the few pages written
    before a checkpoint, so the checkpoint is what does not fit), or where fsync fails."""
    disks = world.disks
    if disks.real:
        disks.empty()
        shutil.copytree(world.root / "run", disks.full / "r", ignore=shutil.ignore_patterns(".lock"))
        disks.fill(leave_pages=4)
        return {"r": str(disks.full / "r")}
    simulate_full_disk(mp)
    return copy_run(world, tmp, paths)


def full_disk(world, tmp, paths, mp):
    disks = world.disks
    if disks.real:
        disks.empty()
        disks.fill()
        return {"out": str(disks.full / "out")}
    simulate_full_disk(mp)
    return {"out": str(tmp / "out")}


def simulate_full_disk(mp):
    """Every write of memattn's fails as on a full disk: its temporaries (files and folders,
    as on a disk out of inodes) cannot be made, and fsync reports ENOSPC."""
    import memattn.fileio as fileio

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for name in ("mkstemp", "mkdtemp", "TemporaryFile"):
        mp.setattr(fileio.tempfile, name, full)
    mp.setattr(fileio.os, "fsync", full)


def read_only_run(world, tmp, paths, mp):
    world.disks.read_only(lambda ro: shutil.copytree(world.root / "run", ro / "r",
                                                     ignore=shutil.ignore_patterns(".lock")))
    return {"r": str(world.disks.ro / "r")}


def read_only(world, tmp, paths, mp):
    world.disks.read_only(lambda ro: None)
    return {"out": str(world.disks.ro / "out")}


def with_translation(world, tmp, paths, mp):
    return {"mt": str(world.translation())}


def with_hf(world, tmp, paths, mp):
    return {"hf": str(world.hf_model())}


HELD: list = []  # output locks a row holds (as another process would), released after it


def held_output(world, tmp, paths, mp):
    """Another memattn process writing {tmp}/same: its lock is held, as while it converts."""
    from memattn.fileio import output_lock

    lock = output_lock(tmp / "same", "-o", ConfigError)
    lock.__enter__()
    HELD.append(lock)
    return {"hf": str(world.hf_model())}


def a_changed_text(world, tmp, paths, mp):
    """A run on its own copy of the text, which then changes (its characters stay)."""
    corpus = tmp / "corpus.txt"
    corpus.write_text(TEXT)
    assert main([a.format(**paths) for a in train_argv(str(tmp / "r"), *SHORT, corpus=str(corpus))]) == 0
    corpus.write_text(TEXT.replace("lazy dog", "dog lazy"))
    return {"r": str(tmp / "r"), "mycorpus": str(corpus)}


def quick_results(world, tmp, paths, mp):
    """results/abc-lm of an earlier --quick run (where a quick run may write), from the cwd."""
    out = tmp / "results" / "abc-lm"
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps({"quick": True}))
    (out / "command.txt").write_text("memattn experiment abc-lm --quick\n")
    mp.chdir(tmp)
    return {"results": str(tmp / "results")}


def another_vocabulary(world, tmp, paths, mp):
    corpus = tmp / "other.txt"
    corpus.write_text(TEXT.upper())  # capitals: characters the run's vocabulary lacks
    return {"other": str(corpus)}


def empty_summary(world, tmp, paths, mp):
    extra = copy_run(world, tmp, paths)
    (tmp / "r" / "summary.json").write_text("")  # what a full disk left under an older memattn
    return extra


def stale_temporary(world, tmp, paths, mp):
    extra = copy_run(world, tmp, paths)
    (tmp / "r" / ".checkpoint.safetensors.x1y2.tmp").write_bytes(b"half a checkpoint")
    return extra


def negative_step_run(world, tmp, paths, mp):
    extra = copy_run(world, tmp, paths)
    shutil.copy(world.root / "negstep.safetensors", tmp / "r" / "checkpoint.safetensors")
    return extra


def earlier_demo(world, tmp, paths, mp):
    copy_run(world, tmp, paths, name="demo/softmax")
    (tmp / "demo" / "summary.json").write_text("[]")
    return {"demo": str(tmp / "demo")}


def full_results(world, tmp, paths, mp):
    """A copy of the committed results of gmat-majority (a full run), where a quick run would go."""
    src = Path(__file__).resolve().parents[1] / "results" / "gmat-majority"
    dst = tmp / "results" / "gmat-majority"
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        dst.mkdir(parents=True)
        (dst / "results.json").write_text(json.dumps({"quick": False}))
        (dst / "command.txt").write_text("memattn experiment gmat-majority\n")
    mp.chdir(tmp)
    return {"results": str(tmp / "results")}


def summary_write_fails(world, tmp, paths, mp):
    """A copy of the run resumed to more steps, on a disk that fills up when summary.json is written."""
    import memattn.fileio as fileio

    extra = copy_run(world, tmp, paths)
    (tmp / "r" / "summary.json").unlink()
    real = fileio.os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(".summary.json."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    mp.setattr(fileio.os, "fsync", fsync)
    return extra


def summary_not_half_written(world, tmp, paths, captured):
    run = tmp / "r"
    assert not (run / "summary.json").exists()  # never an empty or cut file
    assert not list(run.glob(".*.tmp"))
    assert main([a.format(**paths) for a in train_argv("{r}", "--resume", "train.steps=9")]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 9


def overwrite_killed(world, tmp, paths):
    """`train --overwrite` of a finished run, killed (SIGKILL) before its first checkpoint; then
    --resume: the replaced run is back whole (its log without a hole) and found complete."""
    copy_run(world, tmp, paths)
    run = tmp / "r"
    argv = [a.format(**paths, r=run) for a in train_argv("{r}", "--overwrite", "train.steps=100000",
                                                                   "train.save_every=100000", "train.log_every=1")]
    proc = subprocess.Popen([sys.executable, "-m", "memattn", *argv], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if (run / ".replaced" / "log.jsonl").exists() and (run / "log.jsonl").exists():
                break  # set aside, and the new run has started to log
            time.sleep(0.01)
        assert proc.poll() is None, "the replacing run ended before it was killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (run / "checkpoint.safetensors").exists()  # the killed run saved nothing
    resume = [a.format(**paths, r=run) for a in train_argv("{r}", "--resume")]
    return main(resume)


# each op with what it takes beyond q, k, v: slot logits, log forget gates
OPS_WITH_EXTRA = ((ops.softmax_attention, ()), (ops.linear_attention, ()),
                  (ops.abc_attention, (torch.randn(1, 3, 2, 5),)),
                  (ops.gated_slot_attention, (-torch.rand(1, 3, 2, 5),)))


def make_cache_fed_one_row(name):
    def call(world, tmp, paths):
        from memattn.config import AttentionConfig, ModelConfig
        from memattn.models import CausalLM

        model = CausalLM(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_len=32,
                                     attention=AttentionConfig(name)))
        cache = model.init_cache(2)
        with torch.no_grad():
            model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    return call


def small_cache():
    from memattn.config import ModelConfig
    from memattn.models import CausalLM

    model = CausalLM(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_len=32))
    cache = model.init_cache(2)
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    return cache


def generate_no_tokens(world, tmp, paths):
    from memattn.config import ModelConfig
    from memattn.models import EncoderDecoder

    model = EncoderDecoder(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_len=32)).eval()
    out = model.generate(torch.ones(2, 5, dtype=torch.long), bos=1, max_new_tokens=0)
    assert out.shape == (2, 0) and out.dtype == torch.long
    with pytest.raises(ConfigError, match="max_new_tokens"):
        model.generate(torch.ones(2, 5, dtype=torch.long), bos=1, max_new_tokens=-1)


def save_representations_to_a_folder(world, tmp, paths):
    from memattn import representations

    reps = representations.Representations(torch.zeros(1, 1, 2, 2), torch.tensor([3]), {})
    (tmp / "folder").mkdir()
    representations.save(tmp / "folder", reps)


def evaluation_progress(world, tmp, paths):
    from memattn.config import ModelConfig
    from memattn.evaluate import evaluate
    from memattn.models import CausalLM

    model = CausalLM(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_len=64))
    seen = []
    evaluate(model, torch.randint(0, 20, (300,)), seq_len=8, batch_size=4, context=16,
             progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == ((300 - 1 - 16) // 8,) * 2 and len(seen) == -(-seen[-1][1] // 4)


def broken_settings(world, tmp, paths, mp):
    folder = tmp / "x" / "runs" / "softmax"
    folder.mkdir(parents=True)
    (folder / "settings.json").write_text('["data.corpus=text", "train.st')  # cut short
    return {}


def distributed_error(world, tmp, paths, mp):
    import memattn.train as train_module

    def fail(*args, **kwargs):
        raise torch.distributed.DistNetworkError("connection to the rendezvous timed out")

    mp.setattr(train_module.dist, "init_process_group", fail)
    mp.setenv("WORLD_SIZE", "2")
    mp.setenv("RANK", "0")
    return {}


def same_tokens_as_before(world, tmp, paths, captured):
    assert (tmp / "sub" / "dir" / "out.txt").read_text().count("\n") == 2


def unknown_characters_compressed(world, tmp, paths, captured):
    assert (tmp / "c.safetensors").exists()


def tmp_file_removed(world, tmp, paths, captured):
    assert not list((tmp / "r").glob(".*.tmp"))


def replaced_run_back(world, tmp, paths, captured):
    run, original = tmp / "r", world.root / "run"
    for name in ("checkpoint.safetensors", "log.jsonl", "summary.json"):
        assert (run / name).read_bytes() == (original / name).read_bytes(), name
    assert not (run / ".replaced").exists()


def one_line_hf_folder_absent(world, tmp, paths, captured):
    assert not Path(paths["out"]).exists() or not any(Path(paths["out"]).iterdir())


def vocab_note_has_share(world, tmp, paths, captured):
    assert "%" in captured.err


CASES = [
    # --- data lost --------------------------------------------------------------------
    Case("train --overwrite killed before its first checkpoint, then --resume", call=overwrite_killed, status=0,
         phrase="the run it replaced is back", check=replaced_run_back),
    Case("train --overwrite failing before its first checkpoint keeps the old run",
         argv=train_argv("{r}", "--overwrite", "train.seq_len=100000", "model.max_len=200000"),
         phrase="fewer than one window", unchanged=("{run}", "{r}"), setup=copy_run),
    Case("a second demo into the same --out-dir", argv=["demo", "--config", "tiny", "data.corpus=text",
         "data.path={corpus}", "--out-dir", "{demo}"], phrase="holds an earlier demo", unchanged=("{demo}",),
         setup=earlier_demo),
    Case("demo --attention abc-mlp abc-mlp", argv=["demo", "--config", "tiny", "--attention", "softmax", "abc-mlp",
         "abc-mlp", "--out-dir", "{tmp}/demo"], phrase="abc-mlp named twice",
         check=lambda w, t, p, c: not (t / "demo").exists() or pytest.fail("the demo wrote something")),
    Case("experiment --quick over committed full results", argv=["experiment", "gmat-majority", "--quick"],
         phrase="holds the full results", unchanged=("{results}",), setup=full_results),
    Case("experiment --quick refused keeps command.txt", argv=["experiment", "abc-lm", "--quick", "stepz=3"],
         phrase="stepz", unchanged=("{results}",), setup=quick_results),
    Case("experiment refused by its settings writes nothing", argv=["experiment", "gmat-majority", "--quick",
         "--out-dir", "{tmp}/x", "stepz=3"], phrase="stepz",
         check=lambda w, t, p, c: not (t / "x").exists() or pytest.fail(f"wrote {list((t / 'x').iterdir())}")),
    Case("two converts to one -o at once", argv=["convert", "{hf}", "--attention", "abc-mlp", "-o", "{tmp}/same"],
         phrase="is being written by", setup=held_output),
    Case("compress writing over its own input", argv=["compress", "{comp}", "{tmp}/in.txt", "-o", "{tmp}/in.txt"],
         phrase="is the input text this command reads", unchanged=("{tmp}/in.txt", "{comp}"),
         setup=file_in_tmp("in.txt", TEXT[:200])),
    Case("compress writing over its checkpoint", argv=["compress", "{comp}", "{text}", "-o", "{comp}"],
         phrase="is the checkpoint this command reads", unchanged=("{comp}",)),
    Case("translate --output over its --input", argv=["translate", "{run}", "--input", "{text}", "--output", "{text}"],
         phrase="is the --input file", unchanged=("{text}",)),
    # --- silent wrong -------------------------------------------------------------------
    *[Case(f"a cache for 2 rows fed 1 ({name})", call=make_cache_fed_one_row(name), status=ShapeError,
           phrase="holds the state of 2 row(s)")
      for name in ("abc-mlp", "linear", "gated-linear", "abc-random", "abc-cluster", "abc-linformer")],
    Case("--resume after the text changed", argv=train_argv("{r}", "--resume", "train.steps=4", "train.save_every=3",
         "train.eval_every=3", "train.eval_batches=1", "train.log_every=1", corpus="{mycorpus}"), status=0,
         phrase="not the text the checkpoint was trained with", setup=a_changed_text),
    Case("a warm start from another vocabulary", argv=train_argv("{tmp}/w", "train.init_from={run}", "train.steps=1",
         "train.save_every=1", "train.eval_every=1", corpus="{other}"), status=0,
         phrase="are not in the vocabulary of train.init_from", setup=another_vocabulary, check=vocab_note_has_share),
    Case("eval of NaN weights", argv=["eval", "{nan}"], phrase="not finite"),
    Case("generate of NaN weights", argv=["generate", "{nan}", "--tokens", "3"], phrase="not finite"),
    Case("eval of a checkpoint altered after its checksum", argv=["eval", "{tampered}"], phrase="checksum"),
    Case("a refused train leaves no folder behind", argv=train_argv("{tmp}/new", "train.seq_len=100000",
         "model.max_len=200000"), phrase="fewer than one window",
         check=lambda w, t, p, c: not (t / "new").exists() or pytest.fail(f"left {list((t / 'new').iterdir())}")),
    Case("train.label_smoothing with task=lm", argv=train_argv("{tmp}/x", "train.label_smoothing=0.1"),
         phrase="train.label_smoothing"),
    Case("compress of unknown characters says so",
         argv=["compress", "{comp}", "{tmp}/odd.txt", "-o", "{tmp}/c.safetensors"],
         status=0, phrase="read as its unknown symbol",
         setup=file_in_tmp("odd.txt", "the quick brown fox \u00a7\u00a7 \u00e9t\u00e9\n"),
         check=unknown_characters_compressed),
    Case("translate --max-len 0", argv=["translate", "{run}", "--input", "{text}", "--max-len", "0"],
         phrase="--max-len: expected a number >= 1"),
    Case("compress --seq-len 0", argv=["compress", "{comp}", "{text}", "-o", "{tmp}/c", "--seq-len", "0"],
         phrase="--seq-len: expected a number >= 1"),
    Case("cache.reorder with float indices", call=lambda w, t, p: small_cache().reorder(torch.tensor([0.7, 1.2])),
         status=ShapeError, phrase="integer row numbers"),
    Case("--resume of a checkpoint with a negative step", argv=train_argv("{r}", "--resume"),
         phrase="its step is -5", setup=negative_step_run),
    # --- hang ---------------------------------------------------------------------------
    Case("eval --context 100000", argv=["eval", "{run}", "--context", "100000"], phrase="fewer than one window"),
    # --- tracebacks instead of a sentence -----------------------------------------------
    Case("eval reports its progress (windows done of all)", call=evaluation_progress, status=None),
    Case("eval with a window longer than the split", argv=["eval", "{run}", "--seq-len", "100000"],
         phrase="fewer than one window"),
    Case("eval streams longer than the split", argv=["eval", "{run}", "--stream", "--batch-size", "1000"],
         phrase="too few for"),
    Case("train into a file", argv=train_argv("{corpus}"), phrase="is a file", unchanged=("{corpus}",)),
    Case("train under /proc", argv=train_argv("/proc/memattn-hostile/run"), phrase="/proc/memattn-hostile"),
    Case("train on a full disk", argv=train_argv("{out}"), phrase="No space left on device", setup=full_disk,
         disk="full"),
    Case("train --resume on a full disk", argv=train_argv("{r}", "--resume", "train.steps=9"),
         phrase="No space left on device", setup=full_disk_run, disk="full",
         check=lambda w, t, p, c: (Path(p["r"]) / "checkpoint.safetensors").read_bytes()
         == (w.root / "run" / "checkpoint.safetensors").read_bytes() or pytest.fail("checkpoint changed")),
    Case("train --overwrite on a full disk", argv=train_argv("{r}", "--overwrite"), phrase="No space left on device",
         setup=full_disk_run, disk="full", check=lambda w, t, p, c: replaced_run_back(w, Path(p["r"]).parent, p, c)),
    Case("train --resume on a read-only disk", argv=train_argv("{r}", "--resume", "train.steps=9"),
         phrase="Read-only file system", setup=read_only_run, disk="ro", unchanged=("{run}", "{r}")),
    Case("train --overwrite on a read-only disk", argv=train_argv("{r}", "--overwrite"),
         phrase="Read-only file system", setup=read_only_run, disk="ro", unchanged=("{run}", "{r}")),
    Case("summary.json on a disk that fills up", argv=train_argv("{r}", "--resume", "train.steps=7"),
         phrase="No space left on device", setup=summary_write_fails, check=summary_not_half_written),
    Case("--resume of a run whose summary.json an older memattn left empty", argv=train_argv("{r}", "--resume"),
         status=0, phrase="cannot be read", setup=empty_summary),
    Case("checkpoint temporaries of a killed run are removed", argv=train_argv("{r}", "--resume"), status=0,
         setup=stale_temporary, check=tmp_file_removed),
    Case("train --resume under /proc", argv=train_argv("/proc/memattn-hostile/run", "--resume"),
         phrase="/proc/memattn-hostile"),
    Case("train --overwrite under /proc", argv=train_argv("/proc/memattn-hostile/run", "--overwrite"),
         phrase="/proc/memattn-hostile"),
    Case("train on a read-only disk", argv=train_argv("{out}"), phrase="Read-only file system", setup=read_only,
         disk="ro"),
    Case("export-hf -o under /proc", argv=["export-hf", "{run}", "-o", "/proc/memattn-hostile"],
         phrase="/proc/memattn-hostile"),
    Case("export-hf -o a file", argv=["export-hf", "{run}", "-o", "{corpus}"], phrase="is a file",
         unchanged=("{run}", "{corpus}")),
    Case("export-hf on a full disk", argv=["export-hf", "{run}", "-o", "{out}"], phrase="No space left on device",
         setup=lambda w, t, p, mp: (pytest.importorskip("transformers"), full_disk(w, t, p, mp))[1], disk="full",
         check=one_line_hf_folder_absent),
    Case("export-hf on a read-only disk", argv=["export-hf", "{run}", "-o", "{out}"], phrase="Read-only file system",
         setup=lambda w, t, p, mp: (pytest.importorskip("transformers"), read_only(w, t, p, mp))[1], disk="ro"),
    Case("export-hf of a checkpoint whose vocabulary disagrees", argv=["export-hf", "{vocabsize}", "-o", "{tmp}/x"],
         phrase="its vocabulary has 10 symbols"),
    Case("convert -o under /proc", argv=["convert", "{hf}", "--attention", "abc-mlp", "-o", "/proc/memattn-hostile"],
         phrase="/proc/memattn-hostile", setup=with_hf),
    Case("convert -o a file", argv=["convert", "{hf}", "--attention", "abc-mlp", "-o", "{corpus}"],
         phrase="is a file", unchanged=("{corpus}",), setup=with_hf),
    Case("convert on a full disk", argv=["convert", "{hf}", "--attention", "abc-mlp", "-o", "{out}"],
         phrase="No space left on device", setup=lambda w, t, p, mp: {**with_hf(w, t, p, mp), **full_disk(w, t, p, mp)},
         disk="full", check=one_line_hf_folder_absent),
    Case("convert on a read-only disk", argv=["convert", "{hf}", "--attention", "abc-mlp", "-o", "{out}"],
         phrase="Read-only file system", setup=lambda w, t, p, mp: {**with_hf(w, t, p, mp), **read_only(w, t, p, mp)},
         disk="ro"),
    Case("experiment --out-dir under /proc", argv=["experiment", "gmat-majority", "--quick", "--out-dir",
         "/proc/memattn-hostile"], phrase="/proc/memattn-hostile"),
    Case("experiment --out-dir a file", argv=["experiment", "gmat-majority", "--quick", "--out-dir", "{corpus}"],
         phrase="is a file", unchanged=("{corpus}",)),
    Case("experiment on a full disk", argv=["experiment", "gmat-majority", "--quick", "--out-dir", "{out}"],
         phrase="No space left on device", setup=full_disk, disk="full"),
    Case("experiment on a read-only disk", argv=["experiment", "gmat-majority", "--quick", "--out-dir", "{out}"],
         phrase="Read-only file system", setup=read_only, disk="ro"),
    Case("bench --out under /proc", argv=["bench", "decode", "--quick", "--out", "/proc/memattn-hostile"],
         phrase="/proc/memattn-hostile"),
    Case("bench --out a file", argv=["bench", "decode", "--quick", "--out", "{corpus}"], phrase="is a file",
         unchanged=("{corpus}",)),
    Case("bench on a full disk", argv=["bench", "decode", "--quick", "--out", "{out}"],
         phrase="No space left on device", setup=full_disk, disk="full"),
    Case("bench on a read-only disk", argv=["bench", "decode", "--quick", "--out", "{out}"],
         phrase="Read-only file system", setup=read_only, disk="ro"),
    Case("demo --out-dir under /proc", argv=["demo", "--config", "tiny", "--out-dir", "/proc/memattn-hostile"],
         phrase="memattn-hostile"),
    Case("demo --out-dir a file", argv=["demo", "--config", "tiny", "--out-dir", "{corpus}"], phrase="is a file",
         unchanged=("{corpus}",)),
    Case("demo on a full disk", argv=["demo", "--config", "tiny", "--out-dir", "{out}"],
         phrase="No space left on device", setup=full_disk, disk="full"),
    Case("demo on a read-only disk", argv=["demo", "--config", "tiny", "--out-dir", "{out}"],
         phrase="Read-only file system", setup=read_only, disk="ro"),
    Case("translate of a file that is not UTF-8", argv=["translate", "{run}", "--input", "{latin1}"],
         phrase="is not UTF-8 text"),
    Case("translate --batch-size 0", argv=["translate", "{run}", "--input", "{text}", "--batch-size", "0"],
         phrase="--batch-size: expected a number >= 1"),
    Case("translate --batch-size -1", argv=["translate", "{run}", "--input", "{text}", "--batch-size", "-1"],
         phrase="--batch-size: expected a number >= 1"),
    Case("translate --output in a missing folder", argv=["translate", "{mt}", "--input", "{tmp}/two.txt", "--output",
         "{tmp}/sub/dir/out.txt", "--beam", "1"], status=0, unchanged=("{mt}",),
         setup=file_in_tmp("two.txt", "a b c\nd e\n", then=with_translation),
         check=same_tokens_as_before),
    Case("translate --output under /proc", argv=["translate", "{run}", "--input", "{text}", "--output",
         "/proc/memattn-hostile/out.txt"], phrase="/proc/memattn-hostile"),
    Case("compress --batch-size 0", argv=["compress", "{comp}", "{text}", "-o", "{tmp}/c", "--batch-size", "0"],
         phrase="--batch-size: expected a number >= 1"),
    Case("compress --batch-size -1", argv=["compress", "{comp}", "{text}", "-o", "{tmp}/c", "--batch-size", "-1"],
         phrase="--batch-size: expected a number >= 1"),
    Case("decompress --batch-size 0", argv=["decompress", "{tmp}/c", "--checkpoint", "{comp}", "--batch-size", "0"],
         phrase="--batch-size: expected a number >= 1"),
    Case("decompress --batch-size -1", argv=["decompress", "{tmp}/c", "--checkpoint", "{comp}", "--batch-size", "-1"],
         phrase="--batch-size: expected a number >= 1"),
    Case("eval of a checkpoint whose vocabulary metadata is broken", argv=["eval", "{badvocab}"],
         phrase="its vocabulary cannot be read"),
    Case("eval of a checkpoint whose vocabulary disagrees with its sizes", argv=["eval", "{vocabsize}"],
         phrase="its vocabulary has 10 symbols"),
    Case("generate of a checkpoint whose vocabulary disagrees", argv=["generate", "{vocabsize}", "--tokens", "2"],
         phrase="its vocabulary has 10 symbols"),
    Case("generate --device meta", argv=["generate", "{run}", "--device", "meta", "--tokens", "2"],
         phrase="--device: 'meta'"),
    Case("info attention.num_slots=1e8", argv=["info", "--config", "tiny", "attention=abc-mlp",
         "attention.num_slots=1e8"], phrase="attention.num_slots: expected an integer"),
    Case("info of a model too large for this machine", argv=["info", "--config", "tiny", "attention=abc-mlp",
         "attention.num_slots=1000000000000"], phrase="GiB of memory available here"),
    Case("cache.reorder out of range", call=lambda w, t, p: small_cache().reorder(torch.tensor([0, 7])),
         status=ShapeError, phrase="row numbers must lie in [0, 2)"),
    Case("cache.reorder with a negative row", call=lambda w, t, p: small_cache().reorder(torch.tensor([-1, 0])),
         status=ShapeError, phrase="got -1 to 0"),
    Case("EncoderDecoder.generate(max_new_tokens=0)", call=generate_no_tokens, status=None),
    *[Case(f"{op.__name__} with an int64 query", call=lambda w, t, p, op=op, extra=extra: op(
        torch.ones(1, 3, 2, 4, dtype=torch.long), *[torch.randn(1, 3, 2, 4)] * 2, *extra),
        status=ShapeError, phrase="q: expected a floating")
      for op, extra in OPS_WITH_EXTRA],
    *[Case(f"{op.__name__} with k on another device (meta)", call=lambda w, t, p, op=op, extra=extra: op(
        torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4, device="meta"), torch.randn(1, 3, 2, 4), *extra),
        status=ShapeError, phrase="k: expected a tensor on q's device (cpu), got one on meta")
      for op, extra in OPS_WITH_EXTRA],
    *[Case(f"a layer given {dtype} input", call=lambda w, t, p, dtype=dtype: attention_layer("gsa", 8, 2)(
        torch.ones(1, 3, 8, dtype=dtype)), status=ShapeError, phrase="x: expected the layer's dtype (torch.float32)")
      for dtype in (torch.long, torch.float64)],
    Case("a softmax layer given gsa's state", call=lambda w, t, p: attention_layer("softmax", 8, 2)(
        torch.randn(1, 1, 8), memory_state=attention_layer("gsa", 8, 2).init_state(1)),
        status=ShapeError, phrase="memory_state: expected a KVCache"),
    Case("representations.save to a folder", call=save_representations_to_a_folder, status=IsADirectoryError,
         phrase="is a folder"),
    Case("an experiment's run folder with a broken settings.json", argv=["experiment", "abc-lm", "--quick",
         "--out-dir", "{tmp}/x", "data.corpus=text", "data.path={corpus}", "data.cache_dir={root}/cache"],
         phrase="settings.json: not valid JSON", unchanged=("{tmp}/x",), setup=broken_settings),
    Case("torch.distributed failing to start", argv=train_argv("{tmp}/x"), phrase="torch.distributed:",
         setup=distributed_error),
    Case("--debug shows the traceback", argv=["--debug", "eval", "{nan}"], status=Exception, phrase="not finite"),
    Case("--debug after the command's name", argv=["eval", "{nan}", "--debug"], status=Exception, phrase="not finite"),
    Case("MEMATTN_DEBUG=1 shows the traceback", argv=["eval", "{nan}"], status=Exception, phrase="not finite",
         env={"MEMATTN_DEBUG": "1"}),
]


def digest(paths: list[Path]) -> dict[str, str]:
    """sha256 of every file under `paths` (lock files left out: a lock is not content)."""
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        for f in files:
            if not f.name.endswith(".lock"):
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, world, tmp_path, capsys, monkeypatch):
    if case.disk == "ro" and not world.disks.real:
        pytest.skip(f"needs a read-only disk: {world.disks.why}")
    paths = dict(world.paths(), tmp=str(tmp_path))
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    if case.setup is not None:
        paths.update(case.setup(world, tmp_path, paths, monkeypatch) or {})
    try:
        guarded = [Path(p.format(**paths)) for p in case.unchanged]
        before = digest(guarded)
        capsys.readouterr()
        if case.argv is not None:
            argv = [a.format(**paths) for a in case.argv]
            if isinstance(case.status, type):
                with pytest.raises(case.status) as raised:
                    main(argv)
                message = str(raised.value)
            else:
                status = main(argv)
                captured = capsys.readouterr()
                message = captured.err
                assert status == case.status, (argv, captured.err[-3000:])
                assert "Traceback" not in captured.err
                if case.status == 2:
                    errors = [line for line in captured.err.splitlines() if ": error: " in line]
                    assert len(errors) == 1 and errors[0].startswith(f"memattn {argv[0]}: error: ") \
                        or argv[0].startswith("-"), captured.err
        elif isinstance(case.status, type):
            with pytest.raises(case.status) as raised:
                case.call(world, tmp_path, paths)
            message = str(raised.value)
        else:
            status = case.call(world, tmp_path, paths)
            captured = capsys.readouterr()
            message = captured.err
            if case.status is not None:
                assert status == case.status, captured.err[-3000:]
        assert case.phrase in message, message[-3000:]
        assert digest(guarded) == before, "a file that must not change changed"
        if case.check is not None:
            monkeypatch.undo()  # the check sees the machine as it is (a simulated full disk ends)
            case.check(world, tmp_path, paths, captured if "captured" in locals() else None)
    finally:
        while HELD:
            HELD.pop().__exit__(None, None, None)
        if world.disks.real:
            world.disks.empty()
