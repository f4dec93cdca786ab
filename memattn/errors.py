"""Errors that speak to the user: each names the argument, what was expected and what came."""

from __future__ import annotations

import torch


class MemattnError(Exception):
    """Base class of the errors memattn raises on purpose."""


class ConfigError(MemattnError, ValueError):
    """A configuration key or value that cannot be used."""


class ShapeError(MemattnError, ValueError):
    """A tensor with the wrong rank, shape or dtype."""


class CheckpointError(MemattnError, ValueError):
    """A checkpoint that is missing, corrupt or does not fit the model."""


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
