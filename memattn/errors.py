"""Errors that speak to the user: each names the argument, what was expected and what came."""

from __future__ import annotations

import torch


class MemattnError(Exception):
    """Base class of the errors memattn raises on purpose."""


class ConfigError(MemattnError, ValueError):
    """A configuration key or value that cannot be used."""


class UsageError(ConfigError):
    """A command line that cannot be parsed: an unknown option, a missing argument, a number
    out of its range. `prog` is the command it concerns (e.g. "memattn eval")."""

    def __init__(self, message: str, prog: str = "memattn") -> None:
        super().__init__(message)
        self.prog = prog


class ShapeError(MemattnError, ValueError):
    """A tensor with the wrong rank, shape or dtype."""


class CheckpointError(MemattnError, ValueError):
    """A checkpoint that is missing, corrupt or does not fit the model."""


class TrainingError(MemattnError, RuntimeError):
    """Training that cannot go on (e.g. a loss that is no longer finite)."""


def check_tensor(name: str, t: torch.Tensor, shape: str, *sizes: int | None) -> None:
    """Raise ShapeError unless `t` has len(sizes) dims matching `sizes` (None = any).

    `shape` is the expected layout in words, e.g. "[B, T, H, K]", quoted in the message.
    """
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name}: expected a tensor {shape}, got {type(t).__name__}")
    if t.dim() != len(sizes):
        raise ShapeError(f"{name}: expected {len(sizes)} dims {shape}, got shape {tuple(t.shape)}")
    for i, (want, got) in enumerate(zip(sizes, t.shape)):
        if want is not None and want != got:
            raise ShapeError(
                f"{name}: expected {shape} with dim {i} = {want}, got shape {tuple(t.shape)}"
            )


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise ShapeError unless `t` holds floating-point numbers."""
    if not t.is_floating_point():
        raise ShapeError(f"{name}: expected a floating point tensor, got dtype {t.dtype}")


def check_devices(q: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise ShapeError naming the first of `others` (name=tensor, None skipped) that is not on
    q's device: an op computes where its query is, and a tensor elsewhere is a caller's slip."""
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ShapeError(f"{name}: expected a tensor on q's device ({q.device}), got one on {t.device}")

