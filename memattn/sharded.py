"""Fully sharded data parallel training (`train.parallel=fsdp` under torchrun): each rank
holds a shard of every parameter, gradient and optimiser state (`torch.distributed.fsdp.
fully_shard`, one group per block and one for the rest), so a model too large for one
device trains on several.

Checkpoints are sharded: every rank writes its shards of the model and optimiser with
`torch.distributed.checkpoint` into `checkpoint.dcp.<step>/` of the run folder, which a
resumed run reads back, on the same number of ranks or another. Rank 0 then writes the
run's usual `checkpoint.safetensors` with the full weights (gathered into host memory) and
the run's metadata, naming the sharded folder of the same step: that file is what `eval`,
`generate` and `export-hf` read, and writing it last makes the pair atomic — a run stopped
between the two resumes from the previous step's pair, whose folder is kept until then.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memattn.errors import CheckpointError

SHARDED_KEY = "sharded"  # the checkpoint metadata entry naming the sharded folder


def shard(model: nn.Module) -> nn.Module:
    """fully_shard every block (memattn's `Block`, a transformers decoder / encoder layer),
    then the model itself (embeddings, norms, head); in place, returns the model. The mesh
    spans every rank on the model's device type (fully_shard's default takes CUDA whenever
    there is a GPU, and a CPU run with more ranks than GPUs then fails)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memattn.models.lm import Block

    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, Block) or name.endswith(("DecoderLayer", "EncoderLayer")) or name == "GPT2Block":
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank: the full weights gathered into rank 0's host memory (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_shards(out: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                main: bool) -> str:
    """Every rank: write this rank's shards of model and optimiser to out/checkpoint.dcp.<step>;
    returns that folder's name (for the checkpoint's metadata)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = f"checkpoint.dcp.{step}"
    folder = out / name
    if main and folder.exists():  # a partial folder of a run stopped while writing it
        shutil.rmtree(folder)
    torch.distributed.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    return name


def drop_old_shards(out: Path, keep: str) -> None:
    """Rank 0, once the checkpoint names `keep`: remove every other sharded folder."""
    for folder in out.glob("checkpoint.dcp.*"):
        if folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)


def load_shards(out: Path, meta: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: the model and optimiser state of the sharded folder the checkpoint names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    name = meta.get(SHARDED_KEY)
    if name is None:
        raise CheckpointError(f"--resume: the checkpoint in {out} was not written by a sharded run "
                              "(train.parallel=fsdp under torchrun); resume it the way it was trained")
    folder = out / name
    if not folder.is_dir():
        raise CheckpointError(f"--resume: {folder}, the sharded state the checkpoint names, is missing")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
