"""What a benchmark run measures: the device, dtype and mechanisms, and the sizes of each
benchmark (typed dataclasses with presets per device and for --quick, then `key=value`
overrides such as `decode.contexts=[256,1024] lm.d_model=64`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch

from memattn.errors import ConfigError
from memattn.typed import parse_settings

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_positive(owner: str, obj) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        values = value if isinstance(value, tuple) else (value,)
        if isinstance(value, tuple) and not value:
            raise ConfigError(f"{owner}.{f.name}: expected at least one value, got []")
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 for v in values):
            raise ConfigError(f"{owner}.{f.name}: expected positive values, got {value!r}")


def _check_heads(owner: str, d_model: int, n_heads: int) -> None:
    if d_model % n_heads or (d_model // n_heads) % 2:
        raise ConfigError(f"{owner}.d_model: expected a multiple of {owner}.n_heads={n_heads} "
                          f"with an even head dim (rotary positions), got {d_model}")


@dataclass
class LMShape:
    """The small causal LM of the decode and train benchmarks (tied embeddings)."""

    section: ClassVar[str] = "lm"  # the overrides' prefix, named in errors
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ff_mult: float = 4.0
    vocab_size: int = 256
    # rotary: rotated q / k in every layer (memattn's default); none: no positions, the
    # like-for-like setting for peers, whose layers apply none
    positions: Literal["rotary", "none"] = "rotary"

    def __post_init__(self) -> None:
        _check_positive(self.section, self)
        _check_heads(self.section, self.d_model, self.n_heads)


@dataclass
class DecodeSizes:
    contexts: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    batch: int = 4
    steps: int = 32  # timed greedy steps at each context, after --warmup untimed ones
    prefill_chunk: int = 1024  # the context is read through the cache this many tokens at a time
    # decode every model's one-token steps through torch.compile (memattn.generate.decoding_step),
    # compiled in COMPILE_WARMUP untimed steps before the first context's
    compile: bool = False

    def __post_init__(self) -> None:
        _check_positive("decode", self)


@dataclass
class EncodeSizes(LMShape):
    """The bidirectional encoder's shape (the fields of LMShape) and what it encodes: a batch
    of `batch` sequences of `length` tokens."""

    section: ClassVar[str] = "encode"
    d_model: int = 256
    n_layers: int = 4
    batch: int = 16
    length: int = 512
    # the sizes of each mechanism's memory (its `state_size` option; ABC's Table 6: 64 and 128 slots)
    slots: tuple[int, ...] = (64, 128)


@dataclass
class TrainSizes:
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    tokens: int = 4096  # tokens a batch: batch = max(1, tokens // length)
    slots: int = 64  # M of the ABC op compared with its peer

    def __post_init__(self) -> None:
        _check_positive("train", self)


@dataclass
class LookupSizes:
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    key_dim: int = 128  # k: the size of a stored state (C is k×k)
    queries: int = 128  # queries a document, answered in one call
    documents: int = 1

    def __post_init__(self) -> None:
        _check_positive("lookup", self)


@dataclass
class Sizes:
    lm: LMShape = field(default_factory=LMShape)
    decode: DecodeSizes = field(default_factory=DecodeSizes)
    encode: EncodeSizes = field(default_factory=EncodeSizes)
    train: TrainSizes = field(default_factory=TrainSizes)
    lookup: LookupSizes = field(default_factory=LookupSizes)


PRESETS: dict[str, dict[str, dict]] = {
    "cpu": {},  # the dataclass defaults: sized for a 2-core CPU
    "cuda": {
        "lm": {"d_model": 512, "n_layers": 6, "n_heads": 8},
        "decode": {"batch": 16, "steps": 64, "prefill_chunk": 2048},
        "encode": {"d_model": 768, "n_layers": 12, "n_heads": 12},
        "train": {"lengths": (512, 1024, 2048, 4096, 8192, 16384), "tokens": 32768},
        "lookup": {"documents": 16},
    },
    "quick": {
        "lm": {"d_model": 64, "n_layers": 2, "n_heads": 4},
        "decode": {"contexts": (128, 512), "batch": 2, "steps": 4, "prefill_chunk": 512},
        "encode": {"batch": 4, "length": 128, "d_model": 64, "n_layers": 2, "n_heads": 4},
        "train": {"lengths": (128, 512), "tokens": 1024},
        "lookup": {"lengths": (256, 1024, 4096), "key_dim": 64, "queries": 32},
    },
}


def sizes_for(device: torch.device, *, quick: bool, overrides: list[str] = ()) -> Sizes:
    """The preset for the device (or --quick), then `section.field=value` overrides."""
    return parse_settings(Sizes, overrides, PRESETS["quick" if quick else device.type], name="sizes")


@dataclass
class BenchSettings:
    """One `memattn bench` run."""

    device: torch.device
    dtype: torch.dtype
    sizes: Sizes
    out_dir: Path
    command: str
    quick: bool = False
    attention: tuple[str, ...] = ()  # empty: every registered mechanism
    repeats: int = 5
    warmup: int = 1
    progress: bool = True

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)


def parse_device(text: str) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N', checked against what this machine has."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise ConfigError(f"--device: expected cpu, cuda or cuda:N, got {text!r}")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device: {text} was asked for, but this machine has no CUDA GPU "
                              f"that torch {torch.__version__} can use")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device: {text} was asked for, but there are "
                              f"{torch.cuda.device_count()} CUDA devices")
    return device


def device_slug(device: torch.device) -> str:
    """'cpu', or the CUDA device's name in lower case with dashes (e.g. nvidia-h100-80gb-hbm3)."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
