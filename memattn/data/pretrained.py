"""A pretrained tokenizer as the vocabulary: the tokens of an existing model (GPT-2, Llama,
...) instead of characters, bytes or a BPE vocabulary trained on the corpus.

    vocab = PretrainedVocab.load("path/to/folder")   # its tokenizer.json
    vocab = PretrainedVocab.load("gpt2")             # transformers: local cache, else the hub
    ids = vocab.encode("To be, or not to be")        # 1-D array of vocab.dtype, no BOS / EOS
    vocab.decode(ids)                                # 'To be, or not to be'
    Vocab.from_json(vocab.to_json()) == vocab        # the whole tokenizer is saved: offline

Loading: a folder holding `tokenizer.json` is read with `tokenizers` alone. Anything else
(a hub name, a folder of another tokenizer format) goes through
`transformers.AutoTokenizer.from_pretrained`, from local files first
(`local_files_only=True`), then from the network; it must give a fast tokenizer, whose
`tokenizers` pipeline is what the vocabulary keeps. Truncation and padding saved with the
tokenizer are switched off: a corpus is encoded whole.

Encoding is the one of transformers' `tokenizer(text, add_special_tokens=False)`: no BOS /
EOS or other token of the post-processor; a special token written out in the text (e.g.
"<|endoftext|>") is read as that token, as transformers does. Decoding keeps every token,
special ones included, so decode(encode(text)) is `text` for tokenizers that do not
normalise (byte-level BPE such as GPT-2's).

Long texts are encoded in pieces, in parallel, cut after a newline between two non-space
characters (`memattn.data.bpe.pieces`) where the tokenizer tokenises the text on each side
of the cut on its own: the text around each cut is encoded whole and in two, and a cut is
kept only when the ids agree. A tokenizer without a pre-tokenizer (its model reads the whole
text as one word) is never cut, nor in effect one that marks the start of every text (a
prepended "▁"): no cut passes the check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from memattn.data import bpe
from memattn.errors import ConfigError

_WINDOW = 256  # characters on each side of a cut encoded to check it


class PretrainedVocab(bpe.TokenizerVocab):
    """The vocabulary of a pretrained `tokenizers` tokenizer (see the module docstring).

    `size`: one more than the largest id, added tokens included (the number of tokens when
    ids have no gaps, as `len(tokenizer)` in transformers). `name`: where the tokenizer came
    from (a folder or hub name), a label only: vocabularies are equal when their tokenizers
    are. `encode` gives the ids of transformers' `tokenizer(text, add_special_tokens=False)`;
    `decode` writes special tokens too.

    Build one with `PretrainedVocab.load`; save it with `to_json` (which holds the whole
    tokenizer) and rebuild it with `PretrainedVocab.from_json` or `Vocab.from_json`.
    """

    kind = "pretrained"
    _arg, _what, _saved_what = "tokenizer", "a pretrained tokenizer", "a pretrained vocabulary"
    _size_counts = "ids"

    def __init__(self, tokenizer_json: str, name: str = "") -> None:
        """The vocabulary of a tokenizer saved as JSON (`tokenizers.Tokenizer.to_str()`);
        ValueError if it is not one."""
        self.name = name
        super().__init__(tokenizer_json)

    def _prepare(self, tok: Any) -> int:
        tok.no_truncation()
        tok.no_padding()
        self._cuttable = tok.pre_tokenizer is not None  # else its model reads the text as one word
        ids = tok.get_vocab(with_added_tokens=True).values()
        size = max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))
        if size == 0:
            raise ValueError("tokenizer_json: the tokenizer has no tokens")
        return size

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def load(cls, name: str, arg: str = "tokenizer") -> PretrainedVocab:
        """The tokenizer `name`: a folder holding tokenizer.json, or anything
        `transformers.AutoTokenizer` loads as a fast tokenizer (from local files first, then
        the network). Returns the PretrainedVocab; ConfigError naming `arg` when it cannot
        be loaded or the package it needs is missing."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{arg}: expected a tokenizer name or folder, got {name!r}")
        path = Path(name)
        if (path / "tokenizer.json").is_file():
            bpe.require_tokenizers(arg, cls._what)
            try:
                return cls((path / "tokenizer.json").read_text(encoding="utf-8"), name)
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise ConfigError(f"{arg}: could not read {path / 'tokenizer.json'} ({e})") from None
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{arg}: expected a folder holding tokenizer.json or a tokenizer name, "
                              f"got the file {path}")
        return cls(_transformers_json(name, local=path.is_dir(), arg=arg), name)

    # -- encoding -------------------------------------------------------------------------

    def _decode(self, ids: np.ndarray) -> str:
        """Every token is written, special ones included."""
        return self._tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    def _pieces(self, text: str) -> list[str]:
        """`text` in pieces whose ids, concatenated, are the ids of `text`."""
        candidates = bpe.pieces(text)
        if len(candidates) == 1 or not self._cuttable:
            return [text]
        out = [candidates[0]]
        at = len(candidates[0])
        for piece in candidates[1:]:
            if self._same_ids_when_cut(text, at):
                out.append(piece)
            else:
                out[-1] += piece
            at += len(piece)
        return out

    def _same_ids_when_cut(self, text: str, at: int) -> bool:
        left, right = text[max(0, at - _WINDOW):at], text[at:at + _WINDOW]
        whole, a, b = self._tokenizer.encode_batch([left + right, left, right], add_special_tokens=False)
        return whole.ids == a.ids + b.ids

    # -- saving ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The base's JSON with the `name` in it too."""
        return {"version": self._json_version, "kind": self.kind, "name": self.name, "size": self.size,
                "tokenizer": self.tokenizer_json}

    @classmethod
    def _from_saved(cls, data: dict[str, Any]) -> PretrainedVocab:
        return cls(data["tokenizer"], str(data.get("name", "")))

    # -- misc -----------------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tokenizer_json, self.name))

    def __repr__(self) -> str:
        return f"PretrainedVocab({self.name!r}, size={self.size})"


def _transformers_json(name: str, local: bool, arg: str) -> str:
    """The `tokenizers` JSON of the fast tokenizer transformers loads as `name`: from local
    files (a folder, or the hub cache), else, for a name, from the network."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"{arg}: {name!r} is neither a folder holding tokenizer.json nor loadable "
                          "without the package transformers, which is not installed: pip install "
                          "transformers (or the extra: pip install 'memattn[hf]')") from None
    errors = []
    for local_only in (True,) if local else (True, False):
        try:
            tok = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
            break
        except (OSError, ValueError, KeyError, ImportError) as e:  # ImportError: a converter's package
            errors.append(f"{type(e).__name__}: {e}")
    else:
        raise ConfigError(f"{arg}: could not load the tokenizer {name!r} ({errors[-1]})")
    backend = getattr(tok, "backend_tokenizer", None)
    if not getattr(tok, "is_fast", False) or backend is None:
        raise ConfigError(f"{arg}: {name!r} loads as {type(tok).__name__}, a tokenizer without a fast "
                          "(tokenizers) form; a vocabulary needs a fast tokenizer")
    return backend.to_str()
