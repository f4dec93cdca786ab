"""What the benchmarks share: the run's metadata, the mechanisms to measure, the small models,
one guarded measurement, and the progress bar."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import yaml

import memattn
from research.bench.report import BASELINE, Row
from research.bench.settings import BenchSettings, LMShape
from research.bench.timing import ENV, failure, release
from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError
from memattn.layers.base import Mechanism, get_mechanism, mechanisms, parse_options


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_metadata(s: BenchSettings) -> dict[str, Any]:
    """Where and how a run measured: device, versions, threads, environment, command line."""
    gpu = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else None
    return {
        "command": s.command, "device": str(s.device), "dtype": s.dtype_name, "cpu": cpu_name(),
        "gpu": gpu, "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "cuda": torch.version.cuda if gpu else None,
        "memattn": memattn.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "env": {k: os.environ[k] for k in ENV if k in os.environ},
        "quick": s.quick, "repeats": s.repeats, "warmup": s.warmup,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass(frozen=True)
class Choice:
    """A mechanism to measure with its options, and its label in the tables."""

    label: str
    mechanism: Mechanism
    options: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.mechanism.name


def parse_choice(text: str) -> Choice:
    """'NAME' or 'NAME:OPTION=VALUE,OPTION=VALUE' (values read as YAML scalars), checked
    against the mechanism's options; ConfigError names what is wrong."""
    name, _, rest = text.partition(":")
    mech = get_mechanism(name)
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--attention: expected NAME or NAME:OPTION=VALUE,..., got {text!r}")
        options[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    parse_options(name, options)
    return Choice(choice_label(name, options), mech, options)


def choice_label(name: str, options: dict) -> str:
    """A row's name in tables: 'NAME OPTION=VALUE ...', as --attention NAME:OPTION=VALUE,... gives it."""
    return " ".join([name, *(f"{k}={v}" for k, v in options.items())])


def chosen_mechanisms(s: BenchSettings) -> list[Choice]:
    """What --attention names (every registered mechanism at its defaults when empty), with
    plain softmax first: the baseline always runs. A bad name or option raises ConfigError."""
    texts = list(s.attention) or list(mechanisms())
    choices = {c.label: c for c in map(parse_choice, texts)}
    baseline = choices.pop(BASELINE, None) or parse_choice(BASELINE)
    return [baseline, *choices.values()]


def model_config(name: str, options: dict, shape: LMShape, max_len: int) -> ModelConfig:
    return ModelConfig(vocab_size=shape.vocab_size, d_model=shape.d_model, n_layers=shape.n_layers,
                       n_heads=shape.n_heads, ff_mult=shape.ff_mult, max_len=max_len,
                       positions=shape.positions, attention=AttentionConfig(name, dict(options)))


def describe_lm(shape: LMShape) -> str:
    d = asdict(shape)
    return (f"{d['n_layers']} layers, d_model {d['d_model']}, {d['n_heads']} heads of "
            f"{d['d_model'] // d['n_heads']}, feed-forward {d['ff_mult']:g}·d, vocabulary "
            f"{d['vocab_size']}, {'rotary positions' if d['positions'] == 'rotary' else 'no positions'}")


def measure(row: Row, fn: Callable[[], dict[str, float]], s: BenchSettings,
            reraise: tuple[type[Exception], ...] = ()) -> Row:
    """Fill `row` with fn()'s metrics, or record its failure (oom / error) and go on; the
    exceptions of `reraise` are raised to the caller instead."""
    try:
        row.metrics.update(fn())
    except reraise:
        raise
    except Exception as e:  # noqa: BLE001  (one configuration's failure must not stop the run)
        row.status, row.reason = failure(e)
    finally:
        release(s.device)
    return row


class Progress:
    """One tqdm bar over every configuration of the run (silent when progress is off)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="config", dynamic_ncols=True, leave=True)

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description(what, refresh=True)

    def done(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

