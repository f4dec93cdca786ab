"""What the commands share: option types and the argument parser, the config of a run, checks
of a device, of memory and of the files a command reads and writes, a progress bar."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from memattn.errors import ConfigError, MemattnError, UsageError

OVERRIDES_HELP = ("key=value overrides of the config, checked against its fields: "
                  "model.* data.* train.*, and attention=NAME / attention.OPTION=VALUE "
                  "for the mechanism (e.g. model.d_model=128 train.steps=200 attention=softmax)")


# ---------------------------------------------------------------------------------------
# Numeric options: each range is checked once, by its argparse type


def int_at_least(least: int, what: str = "a number", note: str = ""):
    """An argparse type: an integer >= `least`, else a one-line error naming the option
    ("--batch-size: expected a number >= 1, got 0"). `what` names the quantity, `note` follows
    the bound (e.g. " (0: all)")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected {what} >= {least}{note}, got {text}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


def float_at_least(least: float, what: str = "a finite number", note: str = ""):
    """An argparse type: a finite float >= `least`, else a one-line error naming the option."""
    import math

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < least:
            raise argparse.ArgumentTypeError(f"expected {what} >= {least:g}{note}, got {text}")
        return value

    parse.__name__ = f"number >= {least:g}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line raised as UsageError (main prints it and returns 2),
    never a usage block and sys.exit in the middle of a caller's process."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)", prog=self.prog)


# ---------------------------------------------------------------------------------------
# The run a command builds or reads


def with_config(sp, default: str = "demo") -> None:
    """The `--config PRESET_OR_YAML` option and the `key=value` overrides of a command."""
    sp.add_argument("--config", default=default,
                    help=f"preset name in configs/ or a YAML file (default: {default})")
    sp.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def run_config(args):
    """The RunConfig of `--config` and its overrides."""
    from memattn.config import load_config

    return load_config(args.config, args.overrides)


def non_decoding_run(model, cfg) -> str | None:
    """None when the run's model continues a text with a decoding state (its task generates,
    and the model is memattn's own, with a cache); else what a refusal calls the run
    ("a mlm run", "a lm run of a converted model")."""
    from memattn.tasks import task_class

    generates = task_class(cfg.task).generates
    if generates and hasattr(model, "init_cache"):
        return None
    return f"a {cfg.task} run" + (" of a converted model" if generates else "")


# ---------------------------------------------------------------------------------------
# The machine: device and memory


def check_device(name: str) -> None:
    """ConfigError for a device torch cannot use here (e.g. cuda without a GPU)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device: {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device: {name!r} asked for, but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device: {name!r} asked for, but this machine has {torch.cuda.device_count()} "
                          "CUDA device(s), numbered from 0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device: {name!r} asked for, but no Apple GPU (mps) is available")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device: {name!r} is a torch device that memattn does not run on "
                          "(it holds no data or is not supported); use cpu or cuda")


def available_memory() -> int | None:
    """Bytes of memory this process may still take: the system's available memory, and its
    control group's limit where there is one; None when neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits_in_memory(build, what: str) -> None:
    """ConfigError when the model build() makes would not fit in the memory available: it is
    built on the meta device first (shapes, no data), so a size that cannot be held is refused
    before anything is allocated."""
    import torch

    try:
        with torch.device("meta"):
            model = build()
    except MemattnError:
        raise
    except Exception:  # noqa: BLE001 (a model that cannot be sized this way is built for real)
        return
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(t.numel() * t.element_size() for t in tensors)
    have = available_memory()
    if have is not None and need > have:
        params = sum(p.numel() for p in model.parameters())
        raise ConfigError(f"{what}: the model asked for has {params:,} parameters, {need / 2**30:,.1f} GiB, more "
                          f"than the {have / 2**30:,.1f} GiB of memory available here; choose smaller sizes "
                          "(model.d_model, model.n_layers, attention options)")


# ---------------------------------------------------------------------------------------
# Files a command reads and writes


def read_text_input(path: str | os.PathLike, option: str) -> str:
    """The UTF-8 text of the input file `path` (given by `option`), or ConfigError naming it."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{option}: no such file {path}")
    if not path.is_file():
        raise ConfigError(f"{option}: {path} is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{option}: {path} is not UTF-8 text (byte {e.start} cannot be read); convert it "
                          "to UTF-8, e.g. iconv -f latin1 -t utf-8") from None


@contextlib.contextmanager
def output_file(path: str | os.PathLike | None, option: str, reads: dict):
    """Checks and holds the output file `path` of a command (given by `option`) while the block
    writes it: not a file the command reads (`reads`: what names each -> its path), not a
    folder, its folder made now (so a path that cannot be written fails before any work), and
    no other memattn process writing it at the same time. Yields the Path (None: no output
    file, e.g. standard output)."""
    from memattn.fileio import check_not_an_input, output_lock

    if path is None:
        yield None
        return
    out = Path(path)
    check_not_an_input(out, reads, option, ConfigError)
    if out.is_dir():
        raise ConfigError(f"{option}: {out} is a folder; give the path of a file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, option, ConfigError):
        yield out


def new_folder(path: str, reads: dict | None = None) -> Path:
    """The `-o` folder of a command that writes a model: new or empty, not a file, not what
    the command reads (`reads`: what names each -> its path), else ConfigError."""
    from memattn.fileio import check_not_an_input

    out = Path(path)
    check_not_an_input(out, reads or {}, "-o", ConfigError)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"-o: {out} is a file; give a new (or empty) folder")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"-o: {out} is not empty; choose a new folder")
    return out


@contextlib.contextmanager
def new_output_folder(path: str, reads: dict | None = None):
    """Write the `-o` folder `path` of a command: checked (`new_folder`), held against other
    memattn processes writing it at the same time (the second is refused), and written whole
    or not at all (`memattn.fileio.atomic_folder`). Yields the folder to write into."""
    from memattn.fileio import atomic_folder, output_lock

    out = new_folder(path, reads)
    with output_lock(out, "-o", ConfigError):
        new_folder(path, reads)  # again, now that no other memattn process can write it
        with atomic_folder(out) as work:
            yield work


# ---------------------------------------------------------------------------------------
# Progress


@contextlib.contextmanager
def progress_bar(label: str, unit: str, *, quiet: bool = False, delay: float = 2, unit_scale: bool = False):
    """A progress callback (done, total) that shows a bar with the time left on stderr once a
    job has run for `delay` seconds (none with `quiet`); the bar is closed when the block ends."""
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if quiet:
            return
        if bar is None:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc=label, unit=unit, unit_scale=unit_scale, delay=delay, dynamic_ncols=True)
        bar.update(done - bar.n)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()


def research():
    """The research harness beside memattn in a clone of its repository (research/: the
    experiments, the benchmark drivers), made importable; ConfigError where this memattn is
    installed without one."""
    import importlib

    import memattn

    root = Path(memattn.__file__).resolve().parent.parent
    if (root / "research" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module("research")
    except ModuleNotFoundError:
        raise ConfigError("the experiments and benchmark drivers run from a clone of memattn's repository "
                          "(research/ beside memattn/); this installation has none") from None
