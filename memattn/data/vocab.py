"""Token vocabularies: characters (with an optional unknown symbol) or the 256 byte values
(the BPE vocabulary is `memattn.data.bpe.BPEVocab`, a pretrained tokenizer
`memattn.data.pretrained.PretrainedVocab`; `Vocab.from_json` rebuilds them too).

Encoding is vectorised with numpy: a text becomes an array of code points (or UTF-8 bytes)
and each is looked up in the sorted code points of the vocabulary, so a 5 MB text encodes
in a fraction of a second.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from memattn.data.bpe import BPEVocab
    from memattn.data.pretrained import PretrainedVocab

UNK = "\ufffd"  # the Unicode replacement character stands for any character unseen in train
_JSON_VERSION = 1


def id_dtype(size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids below `size`: uint8, uint16 or int32."""
    if size <= 1 << 8:
        return np.dtype(np.uint8)
    if size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def code_points(text: str) -> np.ndarray:
    """The code points of `text` as a 1-D array (uint8 for ASCII text, else uint32)."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def checked_ids(ids: Any, size: int) -> np.ndarray:
    """Token ids (a list, numpy array, torch tensor or int, any shape) as a flat numpy array
    in row-major order; ValueError unless they are integers in [0, size)."""
    if hasattr(ids, "detach"):  # a torch tensor, without importing torch here
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids).reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids: expected integer token ids, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= size):
        raise ValueError(f"ids: expected ids in [0, {size}), got values in [{int(arr.min())}, {int(arr.max())}]")
    return arr


class Vocab:
    """A character or byte vocabulary.

    Character level: ids 0..size-1 name the characters of `symbols` in order; when the
    vocabulary has an unknown symbol it is `symbols[0]` (U+FFFD) and every character not
    in the vocabulary encodes to `unk_id`. Without one, such a character raises ValueError.
    Byte level: ids are the 256 byte values of the UTF-8 encoding; `unk_id` is None.

    Build one with `Vocab.from_text`, `Vocab.of_chars` or `Vocab.of_bytes`; save it with
    `to_json` and rebuild it with `Vocab.from_json`.
    """

    def __init__(self, kind: str, symbols: Iterable[str] = (), unk: bool = False) -> None:
        if kind not in ("char", "byte"):
            raise ValueError(f"kind: expected 'char' or 'byte', got {kind!r}")
        self.kind = kind
        if kind == "byte":
            if unk:
                raise ValueError("unk: a byte vocabulary covers every byte and has no unknown symbol")
            self.symbols: tuple[str, ...] = ()
            self.unk_id: int | None = None
            self.size = 256
            return
        symbols = tuple(symbols)
        for s in symbols:
            if not isinstance(s, str) or len(s) != 1:
                raise ValueError(f"symbols: expected single characters, got {s!r}")
        if len(set(symbols)) != len(symbols):
            raise ValueError("symbols: a character appears twice")
        if unk:
            symbols = (UNK,) + tuple(s for s in symbols if s != UNK)
        if not symbols:
            raise ValueError("symbols: a character vocabulary needs at least one character")
        self.symbols = symbols
        self.unk_id = 0 if unk else None
        self.size = len(symbols)
        cps = np.array([ord(s) for s in symbols], dtype=np.uint32)
        self._order = np.argsort(cps, kind="stable")  # position in sorted order -> id
        self._sorted = cps[self._order]  # [size] sorted code points
        self._cps = cps  # id -> code point

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_text(cls, text: str, unk: bool = True) -> Vocab:
        """Character vocabulary of the distinct characters of `text`, sorted by code point,
        after the unknown symbol at id 0 when `unk`. Returns the Vocab."""
        cps = code_points(text)
        if cps.dtype == np.uint8:  # ASCII: counting is much faster than sorting
            cps = np.flatnonzero(np.bincount(cps, minlength=128))
        else:
            cps = np.unique(cps)
        return cls("char", (chr(c) for c in cps.tolist()), unk=unk)

    @classmethod
    def of_chars(cls, symbols: Iterable[str], unk: bool = False) -> Vocab:
        """Character vocabulary of `symbols` in the given order. Returns the Vocab."""
        return cls("char", symbols, unk=unk)

    @classmethod
    def of_bytes(cls) -> Vocab:
        """The byte vocabulary: size 256, no unknown symbol. Returns the Vocab."""
        return cls("byte")

    # -- encoding -------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """dtype of encoded arrays: the smallest of uint8 / uint16 / int32 that fits."""
        return id_dtype(self.size)

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids of `text` as a 1-D array of `self.dtype`.

        A byte vocabulary encodes the UTF-8 bytes of a str, or takes bytes as they are.
        A character vocabulary maps characters it lacks to `unk_id`, or raises ValueError
        naming the first one when it has no unknown symbol.
        """
        if self.kind == "byte":
            data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
            return np.frombuffer(data, dtype=np.uint8).copy()
        if not isinstance(text, str):
            raise TypeError(f"text: a character vocabulary encodes str, got {type(text).__name__}")
        cps = code_points(text)
        if cps.dtype == np.uint8:  # ASCII: one lookup in a table of the 128 code points
            ascii_ids = np.zeros(128, dtype=self.dtype)
            ascii_known = np.zeros(128, dtype=bool)
            ascii = self._cps < 128
            ascii_ids[self._cps[ascii]] = np.flatnonzero(ascii)
            ascii_known[self._cps[ascii]] = True
            ids, found = ascii_ids[cps], ascii_known[cps]
        else:
            pos = np.minimum(np.searchsorted(self._sorted, cps), self.size - 1)
            found = self._sorted[pos] == cps
            ids = self._order[pos].astype(self.dtype)
        if not found.all():
            if self.unk_id is None:
                first = chr(int(cps[np.argmin(found)]))
                raise ValueError(f"text: character {first!r} is not in the vocabulary, which has no unknown symbol")
            ids[~found] = self.unk_id
        return ids

    def decode(self, ids: Any) -> str:
        """The text of token ids (a list, numpy array, torch tensor or int, any shape,
        read in row-major order). Returns a str; the unknown id decodes to U+FFFD and
        byte sequences that are not valid UTF-8 decode with replacement characters."""
        arr = checked_ids(ids, self.size)
        if arr.size == 0:
            return ""
        if self.kind == "byte":
            return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return self._cps[arr].tobytes().decode("utf-32-le")

    # -- saving ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict that `Vocab.from_json` turns back into an equal Vocab."""
        if self.kind == "byte":
            return {"version": _JSON_VERSION, "kind": "byte", "size": 256}
        return {
            "version": _JSON_VERSION,
            "kind": "char",
            "size": self.size,
            "unk": self.unk_id is not None,
            "symbols": "".join(self.symbols),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Vocab | BPEVocab | PretrainedVocab:
        """The vocabulary saved by `to_json`: a Vocab, a `BPEVocab` for a dict of kind 'bpe'
        (written by `BPEVocab.to_json`) or a `PretrainedVocab` for one of kind 'pretrained'.
        Raises ValueError for a dict none of them wrote."""
        # Imported here: those modules import this one.
        if isinstance(data, dict) and data.get("kind") == "bpe":
            from memattn.data.bpe import BPEVocab

            return BPEVocab.from_json(data)
        if isinstance(data, dict) and data.get("kind") == "pretrained":
            from memattn.data.pretrained import PretrainedVocab

            return PretrainedVocab.from_json(data)
        if not isinstance(data, dict) or data.get("kind") not in ("char", "byte"):
            raise ValueError(f"vocab: expected a dict with kind 'char', 'byte', 'bpe' or 'pretrained', "
                             f"got {data!r:.200}")
        if data.get("version", _JSON_VERSION) > _JSON_VERSION:
            raise ValueError(f"vocab: saved with format version {data['version']}, newer than {_JSON_VERSION}")
        if data["kind"] == "byte":
            return cls.of_bytes()
        symbols = data.get("symbols")
        if not isinstance(symbols, str):
            raise ValueError("vocab: a character vocabulary needs its 'symbols' string")
        unk = bool(data.get("unk", False))
        if unk and not symbols.startswith(UNK):
            raise ValueError("vocab: the unknown symbol U+FFFD must come first")
        vocab = cls("char", symbols[1:] if unk else symbols, unk=unk)
        if "size" in data and data["size"] != vocab.size:
            raise ValueError(f"vocab: 'size' is {data['size']} but there are {vocab.size} symbols")
        return vocab

    # -- misc -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Vocab):
            return NotImplemented
        return (self.kind, self.symbols, self.unk_id) == (other.kind, other.symbols, other.unk_id)

    def __hash__(self) -> int:
        return hash((self.kind, self.symbols, self.unk_id))

    def __repr__(self) -> str:
        if self.kind == "byte":
            return "Vocab(byte, size=256)"
        return f"Vocab(char, size={self.size}, unk={self.unk_id is not None})"
