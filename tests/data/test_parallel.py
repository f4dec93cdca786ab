"""Tests of memattn.data.parallel: load_parallel, ParallelCorpus and ParallelSplit.

Nothing is downloaded: files and Hugging Face datasets are generated under tmp_path, and
`datasets.load_dataset` is replaced where a dataset name is read.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="load_parallel needs the package tokenizers")

from memattn.data import BPEVocab, ParallelCorpus, ParallelSplit, Vocab, load_parallel  # noqa: E402
from memattn.data import parallel as parallel_mod  # noqa: E402
from memattn.errors import ConfigError  # noqa: E402

SPLITS = ("train", "val", "test")
ES_EN = {"el": "the", "niño": "boy", "la": "the", "niña": "girl", "come": "eats", "pan": "bread",
         "bebe": "drinks", "agua": "water", "mañana": "tomorrow", "año": "year", "canta": "sings",
         "canción": "song", "pequeño": "small", "grande": "big", "y": "and", "con": "with"}
SYLLABLES = ["ka", "lo", "mi", "ñu", "ré", "sa", "to", "vi", "zu"]


def make_pairs(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """n aligned pairs: Spanish-like sentences and their word-by-word English."""
    rng = random.Random(seed)
    names = ["".join(rng.choices(SYLLABLES, k=3)) for _ in range(30)]  # the same in both languages
    src, tgt = [], []
    for i in range(n):
        words = [rng.choice(list(ES_EN) + names) for _ in range(rng.randint(2, 9))]
        es = " ".join(words)
        en = " ".join(ES_EN.get(w, w) for w in words)
        end = "?" if i % 7 == 0 else "."
        src.append(("¿" if end == "?" else "") + es[0].upper() + es[1:] + end)
        tgt.append(en[0].upper() + en[1:] + end)
    return src, tgt


def expected_cut(items: list[str]) -> dict[str, list[str]]:
    """Contiguous blocks: the last 5 % (rounded down) test, the 5 % before them validation."""
    k = len(items) // 20
    return {"train": items[:len(items) - 2 * k], "val": items[len(items) - 2 * k:len(items) - k],
            "test": items[len(items) - k:]}


def write_lines(path: Path, lines: list[str], newline: str = "\n") -> Path:
    path.write_bytes(("".join(line + newline for line in lines)).encode("utf-8"))
    return path


def write_tsv(path: Path, src: list[str], tgt: list[str]) -> Path:
    return write_lines(path, [f"{s}\t{t}" for s, t in zip(src, tgt)])


def check_split(corpus: ParallelCorpus, split: str, src: list[str], tgt: list[str]) -> None:
    pairs = corpus.split(split)
    assert isinstance(pairs, ParallelSplit) and len(pairs) == len(src)
    assert pairs.source_text == src and pairs.target_text == tgt
    assert len(pairs.source) == len(pairs.target) == len(src)
    for text, ids in zip(src + tgt, pairs.source + pairs.target):
        assert ids.dtype == corpus.vocab.dtype and ids.ndim == 1 and ids.size > 0
        assert corpus.vocab.decode(ids) == text
        assert not np.isin(ids, [0, 1, 2, 3]).any()  # no <pad>, <s>, </s> or <unk>


def check_same(a: ParallelCorpus, b: ParallelCorpus) -> None:
    assert a.vocab == b.vocab and a.name == b.name
    assert (a.source_lang, a.target_lang, a.origin) == (b.source_lang, b.target_lang, b.origin)
    for s in SPLITS:
        x, y = a.split(s), b.split(s)
        assert x.source_text == y.source_text and x.target_text == y.target_text
        for u, v in zip(x.source + x.target, y.source + y.target):
            assert u.dtype == v.dtype and np.array_equal(u, v)


@pytest.fixture
def pair_files(tmp_path) -> tuple[Path, Path, list[str], list[str]]:
    src, tgt = make_pairs(200)
    return (write_lines(tmp_path / "train.es", src), write_lines(tmp_path / "train.en", tgt, newline="\r\n"),
            src, tgt)


# ---------------------------------------------------------------------------------------
# The input forms


def test_pair_files(tmp_path, pair_files):
    es, en, src, tgt = pair_files
    c = load_parallel(source=es, target=en, source_lang="es", target_lang="en", bpe_size=400,
                      cache_dir=tmp_path / "cache")
    assert c.sizes == {"train": 180, "val": 10, "test": 10}
    assert (c.source_lang, c.target_lang) == ("es", "en") and "train.es" in c.name
    for split in SPLITS:
        check_split(c, split, expected_cut(src)[split], expected_cut(tgt)[split])
    # One vocabulary, trained on the source and target sentences of train together.
    assert c.vocab.size == 400
    k = 10
    assert c.vocab == BPEVocab.train(src[:-2 * k] + tgt[:-2 * k], 400)


def test_joint_vocabulary_is_trained_on_train_only(tmp_path):
    src, tgt = make_pairs(200)
    # A word in the English of train only, and one in the Spanish of test only.
    tgt[:180] = [t.replace(".", " quagmire.") for t in tgt[:180]]
    src[190:] = [s.replace(".", " zorblax.") for s in src[190:]]
    c = load_parallel(source=write_lines(tmp_path / "a", src), target=write_lines(tmp_path / "b", tgt),
                      bpe_size=600, cache_dir=None)
    assert len(c.vocab.encode(" quagmire")) == 1
    assert len(c.vocab.encode(" zorblax")) > 1
    check_split(c, "test", src[190:], tgt[190:])  # still encoded, as its bytes where need be


def test_single_tsv_file(tmp_path, pair_files):
    _, _, src, tgt = pair_files
    path = write_tsv(tmp_path / "pairs.tsv", src, tgt)
    c = load_parallel(path=path, bpe_size=400, cache_dir=None)
    assert c.sizes == {"train": 180, "val": 10, "test": 10}
    assert c.source_lang is None and c.target_lang is None
    for split in SPLITS:
        check_split(c, split, expected_cut(src)[split], expected_cut(tgt)[split])
    # The same pairs as two files give the same corpus.
    pair = load_parallel(source=write_lines(tmp_path / "s", src), target=write_lines(tmp_path / "t", tgt),
                         bpe_size=400, cache_dir=None)
    assert pair.vocab == c.vocab


def test_split_rule_rounds_down(tmp_path):
    src, tgt = make_pairs(59)  # 59 // 20 = 2 pairs each for validation and test
    c = load_parallel(path=write_tsv(tmp_path / "p.tsv", src, tgt), bpe_size=300, cache_dir=None)
    assert c.sizes == {"train": 55, "val": 2, "test": 2}
    assert c.split("val").source_text == src[55:57] and c.split("test").target_text == tgt[57:]


def test_tsv_folder(tmp_path):
    root = tmp_path / "pairs"
    root.mkdir()
    src, tgt = make_pairs(70, seed=3)
    parts = {"train": slice(0, 50), "val": slice(50, 53), "test": slice(53, 70)}
    for split, sl in parts.items():
        write_tsv(root / f"{split}.tsv", src[sl], tgt[sl])
    c = load_parallel(path=root, bpe_size=300, cache_dir=None)
    assert c.sizes == {"train": 50, "val": 3, "test": 17}
    for split, sl in parts.items():
        check_split(c, split, src[sl], tgt[sl])
    assert c.vocab == BPEVocab.train(src[:50] + tgt[:50], 300)


# ---------------------------------------------------------------------------------------
# Hugging Face datasets


def hf_datasets():
    """The datasets module, or a skip of the test that needs it."""
    return pytest.importorskip("datasets", reason="the Hugging Face inputs need the package datasets")


def translation_dataset(parts: dict[str, tuple[list[str], list[str]]], form: str = "translation"):
    datasets = hf_datasets()
    dd = {}
    for split, (src, tgt) in parts.items():
        if form == "translation":
            rows = {"translation": [{"en": t, "es": s} for s, t in zip(src, tgt)]}
        else:
            rows = {"id": list(range(len(src))), "es": src, "en": tgt}
        dd[split] = datasets.Dataset.from_dict(rows)
    return datasets.DatasetDict(dd)


@pytest.fixture
def hf_parts():
    src, tgt = make_pairs(80, seed=4)
    return {"train": (src[:60], tgt[:60]), "validation": (src[60:65], tgt[60:65]), "test": (src[65:], tgt[65:])}


@pytest.mark.parametrize("form", ["translation", "columns"])
def test_saved_dataset(tmp_path, hf_parts, form):
    folder = tmp_path / "saved"
    translation_dataset(hf_parts, form).save_to_disk(str(folder))
    c = load_parallel(name=str(folder), source_lang="es", target_lang="en", bpe_size=300,
                      cache_dir=tmp_path / "cache")
    assert (c.source_lang, c.target_lang) == ("es", "en")
    assert c.sizes == {"train": 60, "val": 5, "test": 15}
    for split, hf_split in zip(SPLITS, ("train", "validation", "test")):
        check_split(c, split, *hf_parts[hf_split])
    assert c.vocab == BPEVocab.train(hf_parts["train"][0] + hf_parts["train"][1], 300)
    # The other direction, naming one language only: the other is the dataset's other one.
    back = load_parallel(name=str(folder), target_lang="es", bpe_size=300, cache_dir=None)
    assert (back.source_lang, back.target_lang) == ("en", "es")
    check_split(back, "val", hf_parts["validation"][1], hf_parts["validation"][0])


def test_saved_dataset_with_train_only_is_cut(tmp_path):
    src, tgt = make_pairs(100, seed=5)
    folder = tmp_path / "one"
    hf_datasets().Dataset.from_dict({"translation": [{"es": s, "en": t} for s, t in zip(src, tgt)]}).save_to_disk(str(folder))
    c = load_parallel(name=str(folder), source_lang="es", target_lang="en", bpe_size=300, cache_dir=None)
    assert c.sizes == {"train": 90, "val": 5, "test": 5}
    check_split(c, "test", src[95:], tgt[95:])


def test_dataset_by_name(tmp_path, hf_parts, monkeypatch):
    datasets = hf_datasets()
    calls = []

    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name))
        return translation_dataset(hf_parts)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cache = tmp_path / "cache"
    c = load_parallel(name="someone/books:en-es", source_lang="en", target_lang="es", bpe_size=300, cache_dir=cache)
    assert calls == [("someone/books", "en-es")]
    check_split(c, "train", hf_parts["train"][1], hf_parts["train"][0])
    assert c.name == "hf:someone/books:en-es:en-es"
    # The datasets' fingerprints key the cache.
    again = load_parallel(name="someone/books:en-es", source_lang="en", target_lang="es", bpe_size=300,
                          cache_dir=cache)
    assert len(list(cache.glob("parallel-*.npz"))) == 1
    check_same(c, again)


# ---------------------------------------------------------------------------------------
# Vocabulary given, cache


def test_given_vocab_encodes_every_split(tmp_path, pair_files):
    es, en, src, tgt = pair_files
    vocab = BPEVocab.train(["Una frase cualquiera, nada más."] * 3, 300)
    c = load_parallel(source=es, target=en, vocab=vocab, cache_dir=tmp_path / "cache")
    assert c.vocab is vocab
    for split in SPLITS:
        check_split(c, split, expected_cut(src)[split], expected_cut(tgt)[split])
        assert all(np.array_equal(ids, vocab.encode(t))
                   for ids, t in zip(c.split(split).source, c.split(split).source_text))
    hit = load_parallel(source=es, target=en, vocab=vocab, cache_dir=tmp_path / "cache")
    assert hit.vocab is vocab
    check_same(c, hit)
    trained = load_parallel(source=es, target=en, bpe_size=300, cache_dir=tmp_path / "cache")
    assert trained.vocab != vocab
    assert len(list((tmp_path / "cache").glob("parallel-*.npz"))) == 2
    # A vocabulary saved with a run comes back through Vocab.from_json.
    rebuilt = Vocab.from_json(trained.vocab.to_json())
    assert load_parallel(source=es, target=en, vocab=rebuilt, cache_dir=None).vocab == trained.vocab


def test_cache_reuse_and_invalidation(tmp_path, pair_files, monkeypatch):
    es, en, src, tgt = pair_files
    cache = tmp_path / "cache"
    calls = []
    prepare = parallel_mod._prepare
    monkeypatch.setattr(parallel_mod, "_prepare", lambda *a: calls.append(1) or prepare(*a))

    first = load_parallel(source=es, target=en, bpe_size=400, cache_dir=cache)
    hit = load_parallel(source=es, target=en, bpe_size=400, cache_dir=cache)
    assert len(calls) == 1
    check_same(first, hit)
    assert len(list(cache.glob("parallel-*.npz"))) == 1
    assert not [p for p in cache.iterdir() if p.suffix == ".tmp"]

    load_parallel(source=es, target=en, bpe_size=300, cache_dir=cache)  # another size
    assert len(calls) == 2

    write_lines(en, [t.upper() for t in tgt])  # a changed file
    changed = load_parallel(source=es, target=en, bpe_size=400, cache_dir=cache)
    assert len(calls) == 3
    assert changed.split("test").target_text == [t.upper() for t in tgt[190:]]
    check_same(changed, load_parallel(source=es, target=en, bpe_size=400, cache_dir=cache))
    assert len(calls) == 3


def test_corrupt_cache_is_prepared_again(tmp_path, pair_files):
    es, en, _, _ = pair_files
    cache = tmp_path / "cache"
    first = load_parallel(source=es, target=en, bpe_size=300, cache_dir=cache)
    (cache_file,) = cache.glob("*.npz")
    cache_file.write_bytes(b"not a zip")
    with pytest.warns(UserWarning, match="cache_dir"):
        check_same(first, load_parallel(source=es, target=en, bpe_size=300, cache_dir=cache))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_same(first, load_parallel(source=es, target=en, bpe_size=300, cache_dir=cache))


def test_split_names_and_empty_arguments(tmp_path, pair_files):
    es, en, src, _ = pair_files
    # "" is "not given", as in a configuration file.
    c = load_parallel(source=es, target=en, path="", name="", source_lang="", target_lang="", bpe_size=300,
                      cache_dir=None)
    assert c.source_lang is None and c.split("train").source_text == src[:180]
    with pytest.raises(ConfigError, match=r"^split: expected one of train, val, test, got 'dev'"):
        c.split("dev")


# ---------------------------------------------------------------------------------------
# Bad input


def test_different_line_counts(tmp_path):
    src, tgt = make_pairs(40)
    es, en = write_lines(tmp_path / "a.es", src), write_lines(tmp_path / "b.en", tgt[:-1])
    with pytest.raises(ConfigError) as e:
        load_parallel(source=es, target=en, cache_dir=None)
    msg = str(e.value)
    assert msg.startswith("source, target:")
    assert f"{es} has 40 lines" in msg and f"{en} has 39" in msg


@pytest.mark.parametrize("side", ["source", "target"])
@pytest.mark.parametrize("blank", ["", "   ", "\t"])
def test_empty_line(tmp_path, side, blank):
    src, tgt = make_pairs(40)
    (src if side == "source" else tgt)[16] = blank
    es, en = write_lines(tmp_path / "a.es", src), write_lines(tmp_path / "b.en", tgt)
    bad = es if side == "source" else en
    with pytest.raises(ConfigError, match=rf"^{side}: {bad}:17: empty line"):
        load_parallel(source=es, target=en, cache_dir=None)


def test_not_utf8(tmp_path):
    src, tgt = make_pairs(40)
    es, en = write_lines(tmp_path / "a.es", src), tmp_path / "b.en"
    en.write_bytes("\n".join(tgt[:5]).encode() + "\ncafé\n".encode("latin-1") + "\n".join(tgt[6:]).encode())
    with pytest.raises(ConfigError, match=rf"^target: {en}:6: not UTF-8 text"):
        load_parallel(source=es, target=en, cache_dir=None)


@pytest.mark.parametrize("line, tabs", [("no tab here", 0), ("one\ttwo\tthree", 2)])
def test_tsv_line_without_one_tab(tmp_path, line, tabs):
    src, tgt = make_pairs(40)
    lines = [f"{s}\t{t}" for s, t in zip(src, tgt)]
    lines[29] = line
    path = write_lines(tmp_path / "p.tsv", lines)
    with pytest.raises(ConfigError, match=rf"^path: {path}:30: expected source<TAB>target with exactly one tab, found {tabs}"):
        load_parallel(path=path, cache_dir=None)


@pytest.mark.parametrize("line, side", [("\tonly target", "source"), ("only source\t ", "target")])
def test_tsv_empty_side(tmp_path, line, side):
    src, tgt = make_pairs(40)
    lines = [f"{s}\t{t}" for s, t in zip(src, tgt)]
    lines[3] = line
    path = write_lines(tmp_path / "p.tsv", lines)
    with pytest.raises(ConfigError, match=rf"^path: {path}:4: empty {side} sentence"):
        load_parallel(path=path, cache_dir=None)


def test_missing_files(tmp_path, pair_files):
    es, en, src, tgt = pair_files
    with pytest.raises(ConfigError, match=rf"^target: no such file: {tmp_path / 'nope.en'}"):
        load_parallel(source=es, target=tmp_path / "nope.en", cache_dir=None)
    with pytest.raises(ConfigError, match=rf"^source: no such file: {tmp_path / 'nope.es'}"):
        load_parallel(source=tmp_path / "nope.es", target=en, cache_dir=None)
    with pytest.raises(ConfigError, match=r"^path: no such file or folder: "):
        load_parallel(path=tmp_path / "nope.tsv", cache_dir=None)
    with pytest.raises(ConfigError, match=r"^source: expected a text file, one sentence a line, got the folder"):
        load_parallel(source=tmp_path, target=en, cache_dir=None)
    root = tmp_path / "folder"
    root.mkdir()
    write_tsv(root / "train.tsv", src, tgt)
    write_tsv(root / "test.tsv", src, tgt)
    with pytest.raises(ConfigError, match=rf"^path: the folder {root} has no val\.tsv"):
        load_parallel(path=root, cache_dir=None)


def test_empty_split(tmp_path):
    src, tgt = make_pairs(30)
    root = tmp_path / "folder"
    root.mkdir()
    write_tsv(root / "train.tsv", src, tgt)
    write_tsv(root / "val.tsv", src[:3], tgt[:3])
    (root / "test.tsv").write_text("")
    with pytest.raises(ConfigError, match=rf"^path: {root / 'test.tsv'} holds no pairs; split 'test' would be empty"):
        load_parallel(path=root, cache_dir=None)
    few = write_tsv(tmp_path / "few.tsv", src[:19], tgt[:19])
    with pytest.raises(ConfigError, match=rf"^path: {few} holds 19 pairs, too few for a 90/5/5 split"):
        load_parallel(path=few, cache_dir=None)
    es, en = write_lines(tmp_path / "e.es", []), write_lines(tmp_path / "e.en", [])
    with pytest.raises(ConfigError, match=r"^source, target: .* holds 0 pairs"):
        load_parallel(source=es, target=en, cache_dir=None)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(), r"^source, target, path, name: expected source and target files"),
        (dict(source="a.es"), r"^target: source was given without target"),
        (dict(target="a.en"), r"^source: target was given without source"),
        (dict(source="a.es", target="a.en", path="p.tsv"), r"^path: give either path .* not both"),
        (dict(name="wmt14", path="p.tsv"), r"^name: a Hugging Face dataset is read instead of files; got name together with path"),
        (dict(name="wmt14", source="a", target="b"), r"^name: .*got name together with source and target"),
        (dict(path="p.tsv", source_lang="en", target_lang="en"), r"^target_lang: expected a language other than source_lang"),
        (dict(path="p.tsv", bpe_size=100), r"^bpe_size: expected an int of at least 260"),
        (dict(path="p.tsv", vocab=Vocab.of_bytes()), r"^vocab: expected a BPEVocab"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_parallel(cache_dir=None, **kwargs)


def test_dataset_errors(tmp_path, hf_parts, monkeypatch):
    folder = tmp_path / "saved"
    translation_dataset(hf_parts).save_to_disk(str(folder))
    with pytest.raises(ConfigError, match=rf"^source_lang: the dataset {folder} has no language 'fr'; it has en, es"):
        load_parallel(name=str(folder), source_lang="fr", target_lang="en", cache_dir=None)
    with pytest.raises(ConfigError, match=r"^target_lang: .*has no language 'de'; it has en, es"):
        load_parallel(name=str(folder), source_lang="es", target_lang="de", cache_dir=None)
    with pytest.raises(ConfigError, match=r"^source_lang, target_lang: .*has the languages en, es; say which"):
        load_parallel(name=str(folder), cache_dir=None)

    columns = tmp_path / "columns"
    translation_dataset(hf_parts, "columns").save_to_disk(str(columns))
    with pytest.raises(ConfigError, match=r"^target_lang: .*has no language 'de'; it has es, en"):
        load_parallel(name=str(columns), source_lang="es", target_lang="de", cache_dir=None)

    src, tgt = hf_parts["validation"]
    bad = dict(hf_parts, validation=(src[:2] + [" "] + src[3:], tgt))
    holed = tmp_path / "holed"
    translation_dataset(bad).save_to_disk(str(holed))
    with pytest.raises(ConfigError, match=r"^name: .*, split 'validation', row 2 \(from 0\): empty es sentence"):
        load_parallel(name=str(holed), source_lang="es", target_lang="en", cache_dir=None)

    no_test = tmp_path / "no-test"
    translation_dataset({k: v for k, v in hf_parts.items() if k != "test"}).save_to_disk(str(no_test))
    with pytest.raises(ConfigError, match=r"^name: .* has no test split \(it has train, validation\)"):
        load_parallel(name=str(no_test), source_lang="es", target_lang="en", cache_dir=None)

    # (datasets cannot load an empty split it saved: this one comes from load_dataset.)
    datasets = hf_datasets()
    empty = translation_dataset(hf_parts)
    empty["test"] = empty["test"].select([])
    with monkeypatch.context() as m:
        m.setattr(datasets, "load_dataset", lambda *a, **k: empty)
        with pytest.raises(ConfigError, match=r"^name: split 'test' of the dataset 'x/y' is empty"):
            load_parallel(name="x/y", source_lang="es", target_lang="en", cache_dir=None)

    with pytest.raises(ConfigError, match=r"^name: could not load the dataset"):
        load_parallel(name=str(tmp_path), source_lang="es", target_lang="en", cache_dir=None)
