"""Training loop for the causal LM: AdamW, warm-up + cosine, clipping, evaluation,
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
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from memattn.checkpoint import load_checkpoint, restore, save_checkpoint
from memattn.fileio import atomic_write
from memattn.config import RunConfig, TrainConfig, from_dict, to_dict
from memattn.errors import CheckpointError, ConfigError, TrainingError
from memattn.evaluate import as_tensor, evaluate, segment_window
from memattn.models import CausalLM, EncoderDecoder, ModelCache
from memattn.warmstart import distill_loss

# Train fields a resumed run may change without changing what it computes up to the
# checkpoint (steps may grow; the cosine then stretches from that point on).
RESUMABLE_CHANGES = {"steps", "eval_every", "log_every", "save_every", "device", "threads", "out_dir"}


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
    """After an optimizer step: each module with a `project_parameters()` method puts its
    parameters back where they are defined (e.g. a learned span into [0, S])."""
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "project_parameters"):
                m.project_parameters()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on norms, biases or gains)."""
    decay, no_decay = [], []
    for p in model.parameters():
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
    for section in ("model", "data", "train"):
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

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ConfigError(f"train.out_dir: {out} is in use by {holder}; wait for it to finish "
                              "or choose another train.out_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


def train(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
          on_step: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train `cfg` and return a summary. `on_step(step, record)` runs after each logged step.

    resume: continue from the checkpoint in train.out_dir; a run that already reached
    train.steps is returned as it is (summary "complete": True; nothing is rewritten).
    overwrite: start anew in a train.out_dir that holds a run; without it (or resume) such a
    folder is refused, so no run is replaced by accident.
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: choose one (continue the run, or replace it)")
    ddp = Distributed(cfg.train.device)
    try:
        out = Path(cfg.train.out_dir)
        with run_folder_lock(out, ddp.main):
            if not (resume or overwrite) and ((out / "checkpoint.safetensors").exists()
                                               or (out / "log.jsonl").exists()):
                raise ConfigError(f"train.out_dir: {out} holds a run already; continue it with "
                                  "--resume, replace it with --overwrite, or choose another train.out_dir")
            summary = _train(cfg, ddp, resume, progress, on_step)
        # Every rank finishes before any tears the process group down: a rank that exits
        # while another is still in gloo's last exchange aborts it ("terminate called
        # without an active exception", seen once torch also loads triton).
        ddp.barrier()
        return summary
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
    if cfg.task == "translation":
        return _train_loop(cfg, ddp, resume, progress, on_step, device,
                           translation_task(cfg, ddp, resume))
    source = None
    if tc.init_from:  # read on resume too: the run reads the corpus with the source's vocabulary
        from memattn.warmstart import read_source

        source = read_source(tc.init_from)
        if source.converted:
            cfg = converted_run(cfg, source)
    corpus = load_run_corpus(cfg, ddp)
    if source is not None and source.vocab is not None:
        from memattn.data import Vocab

        corpus = corpus.encoded_with(Vocab.from_json(source.vocab))
    if cfg.task == "mlm":
        from memattn.masked import MaskedLMTask

        if source is not None and source.converted:
            raise ConfigError("train.init_from: a converted transformers model trains as a causal LM "
                              "(task=lm); a masked-LM run starts from a memattn masked-LM run")
        cfg = with_vocab_size(cfg, corpus.vocab.size + 1)  # and the mask token
        return _train_loop(cfg, ddp, resume, progress, on_step, device, MaskedLMTask(cfg, corpus, source))
    cfg = with_vocab_size(cfg, corpus.vocab.size)
    train_ids, val_ids = as_tensor(corpus.train), as_tensor(corpus.val)
    for split, ids in (("training", train_ids), ("validation", val_ids)):
        if len(ids) < tc.seq_len + 2:
            raise ConfigError(f"train.seq_len: the {split} split of {cfg.data.corpus!r} holds {len(ids):,} "
                              f"tokens, fewer than one window of seq_len + 1 = {tc.seq_len + 1} (and one "
                              "to start from); use a larger corpus or a smaller train.seq_len")
    return _train_loop(cfg, ddp, resume, progress, on_step, device,
                       LanguageModelData(corpus, source, train_ids, val_ids))


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


def translation_task(cfg: RunConfig, ddp: Distributed, resume: bool):
    """The TranslationTask of cfg; resumed, the corpus is read with the checkpoint's vocabulary."""
    from memattn.data import Vocab
    from memattn.translation import TranslationTask, load_parallel_corpus

    vocab = None
    if resume:
        vocab = Vocab.from_json(load_checkpoint(Path(cfg.train.out_dir) / "checkpoint.safetensors").meta["vocab"])

    corpus = main_rank_first(lambda: load_parallel_corpus(cfg, vocab), ddp)
    return TranslationTask(with_vocab_size(cfg, corpus.vocab.size), corpus)


class LanguageModelData(NamedTuple):
    corpus: Any
    source: Any  # the train.init_from model (memattn.warmstart), or None
    train_ids: torch.Tensor
    val_ids: torch.Tensor


def _train_loop(cfg: RunConfig, ddp: Distributed, resume: bool, progress: bool, on_step, device,
                data) -> dict[str, Any]:
    """The loop shared by the tasks: `data` is a LanguageModelData, or the task's object
    (TranslationTask, MaskedLMTask: batch, loss, evaluate)."""
    tc = cfg.train
    task = data if cfg.task != "lm" else None
    if task is not None:
        cfg = task.cfg
        corpus, source = task.corpus, task.source
    else:
        corpus, source, train_ids, val_ids = data
    out = Path(tc.out_dir)
    ckpt_path = out / "checkpoint.safetensors"
    log = JsonlLog(out / "log.jsonl", ddp.main)
    torch.manual_seed(tc.seed)
    model = build_model(cfg)
    teacher = None
    if tc.distill_weight > 0:
        from memattn.warmstart import teacher_model

        teacher = teacher_model(source).to(device)
    if source is not None and not source.converted and not resume:
        from memattn.warmstart import warm_start

        started = warm_start(model, source)
        if ddp.main:
            new = ", ".join(started["new"][:6]) + (" ..." if len(started["new"]) > 6 else "")
            print(f"memattn train: started from {source.path}: {len(started['copied'])} tensors copied, "
                  f"{len(started['new'])} new{': ' + new if new else ''}", file=sys.stderr)
    model = model.to(device)
    sharded = ddp.enabled and tc.parallel == "fsdp"
    if sharded:
        from memattn import sharded as fsdp

        fsdp.shard(model)
    optimizer = torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr, betas=tc.betas)
    carry: ModelCache | None = None  # train.segments: the memory carried from step to step
    if tc.segments:
        check_segments(model, cfg)
        n_segments = (len(train_ids) - 1) // tc.batch_size // tc.seq_len
        if n_segments == 0:
            raise ConfigError(f"train.segments: {tc.batch_size} streams of the training split "
                              f"({len(train_ids):,} tokens) are shorter than train.seq_len={tc.seq_len}")
    start, seconds_before = 0, 0.0
    if resume:
        ckpt = load_checkpoint(ckpt_path)
        check_resumable(ckpt.meta["config"], cfg)
        start = ckpt.step
        seconds_before = float(ckpt.meta.get("train_seconds", 0.0))
        if start >= tc.steps and (out / "summary.json").exists():  # complete: nothing to add
            return dict(json.loads((out / "summary.json").read_text()), complete=True, checkpoint_step=start)
        if sharded:
            fsdp.load_shards(out, ckpt.meta, model, optimizer)
        else:
            restore(ckpt, model, optimizer)
        log.truncate_after(start)
        if tc.segments:
            carry = restore_carried_memory(ckpt, model, tc.batch_size // ddp.world, ddp, device)
    elif ddp.main:
        out.mkdir(parents=True, exist_ok=True)
        log.path.unlink(missing_ok=True)
    if ddp.main:
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    wrapped = model
    if ddp.enabled and not sharded:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    meta = {"config": to_dict(cfg), "vocab": corpus.vocab.to_json(), "corpus": corpus.name,
            "data": {split: fingerprint(corpus.split(split)) for split in ("train", "val", "test")}
            if task is None else {}}
    n_params = model.num_parameters()
    bar = None
    if progress and ddp.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=tc.steps, initial=start, desc=f"train {cfg.model.attention.name}",
                   unit="step", dynamic_ncols=True)
    model.train()
    tokens_since, clock = 0, time.perf_counter()
    wall_start = clock
    last_val: dict[str, float] = {}
    train_loss = float("nan")
    tok_per_s = 0.0
    for step in range(start, tc.steps):
        lr = lr_at(step, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        aux = None
        if task is not None:
            batch = task.batch(step, ddp.rank, ddp.world).to(device)
            torch.manual_seed(step_seed(tc.seed, step, ddp.rank))  # dropout of this step
            loss_sum, scored = task.loss(wrapped, batch)
            # the mean over the global batch's scored tokens, whatever rank holds them: DDP
            # averages the ranks' gradients of loss_sum / (scored tokens per rank on average)
            loss, step_tokens = loss_sum / ddp.mean(float(scored)), ddp.mean(float(task.tokens(batch)))
        else:
            if tc.segments:
                segment = step % n_segments
                window = segment_window(train_ids, tc.batch_size, tc.seq_len, segment).chunk(ddp.world)[ddp.rank]
                x, y = window[:, :-1], window[:, 1:]
                if segment == 0:  # the streams (re)start: an empty memory
                    carry = model.init_cache(x.shape[0], device=device)
            else:
                x, y = sample_batch(train_ids, step, tc, ddp.rank, ddp.world)
            x, y = x.to(device), y.to(device)
            torch.manual_seed(step_seed(tc.seed, step, ddp.rank))  # dropout of this step
            logits = wrapped(x) if carry is None else wrapped(x, cache=carry)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            step_tokens = x.numel()  # per rank
            aux = model.aux_loss()  # e.g. adaptive-span penalties; None for most mechanisms
            if teacher is not None:
                with torch.no_grad():
                    teacher_logits = teacher(x)
                distill = distill_loss(logits, teacher_logits)
                aux = tc.distill_weight * distill if aux is None else aux + tc.distill_weight * distill
        (loss if aux is None else loss + aux).backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        project_parameters(model)
        optimizer.zero_grad(set_to_none=True)
        tokens_since += step_tokens * ddp.world
        done = step + 1
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
            if teacher is not None:
                record.update(distill=ddp.mean(distill.item()))
        if done % tc.eval_every == 0 or done == tc.steps:
            if task is not None:
                last_val = task.evaluate(model, device)
                record.update(step=done, **{f"val_{k}": last_val[k] for k in task.logged})
            else:
                last_val = evaluate(model, val_ids, seq_len=tc.seq_len, batch_size=tc.batch_size,
                                    max_batches=tc.eval_batches, device=device, segments=tc.segments,
                                    chars_per_token=corpus.chars_per_token("val"))
                record.update(step=done, val_loss=last_val["loss"], val_bpc=last_val["bpc"])
            clock = time.perf_counter()  # evaluation time is not training throughput
        if record:
            log.write(record)
            if bar is not None:
                shown = {k: f"{last_val[k]:.3f}" for k in ("bpc", "ppl") if k in last_val}
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tok_per_s:,.0f}", **{f"val_{k}": v for k, v in shown.items()})
            if on_step is not None:
                on_step(done, record)
        extra, segments_meta = carried_memory(carry, ddp) if saving and carry is not None else ({}, None)
        if saving:
            shards = weights = None
            if sharded:  # every rank writes its shards and joins in gathering the weights
                shards = fsdp.save_shards(out, done, model, optimizer, ddp.main)
                weights = fsdp.full_weights(model)
            if ddp.main:
                save_checkpoint(ckpt_path, model, step=done, optimizer=None if sharded else optimizer,
                                extra=extra, state=weights,
                                meta=dict(meta, segments=segments_meta, sharded=shards,
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
    wall = time.perf_counter() - wall_start
    summary = {"attention": cfg.model.attention.name, "params": n_params, "steps": tc.steps,
               "train_loss": train_loss, "val": last_val, "tokens_per_s": tok_per_s,
               "wall_s": wall, "train_seconds": seconds_before + wall, "checkpoint": str(ckpt_path), "world_size": ddp.world,
               "ranks_in_sync": ddp.in_sync(model)}
    if ddp.main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
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
    recorded = load_checkpoint(path).meta.get("data", {}).get(split)
    if recorded is None or recorded == fingerprint(ids):
        return ids, corpus.chars_per_token(split), None
    return ids, corpus.chars_per_token(split), (f"the {split} split of {cfg.data.corpus!r} is not the one this checkpoint was trained "
                 "with (its text changed); the figures are of the text as it is now, read with the "
                 "checkpoint's vocabulary")


def fingerprint(ids) -> str:
    """A short hash of a split's token ids (what a checkpoint was trained and validated on)."""
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]


def build_model(cfg: RunConfig) -> torch.nn.Module:
    """The run's model as initialised: an EncoderDecoder (translation), the converted
    transformers model that train.init_from names, or a CausalLM."""
    if cfg.task == "translation":
        return EncoderDecoder(cfg.model)
    if cfg.task == "mlm":
        from memattn.models import Encoder

        return Encoder(cfg.model)
    from memattn.warmstart import is_converted

    if cfg.train.init_from and is_converted(cfg.train.init_from):  # not read_source: no weights to load
        from memattn.integrations.convert import ConvertedLM, load_converted

        return ConvertedLM(load_converted(cfg.train.init_from)).train()
    return CausalLM(cfg.model)


def model_from_checkpoint(path: str | os.PathLike, device: str = "cpu"):
    """(model in eval mode, RunConfig, vocab dict) from a checkpoint file or run folder."""
    ckpt = load_checkpoint(path)
    missing = [key for key in ("config", "vocab") if not isinstance(ckpt.meta.get(key), dict)]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.path}: its metadata lacks {' and '.join(missing)}; "
                              "not a language-model checkpoint written by `memattn train`")
    cfg = from_dict(RunConfig, ckpt.meta["config"])
    model = build_model(cfg)
    restore(ckpt, model)
    return model.to(device).eval(), cfg, ckpt.meta["vocab"]
