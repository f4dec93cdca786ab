"""Peer libraries measured beside memattn where installed: flash-linear-attention's ABC op.

Every import is guarded: a missing peer, or a device it does not support, gives a reason
that the results record as a skipped row.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

FLA_ABC = "chunk_abc (fla)"


def fla_chunk_abc(device: torch.device) -> tuple[Callable | None, str]:
    """(op(q, k, v, s) -> o [B, T, H, V] for q, k, v [B, T, H, D], s [B, T, H, M], "") where
    flash-linear-attention is installed and runs on `device`; else (None, the reason)."""
    if device.type != "cuda":
        return None, (f"flash-linear-attention's `fla.ops.abc.chunk_abc` is a Triton kernel for "
                      f"CUDA; this run is on {device.type}")
    try:
        from fla.ops.abc import chunk_abc
    except Exception as e:  # noqa: BLE001  (ImportError, or a failing import inside fla)
        return None, f"flash-linear-attention is not installed (`import fla.ops.abc` failed: {e})"
    kwargs = {"head_first": False} if "head_first" in inspect.signature(chunk_abc).parameters else {}

    def op(q, k, v, s):
        return chunk_abc(q, k, v, s, **kwargs)[0]

    return op, ""
