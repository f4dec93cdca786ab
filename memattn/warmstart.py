"""Starting a model from another model's weights (`train.init_from=PATH`): a memattn run or
checkpoint, or a Hugging Face folder written by `memattn export-hf`.

Every tensor whose name and shape the two models share is copied; the rest of the new model
keeps its initialisation. Since every attention layer holds the same q/k/v and output
projections (`AttentionLayer`), a model of one mechanism starts from another's: a softmax
model warm-starts ABC_MLP with its projections, embeddings, norms and feed-forward layers
copied and only the mechanism's own parameters (φ, persistent vectors, ...) new — the
papers' warm-start setting. What cannot be copied outside the attention layers (a different
width, depth or vocabulary) is refused, as is any shared tensor of another shape, but for one
kind: a model that reads longer sequences (a larger model.max_len) starts from a shorter one
by growing its absolute position tables (`grown_position_table`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from memattn.checkpoint import CheckpointError, load_checkpoint

HF_PREFIX = "model.net."
HF_VOCAB = "memattn_vocab.json"


@dataclass
class Source:
    """Weights to start from, named as in memattn's models, and the vocabulary they read."""

    path: Path
    weights: dict[str, torch.Tensor]
    vocab: dict | None
    model: dict | None = None  # its memattn model config, as a mapping
    # a transformers model converted by `memattn convert`: the run trains that model itself
    # (built from the folder), read with its tokenizer
    converted: bool = False
    frozen: nn.Module | None = field(default=None, repr=False)  # teacher_model's, built once




# The config key under which `memattn convert` records a conversion (here, not in
# memattn.integrations.convert, so that telling a converted folder needs no transformers).
CONVERSION_KEY = "memattn_conversion"


def is_converted(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder saved by `memattn convert` (its config records the conversion)."""
    config = Path(path) / "config.json"
    return config.is_file() and CONVERSION_KEY in json.loads(config.read_text())


def read_source(path: str | os.PathLike) -> Source:
    """The weights (and vocabulary) of a memattn run folder / checkpoint or an export-hf folder."""
    path = Path(path)
    config = path / "config.json"
    if is_converted(path):
        record = json.loads(config.read_text())[CONVERSION_KEY]
        family = json.loads(config.read_text()).get("model_type", "")
        bidirectional = (record.get("causal") is False if isinstance(record, dict) and "causal" in record
                         else family.removeprefix("memattn-") in ("bert", "roberta"))
        if bidirectional:
            raise CheckpointError(f"train.init_from: {path} converts a bidirectional encoder ({family}): every "
                                  "token of its layers sees the tokens after it, so as a causal LM it would "
                                  "learn to read the next token; convert a decoder (Llama, Mistral, Qwen2/3, "
                                  "GPT-2) to train a causal LM")
        return Source(path, {}, None, None, converted=True)
    if path.is_dir() and config.exists() and (path / "model.safetensors").exists():
        from safetensors.torch import load_file

        if json.loads(config.read_text()).get("model_type") != "memattn":
            raise CheckpointError(f"train.init_from: {path} is a Hugging Face folder of another model type; "
                                  "convert it first (memattn convert), then train the converted folder")
        weights = {k[len(HF_PREFIX):]: t for k, t in load_file(path / "model.safetensors").items()
                   if k.startswith(HF_PREFIX)}
        vocab_file = path / HF_VOCAB
        meta = json.loads(config.read_text())
        return Source(path, weights, json.loads(vocab_file.read_text()) if vocab_file.exists() else None,
                      meta.get("memattn"))
    ckpt = load_checkpoint(path)
    return Source(ckpt.path, ckpt.model_state(), ckpt.meta.get("vocab"),
                  (ckpt.meta.get("config") or {}).get("model"))


def teacher_model(source: Source, option: str = "train.distill_weight") -> nn.Module:
    """The source as a frozen CausalLM in eval mode (the teacher of a distillation term, the
    softmax model of attention transfer: `option`, which errors name), built once a source:
    both read the same model."""
    from memattn.config import ModelConfig, from_dict
    from memattn.models import CausalLM

    if source.frozen is not None:
        return source.frozen
    if source.converted:
        source.frozen = converted_teacher(source, option)
        return source.frozen
    if not isinstance(source.model, dict):
        raise CheckpointError(f"{option}: {source.path} records no memattn model config to "
                              "rebuild the teacher from")
    teacher = CausalLM(from_dict(ModelConfig, source.model, "model"))
    teacher.load_state_dict(warm_start_weights(teacher, source))
    source.frozen = teacher.eval().requires_grad_(False)
    return source.frozen


def converted_teacher(source: Source, option: str = "train.distill_weight") -> nn.Module:
    """The transformers model a converted folder was made from (the conversion records its
    name or folder), frozen, as a teacher."""
    from transformers import AutoModelForCausalLM

    from memattn.integrations.convert import CONFIG_KEY, ConvertedLM

    original = json.loads((source.path / "config.json").read_text())[CONFIG_KEY].get("source")
    if not original:
        raise CheckpointError(f"{option}: {source.path} does not record the model it was "
                              "converted from (convert a saved or hub model with memattn convert)")
    try:
        model = AutoModelForCausalLM.from_pretrained(original)
    except OSError as e:
        raise CheckpointError(f"{option}: the teacher {original}, which {source.path} was "
                              f"converted from, cannot be loaded ({e})") from None
    return ConvertedLM(model).eval().requires_grad_(False)


def warm_start_weights(model: nn.Module, source: Source) -> dict[str, torch.Tensor]:
    """The source's weights keyed as `model` holds them: a tensor the model ties under several
    names (a head and the embedding), saved once, is given under each."""
    weights = dict(source.weights)
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():
        saved = next((n for n in names if n in weights), None)
        for n in names if saved else ():
            weights.setdefault(n, weights[saved])
    return weights


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) per token, averaged: Σ_v p_t(v) (log p_t(v) − log p_s(v)), in fp32."""
    student = torch.log_softmax(logits.float(), -1).flatten(0, -2)
    teacher = torch.log_softmax(teacher_logits.float(), -1).flatten(0, -2)
    return torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")


def grown_position_table(own: torch.Tensor, shorter: torch.Tensor, blocks: bool) -> torch.Tensor:
    """A position table own [N, d] started from a shorter one's rows shorter [n, d], n < N: its
    first n rows are the shorter's; the rows past them are, for a split table's blocks (q of
    p = 512·q + r: `blocks`), copies of the shorter's last block, so that each new block of
    positions reads as the one trained, and otherwise (one row a position, none trained that
    far) `own`'s as initialised."""
    grown = own.clone()
    grown[: len(shorter)] = shorter
    if blocks:
        grown[len(shorter):] = shorter[-1]
    return grown


def warm_start(model: nn.Module, source: Source) -> dict[str, list[str]]:
    """Copy into `model` every tensor of `source` it shares by name and shape; returns the names
    {"copied", "new" (kept as initialised), "dropped" (in the source only), "grown" (position
    tables of the source with fewer rows, grown by `grown_position_table`; among "copied")}.

    CheckpointError when a shared name has another shape (but for a longer position table of
    the same width), or when a tensor outside the attention layers (`.attn.`) is missing from
    the source: the trunk must be the same.
    """
    from memattn.models.lm import position_tables

    own = model.state_dict()
    weights = warm_start_weights(model, source)
    tables = position_tables(model)
    grown = sorted(k for k in tables
                   if k in weights and weights[k].shape[1:] == own[k].shape[1:] and len(weights[k]) < len(own[k]))
    for k in grown:
        weights[k] = grown_position_table(own[k], weights[k], tables[k])
    wrong = [f"{k}: {tuple(weights[k].shape)} in the source, {tuple(t.shape)} here"
             for k, t in own.items() if k in weights and weights[k].shape != t.shape]
    if wrong:
        raise CheckpointError(f"train.init_from: {source.path} does not fit this model: {'; '.join(wrong[:4])}")
    trunk = sorted(k for k in own if k not in weights and ".attn." not in k)
    if trunk:
        raise CheckpointError(f"train.init_from: {source.path} lacks {', '.join(trunk[:5])} outside the "
                              "attention layers; only a model of the same width, depth, vocabulary and "
                              "positions can start this one")
    copied = sorted(k for k in own if k in weights)
    model.load_state_dict({k: weights[k] for k in copied}, strict=False)
    return {"copied": copied, "new": sorted(k for k in own if k not in weights),
            "dropped": sorted(k for k in weights if k not in own), "grown": grown}
