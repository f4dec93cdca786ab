"""Files: atomic writes of files and folders (nothing half-written is ever left under the
final name), locks on outputs (a second writer is refused), the checks of a command's outputs
(never one of its inputs), failures of the file system in one sentence, and the safetensors
files memattn tags with a JSON header."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call write(tmp) on a temporary file beside `path`, fsync it, then rename it over `path`.

    A crash at any point leaves either the old file or the new one, and no temporary. A failure
    of the file system (a full or read-only disk, a folder in the way, ...) raises OSError naming
    `path` itself, never the temporary; a folder at `path` is refused before anything is written.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder; give the path of a file to write", str(path))
    tmp = None
    try:
        with os_errors_naming(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            tmp = Path(name)
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes files readable by their owner only
            os.replace(tmp, path)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """`text` written to `path` as UTF-8, atomically (`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


@contextlib.contextmanager
def os_errors_naming(path: str | os.PathLike) -> Iterator[None]:
    """Within: a failure of the file system while writing `path` (through a temporary beside
    it, file or folder) raises OSError naming `path` itself (`as_os_error`); any other error
    passes as it is."""
    try:
        yield
    except Exception as e:
        error = as_os_error(e, path)
        if error is None:
            raise
        raise error from e


def as_os_error(e: BaseException, path: str | os.PathLike) -> OSError | None:
    """The failure `e` of writing `path` as an OSError naming `path` (not a temporary beside
    it): an OSError, or a safetensors error that wraps one (its errno read from the message);
    None for anything else."""
    if isinstance(e, OSError):
        if e.errno is None:
            return None if e.filename is not None else OSError(errno.EIO, str(e), str(path))
        return type(e)(e.errno, e.strerror or os.strerror(e.errno), str(path))
    from safetensors import SafetensorError

    if isinstance(e, SafetensorError):
        found = re.search(r"(?:code: |os error )(\d+)", str(e))
        code = int(found.group(1)) if found else errno.EIO
        return OSError(code, os.strerror(code) if found else str(e), str(path))
    return None


def describe_os_error(e: OSError) -> str:
    """One sentence for a failure of the file system: the file, what happened, what to do."""
    where = f"{e.filename}: " if e.filename is not None else ""
    if e.filename2 is not None:
        where = f"{e.filename} -> {e.filename2}: "
    what = e.strerror or str(e)
    advice = {
        errno.ENOSPC: "free some space on that disk or write somewhere else",
        errno.EDQUOT: "free some space (a disk quota is reached) or write somewhere else",
        errno.EROFS: "write somewhere else",
        errno.EACCES: "check its permissions or write somewhere else",
        errno.EPERM: "check its permissions or write somewhere else",
        errno.EISDIR: "give the path of a file, not of a folder",
        errno.ENOTDIR: "a part of that path is a file, not a folder; give another path",
        errno.ENOENT: "check the path (a folder on the way may be missing or not creatable there)",
        errno.EEXIST: "something is in the way; move it or choose another path",
        errno.ENOTEMPTY: "the folder is not empty; move it or choose another path",
        errno.EMFILE: "too many open files; raise the limit (ulimit -n)",
        errno.EIO: "the device reports an error; check the disk",
    }.get(e.errno or 0, "check the path and the disk")
    return f"{where}{what}; {advice}"


def check_writable(folder: str | os.PathLike) -> None:
    """Make `folder` (and its parents) and write a temporary file in it: a folder that cannot
    be written (read-only, full, not a folder) raises OSError now, before any long work."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder) as f:
        f.write(b"0")
        f.flush()


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporaries `atomic_write` left in `folder` when its process was killed
    mid-write (`.NAME.*.tmp`); only for a caller that holds the folder (e.g. its lock), so no
    write is under way there. Returns what was removed."""
    removed = []
    for tmp in Path(folder).glob(".*.tmp"):
        if tmp.is_file():
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether paths `a` and `b` name one file (after links and `..`), existing or not."""
    a, b = Path(a), Path(b)
    with contextlib.suppress(OSError):
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def check_not_an_input(out: str | os.PathLike, inputs: dict[str, str | os.PathLike | None],
                       option: str, error: type[Exception]) -> None:
    """Raise `error` when the output `out` (given by `option`) is one of the files the command
    reads, `inputs` (what names each -> its path; a run folder stands for its checkpoint):
    no command writes over what it reads."""
    for what, path in inputs.items():
        if path is None:
            continue
        path = Path(path)
        reads = [path] if not path.is_dir() else [path, path / "checkpoint.safetensors"]
        if any(same_file(out, p) for p in reads):
            raise error(f"{option}: {out} is {what} this command reads; write the output somewhere else")


@contextlib.contextmanager
def output_lock(path: str | os.PathLike, option: str, error: type[Exception]) -> Iterator[None]:
    """Hold an exclusive lock on the output `path` (a file or folder, given by `option`) while
    a command writes it: a second memattn process writing the same output is refused with
    `error` naming the process that holds it. The lock is a file beside `path`
    (`.NAME.lock`), removed when released."""
    import fcntl
    import socket

    path = Path(path)
    lock = path.parent / f".{path.name}.lock"
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(lock, "a+")
        except OSError as e:  # where the lock cannot be made, the output cannot be written: say so of it
            raise type(e)(e.errno, e.strerror, str(path)) from e
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise error(f"{option}: {path} is being written by {holder}; wait for it to finish or "
                        "choose another output") from None
        try:  # the lock file may have been removed by its last holder after we opened it
            current = os.stat(lock)
        except FileNotFoundError:
            current = None
        if current is not None and current.st_ino == os.fstat(f.fileno()).st_ino:
            break
        f.close()
    try:
        with contextlib.suppress(OSError):  # who holds it, for the message of the refused (a full disk: unsaid)
            f.seek(0)
            f.truncate()
            os.write(f.fileno(), f"memattn process {os.getpid()} on {socket.gethostname()}\n".encode())  # unbuffered
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        f.close()


@contextlib.contextmanager
def atomic_folder(out: str | os.PathLike) -> Iterator[Path]:
    """A new folder of the same name as `out`, inside a temporary folder beside it, to write
    into; moved to `out` (which must be missing or empty) when the block ends without error,
    removed when it fails: `out` is either left as it was or holds everything the block wrote.
    A failure of the file system raises OSError naming `out`."""
    out = Path(out)
    holder = None
    try:
        with os_errors_naming(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            holder = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
            work = holder / out.name
            work.mkdir()
            yield work
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            os.rename(work, out)
    finally:
        if holder is not None:
            shutil.rmtree(holder, ignore_errors=True)


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
