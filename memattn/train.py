"""The training loop of every task (memattn.tasks): AdamW, warm-up + cosine, clipping, evaluation,
atomic checkpoints, exact resume, and data-parallel training under torchrun.

Determinism: the batch of step s and the dropout seed of step s are functions of
(train.seed, s, rank) alone, so a resumed run sees the same data and randomness as an
uninterrupted one, and its log holds the same losses.

Segment-level training (train.segments, Transformer-XL style): the batch is batch_size
contiguous streams of the training split, step s reads their segment s mod n (n segments
fit a stream; a stream that ends starts over with an empty memory), and the model's cache
carries each layer's bounded, detached memory of the previous segment into the next step.
That memory was made with the previous step's weights, so it cannot be rebuilt from a
checkpoint's weights: checkpoints store it (gathered over the ranks) and --resume restores it.
The objective adds the model's auxiliary losses (`aux_loss()`, e.g. adaptive-span penalties).

Early stopping (train.patience > 0): every evaluation is weighed on the figure the task selects
on (`task.selects`); training stops once train.patience evaluations in a row fail to beat the
best by more than train.min_delta, and the run ends with the weights of its best evaluation,
written to best.safetensors (`run_weights`). Every checkpoint holds the best weights and the
count so far, so a resumed run stops at the same step with the same best weights.

A run started from a softmax run may first transfer attention (train.transfer_steps,
memattn.transfer): steps of their own, before the ordinary ones, that train the mechanism's own
parameters alone; they are logged, checkpointed and resumed like the ordinary steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import yaml

from memattn.checkpoint import load_checkpoint, restore, save_checkpoint
from memattn.fileio import atomic_write, atomic_write_text, remove_stale_temporaries
from memattn.config import RunConfig, TrainConfig, from_dict, to_dict
from memattn.errors import CheckpointError, ConfigError, TrainingError
from memattn.layers.base import attention_layers
from memattn.models import CausalLM, ModelCache
from memattn.tasks import task_class

# Train fields a resumed run may change without changing what it computes up to the
# checkpoint (steps may grow; the cosine then stretches from that point on).
RESUMABLE_CHANGES = {"steps", "eval_every", "log_every", "save_every", "device", "threads", "out_dir"}
BEST_FILE = "best.safetensors"  # train.patience: the weights of the best evaluation


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of update `step` (0-based): linear warm-up, then cosine to lr·min_lr_ratio."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    return (seed * 1_000_003 + step) * 1009 + rank


def sample_batch(ids: torch.Tensor, step: int, cfg: TrainConfig, rank: int = 0,
                 world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch of random windows: x, y [b, seq_len]."""
    gen = torch.Generator().manual_seed(step_seed(cfg.seed, step))
    starts = torch.randint(0, len(ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    starts = starts.chunk(world)[rank]
    window = ids[starts[:, None] + torch.arange(cfg.seq_len + 1)[None, :]]
    return window[:, :-1], window[:, 1:]


def project_parameters(model: torch.nn.Module) -> None:
    """After an optimizer step: each attention layer whose mechanism declares
    `project_parameters` puts its parameters back where they are defined (e.g. a learned
    span into [0, S])."""
    with torch.no_grad():
        for layer, mech in attention_layers(model):
            if mech.project_parameters:
                layer.project_parameters()


def decay_groups(params, weight_decay: float) -> list[dict[str, Any]]:
    """The optimiser's groups of `params`: weight decay on matrices only (not on norms, biases
    or gains)."""
    decay, no_decay = [], []
    for p in params:
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Distributed:
    """Rank and world size from torchrun's environment; gloo on CPU, NCCL on CUDA."""

    def __init__(self, device: str) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.enabled = self.world > 1
        if self.enabled and not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mean(self, value: float) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / self.world

    def in_sync(self, model: torch.nn.Module) -> bool:
        """Whether every rank holds bit-identical parameters (compared by checksums)."""
        if not self.enabled:
            return True
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # fsdp shards
        flat = torch.cat([p.detach().double().flatten() for p in full])
        sums = torch.stack([flat.sum(), (flat * torch.arange(len(flat), dtype=torch.float64, device=flat.device)).sum()])
        gathered = [torch.empty_like(sums) for _ in range(self.world)]
        dist.all_gather(gathered, sums)
        return all(torch.equal(g, gathered[0]) for g in gathered)

    def gather_batch(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` concatenated along dim 0, in rank order (the global batch)."""
        if not self.enabled:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def average_grads(self, params) -> None:
        """Each gradient of `params` averaged over the ranks (for parameters that no DDP wrapper
        reduces: attention transfer, which calls layers directly, and LoRA adapters)."""
        if not self.enabled:
            return
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= self.world

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def resolve_device(name: str, ddp: Distributed) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device: {name!r} asked for, but no CUDA device is available")
        if ddp.enabled:
            name = f"cuda:{ddp.local_rank}"
    return torch.device(name)


def check_resumable(saved: dict[str, Any], cfg: RunConfig) -> None:
    """Raise CheckpointError if `cfg` differs from the checkpoint's config in a way that matters."""
    now = to_dict(cfg)
    for section in ("task_options", "model", "data", "train"):
        for key, value in saved.get(section, {}).items():
            if section == "train" and key in RESUMABLE_CHANGES:
                continue
            if now[section].get(key) != value:
                raise CheckpointError(f"--resume: the checkpoint was made with {section}.{key}={value!r}, "
                                      f"this run has {now[section].get(key)!r}")


class JsonlLog:
    """Append-only JSON lines; on resume, lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """Keep the records up to `step`; a torn line (a crash mid-write) is dropped."""
        if not (self.enabled and self.path.exists()):
            return
        kept = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
        atomic_write(self.path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept)))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


class EarlyStopping:
    """train.patience: the best value of the task's figure (task.selects) so far, the step,
    figures and weights (on the CPU) of its evaluation, and how many evaluations in a row have
    failed to beat it by more than train.min_delta."""

    def __init__(self, selects: tuple[str, str], tc: TrainConfig) -> None:
        self.figure, direction = selects
        self.sign = 1.0 if direction == "higher" else -1.0
        self.patience, self.min_delta = tc.patience, tc.min_delta
        self.best: float | None = None
        self.step, self.stale = 0, 0
        self.val: dict[str, float] = {}
        self.weights: dict[str, torch.Tensor] = {}

    @property
    def stopped(self) -> bool:
        return self.stale >= self.patience

    def update(self, val: dict[str, float], step: int, model: torch.nn.Module) -> None:
        """Weigh the evaluation `val` of `model` at `step`."""
        gain = math.inf if self.best is None else self.sign * (val[self.figure] - self.best)
        self.stale = 0 if gain > self.min_delta else self.stale + 1
        if gain > 0:
            self.best, self.step, self.val = val[self.figure], step, dict(val)
            self.weights = {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()}

    def saved(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(extra tensors, JSON) of a checkpoint."""
        return ({f"best.{k}": t for k, t in self.weights.items()},
                {"figure": self.figure, "best": self.best, "step": self.step, "val": self.val, "stale": self.stale})

    def load(self, ckpt) -> None:
        info = ckpt.meta.get("early_stopping")
        if info is None:
            raise CheckpointError(f"--resume: checkpoint {ckpt.path} was saved without early stopping "
                                  "(train.patience 0); resume it with train.patience=0")
        self.best, self.step, self.val, self.stale = info["best"], info["step"], info["val"], info["stale"]
        self.weights = {k[len("best."):]: t for k, t in ckpt.extra().items() if k.startswith("best.")}


def run_weights(out: Path) -> Path:
    """The file of the weights the run in folder `out` ends with: its best evaluation's under
    train.patience (BEST_FILE), else its checkpoint."""
    best = Path(out) / BEST_FILE
    return best if best.exists() else Path(out) / "checkpoint.safetensors"


def check_segments(model: CausalLM, cfg: RunConfig) -> None:
    """Raise ConfigError unless every layer's state can be carried between training segments."""
    if cfg.model.positions in ("learned", "split"):
        raise ConfigError(f"train.segments: a stream runs past any absolute position table; use "
                          f"model.positions=rotary or none, got {cfg.model.positions!r}")
    states = model.init_cache(1).states
    if not all(s.carries_segments and s.fixed_size for s in states):
        raise ConfigError(f"train.segments: attention {cfg.model.attention.name!r} with options "
                          f"{cfg.model.attention.options or {}} keeps no bounded memory to carry from one "
                          "segment to the next (attention=persistent with attention.context=window or "
                          "attention.adaptive_span=true does)")


def carried_memory(carry: ModelCache, ddp: Distributed) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON) of the segment memory for a checkpoint: every rank's share, gathered."""
    tensors = {f"carry.{i}.{name}": ddp.gather_batch(t)
               for i, state in enumerate(carry.states) for name, t in state.state_dict().items()}
    return tensors, {"position": carry.position, "seen": [s.seen for s in carry.states]}


def restore_carried_memory(ckpt, model: CausalLM, batch: int, ddp: Distributed,
                           device: torch.device) -> ModelCache:
    """The segment memory saved by `carried_memory`, this rank's share of it."""
    info = ckpt.meta.get("segments")
    if info is None:
        raise CheckpointError(f"--resume: checkpoint {ckpt.path} holds no segment memory to carry on with")
    carry = model.init_cache(batch, device=device)
    saved = ckpt.extra()
    for i, state in enumerate(carry.states):
        prefix = f"carry.{i}."
        mine = {name[len(prefix):]: t.chunk(ddp.world)[ddp.rank].to(device)
                for name, t in saved.items() if name.startswith(prefix)}
        state.load_state_dict(mine, info["seen"][i])
    carry.position = info["position"]
    return carry


def load_run_corpus(cfg: RunConfig, ddp: Distributed | None = None):
    """The corpus of `cfg.data`; under torchrun rank 0 prepares the cache first."""
    from memattn.data import load_corpus

    def load():
        d = cfg.data
        return load_corpus(corpus=d.corpus, path=d.path, level=d.level, cache_dir=d.cache_dir,
                           bpe_size=d.bpe_size, name=d.name, split=d.split, text_field=d.text_field,
                           tokenizer=d.tokenizer)

    return main_rank_first(load, ddp)


def load_task_corpus(cfg: RunConfig, ddp: Distributed, source):
    """The run's corpus, read with the vocabulary of the train.init_from model `source` when it
    has one (a note on stderr of the characters that vocabulary lacks)."""
    corpus = load_run_corpus(cfg, ddp)
    if source is not None and source.vocab is not None:
        from memattn.data import Vocab

        corpus = read_with_vocab(corpus, Vocab.from_json(source.vocab), f"the vocabulary of "
                                 f"train.init_from {cfg.train.init_from}", say=ddp.main)
    return corpus


def main_rank_first(load: Callable[[], Any], ddp: Distributed | None) -> Any:
    """load() in this process; under torchrun rank 0 first (it writes the data cache) and the
    other ranks after it, reading that cache."""
    if ddp is None or not ddp.enabled:
        return load()
    result = load() if ddp.main else None
    ddp.barrier()
    return result if result is not None else load()


@contextlib.contextmanager
def run_folder_lock(out: Path, enabled: bool = True):
    """Hold `out/.lock` while a process trains in the run folder `out`; a second trainer is
    refused with a ConfigError naming the process that holds it."""
    if not enabled:
        yield
        return
    import fcntl

    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / ".lock", "a+")
    except OSError as e:  # where the lock cannot be made, the run cannot be written: say so of the folder
        raise type(e)(e.errno, e.strerror, str(out)) from e
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ConfigError(f"train.out_dir: {out} is in use by {holder}; wait for it to finish "
                              "or choose another train.out_dir") from None
        with contextlib.suppress(OSError):  # who holds it, for the message of the refused (a full disk: unsaid)
            f.seek(0)
            f.truncate()
            os.write(f.fileno(), f"process {os.getpid()} on {socket.gethostname()}\n".encode())  # unbuffered
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


REPLACED = ".replaced"  # the run an --overwrite replaces, kept until the new run's first checkpoint
REPLACING = ".replacing"  # the same while its files are being moved there


def run_files(out: Path) -> list[Path]:
    """The files of the run in folder `out` (what --overwrite replaces)."""
    names = ("checkpoint.safetensors", BEST_FILE, "log.jsonl", "summary.json", "config.yaml")
    return [out / n for n in names if (out / n).exists()] + sorted(out.glob("checkpoint.dcp.*"))


def holds_run(out: Path) -> bool:
    return (out / "checkpoint.safetensors").exists() or (out / "log.jsonl").exists()


def set_run_aside(out: Path) -> bool:
    """--overwrite: move the run in `out` into out/REPLACED (nothing is deleted yet); returns
    whether there was one."""
    files = run_files(out)
    if not files:
        return False
    moving = out / REPLACING  # renamed to REPLACED once every file is in: a kill midway leaves REPLACING
    moving.mkdir()
    for f in files:
        f.rename(moving / f.name)
    moving.rename(out / REPLACED)
    return True


def settle_replaced_run(out: Path) -> None:
    """Finish what an --overwrite left: once the new run has a checkpoint the replaced run is
    removed; a new run that stopped before its first one is dropped and the replaced run put
    back (said on stderr)."""
    import shutil

    moving = out / REPLACING
    if moving.is_dir():  # killed while setting the run aside, before the new run started: put it back
        for f in moving.iterdir():
            f.rename(out / f.name)
        moving.rmdir()
    aside = out / REPLACED
    if not aside.is_dir():
        return
    if (out / "checkpoint.safetensors").exists():
        shutil.rmtree(aside)
        return
    for f in run_files(out):  # the new run's log and config: it saved nothing to go on from
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    for f in aside.iterdir():
        f.rename(out / f.name)
    aside.rmdir()
    print(f"memattn train: note: {out}: the run replacing the one there (--overwrite) stopped before its "
          "first checkpoint; the run it replaced is back, as it was", file=sys.stderr)


def read_summary(out: Path) -> dict[str, Any] | None:
    """summary.json of the run in `out`, None when there is none or it cannot be read (a
    write cut short by an older memattn; it is then written anew, and said so)."""
    path = out / "summary.json"
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        summary = None
    if not isinstance(summary, dict):
        print(f"memattn train: note: {path} cannot be read (cut short); it is written anew", file=sys.stderr)
        return None
    return summary


def train(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
          on_step: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train `cfg` and return a summary. `on_step(step, record)` runs after each logged step.

    resume: continue from the checkpoint in train.out_dir; a run that already reached
    train.steps is returned as it is (summary "complete": True; nothing is rewritten).
    overwrite: start anew in a train.out_dir that holds a run; without it (or resume) such a
    folder is refused, so no run is replaced by accident. The replaced run is moved aside
    (`REPLACED`) and removed only once the new run has saved its first checkpoint: a new run
    that stops before that gives the old one back (at once, or at the next `train` in the
    folder when the process was killed).
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: choose one (continue the run, or replace it)")
    out = Path(cfg.train.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.out_dir: {out} is a file, not a folder; choose a folder for the run")
    ddp = Distributed(cfg.train.device)
    created = ddp.main and not out.exists()
    try:
        with run_folder_lock(out, ddp.main):
            if ddp.main:
                remove_stale_temporaries(out)  # what a killed write left; the lock says none is under way
                settle_replaced_run(out)
            ddp.barrier()  # every rank decides on the folder as the main rank left it
            if not (resume or overwrite) and holds_run(out):
                raise ConfigError(f"train.out_dir: {out} holds a run already; continue it with "
                                  "--resume, replace it with --overwrite, or choose another train.out_dir")
            replacing = overwrite and ddp.main and set_run_aside(out)
            try:
                summary = _train(cfg, ddp, resume, progress, on_step)
            finally:
                if replacing:
                    settle_replaced_run(out)
        # Every rank finishes before any tears the process group down: a rank that exits
        # while another is still in gloo's last exchange aborts it ("terminate called
        # without an active exception", seen once torch also loads triton).
        ddp.barrier()
        return summary
    except BaseException:
        if created and out.is_dir() and {p.name for p in out.iterdir()} <= {".lock"}:  # refused: no empty folder left
            (out / ".lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    finally:
        ddp.close()


def _train(cfg: RunConfig, ddp: Distributed, resume: bool, progress: bool, on_step) -> dict[str, Any]:
    tc = cfg.train
    device = resolve_device(tc.device, ddp)
    threads = tc.threads or (max(1, (os.cpu_count() or 1) // ddp.world) if ddp.enabled else 0)
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)
    if tc.batch_size % ddp.world:
        raise ConfigError(f"train.batch_size: {tc.batch_size} does not split over {ddp.world} processes")
    source = None
    if tc.init_from:  # read on resume too: the run reads the corpus with the source's vocabulary
        from memattn.warmstart import read_source

        source = read_source(tc.init_from)
    task = task_class(cfg.task).prepare(cfg, ddp, resume, source)
    return _train_loop(task, ddp, resume, progress, on_step, device)


def converted_run(cfg: RunConfig, source) -> RunConfig:
    """cfg for training a converted transformers model (`memattn convert`): the model is that
    folder's, the text is read with its tokenizer unless data.tokenizer names another."""
    if cfg.train.segments:
        raise ConfigError("train.segments: a converted transformers model reads whole windows")
    if cfg.data.tokenizer:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(source.path)))


def with_vocab_size(cfg: RunConfig, size: int) -> RunConfig:
    """cfg with model.vocab_size set to the data's vocabulary (ConfigError if it says otherwise)."""
    if cfg.model.vocab_size not in (0, size):
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} does not match the corpus "
                          f"vocabulary of {size}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=size))


def drop_transfer_records_after(log: JsonlLog, step: int) -> None:
    """Keep the transfer steps' records up to transfer step `step` (a resume in the transfer phase)."""
    if not (log.enabled and log.path.exists()):
        return
    kept = []
    for line in log.path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(record, dict) and record.get("transfer_step", 0) > step):
            kept.append(line)
    atomic_write(log.path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept)))


def transfer_attention(cfg: RunConfig, ddp: Distributed, transfer, optimizer: torch.optim.Optimizer,
                       train_ids: torch.Tensor, device, log: JsonlLog, ckpt_path: Path, meta: dict[str, Any],
                       first: int, seconds_before: float, progress: bool, on_step) -> float:
    """Transfer steps first .. train.transfer_steps of attention transfer (memattn.transfer):
    `optimizer` updates the mechanism's own parameters only, every other one frozen meanwhile.

    Like the ordinary steps, step k reads a batch and a dropout seed that are functions of
    (train.seed, k, rank) alone (batches of "step" -1 - k: other windows than the ordinary
    steps'), logs every train.log_every steps ({"phase": "transfer", "step": 0, "transfer_step",
    "transfer_loss", "transfer_layers": the error of each transferred layer, "lr"}) and
    checkpoints every train.save_every and at the last one (step 0, meta "transfer": {"step",
    "steps"}, the transfer optimiser's state), so a run resumed in this phase goes on as an
    uninterrupted one. Returns the seconds spent.
    """
    tc = cfg.train
    n = tc.transfer_steps
    schedule = dataclasses.replace(tc, steps=n, lr=tc.transfer_lr or tc.lr, warmup=min(tc.warmup, n // 10))
    model = transfer.model
    params = [p for group in optimizer.param_groups for p in group["params"]]
    was = {id(p): p.requires_grad for p in model.parameters()}
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    model.train()
    bar = None
    if progress and ddp.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, initial=first, desc=f"transfer to {cfg.model.attention.name}", unit="step",
                   dynamic_ncols=True)
    started = time.perf_counter()
    try:
        for k in range(first, n):
            lr = lr_at(k, schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, _ = sample_batch(train_ids, -1 - k, tc, ddp.rank, ddp.world)
            torch.manual_seed(step_seed(tc.seed, -1 - k, ddp.rank))  # dropout of this step
            loss, layers = transfer.loss(x.to(device))
            loss.backward()
            ddp.average_grads(params)
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            optimizer.step()
            project_parameters(model)
            optimizer.zero_grad(set_to_none=True)
            done = k + 1
            saving, logging = done % tc.save_every == 0 or done == n, done % tc.log_every == 0 or done == n
            value = ddp.mean(loss.item()) if saving or logging else 0.0
            if not math.isfinite(value):
                raise TrainingError(f"transfer step {done}: the transfer loss is {value} (not finite), so "
                                    f"training stopped and nothing of it was saved; lower train.transfer_lr "
                                    f"(now {schedule.lr:g})")
            if logging:
                record = {"phase": "transfer", "step": 0, "transfer_step": done, "transfer_loss": value,
                          "transfer_layers": {str(i): ddp.mean(t.item()) for i, t in zip(transfer.layers, layers)},
                          "lr": lr}
                log.write(record)
                if bar is not None:
                    bar.set_postfix(transfer_loss=f"{value:.4g}")
                if on_step is not None:
                    on_step(0, record)
            if saving and ddp.main:
                save_checkpoint(ckpt_path, model, step=0, optimizer=optimizer,
                                meta=dict(meta, transfer={"step": done, "steps": n},
                                          train_seconds=seconds_before + time.perf_counter() - started))
            if saving:
                ddp.barrier()
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        for p in model.parameters():
            p.requires_grad_(was[id(p)])
    return time.perf_counter() - started


def _train_loop(task, ddp: Distributed, resume: bool, progress: bool, on_step, device) -> dict[str, Any]:
    """The loop of every task (memattn.tasks): its batches, its loss plus the model's
    auxiliary losses, its evaluations and early stopping on the figure it selects on
    (train.patience); checkpoints, resume, data parallelism, and the language model's
    attention transfer and LoRA (train.transfer_steps, train.lora_rank)."""
    cfg, source = task.cfg, task.source
    tc = cfg.train
    out = Path(tc.out_dir)
    ckpt_path = out / "checkpoint.safetensors"
    log = JsonlLog(out / "log.jsonl", ddp.main)
    torch.manual_seed(tc.seed)
    model = build_model(cfg)
    own = None  # train.transfer_steps / lora_rank: the names of the mechanism's own parameters
    if tc.transfer_steps or tc.lora_rank:
        from memattn.transfer import check_transfer, own_parameters

        own = own_parameters(model, source)
        if tc.transfer_steps:
            check_transfer(model, source, own)
    task.setup(model, device)
    softmax_model = None  # train.transfer_steps: the init_from model, frozen
    if tc.transfer_steps:
        from memattn.warmstart import teacher_model

        softmax_model = teacher_model(source, "train.transfer_steps").to(device)
    if source is not None and not source.converted and not resume:
        from memattn.warmstart import warm_start

        started = warm_start(model, source)
        if ddp.main:
            new = ", ".join(started["new"][:6]) + (" ..." if len(started["new"]) > 6 else "")
            print(f"memattn train: started from {source.path}: {len(started['copied'])} tensors copied, "
                  f"{len(started['new'])} new{': ' + new if new else ''}"
                  + (f"; position tables grown to model.max_len: {', '.join(started['grown'])}"
                     if started["grown"] else ""), file=sys.stderr)
    model = model.to(device)
    sharded = ddp.enabled and tc.parallel == "fsdp"
    if sharded:
        from memattn import sharded as fsdp

        fsdp.shard(model)
    trainable = list(model.parameters())  # what the ordinary steps train
    transfer_optimizer = lora = None
    if own is not None:
        named = dict(model.named_parameters())
        if tc.transfer_steps:
            transfer_optimizer = torch.optim.AdamW(decay_groups([named[n] for n in own], tc.weight_decay),
                                                   lr=tc.transfer_lr or tc.lr, betas=tc.betas)
        if tc.lora_rank:
            from memattn.transfer import LoRA

            lora = LoRA(model, LoRA.targets_of(model, own), tc.lora_rank)
            trainable = [named[n] for n in own] + list(lora.parameters())
    optimizer = torch.optim.AdamW(decay_groups(trainable, tc.weight_decay), lr=tc.lr, betas=tc.betas)
    transferred = tc.transfer_steps if resume else 0  # transfer steps done (a checkpoint may say fewer)
    stopping = EarlyStopping(task.selects, tc) if tc.patience else None
    start, seconds_before = 0, 0.0
    if resume:
        ckpt = load_checkpoint(ckpt_path)
        check_resumable(ckpt.meta["config"], cfg)
        start = ckpt.step
        seconds_before = float(ckpt.meta.get("train_seconds", 0.0))
        if stopping is not None and start > 0:
            stopping.load(ckpt)
        finished = start >= tc.steps or (stopping is not None and stopping.stopped)
        done_summary = read_summary(out) if finished else None
        if done_summary is not None:  # complete: nothing to add
            return dict(done_summary, complete=True, checkpoint_step=start)
        in_transfer = start == 0 and "transfer" in ckpt.meta  # saved by the transfer steps
        if in_transfer:
            transferred = int(ckpt.meta["transfer"]["step"])
        if sharded:
            fsdp.load_shards(out, ckpt.meta, model, optimizer)
        elif in_transfer:
            restore(ckpt, model, transfer_optimizer if transferred < tc.transfer_steps else None)
        else:
            restore(ckpt, model, optimizer)
        if lora is not None and not in_transfer:  # the checkpoint holds merged weights: the base is the source's
            from memattn.transfer import start_weights

            lora.load(ckpt.extra(), start_weights(model, source))
        log.truncate_after(start)
        if in_transfer:
            drop_transfer_records_after(log, transferred)
        task.resumed(ckpt, model, ddp, device)
    elif ddp.main:
        out.mkdir(parents=True, exist_ok=True)
        log.path.unlink(missing_ok=True)
    if ddp.main:
        atomic_write_text(out / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    meta = {"config": to_dict(cfg), **task.meta()}
    if transferred < tc.transfer_steps:
        from memattn.transfer import AttentionTransfer

        seconds_before += transfer_attention(
            cfg, ddp, AttentionTransfer(model, softmax_model, own), transfer_optimizer, task.train_ids, device, log,
            ckpt_path, meta, transferred, seconds_before, progress, on_step)
    if lora is not None:  # the ordinary steps train the adapters and the mechanism's own parameters
        model.requires_grad_(False)
        for p in trainable:
            p.requires_grad_(True)
        lora.attach()
    wrapped = model
    if ddp.enabled and not sharded:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    n_params = model.num_parameters()
    bar = None
    if progress and ddp.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=tc.steps, initial=start, desc=f"train {task.model_name}",
                   unit="step", dynamic_ncols=True)
    model.train()
    tokens_since, clock = 0, time.perf_counter()
    wall_start = clock
    last_val: dict[str, float] = {}
    train_loss = float("nan")
    tok_per_s = 0.0
    steps_done = start
    for step in range(start, tc.steps):
        if stopping is not None and stopping.stopped:
            break
        lr = lr_at(step, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = task.batch(step, ddp.rank, ddp.world).to(device)
        torch.manual_seed(step_seed(tc.seed, step, ddp.rank))  # dropout of this step
        step_loss = task.loss(wrapped, batch)
        # the mean over the global batch's scored positions, whatever rank holds them: DDP
        # averages the ranks' gradients of total / (scored positions per rank on average)
        loss = step_loss.total / ddp.mean(float(step_loss.scored))
        step_tokens = ddp.mean(float(task.tokens(batch)))
        aux = model.aux_loss()  # e.g. adaptive-span penalties; None for most mechanisms
        for weight, value in step_loss.terms.values():
            aux = weight * value if aux is None else aux + weight * value
        (loss if aux is None else loss + aux).backward()
        if lora is not None:
            ddp.average_grads(lora.parameters())
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, tc.grad_clip)
        optimizer.step()
        project_parameters(model)
        optimizer.zero_grad(set_to_none=True)
        tokens_since += step_tokens * ddp.world
        done = steps_done = step + 1
        record: dict[str, Any] = {}
        saving = done % tc.save_every == 0 or done == tc.steps
        if (saving or done % tc.log_every == 0) and not math.isfinite(ddp.mean(loss.item())):
            raise TrainingError(f"step {done}: the training loss is {loss.item()} (not finite), so "
                                f"training stopped and nothing of it was saved; the checkpoint in {out} "
                                f"(if any) is the last finite one. Lower train.lr (now {tc.lr:g}) or "
                                "check the data")
        if done % tc.log_every == 0 or done == tc.steps:
            now = time.perf_counter()
            tok_per_s = tokens_since / max(now - clock, 1e-9)
            train_loss = ddp.mean(loss.item())
            tokens_since, clock = 0, now
            record.update(step=done, loss=train_loss, lr=lr, tokens_per_s=round(tok_per_s, 1))
            if aux is not None:
                record.update(aux_loss=aux.item())
            record.update({name: ddp.mean(value.item()) for name, (_, value) in step_loss.terms.items()})
        if done % tc.eval_every == 0 or done == tc.steps:
            last_val = task.evaluate(model, device)
            record.update(step=done, **{f"val_{k}": last_val[k] for k in task.logged})
            if stopping is not None:
                stopping.update(last_val, done, model)
                saving = saving or stopping.stopped
            clock = time.perf_counter()  # evaluation time is not training throughput
        if record:
            log.write(record)
            if bar is not None:
                shown = {k: f"{last_val[k]:.3f}" for k in ("bpc", "ppl") if k in last_val}
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tok_per_s:,.0f}", **{f"val_{k}": v for k, v in shown.items()})
            if on_step is not None:
                on_step(done, record)
        extra, segments_meta = task.carried(ddp) if saving else ({}, None)
        stopping_meta = None
        if saving and stopping is not None:
            best, stopping_meta = stopping.saved()
            extra = dict(extra, **best)
        if saving:
            shards = weights = None
            if sharded:  # every rank writes its shards and joins in gathering the weights
                shards = fsdp.save_shards(out, done, model, optimizer, ddp.main)
                weights = fsdp.full_weights(model)
            if lora is not None:  # a model that reads without adapters, and the adapters to go on with
                weights, extra = lora.merged_state(model), dict(extra, **lora.tensors())
            if ddp.main:
                save_checkpoint(ckpt_path, model, step=done, optimizer=None if sharded else optimizer,
                                extra=extra, state=weights,
                                meta=dict(meta, segments=segments_meta, sharded=shards, early_stopping=stopping_meta,
                                          train_seconds=seconds_before + time.perf_counter() - wall_start,
                                          metrics={"train_loss": train_loss, **{f"val_{k}": v for k, v in last_val.items()}}))
                if sharded:
                    fsdp.drop_old_shards(out, shards)
        if done % tc.save_every == 0:
            ddp.barrier()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if stopping is not None:  # the run ends with its best evaluation's weights
        model.load_state_dict(stopping.weights)
        last_val = stopping.val
        if ddp.main:
            save_checkpoint(out / BEST_FILE, model, step=stopping.step,
                            meta=dict(meta, early_stopping=stopping.saved()[1],
                                      metrics={f"val_{k}": v for k, v in last_val.items()}))
    wall = time.perf_counter() - wall_start
    summary = {"attention": task.model_name, "params": n_params, "steps": steps_done,
               "train_loss": train_loss, "val": last_val, "tokens_per_s": tok_per_s,
               "wall_s": wall, "train_seconds": seconds_before + wall, "checkpoint": str(ckpt_path), "world_size": ddp.world,
               **({"best_step": stopping.step, "stopped": stopping.stopped} if stopping is not None else {}),
               "ranks_in_sync": ddp.in_sync(model)}
    if ddp.main:
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def checkpoint_split(path: str | os.PathLike, cfg: RunConfig, vocab_json: dict[str, Any], split: str):
    """(ids, characters per token, note): split `split` of the checkpoint's corpus encoded
    with the checkpoint's vocabulary (never the corpus's own, which follows the text as it is
    now), and a note when that split differs from the one the checkpoint recorded at
    training (None when equal)."""
    from memattn.data import Vocab

    corpus = load_run_corpus(cfg)
    vocab = Vocab.from_json(vocab_json)
    if corpus.vocab != vocab:
        try:
            corpus = corpus.encoded_with(vocab)
        except ConfigError as e:
            raise ConfigError(f"{split} split of {cfg.data.corpus!r}: {e}") from None
    ids = corpus.split(split)
    if split not in changed_splits(load_checkpoint(path).meta.get("data", {}), corpus, (split,)):
        return ids, corpus.chars_per_token(split), None
    return ids, corpus.chars_per_token(split), (f"the {split} split of {cfg.data.corpus!r} is not the one this checkpoint was trained "
                 "with (its text changed); the figures are of the text as it is now, read with the "
                 "checkpoint's vocabulary")


def read_with_vocab(corpus, vocab, what: str, say: bool = True):
    """`corpus` read with another vocabulary (`Corpus.encoded_with`), and a note on stderr
    (`say`) of the characters `what` (that vocabulary, in words) lacks and reads as its
    unknown symbol: how many, what share, which."""
    import numpy as np

    encoded = corpus.encoded_with(vocab)
    if encoded is corpus or getattr(vocab, "kind", None) != "char" or vocab.unk_id is None \
            or getattr(corpus.vocab, "kind", None) != "char":
        return encoded
    known = set(vocab.symbols) - {vocab.symbols[vocab.unk_id]}
    missing = [i for i, c in enumerate(corpus.vocab.symbols) if c not in known and i != corpus.vocab.unk_id]
    if not missing or not say:
        return encoded
    counts = {s: np.isin(corpus.split(s), missing) for s in ("train", "val", "test")}
    n, total = sum(int(m.sum()) for m in counts.values()), sum(len(m) for m in counts.values())
    if n:
        seen = np.unique(np.concatenate([corpus.split(s)[m] for s, m in counts.items()]))
        shown = "".join(corpus.vocab.symbols[i] for i in seen[:40])
        print(f"memattn train: note: {n:,} of the {total:,} characters of {corpus.name!r} ({100 * n / total:.2g} %) "
              f"are not in {what} and are read as its unknown symbol: {shown!r}", file=sys.stderr)
    return encoded


def changed_splits(recorded: dict[str, str], corpus, splits=("train", "val", "test")) -> list[str]:
    """The splits of `corpus` whose token ids differ from the fingerprints a checkpoint
    recorded at training (`recorded`: split -> fingerprint; a split it did not record counts
    as unchanged): what eval and --resume say when the text changed since."""
    return [s for s in splits if recorded.get(s) is not None and recorded[s] != fingerprint(corpus.split(s))]


def fingerprint(ids) -> str:
    """A short hash of a split's token ids (what a checkpoint was trained and validated on)."""
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]


def build_model(cfg: RunConfig) -> torch.nn.Module:
    """The run's model as initialised, built by its task (memattn.tasks)."""
    return task_class(cfg.task).build_model(cfg)


def model_from_checkpoint(path: str | os.PathLike, device: str = "cpu"):
    """(model in eval mode, RunConfig, vocab dict) from a checkpoint file or run folder (the
    weights the run ends with: `run_weights`)."""
    ckpt = load_checkpoint(run_weights(path) if Path(path).is_dir() else path)
    missing = [key for key in ("config", "vocab") if not isinstance(ckpt.meta.get(key), dict)]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.path}: its metadata lacks {' and '.join(missing)}; "
                              "not a language-model checkpoint written by `memattn train`")
    cfg = from_dict(RunConfig, ckpt.meta["config"])
    check_vocab_fits(ckpt, cfg)
    model = build_model(cfg)
    restore(ckpt, model)
    return model.to(device).eval(), cfg, ckpt.meta["vocab"]


def check_vocab_fits(ckpt, cfg: RunConfig) -> None:
    """CheckpointError unless the checkpoint's vocabulary can be read and has the size its
    model was built for (model.vocab_size; one more, the mask token, for a masked LM): text
    encoded with a vocabulary of another size would give ids the model does not have."""
    from memattn.data import Vocab
    from memattn.warmstart import is_converted

    try:
        vocab = Vocab.from_json(ckpt.meta["vocab"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt.path}: its vocabulary cannot be read ({e}); the file was "
                              "altered after it was saved") from None
    if cfg.train.init_from and is_converted(cfg.train.init_from):
        return  # the converted model's own vocabulary, read from its folder
    extra = task_class(cfg.task).extra_symbols
    if cfg.model.vocab_size != vocab.size + extra:
        raise CheckpointError(f"checkpoint {ckpt.path}: its vocabulary has {vocab.size} symbols, but its model "
                              f"was built for model.vocab_size={cfg.model.vocab_size}"
                              f"{f' (with {extra} more of its task)' if extra else ''}; the metadata was "
                              "altered after it was saved")
