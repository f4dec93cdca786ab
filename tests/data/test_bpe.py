"""Tests of memattn.data.bpe (BPEVocab) and of load_corpus at level 'bpe'.

Nothing is downloaded: every text is generated here.
"""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers", reason="BPEVocab needs the package tokenizers")

from memattn.data import BPEVocab, Corpus, Vocab, bpe, load_corpus  # noqa: E402
from memattn.data import corpus as corpus_mod  # noqa: E402
from memattn.errors import ConfigError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORDS_ES = ["el", "niño", "come", "pan", "la", "niña", "bebe", "agua", "año", "mañana", "¿Qué?", "sí,", "canción."]
WORDS_EN = ["the", "child", "eats", "bread", "girl", "drinks", "water", "year", "tomorrow", "What?", "yes,", "song."]
SYLLABLES = ["ka", "lo", "mi", "ñu", "ré", "sa", "to", "vi", "zu", "pe", "gra", "dón"]
# Made-up words, so that the texts hold more pairs to merge than the vocabularies' sizes.
WORDS_MADE_UP = sorted({"".join(random.Random(i).choices(SYLLABLES, k=2 + i % 3)) for i in range(200)})
WORDS = WORDS_ES + WORDS_EN + WORDS_MADE_UP


def sentences(n: int, seed: int = 0, words: list[str] = WORDS) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(3, 10)))
        out.append(s[0].upper() + s[1:])
    return out


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return sentences(2000)


@pytest.fixture(scope="module")
def vocab(lines) -> BPEVocab:
    return BPEVocab.train(lines, 500)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, written out from its definition."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def model_vocab(v: BPEVocab) -> dict[str, int]:
    return json.loads(v.tokenizer_json)["model"]["vocab"]


# ---------------------------------------------------------------------------------------
# Round trips and unseen characters


ROUND_TRIP = [
    "¿Qué tal, niño? Sí, mañana.",
    "El año pasado   (dos espacios)  y\ttabulador.",
    "  leading and trailing spaces  ",
    "lines\n\nwith blank ones\r\nand CRLF\n",
    "Ünïcödé — naïve café, 日本語 and emoji 🎭; Ελληνικά, русский, עברית.",
    "\u00a0non-breaking\u2028line separator\u200bzero width",
    "literal <s> and </s> and <pad> and <unk> are text",
    "x",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(vocab, text):
    ids = vocab.encode(text)
    assert ids.dtype == vocab.dtype == np.uint16 and ids.ndim == 1
    assert vocab.decode(ids) == text
    # No special token comes out of encode, not even for their names written in the text.
    assert not np.isin(ids, [0, 1, 2, 3]).any()


def test_unseen_characters_are_their_bytes(vocab, lines):
    """Characters never seen in training encode as their UTF-8 bytes, none as <unk>."""
    seen = set("".join(lines))
    table, tokens = bytes_to_unicode(), model_vocab(vocab)
    for ch in "日🎭Ωж":
        assert ch not in seen
        expected = [tokens[table[b]] for b in ch.encode("utf-8")]
        assert vocab.encode(ch).tolist() == expected, ch
    # Every one of the 256 bytes has a token of its own.
    assert all(table[b] in tokens for b in range(256))


def test_merges_join_frequent_words(lines):
    v = BPEVocab.train(lines + ["El niño come pan mañana"] * 300, 400)
    # Words frequent in training become single tokens (after a space, as in the text).
    for word in (" niño", " mañana", " come"):
        ids = v.encode(word)
        assert len(ids) == 1 and v.decode(ids) == word, word
    assert len(v.encode(" zyzzyva")) > 1


def test_specials_have_fixed_ids(vocab):
    assert (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2, 3)
    added = {t["id"]: t["content"] for t in json.loads(vocab.tokenizer_json)["added_tokens"]}
    assert added == {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>"}
    assert [vocab.token(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert vocab.kind == "bpe" and len(vocab) == vocab.size


def test_decode_drops_pad_bos_eos_and_marks_unk(vocab):
    a, b = vocab.encode("el niño").tolist(), vocab.encode(" come").tolist()
    assert vocab.decode([1, *a, *b, 2, 0, 0]) == "el niño come"
    assert vocab.decode([*a, 3, *b]) == "el niño\ufffd come"
    assert vocab.decode(torch.tensor([[1, *a], [2, *a]])) == "el niñoel niño"
    assert vocab.decode(np.int64(a[0])) == vocab.decode([a[0]])
    assert vocab.decode([]) == ""
    with pytest.raises(ValueError, match=r"^ids: "):
        vocab.decode([vocab.size])
    with pytest.raises(ValueError, match=r"^ids: "):
        vocab.decode([0.5])
    with pytest.raises(TypeError, match=r"^text: "):
        vocab.encode(b"bytes")


def test_long_text_is_encoded_in_pieces_to_the_same_ids(vocab, monkeypatch):
    import tokenizers

    rng = random.Random(5)
    parts = ["el niño", "\n", "\n\n", " \n", "\n ", "\t\n", "\r\n", "¿Qué?", "  ", "año", "\n\n\n x", "canción."]
    text = "".join(rng.choice(parts) for _ in range(3000))
    whole = tokenizers.Tokenizer.from_str(vocab.tokenizer_json).encode(text, add_special_tokens=False).ids
    monkeypatch.setattr(bpe, "PIECE_CHARS", 16)
    cut = bpe.pieces(text)
    assert len(cut) > 20 and "".join(cut) == text
    for piece in cut[1:]:  # each cut is a newline between two non-space characters
        assert not piece[0].isspace()
    for piece in cut[:-1]:
        assert piece[-1] == "\n" and not piece[-2].isspace()
    assert vocab.encode(text).tolist() == whole
    assert vocab.decode(vocab.encode(text)) == text


def test_encode_batch(vocab):
    texts = ["el niño", "", "¿Qué?", "日本"]
    out = vocab.encode_batch(texts)
    assert len(out) == 4 and out[1].size == 0
    for t, ids in zip(texts, out):
        assert ids.dtype == vocab.dtype and vocab.decode(ids) == t


# ---------------------------------------------------------------------------------------
# Training, determinism, saving


def test_size(lines):
    v = BPEVocab.train(lines, 300)
    assert v.size == 300 and v.dtype == np.uint16
    assert len(model_vocab(v)) == 300
    # A small text runs out of pairs seen twice before reaching the size asked for.
    small = BPEVocab.train(["ab ab cd"], 1000)
    assert 260 < small.size < 1000
    with pytest.raises(ValueError, match=r"^size: .*at least 260"):
        BPEVocab.train(lines, 259)
    with pytest.raises(ValueError, match=r"^min_frequency: "):
        BPEVocab.train(lines, 300, min_frequency=0)


def test_min_frequency(lines):
    texts = lines + ["a qqxq qqxq"]  # " qqxq" occurs twice, all its pairs too
    often = BPEVocab.train(texts, 2000, min_frequency=2)
    rare = BPEVocab.train(texts, 2000, min_frequency=3)
    assert len(often.encode(" qqxq")) == 1 and len(rare.encode(" qqxq")) > 1


def test_training_is_deterministic(lines, vocab):
    again = BPEVocab.train(lines, 500)
    assert again == vocab and again.tokenizer_json == vocab.tokenizer_json
    assert BPEVocab.train(lines[::-1], 500) == vocab  # the order of the texts does not matter
    assert BPEVocab.train(lines, 400) != vocab


def test_training_is_deterministic_across_processes(tmp_path, lines, vocab):
    """Another process (other hash seeds in tokenizers) trains the same vocabulary."""
    (tmp_path / "lines.json").write_text(json.dumps(lines))
    code = (
        "import json, sys; from memattn.data import BPEVocab; "
        "v = BPEVocab.train(json.load(open(sys.argv[1])), 500); print(v.fingerprint)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "lines.json")], cwd=REPO,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == vocab.fingerprint


def test_json_round_trip(vocab):
    data = json.loads(json.dumps(vocab.to_json()))
    assert data["kind"] == "bpe" and data["size"] == vocab.size and isinstance(data["tokenizer"], str)
    for back in (BPEVocab.from_json(data), Vocab.from_json(data)):
        assert isinstance(back, BPEVocab) and back == vocab and hash(back) == hash(vocab)
        assert back.size == vocab.size
        text = ROUND_TRIP[0] + ROUND_TRIP[4]
        assert np.array_equal(back.encode(text), vocab.encode(text))
    assert pickle.loads(pickle.dumps(vocab)) == vocab
    assert vocab != Vocab.of_bytes() and Vocab.of_bytes() != vocab


def test_bad_json(vocab):
    data = vocab.to_json()
    with pytest.raises(ValueError, match=r"^vocab: .*'tokenizer'"):
        Vocab.from_json({"kind": "bpe", "size": 300})
    with pytest.raises(ValueError, match=r"^vocab: 'size' is 7"):
        BPEVocab.from_json({**data, "size": 7})
    with pytest.raises(ValueError, match=r"^tokenizer_json: "):
        BPEVocab.from_json({**data, "tokenizer": "{not json"})
    with pytest.raises(ValueError, match=r"^vocab: expected a dict with kind 'bpe'"):
        BPEVocab.from_json(Vocab.of_bytes().to_json())
    moved = json.loads(data["tokenizer"])
    for t in moved["added_tokens"]:
        t["content"] = {"<s>": "</s>", "</s>": "<s>"}.get(t["content"], t["content"])
    v = moved["model"]["vocab"]
    v["<s>"], v["</s>"] = v["</s>"], v["<s>"]
    with pytest.raises(ValueError, match=r"^tokenizer_json: expected the token '<s>' at id 1, got id 2"):
        BPEVocab(json.dumps(moved))


def test_without_tokenizers(monkeypatch, lines):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    with pytest.raises(ConfigError, match=r"pip install tokenizers .*memattn\[hf\]"):
        BPEVocab.train(lines, 300)
    with pytest.raises(ConfigError, match=r"^level: .*pip install tokenizers"):
        load_corpus("text", REPO / "pyproject.toml", level="bpe", cache_dir=None)


def test_memattn_imports_without_tokenizers_and_datasets():
    code = (
        "import sys; sys.modules['tokenizers'] = None; sys.modules['datasets'] = None\n"
        "import memattn, memattn.data, memattn.data.bpe, memattn.data.parallel\n"
        "from memattn.data import Vocab, load_corpus\n"
        "assert Vocab.from_text('ab').encode('ab').tolist() == [1, 2]\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------
# load_corpus(level="bpe") and character counts


@pytest.fixture
def text_path(tmp_path) -> tuple[Path, str]:
    text = "\n".join(sentences(800, seed=1)) + "\nÚltima línea con 日本語.\n"
    path = tmp_path / "es.txt"
    path.write_text(text, encoding="utf-8")
    return path, text


def test_corpus_bpe_contiguous(tmp_path, text_path):
    path, text = text_path
    c = load_corpus("text", path, level="bpe", bpe_size=400, cache_dir=tmp_path / "cache")
    n = len(text)
    a, b = n - 2 * (n // 20), n - n // 20  # 90 / 5 / 5 in characters
    assert c.level == "bpe" and isinstance(c.vocab, BPEVocab) and c.vocab.size == 400
    assert {s: c.characters(s) for s in ("train", "val", "test")} == {"train": a, "val": b - a, "test": n - b}
    expected = {"train": text[:a], "val": text[a:b], "test": text[b:]}
    for split, part in expected.items():
        ids = c.split(split)
        assert ids.dtype == np.uint16
        assert c.vocab.decode(ids) == part, split
        assert ids.size < len(part), split  # a token spans more than a character on average
    # The vocabulary is trained on the train split's text only.
    assert c.vocab == BPEVocab.train([text[:a]], 400)
    assert "日" not in text[:a] and c.vocab.encode("日").size == 3


def test_corpus_bpe_cache(tmp_path, text_path, monkeypatch):
    path, text = text_path
    cache = tmp_path / "cache"
    first = load_corpus("text", path, level="bpe", bpe_size=400, cache_dir=cache)
    assert len(list(cache.glob("text-bpe-*.npz"))) == 1
    assert not [p for p in cache.iterdir() if p.suffix == ".tmp"]

    def fail(*args, **kwargs):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(BPEVocab, "train", fail)
    again = load_corpus("text", path, level="bpe", bpe_size=400, cache_dir=cache)
    assert again.vocab == first.vocab and isinstance(again.vocab, BPEVocab)
    for s in ("train", "val", "test"):
        assert np.array_equal(again.split(s), first.split(s)) and again.characters(s) == first.characters(s)
    # Another size is another cache entry.
    monkeypatch.undo()
    other = load_corpus("text", path, level="bpe", bpe_size=300, cache_dir=cache)
    assert other.vocab.size == 300
    assert len(list(cache.glob("text-bpe-*.npz"))) == 2


def test_corpus_bpe_folder_split_by_document(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    docs = {f"d{i}.txt": "\n".join(sentences(60, seed=10 + i)) + "\n" for i in range(6)}
    for name, text in docs.items():
        (root / name).write_text(text, encoding="utf-8")
    c = load_corpus("text", root, level="bpe", bpe_size=300, cache_dir=None)
    for split in ("train", "val", "test"):
        joined = "\n".join(docs[n] for n in c.documents[split])
        assert c.vocab.decode(c.split(split)) == joined
        assert c.characters(split) == len(joined)
    assert c.vocab == BPEVocab.train(["\n".join(docs[n] for n in c.documents["train"])], 300)


def test_characters_at_char_and_byte_level(tmp_path):
    text = "Ünïcödé — naïve café, 日本語 🎭.\n" * 40
    path = tmp_path / "u.txt"
    path.write_text(text, encoding="utf-8")
    char = load_corpus("text", path, level="char", cache_dir=tmp_path / "cache")
    byte = load_corpus("text", path, level="byte", cache_dir=tmp_path / "cache")
    assert sum(char.characters(s) for s in ("train", "val", "test")) == len(text)
    assert sum(byte.characters(s) for s in ("train", "val", "test")) == len(text.encode("utf-8"))
    for s in ("train", "val", "test"):
        assert char.characters(s) == char.split(s).size and byte.characters(s) == byte.split(s).size
    # Read back from the cache, and from a corpus built without counts.
    assert load_corpus("text", path, level="char", cache_dir=tmp_path / "cache").characters("val") == char.characters("val")
    bare = Corpus("x", "char", char.vocab, char.train, char.val, char.test)
    assert bare.characters("test") == char.test.size
    # Read with a BPE vocabulary, the split keeps its characters.
    v = BPEVocab.train([text], 300)
    re_read = char.encoded_with(v)
    for s in ("train", "val", "test"):
        assert re_read.characters(s) == char.characters(s)
        assert v.decode(re_read.split(s)) == char.vocab.decode(char.split(s))


def test_bad_bpe_size(tmp_path, text_path):
    path, _ = text_path
    for size in (259, "8000", 8000.0, True):
        with pytest.raises(ConfigError, match=r"^bpe_size: expected an int of at least 260"):
            load_corpus("text", path, level="bpe", bpe_size=size, cache_dir=None)
    # Ignored at the other levels.
    assert load_corpus("text", path, level="char", bpe_size=3, cache_dir=None).level == "char"


def test_cache_key_of_char_level_ignores_bpe_size(tmp_path, text_path):
    path, _ = text_path
    key = corpus_mod._cache_key("text", "char", path, [path], path.resolve())
    assert corpus_mod._cache_key("text", "char", path, [path], path.resolve(), 0) == key
    assert (corpus_mod._cache_key("text", "bpe", path, [path], path.resolve(), 300)
            != corpus_mod._cache_key("text", "bpe", path, [path], path.resolve(), 400))
