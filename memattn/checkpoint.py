"""Checkpoints: one safetensors file (no pickle) with the run's JSON in its metadata.

Tensors: `model.<name>` (tied parameters stored once, their aliases listed in the JSON),
`optim.<param index>.<key>` for the optimiser state, `extra.<name>` for any other run state
(e.g. the memory carried between training segments). Metadata key "memattn" holds the
JSON: format version, step, config, vocabulary, optimiser param groups, metrics, and a
checksum of every tensor (checked when the file is read; files written before it was
added load without it). A loaded checkpoint is verified: a step >= 0, finite numbers only,
aliases that name stored tensors.
Writes are atomic: a temporary file in the same folder, fsync, then os.replace.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from memattn.errors import CheckpointError
from memattn.fileio import atomic_write, read_tagged

FORMAT = "memattn-checkpoint/1"


@dataclass
class Checkpoint:
    path: Path
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def extra(self) -> dict[str, torch.Tensor]:
        """The `extra` tensors saved with the checkpoint, by name."""
        return {k[len("extra."):]: v for k, v in self.tensors.items() if k.startswith("extra.")}

    def model_state(self) -> dict[str, torch.Tensor]:
        state = {k[len("model."):]: v for k, v in self.tensors.items() if k.startswith("model.")}
        for alias, target in self.meta.get("aliases", {}).items():
            state[alias] = state[target]
        return state


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, *, step: int,
                    meta: dict[str, Any], optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, torch.Tensor] | None = None,
                    state: dict[str, torch.Tensor] | None = None) -> None:
    """Write model (+ optimiser, + `extra` tensors) state and `meta` (JSON-able) atomically to
    `path`; `state`: the model's weights when not its own state_dict (e.g. gathered shards)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, t in (state if state is not None else model.state_dict()).items():
        key = seen.get(t.data_ptr()) if t.numel() else None
        if key is not None and t.shape == tensors[f"model.{key}"].shape:
            aliases[name] = key  # tied weight: stored once
            continue
        seen[t.data_ptr()] = name
        tensors[f"model.{name}"] = t.detach().contiguous().cpu()
    for name, t in (extra or {}).items():
        tensors[f"extra.{name}"] = t.detach().contiguous().cpu()
    full = dict(meta, format=FORMAT, step=step, aliases=aliases)
    if optimizer is not None:
        sd = optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for pid, pstate in sd["state"].items():
            for key, value in pstate.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{pid}.{key}"] = value.detach().contiguous().cpu()
                else:
                    scalars.setdefault(str(pid), {})[key] = value
        full["optimizer"] = {"param_groups": sd["param_groups"], "scalars": scalars}
    full["checksum"] = checksum(tensors)
    text = json.dumps(full)
    try:
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"memattn": text}))
    except (OSError, SafetensorError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CheckpointError(f"checkpoint {path}: could not be written ({why}); the previous "
                              "checkpoint, if any, is kept") from None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint; a missing, corrupt or foreign file raises CheckpointError."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.safetensors"
    if not path.exists():
        raise CheckpointError(f"checkpoint: no such file {path}")
    meta, tensors = read_tagged(path, what="checkpoint", error=CheckpointError)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    verify(path, meta, tensors)
    return Checkpoint(path, meta, tensors)


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return f"blake2b:{h.hexdigest()}"


def verify(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """CheckpointError unless the checkpoint read from `path` is whole and usable: its step a
    number >= 0, its tensors those its checksum was made of (when it has one), every number
    finite, every alias naming a stored tensor."""
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint {path}: its step is {step!r}, expected a number of steps >= 0; "
                              "the file was altered after it was saved")
    if "checksum" in meta and meta["checksum"] != checksum(tensors):
        raise CheckpointError(f"checkpoint {path}: its tensors do not match the checksum saved with them; "
                              "the file was altered or damaged after it was saved (use an earlier copy, or "
                              "train it again)")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"checkpoint {path}: tensor {name} holds {bad:,} values that are not finite "
                                  "(NaN or infinity); a model with them computes nothing useful (use an earlier "
                                  "checkpoint, or train again with a lower train.lr)")
    aliases = meta.get("aliases", {})
    if not isinstance(aliases, dict) or any(f"model.{target}" not in tensors for target in aliases.values()):
        raise CheckpointError(f"checkpoint {path}: its tied-weight aliases name tensors it does not hold; "
                              "the file was altered after it was saved")


def restore(ckpt: Checkpoint, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load the model (and optimiser) state, with a clear error when they do not fit."""
    state = ckpt.model_state()
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and own[k].shape != state[k].shape]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}")
        if wrong:
            parts.extend(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                         for k in wrong[:5])
        raise CheckpointError(f"checkpoint {ckpt.path} does not fit this model: {'; '.join(parts)}")
    model.load_state_dict(state)
    if optimizer is None:
        return
    info = ckpt.meta.get("optimizer")
    if info is None:
        raise CheckpointError(f"checkpoint {ckpt.path}: holds no optimiser state to resume from")
    opt_state: dict[int, dict[str, Any]] = {}
    for key, t in ckpt.tensors.items():
        if key.startswith("optim."):
            _, pid, name = key.split(".", 2)
            opt_state.setdefault(int(pid), {})[name] = t
    for pid, values in info["scalars"].items():
        opt_state.setdefault(int(pid), {}).update(values)
    try:
        optimizer.load_state_dict({"state": opt_state, "param_groups": info["param_groups"]})
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {ckpt.path}: optimiser state does not fit ({e})") from None
