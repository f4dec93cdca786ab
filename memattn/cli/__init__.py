"""The `memattn` command line: train, eval, translate, generate, info, demo, experiment, export-hf,
convert, compress, decompress, bench.

Every command that builds a run takes `--config PRESET_OR_YAML` and `key=value` overrides,
e.g. `memattn train --config demo model.n_layers=2 attention=softmax train.steps=100`.

One module a group of commands, each adding its subcommands (`add_commands`) next to their
code, over the option types and checks they share (`common`): `run` (train, eval, translate,
generate), `info`, `research` (demo, experiment), `huggingface` (export-hf, convert), `text`
(compress, decompress), `bench`. Heavy modules are imported inside the commands.
"""

from __future__ import annotations

import argparse
import os
import sys

from memattn.cli import bench, huggingface, info, research, run, text
from memattn.cli.common import ArgumentParser
from memattn.errors import MemattnError, UsageError

GROUPS = (run, info, research, huggingface, text, bench)  # in the order `memattn --help` lists them


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="memattn", description=(
        "Attention over a memory: train, evaluate and sample language models whose attention "
        "is any registered mechanism (see `memattn info`)."))
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error instead of its one line (also MEMATTN_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_commands(sub)
    for command in sub.choices.values():  # the global flag, also accepted after the command's name
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error instead of its one line")
    return p


def edge_message(e: BaseException) -> str | None:
    """The one line a command prints for an error that reached its edge: what memattn raises on
    purpose, and what the file system, safetensors, JSON and text decoding, torch.distributed
    and the allocator raise (naming the file or option and what to do); None for anything else
    (a bug: its traceback is shown)."""
    import json as _json

    from safetensors import SafetensorError

    from memattn.fileio import describe_os_error

    if isinstance(e, MemattnError):
        return str(e)
    if isinstance(e, OSError):
        return describe_os_error(e)
    if isinstance(e, SafetensorError):
        return f"a safetensors file could not be read or written ({e}); check the file and the disk"
    if isinstance(e, _json.JSONDecodeError):
        return (f"a file is not valid JSON ({e}; near {e.doc[max(0, e.pos - 20):e.pos + 20]!r}); it was cut "
                "short or edited: restore or remove it")
    if isinstance(e, UnicodeDecodeError):
        return (f"a file is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8, "
                "e.g. iconv -f latin1 -t utf-8")
    import torch

    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return (f"torch.distributed: {e}; check that every process of the run is alive and can reach "
                "the others (torchrun's MASTER_ADDR / MASTER_PORT)")
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))):
        return (f"not enough memory ({e or type(e).__name__}); use smaller sizes (model, --batch-size, "
                "context) or a machine with more memory")
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit status. A bad command line or input, a full or
    read-only disk, a broken file: one line on stderr and status 2 (--debug or MEMATTN_DEBUG=1:
    the traceback instead)."""
    import shlex

    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("MEMATTN_DEBUG", "") not in ("", "0")
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # key=value overrides may also come after the flags (`experiment NAME --quick steps=10`)
        if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except UsageError as e:
        if debug:
            raise
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return 2
    args.command_line = shlex.join(["memattn", *argv])
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print(f"memattn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`memattn info | head -2`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 141
    except Exception as e:  # noqa: BLE001 (the command's edge: one line, or the traceback)
        message = edge_message(e)
        if message is None or debug:
            raise
        print(f"memattn {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2

