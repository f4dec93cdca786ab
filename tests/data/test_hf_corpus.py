"""Tests of load_corpus(corpus='hf') (the text of a Hugging Face dataset), of load_corpus with
a pretrained tokenizer, and of PretrainedVocab (memattn.data.pretrained).

Nothing is downloaded: datasets are saved with `save_to_disk` under tmp_path, tokenizers are
trained here and saved with transformers' `save_pretrained`, and where a name would be
looked up on the hub (`datasets.load_dataset`, `AutoTokenizer.from_pretrained`) the function
is replaced.
"""

from __future__ import annotations

import json
import math
import pickle
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets", reason="corpus 'hf' needs the package datasets")
transformers = pytest.importorskip("transformers", reason="the reference tokenizer is transformers'")
tokenizers = pytest.importorskip("tokenizers", reason="PretrainedVocab needs the package tokenizers")

from memattn.data import BPEVocab, Corpus, PretrainedVocab, Vocab, bpe, load_corpus  # noqa: E402
from memattn.data import corpus as corpus_mod  # noqa: E402
from memattn.data.corpus import contiguous_bounds  # noqa: E402
from memattn.errors import ConfigError  # noqa: E402

SPLITS = ("train", "val", "test")
WORDS = ["the", "king", "queen", "doth", "speak", "thou", "art", "my", "lord", "good", "night",
         "niño", "mañana", "canción", "sweet", "prince", "and", "to", "be", "or", "not", "what?"]


def rows(n: int, seed: int = 0) -> list[str]:
    """n lines of made-up text, some empty (as the blank lines of wikitext)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 9 == 4:
            out.append("")
            continue
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))
        out.append(line[0].upper() + line[1:] + ("." if i % 3 else ","))
    return out


@pytest.fixture(scope="module")
def parts() -> dict[str, list[str]]:
    """The rows of each split of the dataset, under the dataset's own split names."""
    return {"train": rows(300, 1), "validation": rows(40, 2), "test": rows(40, 3)}


def save_dataset(folder: Path, parts: dict[str, list[str]], **columns) -> Path:
    dd = {}
    for split, texts in parts.items():
        data = {"id": list(range(len(texts))), "text": texts}
        data.update({k: v[split] for k, v in columns.items()})
        dd[split] = datasets.Dataset.from_dict(data)
    datasets.DatasetDict(dd).save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory, parts) -> Path:
    return save_dataset(tmp_path_factory.mktemp("hf") / "saved", parts)


def byte_level_tokenizer(lines: list[str], size: int = 400) -> tokenizers.Tokenizer:
    """A GPT-2-like tokenizer: byte-level BPE, with a post-processor that adds <s> ... </s>."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return tok


def metaspace_tokenizer(lines: list[str]) -> tokenizers.Tokenizer:
    """A sentencepiece-like tokenizer: "▁" for spaces, prepended to the start of a text."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    return tok


def save_tokenizer(folder: Path, tok: tokenizers.Tokenizer) -> Path:
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.add_tokens(["<extra>"])  # an added, not special, token: part of the vocabulary's size
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, parts) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", byte_level_tokenizer(parts["train"]))


@pytest.fixture(scope="module")
def reference(tok_dir):
    """transformers' own reading of the saved tokenizer."""
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def ref_ids(reference, text: str) -> list[int]:
    return reference(text, add_special_tokens=False)["input_ids"]


def own_texts(parts) -> dict[str, str]:
    return {"train": "\n".join(parts["train"]), "val": "\n".join(parts["validation"]),
            "test": "\n".join(parts["test"])}


def cut_texts(text: str | bytes) -> dict[str, str | bytes]:
    """The contiguous 90/5/5 cut, written out: the last n // 20 test, the n // 20 before them
    validation."""
    k = len(text) // 20
    return {"train": text[:len(text) - 2 * k], "val": text[len(text) - 2 * k:len(text) - k],
            "test": text[len(text) - k:]}


def assert_same(a: Corpus, b: Corpus) -> None:
    for s in SPLITS:
        assert a.split(s).dtype == b.split(s).dtype and np.array_equal(a.split(s), b.split(s)), s
        assert a.characters(s) == b.characters(s)
    assert a.vocab == b.vocab and a.documents == b.documents and a.name == b.name and a.level == b.level


# ---------------------------------------------------------------------------------------
# corpus 'hf': splits and levels


def test_the_datasets_own_splits(saved, parts):
    c = load_corpus("hf", name=str(saved), cache_dir=None)
    texts = own_texts(parts)
    assert c.name == f"hf:{saved}" and c.level == "char" and c.source == str(saved)
    assert c.documents == {"train": ("train",), "val": ("validation",), "test": ("test",)}
    assert c.vocab == Vocab.from_text(texts["train"], unk=True)
    for s in SPLITS:
        assert c.vocab.decode(c.split(s)) == texts[s]
        assert c.characters(s) == len(texts[s]) == c.sizes[s]
    assert_same(c, load_corpus("hf", name=saved, cache_dir=None))  # a Path names the folder too


@pytest.mark.parametrize("names", [("train", "valid", "test"), ("train", "dev", "test"), ("train", "val", "test")])
def test_other_names_of_the_validation_split(tmp_path, parts, names):
    folder = save_dataset(tmp_path / "d", dict(zip(names, parts.values())))
    c = load_corpus("hf", name=str(folder), cache_dir=None)
    assert c.documents["val"] == (names[1],)
    assert c.vocab.decode(c.val) == "\n".join(parts["validation"])


@pytest.mark.parametrize("level", ["char", "byte"])
def test_split_is_cut_90_5_5(saved, parts, level):
    c = load_corpus("hf", name=str(saved), split="train", level=level, cache_dir=None)
    text = "\n".join(parts["train"])
    data = text.encode("utf-8") if level == "byte" else text
    n = len(data)
    a, b = n - 2 * (n // 20), n - n // 20
    assert contiguous_bounds(n) == (a, b)
    assert c.sizes == {"train": a, "val": b - a, "test": n - b}  # one id per character (byte)
    assert c.documents == {s: ("train",) for s in SPLITS}
    for s, expected in cut_texts(data).items():
        got = c.split(s).tobytes() if level == "byte" else c.vocab.decode(c.split(s))
        assert got == expected and c.characters(s) == len(expected)
    # Another split the same way: validation.
    v = load_corpus("hf", name=str(saved), split="validation", cache_dir=None)
    assert v.vocab.decode(v.test) == cut_texts("\n".join(parts["validation"]))["test"]


def test_a_dataset_of_one_split_is_cut(tmp_path, parts):
    folder = tmp_path / "one"
    datasets.Dataset.from_dict({"text": parts["train"]}).save_to_disk(str(folder))
    c = load_corpus("hf", name=str(folder), cache_dir=None)
    for s, expected in cut_texts("\n".join(parts["train"])).items():
        assert c.vocab.decode(c.split(s)) == expected


def test_bpe_level_and_another_column(tmp_path, parts):
    upper = {s: [t.upper() for t in texts] for s, texts in parts.items()}
    folder = save_dataset(tmp_path / "d", parts, shout=upper)
    c = load_corpus("hf", name=str(folder), level="bpe", bpe_size=300, text_field="shout", cache_dir=None)
    texts = own_texts(upper)
    assert c.level == "bpe" and c.vocab == BPEVocab.train([texts["train"]], 300)
    for s in SPLITS:
        assert np.array_equal(c.split(s), c.vocab.encode(texts[s]))
        assert c.characters(s) == len(texts[s])
        assert c.chars_per_token(s) == pytest.approx(len(texts[s]) / c.sizes[s])


def test_dataset_by_name_with_a_configuration(tmp_path, parts, monkeypatch):
    calls = []

    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name))
        return datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": t}) for s, t in parts.items()})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    prepared = []
    prepare = corpus_mod._prepare_hf
    monkeypatch.setattr(corpus_mod, "_prepare_hf", lambda *a: prepared.append(1) or prepare(*a))
    cache = tmp_path / "cache"
    c = load_corpus("hf", name="someone/plays:small", cache_dir=cache)
    assert calls == [("someone/plays", "small")] and c.name == "hf:someone/plays:small"
    assert c.vocab.decode(c.test) == "\n".join(parts["test"])
    # The fingerprints of its splits key the cache: read again, it comes from there.
    again = load_corpus("hf", name="someone/plays:small", cache_dir=cache)
    assert len(prepared) == 1 and len(list(cache.glob("hf-char-*.npz"))) == 1
    assert_same(c, again)


# ---------------------------------------------------------------------------------------
# Pretrained tokenizers


def test_tokenizer_ids_are_those_of_transformers(saved, parts, tok_dir, reference):
    c = load_corpus("hf", name=str(saved), tokenizer=str(tok_dir), cache_dir=None)
    assert c.level == "pretrained" and isinstance(c.vocab, PretrainedVocab)
    assert c.vocab.size == len(reference) == reference.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    assert c.vocab.name == str(tok_dir) and c.vocab.dtype == np.uint16
    for s, text in own_texts(parts).items():
        assert c.split(s).tolist() == ref_ids(reference, text)
        assert c.characters(s) == len(text)  # bits per character stay per character
        assert c.chars_per_token(s) == pytest.approx(len(text) / len(ref_ids(reference, text)))
        assert c.vocab.decode(c.split(s)) == text


def test_tokenizer_on_a_text_file(text_file, tok_dir, reference):
    c = load_corpus("text", text_file, tokenizer=str(tok_dir), cache_dir=None)
    text = text_file.read_text()
    for s, piece in cut_texts(text).items():
        assert c.split(s).tolist() == ref_ids(reference, piece) and c.characters(s) == len(piece)


def test_a_corpus_read_again_with_a_pretrained_tokenizer(saved, parts, tok_dir, reference):
    c = load_corpus("hf", name=str(saved), cache_dir=None).encoded_with(PretrainedVocab.load(str(tok_dir)))
    for s, text in own_texts(parts).items():
        assert c.split(s).tolist() == ref_ids(reference, text) and c.characters(s) == len(text)


def test_pretrained_vocab_encodes_without_bos_or_eos(tok_dir, reference):
    vocab = PretrainedVocab.load(str(tok_dir))
    text = "The king doth speak, niño. <extra> ¿Qué? 日本"
    ids = vocab.encode(text)
    assert ids.tolist() == ref_ids(reference, text) != reference(text)["input_ids"]
    assert reference(text)["input_ids"][0] == reference.bos_token_id not in ids.tolist()
    assert vocab.decode(ids) == text  # the added token and unseen characters included
    assert vocab.decode(ids.tolist()) == vocab.decode(ids.astype(np.int64)) == text
    # A special token written out in the text is that token, as in transformers, and decodes back.
    marked = "the end<|endoftext|>the start"
    assert vocab.encode(marked).tolist() == ref_ids(reference, marked)
    assert reference.convert_tokens_to_ids("<|endoftext|>") in vocab.encode(marked).tolist()
    assert vocab.decode(vocab.encode(marked)) == marked
    assert vocab.encode("").tolist() == [] and vocab.decode([]) == ""
    with pytest.raises(ValueError, match=rf"^ids: expected ids in \[0, {vocab.size}\)"):
        vocab.decode([vocab.size])
    with pytest.raises(TypeError, match="^text: a pretrained tokenizer encodes str"):
        vocab.encode(b"bytes")


def test_long_texts_are_cut_only_where_the_ids_agree(monkeypatch, tmp_path, parts, tok_dir, reference):
    text = "\n".join(rows(400, 7))
    whole = ref_ids(reference, text)
    vocab = PretrainedVocab.load(str(tok_dir))
    monkeypatch.setattr(bpe, "PIECE_CHARS", 200)
    assert len(vocab._pieces(text)) > 10 and "".join(vocab._pieces(text)) == text
    assert vocab.encode(text).tolist() == whole
    # A tokenizer that marks the start of a text is never cut, and stays exact.
    meta_dir = save_tokenizer(tmp_path / "meta", metaspace_tokenizer(parts["train"]))
    meta = PretrainedVocab.load(str(meta_dir))
    meta_ref = transformers.AutoTokenizer.from_pretrained(str(meta_dir), local_files_only=True)
    assert meta._pieces(text) == [text]
    assert meta.encode(text).tolist() == ref_ids(meta_ref, text)


def test_pretrained_vocab_json_round_trip(tok_dir):
    vocab = PretrainedVocab.load(str(tok_dir))
    data = json.loads(json.dumps(vocab.to_json()))
    assert data["kind"] == "pretrained" and data["name"] == str(tok_dir) and data["size"] == vocab.size
    back = Vocab.from_json(data)
    assert isinstance(back, PretrainedVocab) and back == vocab and hash(back) == hash(vocab)
    assert back.name == vocab.name and back.fingerprint == vocab.fingerprint
    text = "Good night, sweet prince."
    assert np.array_equal(back.encode(text), vocab.encode(text))
    assert pickle.loads(pickle.dumps(vocab)) == vocab
    assert vocab != BPEVocab.train(["the king and the queen"], 300) and vocab != Vocab.of_bytes()
    assert repr(vocab) == f"PretrainedVocab({str(tok_dir)!r}, size={vocab.size})"
    with pytest.raises(ValueError, match=rf"vocab: 'size' is 7 but the tokenizer has {vocab.size} ids"):
        Vocab.from_json(dict(data, size=7))
    with pytest.raises(ValueError, match="vocab: a pretrained vocabulary needs its 'tokenizer' JSON string"):
        Vocab.from_json({"kind": "pretrained"})
    with pytest.raises(ValueError, match="^tokenizer_json: not a tokenizer"):
        PretrainedVocab("{}")


def test_tokenizer_by_name_tries_local_files_first(monkeypatch, tok_dir, reference):
    calls = []

    def from_pretrained(name, local_files_only=False, **kwargs):
        calls.append((name, local_files_only))
        if local_files_only:
            raise OSError("not in the cache")
        return reference

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    vocab = PretrainedVocab.load("someone/tokenizer")
    assert calls == [("someone/tokenizer", True), ("someone/tokenizer", False)]
    assert vocab == PretrainedVocab.load(str(tok_dir)) and vocab.name == "someone/tokenizer"

    def missing(name, local_files_only=False, **kwargs):
        raise OSError(f"{name} is not a tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", missing)
    with pytest.raises(ConfigError, match=r"^tokenizer: could not load the tokenizer 'no/such' \(OSError"):
        load_corpus("shakespeare", tokenizer="no/such", cache_dir=None)


# ---------------------------------------------------------------------------------------
# Cache


def test_cache_reuse_and_what_keys_it(tmp_path, parts, tok_dir, monkeypatch):
    folder = save_dataset(tmp_path / "d", parts, shout={s: [t.upper() for t in v] for s, v in parts.items()})
    cache = tmp_path / "cache"
    calls = []
    prepare = corpus_mod._prepare_hf
    monkeypatch.setattr(corpus_mod, "_prepare_hf", lambda *a: calls.append(1) or prepare(*a))

    def load(**kwargs):
        return load_corpus("hf", name=str(folder), cache_dir=cache, **kwargs)

    first = load(tokenizer=str(tok_dir))
    again = load(tokenizer=str(tok_dir))
    assert len(calls) == 1 and isinstance(again.vocab, PretrainedVocab)
    assert_same(first, again)
    # The tokenizer keys the cache by what it is, not where it lies; the vocabulary is the caller's.
    copy = shutil.copytree(tok_dir, tmp_path / "copy")
    moved = load(tokenizer=str(copy))
    assert len(calls) == 1 and moved.vocab.name == str(copy)
    assert_same(first, moved)
    assert [p.name.startswith("hf-pretrained-") for p in cache.iterdir()] == [True]
    # Each of these is prepared anew, once.
    variants = [{}, {"level": "byte"}, {"level": "bpe", "bpe_size": 300}, {"level": "bpe", "bpe_size": 301},
                {"split": "train"}, {"split": "test"}, {"text_field": "shout"}]
    for kwargs in variants:
        load(**kwargs)
        load(**kwargs)
    assert len(calls) == 1 + len(variants) and len(list(cache.glob("*.npz"))) == len(calls)
    # Another tokenizer is another vocabulary.
    other = save_tokenizer(tmp_path / "other", byte_level_tokenizer(parts["test"], size=300))
    assert load(tokenizer=str(other)).vocab != first.vocab and len(calls) == len(variants) + 2
    # A dataset saved anew is prepared anew.
    save_dataset(folder, {s: [t + "!" for t in v] for s, v in parts.items()},
                 shout={s: v for s, v in parts.items()})
    changed = load(tokenizer=str(tok_dir))
    assert len(calls) == len(variants) + 3
    assert changed.vocab.decode(changed.val) == "\n".join(t + "!" for t in parts["validation"])


# ---------------------------------------------------------------------------------------
# Errors


def test_unknown_column_and_split(saved):
    with pytest.raises(ConfigError, match=r"^text_field: split 'train' of the dataset .* has no column 'body'; "
                                          r"it has id, text$"):
        load_corpus("hf", name=str(saved), text_field="body", cache_dir=None)
    with pytest.raises(ConfigError, match=r"^split: the dataset .* has no split 'dev'; it has train, validation, test$"):
        load_corpus("hf", name=str(saved), split="dev", cache_dir=None)


def test_missing_splits_of_the_dataset(tmp_path, parts):
    no_train = save_dataset(tmp_path / "no-train", {"validation": parts["validation"], "test": parts["test"]})
    with pytest.raises(ConfigError, match=r"^split: the dataset .* has no 'train' split \(it has validation, test\)"):
        load_corpus("hf", name=str(no_train), cache_dir=None)
    c = load_corpus("hf", name=str(no_train), split="test", cache_dir=None)  # one of them, cut
    assert c.vocab.decode(c.train) == cut_texts("\n".join(parts["test"]))["train"]
    no_test = save_dataset(tmp_path / "no-test", {"train": parts["train"], "validation": parts["validation"]})
    with pytest.raises(ConfigError, match=r"^split: the dataset .* has no test split \(it has train, validation\)"):
        load_corpus("hf", name=str(no_test), cache_dir=None)


def test_values_that_are_not_text(tmp_path, parts):
    with pytest.raises(ConfigError, match=r"^text_field: column 'id' of split 'train' of the dataset .* holds int 0 "
                                          r"at row 0 \(from 0\); expected text"):
        load_corpus("hf", name=str(save_dataset(tmp_path / "d", parts)), text_field="id", cache_dir=None)
    holed = dict(parts, test=parts["test"][:5] + [None] + parts["test"][6:])
    folder = save_dataset(tmp_path / "holed", holed)
    with pytest.raises(ConfigError, match=r"^text_field: column 'text' of split 'test' of .* holds NoneType None at "
                                          r"row 5 \(from 0\)"):
        load_corpus("hf", name=str(folder), cache_dir=None)


def test_empty_splits(tmp_path, parts, monkeypatch):
    blank = save_dataset(tmp_path / "blank", dict(parts, validation=["", ""]))
    with pytest.raises(ConfigError, match=r"^name: split 'validation' of the dataset .* is empty \(its rows hold no text\)"):
        load_corpus("hf", name=str(blank), cache_dir=None)
    with pytest.raises(ConfigError, match=r"^split: split 'validation' of the dataset .* is empty"):
        load_corpus("hf", name=str(blank), split="validation", cache_dir=None)
    short = save_dataset(tmp_path / "short", dict(parts, test=["a few words"]))
    with pytest.raises(ConfigError, match=r"^split: split 'test' of the dataset .* holds 11 characters, too few for "
                                          r"a 90/5/5 split"):
        load_corpus("hf", name=str(short), split="test", cache_dir=None)
    # (datasets cannot load an empty split it saved: this one comes from load_dataset.)
    empty = datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": t}) for s, t in parts.items()})
    empty["test"] = empty["test"].select([])
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: empty)
    with pytest.raises(ConfigError, match=r"^name: split 'test' of the dataset 'x/y' is empty$"):
        load_corpus("hf", name="x/y", cache_dir=None)


def test_without_datasets(monkeypatch, saved):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(ConfigError, match=r"^name: reading a Hugging Face dataset needs the package datasets, .*"
                                          r"pip install datasets .*memattn\[hf\]"):
        load_corpus("hf", name=str(saved), cache_dir=None)


def test_without_tokenizers_or_transformers(monkeypatch, tok_dir):
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "tokenizers", None)
        with pytest.raises(ConfigError, match=r"^tokenizer: a pretrained tokenizer needs the package tokenizers, "
                                              r"which is not installed: pip install tokenizers"):
            load_corpus("shakespeare", tokenizer=str(tok_dir), cache_dir=None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert PretrainedVocab.load(str(tok_dir)).size > 0  # a folder with tokenizer.json needs tokenizers only
    with pytest.raises(ConfigError, match=r"^tokenizer: 'gpt2' is neither a folder holding tokenizer\.json nor "
                                          r"loadable without the package transformers.*memattn\[hf\]"):
        PretrainedVocab.load("gpt2")


def test_dataset_that_cannot_be_loaded(tmp_path):
    with pytest.raises(ConfigError, match=r"^name: could not load the dataset"):
        load_corpus("hf", name=str(tmp_path), cache_dir=None)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"corpus": "hf"}, r"^name: corpus 'hf' needs the name of a Hugging Face dataset"),
    ({"corpus": "hf", "name": "x", "path": "y"}, r"^path: corpus 'hf' reads the dataset given by name"),
    ({"corpus": "hf", "name": "x", "text_field": ""}, r"^text_field: expected the name of a column"),
    ({"corpus": "shakespeare", "name": "x"}, r"^name: for a Hugging Face dataset \(corpus 'hf'\), not corpus 'shakespeare'"),
    ({"corpus": "text", "path": "x", "split": "train"}, r"^split: for a Hugging Face dataset"),
    ({"corpus": "enwik8", "path": "x", "tokenizer": "gpt2"}, r"^tokenizer: enwik8 is read with its own vocabulary"),
    ({"corpus": "text8", "path": "x", "tokenizer": "gpt2"}, r"^tokenizer: text8 is read with its own vocabulary"),
    ({"corpus": "shakespeare", "tokenizer": 3}, r"^tokenizer: expected a tokenizer name or folder, got 3"),
])
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_corpus(cache_dir=None, **kwargs)


def test_bad_tokenizer_folder(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"^tokenizer: could not read .*tokenizer\.json"):
        PretrainedVocab.load(str(tmp_path / "bad"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"^tokenizer: expected a folder holding tokenizer\.json .*got the file"):
        PretrainedVocab.load(str(tmp_path / "file.txt"))


# ---------------------------------------------------------------------------------------
# End to end: train, eval and generate on a dataset with a pretrained tokenizer


def test_train_eval_generate_on_a_dataset_with_a_pretrained_tokenizer(tmp_path, saved, tok_dir, reference, capsys):
    from memattn.cli import main
    from memattn.config import load_config
    from memattn.train import model_from_checkpoint, train

    run, tok_copy = tmp_path / "run", tmp_path / "tokenizer"
    shutil.copytree(tok_dir, tok_copy)
    cfg = load_config("tiny", ["data.corpus=hf", f"data.name={saved}", f"data.tokenizer={tok_copy}",
                               f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={run}", "train.threads=1",
                               "train.steps=3", "train.eval_every=3", "train.save_every=3"])
    summary = train(cfg, progress=False)
    _, trained, vocab_json = model_from_checkpoint(run)
    assert trained.model.vocab_size == len(reference) == vocab_json["size"]
    assert vocab_json["kind"] == "pretrained" and vocab_json["name"] == str(tok_copy)
    assert 0 < summary["val"]["bpc"] < 3 * math.log2(len(reference))

    capsys.readouterr()
    assert main(["eval", str(run), "--split", "test", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == "test" and result["tokens"] > 0 and result["bpc"] > 0

    # The checkpoint holds the tokenizer: generation does not need its folder.
    shutil.rmtree(tok_copy)
    assert main(["generate", str(run), "--prompt", "The king doth", "--tokens", "12", "--seed", "1"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("The king doth") and len(out.out) > len("The king doth") + 1
    assert "tokens/s" in out.err and "note" not in out.err
