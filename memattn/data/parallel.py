"""Parallel text for translation: aligned sentence pairs, split, with a joint BPE vocabulary.

    corpus = load_parallel(source="data/europarl.de", target="data/europarl.en")
    corpus = load_parallel(path="pairs.tsv")              # source<TAB>target, a pair a line
    corpus = load_parallel(path="pairs/")                 # train.tsv, val.tsv, test.tsv
    corpus = load_parallel(name="saved/", source_lang="de", target_lang="en")
    pairs = corpus.split("train")                         # a ParallelSplit
    pairs.source[0], pairs.target[0]                      # token ids, without <s> / </s>
    pairs.source_text[0], pairs.target_text[0]            # the raw sentences, for BLEU

Inputs, one of:

- `source` and `target`: two UTF-8 text files, one sentence a line, line i of one the
  translation of line i of the other.
- `path` a file: a UTF-8 TSV file, one pair a line, `source<TAB>target`.
- `path` a folder: `train.tsv`, `val.tsv` and `test.tsv` in that form, the three splits.
- `name`: a Hugging Face dataset of translation pairs: a folder written by `save_to_disk`
  (read with `datasets.load_from_disk`), else a dataset name for `datasets.load_dataset`,
  which reads its local cache or downloads; `"<name>:<config>"` picks a configuration
  (e.g. "wmt14:de-en"). Rows hold either a `translation` dict {language: text}, as in the
  WMT and OPUS datasets, or one text column per language, named by the language.
  `source_lang` and `target_lang` choose the two languages (one is enough when the
  dataset has two). The dataset's own splits are used: train, validation (or val / valid /
  dev) and test; a dataset with a train split only is cut like a single file.

In files a line ends at "\\n" (a "\\r" before it is dropped) and is kept as it is otherwise;
a line that is empty or holds only spaces is an error, as is a TSV line without exactly
one tab. `source_lang` and `target_lang` only label file inputs.

Splits of a single file pair or TSV file (and of a train-only dataset): contiguous blocks
in file order; of N pairs, the last N // 20 are test, the N // 20 before them validation
and the rest train (`memattn.data.corpus.contiguous_bounds`), so about 5 % each.

Vocabulary: a joint byte-level BPE vocabulary (`memattn.data.bpe`) of `bpe_size` tokens,
trained on the source and target sentences of train together, unless `vocab` is given:
then every split is encoded with it (to resume or evaluate a run with its own vocabulary).

Cache: the sentences, their ids and the vocabulary are saved in one `.npz` under
`cache_dir`, `parallel-<key>.npz`, where the key hashes the format version, the form of
the input, the names, sizes and modification times of its files (of every file of a
saved dataset's folder; for a downloaded dataset the fingerprints of its splits), the
languages and `bpe_size` (or the given vocabulary). Written to a temporary file and moved
into place, so a reader never sees a partial cache.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memattn.data import bpe
from memattn.data.bpe import BPEVocab
from memattn.data.corpus import SPLITS, check_bpe_size, contiguous_bounds, read_npz_cache, write_npz_cache
from memattn.data.hf_datasets import load_hf_dataset
from memattn.data.vocab import Vocab
from memattn.errors import ConfigError

FORMAT_VERSION = 1  # bump when reading, splitting or encoding changes
TSV_SPLITS = {"train": "train.tsv", "val": "val.tsv", "test": "test.tsv"}
SIDES = ("source", "target")

Texts = dict[str, tuple[list[str], list[str]]]  # split -> (source sentences, target sentences)


@dataclass(eq=False)
class ParallelSplit:
    """The sentence pairs of one split.

    `source_text[i]`, `target_text[i]`: the i-th pair as read (str). `source[i]`,
    `target[i]`: their token ids, 1-D arrays of `vocab.dtype` without <s> or </s> (the
    model adds them).
    """

    source_text: list[str]
    target_text: list[str]
    source: list[np.ndarray]
    target: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.source_text)

    def __repr__(self) -> str:
        return f"ParallelSplit({len(self):,} pairs)"


@dataclass(eq=False)
class ParallelCorpus:
    """A prepared parallel corpus: `train`, `val` and `test` ParallelSplits sharing one
    BPE `vocab`. `source_lang` / `target_lang`: the languages (None for unlabelled files);
    `origin`: the files or dataset read."""

    name: str
    vocab: BPEVocab
    train: ParallelSplit
    val: ParallelSplit
    test: ParallelSplit
    source_lang: str | None = None
    target_lang: str | None = None
    origin: str = ""

    def split(self, name: str) -> ParallelSplit:
        """The split `name` ('train', 'val' or 'test')."""
        if name not in SPLITS:
            raise ConfigError(f"split: expected one of {', '.join(SPLITS)}, got {name!r}")
        return getattr(self, name)

    @property
    def sizes(self) -> dict[str, int]:
        """Pairs per split, e.g. {'train': 9000, 'val': 500, 'test': 500}."""
        return {s: len(self.split(s)) for s in SPLITS}

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v:,}" for k, v in self.sizes.items())
        return f"ParallelCorpus({self.name!r}, {self.vocab!r}, {sizes} pairs)"


# ---------------------------------------------------------------------------------------
# Entry point


def load_parallel(
    *,
    source: str | os.PathLike | None = None,
    target: str | os.PathLike | None = None,
    path: str | os.PathLike | None = None,
    name: str | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
    bpe_size: int = 8000,
    cache_dir: str | os.PathLike | None = ".cache/memattn",
    vocab: BPEVocab | None = None,
) -> ParallelCorpus:
    """Load a parallel corpus (see the module docstring for the inputs, the split rule
    and the cache), from the cache under `cache_dir` when it is there and current.

    source, target: two aligned text files, one sentence a line.
    path: a TSV file of pairs, or a folder of train.tsv, val.tsv and test.tsv.
    name: a Hugging Face dataset: a folder saved with `save_to_disk`, or a name (with an
        optional ":<config>") for `datasets.load_dataset`.
    source_lang, target_lang: the languages to read from a dataset; labels for files.
    bpe_size: size of the joint BPE vocabulary trained on train (at least 260).
    cache_dir: where prepared corpora are kept; None prepares without caching.
    vocab: a BPEVocab to encode every split with, instead of training one.

    An argument given as "" counts as not given. Returns a ParallelCorpus. Raises ConfigError naming the argument (and the file and
    line, or the dataset, split and row) for options that do not go together, a missing
    file, files of different line counts, an empty line or sentence, a TSV line without
    exactly one tab, an unknown language or an empty split.
    """
    # "" stands for "not given", as in a configuration file.
    source, target, path = (None if a is None or os.fspath(a) == "" else a for a in (source, target, path))
    name, source_lang, target_lang = (None if a is None or a == "" else a for a in (name, source_lang, target_lang))
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    _check_arguments(source, target, path, name, source_lang, target_lang)
    if vocab is None:
        check_bpe_size(bpe_size)
    elif not isinstance(vocab, BPEVocab):
        raise ConfigError(f"vocab: expected a BPEVocab, got {vocab!r}")
    bpe.require_tokenizers()

    if name is not None:
        inputs: _Inputs = _DatasetInputs(name, source_lang, target_lang)
    else:
        inputs = _FileInputs(source, target, path, source_lang, target_lang)

    def prepare() -> ParallelCorpus:
        return _prepare(inputs, vocab, bpe_size)

    if cache_dir is None:
        return prepare()
    described = inputs.key()
    if described is None:  # a dataset that cannot say whether it changed
        return prepare()
    key = _hash({"format": FORMAT_VERSION, "inputs": described,
                 "vocab": vocab.fingerprint if vocab is not None else None,
                 "bpe_size": bpe_size if vocab is None else None})
    cache_file = Path(cache_dir) / f"parallel-{key[:20]}.npz"
    cached = _read_cache(cache_file, key)
    if cached is not None:
        if vocab is not None:  # equal to the cached one; the caller's own object
            cached.vocab = vocab
        return cached
    result = prepare()
    _write_cache(cache_file, key, result)
    return result


def _check_arguments(source: Any, target: Any, path: Any, name: Any,
                     source_lang: str | None, target_lang: str | None) -> None:
    files = [a for a, v in (("source", source), ("target", target), ("path", path)) if v is not None]
    if name is not None and files:
        raise ConfigError(f"name: a Hugging Face dataset is read instead of files; got name together "
                          f"with {' and '.join(files)}")
    if path is not None and (source is not None or target is not None):
        raise ConfigError("path: give either path (a TSV file or folder) or the source and target files, not both")
    if (source is None) != (target is None):
        given, missing = ("source", "target") if target is None else ("target", "source")
        raise ConfigError(f"{missing}: {given} was given without {missing}; aligned text needs both files")
    if name is None and path is None and source is None:
        raise ConfigError("source, target, path, name: expected source and target files, a path to a TSV "
                          "file or folder, or a dataset name; got none")
    for arg, lang in (("source_lang", source_lang), ("target_lang", target_lang)):
        if lang is not None and (not isinstance(lang, str) or not lang):
            raise ConfigError(f"{arg}: expected a language name, got {lang!r}")
    if source_lang is not None and source_lang == target_lang:
        raise ConfigError(f"target_lang: expected a language other than source_lang, got {target_lang!r} for both")


# ---------------------------------------------------------------------------------------
# Preparation


class _Inputs:
    """What `load_parallel` reads: its name, its cache key and its sentences."""

    name: str
    origin: str
    source_lang: str | None
    target_lang: str | None

    def key(self) -> Any:
        """JSON-ready description that changes when the input does; None: do not cache."""
        raise NotImplementedError

    def read(self) -> Texts:
        """The sentences of each split, checked (no empty sentence, no empty split)."""
        raise NotImplementedError


def _prepare(inputs: _Inputs, vocab: BPEVocab | None, bpe_size: int) -> ParallelCorpus:
    texts = inputs.read()
    if vocab is None:
        src, tgt = texts["train"]
        vocab = BPEVocab.train(itertools.chain(src, tgt), bpe_size)
    splits = {s: ParallelSplit(src, tgt, vocab.encode_batch(src), vocab.encode_batch(tgt))
              for s, (src, tgt) in texts.items()}
    return ParallelCorpus(inputs.name, vocab, **splits, source_lang=inputs.source_lang,
                          target_lang=inputs.target_lang, origin=inputs.origin)


def _cut(src: list[str], tgt: list[str], where: str) -> Texts:
    """The contiguous split of aligned `src` and `tgt` (see the module docstring); ConfigError
    naming `where` when validation and test would be empty (fewer than 20 pairs)."""
    n = len(src)
    if n // 20 == 0:
        raise ConfigError(f"{where} holds {n} pairs, too few for a 90/5/5 split (the validation and "
                          f"test splits would be empty; at least 20 are needed)")
    a, b = contiguous_bounds(n)
    return {"train": (src[:a], tgt[:a]), "val": (src[a:b], tgt[a:b]), "test": (src[b:], tgt[b:])}


def _label(base: str, source_lang: str | None, target_lang: str | None) -> str:
    if source_lang is None and target_lang is None:
        return base
    return f"{base}:{source_lang or '?'}-{target_lang or '?'}"


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def _file_stat(path: Path, name: str) -> list[Any]:
    st = path.stat()
    return [name, st.st_size, st.st_mtime_ns]


# ---------------------------------------------------------------------------------------
# Files


class _FileInputs(_Inputs):
    """Two aligned text files, a TSV file or a folder of three TSV files."""

    def __init__(self, source: Any, target: Any, path: Any,
                 source_lang: str | None, target_lang: str | None) -> None:
        self.source_lang, self.target_lang = source_lang, target_lang
        if path is None:
            self.form = "pair"
            self.files = [_existing_file(Path(source), "source"), _existing_file(Path(target), "target")]
            base = f"parallel:{self.files[0].name}+{self.files[1].name}"
        else:
            root = Path(path)
            if not root.exists():
                raise ConfigError(f"path: no such file or folder: {root}")
            if root.is_dir():
                self.form = "folder"
                self.files = []
                for fname in TSV_SPLITS.values():
                    if not (root / fname).is_file():
                        raise ConfigError(f"path: the folder {root} has no {fname}; a folder of pairs "
                                          f"holds {', '.join(TSV_SPLITS.values())}")
                    self.files.append(root / fname)
            else:
                self.form = "tsv"
                self.files = [root]
            base = f"parallel:{root.name}"
        self.name = _label(base, source_lang, target_lang)
        self.origin = ", ".join(str(f) for f in self.files)

    def key(self) -> Any:
        return {"form": self.form, "name": self.name,
                "files": [_file_stat(f, str(f.resolve())) for f in self.files]}

    def read(self) -> Texts:
        if self.form == "pair":
            src_file, tgt_file = self.files
            src, tgt = _read_lines(src_file, "source"), _read_lines(tgt_file, "target")
            if len(src) != len(tgt):
                raise ConfigError(
                    f"source, target: the files are not aligned: {src_file} has {len(src)} lines but "
                    f"{tgt_file} has {len(tgt)} (one sentence a line, line i of one translating line i "
                    f"of the other)"
                )
            for arg, f, lines in (("source", src_file, src), ("target", tgt_file, tgt)):
                for i, line in enumerate(lines):
                    if not line.strip():
                        raise ConfigError(f"{arg}: {f}:{i + 1}: empty line; every line holds a sentence")
            return _cut(src, tgt, f"source, target: {src_file} and {tgt_file}")
        if self.form == "tsv":
            src, tgt = _read_tsv(self.files[0])
            return _cut(src, tgt, f"path: {self.files[0]}")
        texts = {}
        for split, f in zip(TSV_SPLITS, self.files):
            texts[split] = _read_tsv(f)
            if not texts[split][0]:
                raise ConfigError(f"path: {f} holds no pairs; split {split!r} would be empty")
        return texts


def _existing_file(path: Path, arg: str) -> Path:
    if not path.exists():
        raise ConfigError(f"{arg}: no such file: {path}")
    if not path.is_file():
        raise ConfigError(f"{arg}: expected a text file, one sentence a line, got the folder {path}")
    return path


def _read_lines(path: Path, arg: str) -> list[str]:
    """The lines of the UTF-8 file `path` (without their "\\n" or "\\r\\n"); ConfigError
    naming `arg`, the file and the line for text that is not UTF-8."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"{arg}: {path}:{line}: not UTF-8 text ({e.reason})") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line (or an empty file)
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _read_tsv(path: Path) -> tuple[list[str], list[str]]:
    """(sources, targets) of the TSV file `path`; ConfigError naming the file and line for
    a line without exactly one tab or with an empty side."""
    src, tgt = [], []
    for i, line in enumerate(_read_lines(path, "path")):
        parts = line.split("\t")
        if len(parts) != 2:
            raise ConfigError(f"path: {path}:{i + 1}: expected source<TAB>target with exactly one tab, "
                              f"found {len(parts) - 1}")
        for side, text in zip(SIDES, parts):
            if not text.strip():
                raise ConfigError(f"path: {path}:{i + 1}: empty {side} sentence")
        src.append(parts[0])
        tgt.append(parts[1])
    return src, tgt


# ---------------------------------------------------------------------------------------
# Hugging Face datasets


class _DatasetInputs(_Inputs):
    """A Hugging Face dataset: a folder written by `save_to_disk`, or a name to load."""

    def __init__(self, name: str, source_lang: str | None, target_lang: str | None) -> None:
        self.dataset = load_hf_dataset(name)
        self.where = self.dataset.where
        self.splits = self.dataset.pick_splits()
        for hf_name, ds in self.splits.values():
            if len(ds) == 0:
                raise ConfigError(f"name: split {hf_name!r} of {self.where} is empty")
        self.column, langs = _languages(self.splits["train"][1])
        if len(langs) < 2:
            raise ConfigError(f"name: {self.where} holds no translation pairs: expected a 'translation' "
                              f"column or a text column per language, got columns "
                              f"{', '.join(self.splits['train'][1].column_names)}")
        self.source_lang, self.target_lang = _pick_languages(langs, source_lang, target_lang, self.where)
        for hf_name, ds in self.splits.values():
            column, other = _languages(ds)
            missing = [lang for lang in (self.source_lang, self.target_lang) if lang not in other]
            if column != self.column or missing:
                raise ConfigError(f"name: split {hf_name!r} of {self.where} is not laid out as its train "
                                  f"split (it has {', '.join(other) or 'no languages'})")
        self.name = _label(f"hf:{name}", self.source_lang, self.target_lang)
        self.origin = name

    def key(self) -> Any:
        common = {"form": "hf", "name": self.name, "splits": {s: n for s, (n, _) in self.splits.items()},
                  "column": self.column}
        source = self.dataset.key(self.splits)
        return None if source is None else {**common, **source}

    def read(self) -> Texts:
        texts = {}
        for split, (hf_name, ds) in self.splits.items():
            texts[split] = self._sentences(hf_name, ds)
        if "val" not in texts:  # a train split only: cut it
            return _cut(*texts["train"], f"name: split 'train' of {self.where}")
        return texts

    def _sentences(self, hf_name: str, ds: Any) -> tuple[list[str], list[str]]:
        langs = (self.source_lang, self.target_lang)
        if self.column is not None:
            rows = ds.select_columns([self.column]).to_dict()[self.column]
            sides = [[row.get(lang) if isinstance(row, dict) else None for row in rows] for lang in langs]
        else:
            table = ds.select_columns(list(langs)).to_dict()
            sides = [table[lang] for lang in langs]
        for lang, texts in zip(langs, sides):
            for i, text in enumerate(texts):
                if not isinstance(text, str) or not text.strip():
                    raise ConfigError(f"name: {self.where}, split {hf_name!r}, row {i} (from 0): empty "
                                      f"{lang} sentence ({text!r})")
        return sides[0], sides[1]


def _languages(ds: Any) -> tuple[str | None, list[str]]:
    """('translation', its languages) for a dataset with a translation column, else (None,
    its text columns)."""
    features = ds.features
    if "translation" in features:
        f = features["translation"]
        langs = getattr(f, "languages", None)
        if langs is None:
            langs = list(f) if isinstance(f, dict) else []
        return "translation", list(langs)
    return None, [c for c, f in features.items() if getattr(f, "dtype", None) in ("string", "large_string")]


def _pick_languages(langs: list[str], source_lang: str | None, target_lang: str | None,
                    where: str) -> tuple[str, str]:
    """(source, target) among the dataset's `langs`; a missing one is the other of two."""
    for arg, lang in (("source_lang", source_lang), ("target_lang", target_lang)):
        if lang is not None and lang not in langs:
            raise ConfigError(f"{arg}: {where} has no language {lang!r}; it has {', '.join(langs)}")
    if source_lang is not None and target_lang is not None:
        return source_lang, target_lang
    if source_lang is None and target_lang is None:
        raise ConfigError(f"source_lang, target_lang: {where} has the languages {', '.join(langs)}; "
                          f"say which to translate from and to")
    given = source_lang or target_lang
    others = [lang for lang in langs if lang != given]
    if len(others) != 1:
        missing = "target_lang" if target_lang is None else "source_lang"
        raise ConfigError(f"{missing}: {where} has the languages {', '.join(langs)}; say which to use")
    return (given, others[0]) if target_lang is None else (others[0], given)


# ---------------------------------------------------------------------------------------
# Cache


def _read_cache(cache_file: Path, key: str) -> ParallelCorpus | None:
    """The ParallelCorpus saved in `cache_file` for `key`, or None."""
    def build(meta, z) -> ParallelCorpus:
        vocab = Vocab.from_json(meta["vocab"])
        if not isinstance(vocab, BPEVocab):
            raise ValueError("the vocabulary is not a BPE vocabulary")
        splits = {}
        for s in SPLITS:
            side = {}
            for name in SIDES:
                ids = np.split(z[f"{s}_{name}_ids"], np.cumsum(z[f"{s}_{name}_tokens"])[:-1])
                text = z[f"{s}_{name}_text"].tobytes().decode("utf-8")
                ends = np.cumsum(z[f"{s}_{name}_chars"]).tolist()
                side[name] = (ids, [text[a:b] for a, b in zip([0] + ends[:-1], ends)])
            splits[s] = ParallelSplit(side["source"][1], side["target"][1], side["source"][0], side["target"][0])
        return ParallelCorpus(meta["name"], vocab, **splits, source_lang=meta["source_lang"],
                              target_lang=meta["target_lang"], origin=meta["origin"])

    return read_npz_cache(cache_file, key, FORMAT_VERSION, build)


def _write_cache(cache_file: Path, key: str, corpus: ParallelCorpus) -> None:
    """Save `corpus` to `cache_file` atomically. A cache folder that cannot be written only
    warns: the corpus is still returned."""
    meta = {"format": FORMAT_VERSION, "key": key, "name": corpus.name, "origin": corpus.origin,
            "source_lang": corpus.source_lang, "target_lang": corpus.target_lang,
            "vocab": corpus.vocab.to_json()}
    arrays = {}
    for s in SPLITS:
        split = corpus.split(s)
        for name, ids, texts in (("source", split.source, split.source_text),
                                 ("target", split.target, split.target_text)):
            arrays[f"{s}_{name}_ids"] = np.concatenate(ids) if ids else np.zeros(0, corpus.vocab.dtype)
            arrays[f"{s}_{name}_tokens"] = np.array([len(x) for x in ids], dtype=np.int64)
            arrays[f"{s}_{name}_text"] = np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)
            arrays[f"{s}_{name}_chars"] = np.array([len(t) for t in texts], dtype=np.int64)

    write_npz_cache(cache_file, meta, arrays)
