"""Files: atomic writes (nothing half-written is ever left under the final name) and the
safetensors files memattn tags with a JSON header."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call write(tmp) on a temporary file beside `path`, fsync it, then rename it over `path`.

    A crash at any point leaves either the old file or the new one, and no temporary.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes files readable by their owner only
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def read_tagged(path: str | os.PathLike, *, what: str,
                error: type[Exception]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON metadata, tensors) of a safetensors file memattn wrote with a "memattn" header.

    `what` names the kind of file in messages ("checkpoint", "compressed file", ...). A file
    that cannot be read, has no memattn header or whose header is not a JSON object raises
    `error` naming the path.
    """
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise error(f"{what} {path}: not a readable safetensors file; truncated or not written "
                    f"by memattn ({e})") from None
    if "memattn" not in header:
        raise error(f"{what} {path}: a safetensors file, but not a memattn {what}")
    try:
        meta = json.loads(header["memattn"])
    except json.JSONDecodeError as e:
        raise error(f"{what} {path}: metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise error(f"{what} {path}: metadata is not a JSON object")
    return meta, tensors
