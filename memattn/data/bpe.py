"""A byte-level byte-pair-encoding (BPE) vocabulary, built with Hugging Face `tokenizers`.

    vocab = BPEVocab.train(lines, size=8000)     # merges learnt from `lines`
    ids = vocab.encode("¿Qué tal, niño?")        # 1-D array of vocab.dtype, no <s> / </s>
    vocab.decode(ids)                            # '¿Qué tal, niño?'
    BPEVocab.from_json(vocab.to_json()) == vocab

Scheme (the one of GPT-2): the text is cut into words by the GPT-2 pattern (letters,
digits and punctuation apart, a space kept at the front of the word it precedes), each
word is written as its UTF-8 bytes, and merges join bytes into longer tokens within a word.
The 256 byte values are all in the vocabulary, so every text encodes, characters never
seen in training included (as their bytes): nothing becomes <unk> and decode(encode(text))
is `text` for any str. There is no normalisation (no lowercasing, no Unicode folding).

Special tokens have fixed ids: <pad> 0, <s> 1, </s> 2, <unk> 3. They are never produced
by `encode`: a literal "<s>" in a text is encoded as the characters it is made of.

`tokenizers` is imported only when a BPE vocabulary is trained or rebuilt, so memattn
works without it for the other vocabularies. `TokenizerVocab`, the base of `BPEVocab` and
of the pretrained tokenizer's `memattn.data.pretrained.PretrainedVocab`, holds what any
vocabulary that is a `tokenizers` tokenizer does: its JSON, saving, equality, encoding.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from memattn.data.vocab import checked_ids, id_dtype
from memattn.errors import ConfigError

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
MIN_SIZE = len(SPECIALS) + 256  # the special tokens and the 256 bytes
INSTALL_HINT = "pip install tokenizers (or the extra: pip install 'memattn[hf]')"
# Texts longer than this are encoded in pieces, in parallel (see `pieces`).
PIECE_CHARS = 1 << 16
_BATCH = 4096  # texts per call of the tokenizer's batch encoder
# A newline between two non-space characters always ends a word of the GPT-2 pattern, so a
# text cut just after it encodes to the same tokens as the whole text. Python's \s holds
# every character the pattern counts as space, so its \S is the safe side.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def require_tokenizers(arg: str = "vocab", what: str = "a BPE vocabulary") -> Any:
    """The `tokenizers` module; ConfigError naming `arg`, `what` needs it and the install
    command when it is missing."""
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"{arg}: {what} needs the package tokenizers, which is not installed: "
                          f"{INSTALL_HINT}") from None
    return tokenizers


def pieces(text: str, target: int | None = None) -> list[str]:
    """`text` cut into pieces of about `target` characters (default PIECE_CHARS) or more,
    only just after a newline between two non-space characters, where the pre-tokenizer
    cuts anyway: the pieces' tokens, concatenated, are the tokens of `text`. A text
    without such a place stays whole. Returns the pieces, joining to `text`."""
    target = PIECE_CHARS if target is None else target
    out, start = [], 0
    while len(text) - start > target:
        m = _SAFE_CUT.search(text, start + target)
        if m is None:
            break
        out.append(text[start:m.start()])
        start = m.start()
    out.append(text[start:])
    return out


_V = TypeVar("_V", bound="TokenizerVocab")


class TokenizerVocab:
    """A vocabulary that is a `tokenizers` tokenizer, saved whole as its JSON: what
    `BPEVocab` and `memattn.data.pretrained.PretrainedVocab` share.

    `tokenizer_json`: the tokenizer as `tokenizers.Tokenizer.to_str()` writes it, which
    `to_json` saves and equality, hashing, pickling and `fingerprint` go by; `size`: the
    number of ids. A subclass sets `kind` and the words of its errors, checks and sets up
    the tokenizer it is given (`_prepare`) and decodes (`_decode`); it may cut long texts
    otherwise (`_pieces`). Vocabularies of different kinds are never equal.
    """

    kind: str  # the "kind" of its JSON, on which `Vocab.from_json` dispatches
    # How errors name things: the argument and the vocabulary when tokenizers is missing or
    # a text is not a str, the vocabulary a saved JSON is of, what `size` counts.
    _arg: str
    _what: str
    _saved_what: str
    _size_counts: str
    _json_version = 1

    def __init__(self, tokenizer_json: str) -> None:
        """The vocabulary of a tokenizer saved as JSON (`tokenizers.Tokenizer.to_str()`);
        ValueError if it is not one, or not one `_prepare` takes."""
        tokenizers = require_tokenizers(self._arg, self._what)
        try:
            tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises its own Exception type for a bad JSON
            raise ValueError(f"tokenizer_json: not a tokenizer saved by tokenizers ({e})") from None
        self.size: int = self._prepare(tok)
        self._tokenizer = tok
        self.tokenizer_json: str = tok.to_str()

    def _prepare(self, tok: Any) -> int:
        """Check the `tokenizers.Tokenizer` `tok` just read (ValueError naming
        tokenizer_json) and set it up in place for encoding. Returns the vocabulary size."""
        raise NotImplementedError

    # -- encoding -------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """dtype of encoded arrays: the smallest of uint8 / uint16 / int32 that fits."""
        return id_dtype(self.size)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as a 1-D array of `self.dtype`, without the tokens the
        tokenizer's post-processor would add (<s> / </s>, BOS / EOS). Long texts are encoded
        in pieces (`_pieces`), in parallel, to the same ids."""
        if not isinstance(text, str):
            raise TypeError(f"text: {self._what} encodes str, got {type(text).__name__}")
        return np.concatenate(self.encode_batch(self._pieces(text)))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each of `texts`, each encoded whole, in parallel. Returns one 1-D
        array of `self.dtype` per text."""
        return encode_texts(self._tokenizer, texts, self.dtype, self._what)

    def _pieces(self, text: str) -> list[str]:
        """`text` in pieces whose ids, concatenated, are the ids of `text`: `pieces`."""
        return pieces(text)

    def decode(self, ids: Any) -> str:
        """The text of token ids (a list, numpy array, torch tensor or int, any shape, read
        in row-major order); which special tokens it writes is the subclass's `_decode`.
        Returns a str."""
        arr = checked_ids(ids, self.size)
        if arr.size == 0:
            return ""
        return self._decode(arr)

    def _decode(self, ids: np.ndarray) -> str:
        """The text of the checked, non-empty 1-D array of token ids `ids`."""
        raise NotImplementedError

    # -- saving ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict that `from_json` (or `Vocab.from_json`) turns back into an
        equal vocabulary, offline: the whole tokenizer is in it, as its JSON string."""
        return {"version": self._json_version, "kind": self.kind, "size": self.size,
                "tokenizer": self.tokenizer_json}

    @classmethod
    def from_json(cls: type[_V], data: dict[str, Any]) -> _V:
        """The vocabulary saved by `to_json`, of this class. Raises ValueError for a dict it
        did not write."""
        if not isinstance(data, dict) or data.get("kind") != cls.kind:
            raise ValueError(f"vocab: expected a dict with kind {cls.kind!r}, got {data!r:.200}")
        if data.get("version", cls._json_version) > cls._json_version:
            raise ValueError(f"vocab: saved with format version {data['version']}, newer than "
                             f"{cls._json_version}")
        if not isinstance(data.get("tokenizer"), str):
            raise ValueError(f"vocab: {cls._saved_what} needs its 'tokenizer' JSON string")
        vocab = cls._from_saved(data)
        if "size" in data and data["size"] != vocab.size:
            raise ValueError(f"vocab: 'size' is {data['size']} but the tokenizer has {vocab.size} "
                             f"{cls._size_counts}")
        return vocab

    @classmethod
    def _from_saved(cls: type[_V], data: dict[str, Any]) -> _V:
        """The vocabulary of the checked dict `data` that `to_json` wrote."""
        return cls(data["tokenizer"])

    @property
    def fingerprint(self) -> str:
        """Hex SHA-256 of the tokenizer's JSON: equal vocabularies have equal fingerprints."""
        return hashlib.sha256(self.tokenizer_json.encode("utf-8")).hexdigest()

    # -- misc -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenizerVocab):
            return NotImplemented
        return self.kind == other.kind and self.tokenizer_json == other.tokenizer_json

    def __hash__(self) -> int:
        return hash(self.tokenizer_json)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tokenizer_json,))


class BPEVocab(TokenizerVocab):
    """A byte-level BPE vocabulary of `size` tokens (see the module docstring).

    Ids: `pad_id` 0, `bos_id` 1, `eos_id` 2, `unk_id` 3, then the 256 bytes, then the
    merged tokens. `encode` adds no <s> / </s>; `decode` leaves out <pad>, <s> and </s>
    and writes U+FFFD for <unk>. `BPEVocab(tokenizer_json)` raises ValueError unless the
    tokenizer holds the special tokens at their ids.

    Build one with `BPEVocab.train`; save it with `to_json` (which holds the whole
    tokenizer) and rebuild it with `BPEVocab.from_json` or `Vocab.from_json`.
    """

    kind = "bpe"
    _arg, _what, _saved_what = "vocab", "a BPE vocabulary", "a BPE vocabulary"
    _size_counts = "tokens"
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def _prepare(self, tok: Any) -> int:
        for i, special in enumerate(SPECIALS):
            if tok.token_to_id(special) != i:
                raise ValueError(f"tokenizer_json: expected the token {special!r} at id {i}, "
                                 f"got id {tok.token_to_id(special)}")
        tok.encode_special_tokens = True  # not saved in the JSON: "<s>" in a text is text
        return tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def train(cls, texts: Iterable[str], size: int, min_frequency: int = 2) -> BPEVocab:
        """Learn merges from `texts` until the vocabulary holds `size` tokens (fewer when
        no pair occurring at least `min_frequency` times is left). The same texts give the
        same vocabulary, whatever their order. Returns the BPEVocab; ValueError for a
        `size` below MIN_SIZE (260: the specials and the 256 bytes)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SIZE:
            raise ValueError(f"size: expected an int of at least {MIN_SIZE} (4 special tokens and "
                             f"256 bytes), got {size!r}")
        if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
            raise ValueError(f"min_frequency: expected a positive int, got {min_frequency!r}")
        tokenizers = require_tokenizers()
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = tokenizers.Tokenizer(models.BPE(unk_token=SPECIALS[UNK_ID]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIALS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_in_pieces(texts), trainer)
        return cls(tok.to_str())

    def _decode(self, ids: np.ndarray) -> str:
        """<pad>, <s> and </s> are left out, <unk> becomes U+FFFD and bytes that do not form
        UTF-8 decode to replacement characters."""
        # The tokenizer drops every special token; <unk> is put back as U+FFFD between runs.
        runs = np.split(ids, np.flatnonzero(ids == UNK_ID))
        texts = [self._tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in runs]
        return "\ufffd".join(texts)

    def token(self, i: int) -> str:
        """The text of token `i` (a special token's name for ids below 4)."""
        if not 0 <= int(i) < self.size:
            raise ValueError(f"i: expected an id in [0, {self.size}), got {i}")
        if i < len(SPECIALS):
            return SPECIALS[i]
        return self._tokenizer.decode([int(i)])

    def __repr__(self) -> str:
        return f"BPEVocab(size={self.size})"


def encode_texts(tokenizer: Any, texts: Sequence[str], dtype: np.dtype, what: str) -> list[np.ndarray]:
    """The ids of each of `texts` under the `tokenizers.Tokenizer` `tokenizer`, without the
    special tokens its post-processor would add, encoded in parallel in batches. Returns
    one 1-D array of `dtype` per text; TypeError naming `what` for a text that is not str."""
    out: list[np.ndarray] = []
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for start in range(0, len(texts), _BATCH):
        batch = list(texts[start:start + _BATCH])
        for i, t in enumerate(batch):
            if not isinstance(t, str):
                raise TypeError(f"texts[{start + i}]: {what} encodes str, got {type(t).__name__}")
        encodings = encode(batch, add_special_tokens=False)
        lengths = [len(e.ids) for e in encodings]
        flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=dtype, count=sum(lengths))
        out.extend(np.split(flat, np.cumsum(lengths)[:-1]))
    return out


def _in_pieces(texts: Iterable[str]) -> Iterator[str]:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}]: expected str, got {type(text).__name__}")
        yield from pieces(text)

