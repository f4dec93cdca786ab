"""Atomic file writes: nothing half-written is ever left under the final name."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable


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
