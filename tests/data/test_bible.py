"""Tests of research.data.bible: parse_diatheke, align, split_by_book, prepare_bible and the
installation of its Debian packages.

Nothing here runs diatheke or apt-get: the texts below are written in the form diatheke
prints (`-f OSIS -o h -l en`, one verse a line, the module name last), and the commands
are replaced by fakes.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from research.data import bible
from research.data.bible import (
    BOOKS,
    OLD_TESTAMENT,
    PACKAGES,
    TEST_BOOKS,
    VAL_BOOKS,
    BibleError,
    align,
    parse_diatheke,
    prepare_bible,
    split_by_book,
)
from memattn.errors import ConfigError, MemattnError

INSTALL = "apt-get install -y diatheke sword-text-web sword-text-sparv"

ENGLISH = """\
Genesis 1:1: <w>In</w> <w>the</w> <w>beginning</w>, <w>God</w><w>created</w> <w>the</w> <w>heavens</w> <w>and</w> <w>the</w> <w>earth</w>.<milestone type="line"/>
Genesis 1:2: <w>The</w>\t<w>earth</w> <w>was</w> formless <w>and</w> <w>empty</w>. <milestone type="line"/>
Genesis 1:3: <w>God</w> <w>said</w>, “<w>Let</w> <w>there</w> <w>be</w> <w>light</w>,” <w>and</w> <w>there</w>
<w>was</w> <w>light</w>.<milestone type="line"/>
A Psalm by David, when he fled from Absalom his son.  Psalms 3:1: Yahweh, how <w>my</w> adversaries <w>have</w> increased! <milestone type="line"/>
Psalms 3:2: <w>Many</w> <w>there</w> <w>are</w> <w>who</w> say <w>of</w> <w>my</w> soul. Selah.<milestone type="line"/>
Beloved  Song of Solomon 1:4: <w>The</w> <w>king</w> <w>has</w> <w>brought</w> <w>me</w> <w>into</w> <w>his</w> <w>rooms</w>.  Friends  We <w>will</w> <w>be</w> <w>glad</w>!  Beloved  <w>They</w> <w>are</w> <w>right</w>. <milestone type="line"/>
Matthew 9:13: <w>Go</w> <w>and</w> <w>learn</w>, ‘<w>I</w> <w>desire</w> <w>mercy</w>, <w>and</w> <w>not</w> <w>sacrifice</w>,’<w>for</w> <w>I</w> <w>came</w>. <milestone type="line"/>
Matthew 23:5: <w>They</w> <w>make</w> <w>their</w> <w>phylacteries</w>broad <w>and</w> enlarge <w>the</w> fringes<w>of</w> <w>their</w> garments, <milestone type="line"/>
Romans 16:25:    <milestone type="line"/>
<title canonical="true" type="psalm">A praise psalm by David.</title> <lg sID="gen13352"/> <l level="1" sID="gen13353"/>Tobit 6:18: <milestone type="line"/>
Tobit 6:19: <w>He</w> <w>heard</w><w>me</w>. <milestone type="line"/>
Esther (Greek) 1:1: <w>In</w> <w>the</w> <w>second</w> <w>year</w>.<milestone type="line"/>
I John 1:1: <w>That</w> <w>which</w> <w>was</w> <w>from</w> <w>the</w> <w>beginning</w>. <milestone type="line"/>
Revelation of John 22:21: <w>The</w> <w>grace</w> <w>of</w> <w>the</w> <w>Lord</w> be with all the saints. Amen.         World English Bible Glossary   The following words used in the World English Bible (WEB) are not very common. <milestone type="line"/>
(engWEB2015eb)
"""

SPANISH = """\
Genesis 1:1: <w>EN el principio</w> <w>crió</w> <w>Dios</w> <w>los cielos</w> <w>y la tierra</w>.<milestone type="line"/>
Genesis 1:2: <w>Y la tierra</w> <w>estaba</w> <w>desordenada</w>.<milestone type="line"/>
Genesis 1:30: <w>en que</w> <w lemma="H2416">hay vida</w>, <w>toda</w> <w>hierba</w> <w>verde</w>.<milestone type="line"/>
Genesis 2:1: <w>Y JEHOVÁ</w> <w>acabó</w> <w>los cielos</w>: <w>y Jehová</w> <w>reposó</w>.<milestone type="line"/>
Genesis 2:12: <w>hay allí</w>también<w>bdelio</w> <w>y piedra</w> <w>cornerina</w>.<milestone type="line"/>
Genesis 3:1: <w>Y DE</w> <w>aquí</w> <w>se</w> <w>repartía</w>: <w>YO SOY</w> <w>de</w> <w>ellos</w>.<milestone type="line"/>
Psalms 3:1: <w>Salmo de David</w>, <w>cuando</w> <w>huía</w>. ¡<w>OH Jehová</w>, <w>cuánto</w> <w>se han multiplicado</w>!<milestone type="line"/>
Psalms 39:1: <w>YO DIJE</w>: <w>Atenderé</w> <w>á mis caminos</w>.<milestone type="line"/>
Psalms 119:1: <w>ALEPH</w>. <w>BIENAVENTURADOS</w> <w>los perfectos</w>.<milestone type="line"/>
Matthew 1:1: <w>Y</w> <w>díjo</w>le: <w>no</w> <w>lo</w> <w>hizo</w>, <w>no</w>lo <w>hizo</w>.<milestone type="line"/>
Matthew 1:2: <w>Ve</w> <w>á</w> <w>sacar</w>la <w>y</w> <w>no</w> <w>sacar</w> <w>nada</w>.<milestone type="line"/>
Matthew 1:3: <w>da</w>lo <w>á los pobres</w>, <w>y</w> <w>da</w> <w>pan</w>; <w>vi</w>las <w>almas</w> <w>que</w> <w>vi</w>.<milestone type="line"/>
Romans 16:25: <w>Y al que puede</w> <w>confirmaros</w>.<milestone type="line"/>
I John 1:1: <w>Lo que</w> <w>era</w> <w>desde el principio</w>.<milestone type="line"/>
Revelation of John 22:21: <w>La gracia</w> <w>sea</w> <w>con</w> <w>todos</w> <w>vosotros</w>. <w>Amén</w>.   <milestone type="line"/>
(spaRV1909eb)
"""


@pytest.fixture
def english() -> dict[str, str]:
    return parse_diatheke(ENGLISH, language="en")


@pytest.fixture
def spanish() -> dict[str, str]:
    return parse_diatheke(SPANISH, language="es")


# ---------------------------------------------------------------------------------------
# parse_diatheke


def test_parse_references_and_module_line(english):
    assert list(english) == [
        "Genesis 1:1", "Genesis 1:2", "Genesis 1:3", "Psalms 3:1", "Psalms 3:2",
        "Song of Solomon 1:4", "Matthew 9:13", "Matthew 23:5", "Romans 16:25", "Tobit 6:18",
        "Tobit 6:19", "Esther (Greek) 1:1", "I John 1:1", "Revelation of John 22:21",
    ]
    assert not any("engWEB2015eb" in text for text in english.values())


def test_parse_glued_words_get_their_space(english):
    assert english["Genesis 1:1"] == "In the beginning, God created the heavens and the earth."
    assert english["Matthew 9:13"] == "Go and learn, ‘I desire mercy, and not sacrifice,’ for I came."
    assert english["Matthew 23:5"] == (
        "They make their phylacteries broad and enlarge the fringes of their garments,"
    )
    assert english["Tobit 6:19"] == "He heard me."  # no Spanish pronoun rule in English


def test_parse_whitespace_and_continuation_lines(english):
    assert english["Genesis 1:2"] == "The earth was formless and empty."
    assert english["Genesis 1:3"] == "God said, “Let there be light,” and there was light."


def test_parse_headings(english):
    # A psalm title stays at the start of its verse; other headings and the speaker labels
    # of the Song of Solomon go, as does a heading left over before another book's verse.
    assert english["Psalms 3:1"] == (
        "A Psalm by David, when he fled from Absalom his son. Yahweh, how my adversaries have increased!"
    )
    assert english["Psalms 3:2"] == "Many there are who say of my soul. Selah."
    assert english["Song of Solomon 1:4"] == (
        "The king has brought me into his rooms. We will be glad! They are right."
    )
    assert english["Tobit 6:18"] == ""


def test_parse_empty_verse_and_appendix(english):
    assert english["Romans 16:25"] == ""
    assert english["Revelation of John 22:21"] == "The grace of the Lord be with all the saints. Amen."


def test_parse_strongs_numbers_and_glue_in_spanish(spanish):
    assert spanish["Genesis 1:30"] == "en que hay vida, toda hierba verde."
    assert spanish["Genesis 2:12"] == "hay allí también bdelio y piedra cornerina."


def test_parse_spanish_enclitic_pronouns(spanish):
    # díjo+le: "díjo" is never a word by itself; no+lo: "no" is, and "nolo" is not.
    assert spanish["Matthew 1:1"] == "Y díjole: no lo hizo, no lo hizo."
    # sacar+la: an infinitive.
    assert spanish["Matthew 1:2"] == "Ve á sacarla y no sacar nada."
    # da+lo before "á": a pronoun before a verb is not followed by a preposition;
    # vi+las before a noun: an article.
    assert spanish["Matthew 1:3"] == "dalo á los pobres, y da pan; vi las almas que vi."


def test_parse_chapter_capitals(spanish):
    assert spanish["Genesis 1:1"] == "En el principio crió Dios los cielos y la tierra."
    assert spanish["Genesis 2:1"] == "Y Jehová acabó los cielos: y Jehová reposó."
    # Only the opening words; capitals later in the verse are the text's own.
    assert spanish["Genesis 3:1"] == "Y de aquí se repartía: YO SOY de ellos."
    assert spanish["Psalms 3:1"] == "Salmo de David, cuando huía. ¡Oh Jehová, cuánto se han multiplicado!"
    assert spanish["Psalms 39:1"] == "Yo dije: Atenderé á mis caminos."
    assert spanish["Psalms 119:1"] == "ALEPH. Bienaventurados los perfectos."
    # Not a first verse: left as written.
    assert spanish["Genesis 1:2"] == "Y la tierra estaba desordenada."


def test_parse_counts_what_it_changed():
    _, stats = bible._parse(SPANISH, "es")
    assert stats["verses"] == 15
    assert stats["chapter_capitals"] == 6  # Genesis 1:1, 2:1, 3:1, Psalms 3:1, 39:1, 119:1
    assert stats["enclitics_joined"] == 3  # díjole, sacarla, dalo
    assert stats["spaces_at_markup"] == 4  # allí|también|bdelio, no|lo, vi|las


def test_parse_drops_subscriptions():
    text = ("Philippians 4:23: <w>La gracia</w> <w>sea</w> <w>con</w> <w>todos</w> "
            "<w>vosotros</w>. <w>Amén</w>. Escrita de Roma con Epafrodito.<milestone type=\"line\"/>\n"
            "I Kings 1:36: <w>Amén</w>. <w>Así lo diga</w> <w>Jehová</w>.<milestone type=\"line\"/>\n")
    assert parse_diatheke(text, language="es") == {
        "Philippians 4:23": "La gracia sea con todos vosotros. Amén.",
        "I Kings 1:36": "Amén. Así lo diga Jehová.",
    }


def test_parse_unknown_language():
    with pytest.raises(ConfigError, match="language"):
        parse_diatheke(ENGLISH, language="fr")


# ---------------------------------------------------------------------------------------
# align and split_by_book


def test_align_keeps_verses_on_both_sides(english, spanish):
    pairs = align(english, spanish)
    assert [ref for _, ref, _, _ in pairs] == [
        "Genesis 1:1", "Genesis 1:2", "Psalms 3:1", "I John 1:1", "Revelation of John 22:21",
    ]
    assert pairs[0] == (
        "Genesis", "Genesis 1:1", "In the beginning, God created the heavens and the earth.",
        "En el principio crió Dios los cielos y la tierra.",
    )
    assert pairs[3][0] == "I John"
    counts = bible.alignment_counts(english, spanish)
    # English: Genesis 1:3, Psalms 3:2, Song 1:4, Matthew 9:13, 23:5 have no Spanish;
    # Romans 16:25 is empty; Tobit and Esther (Greek) are outside the 66 books.
    assert counts == {
        "english_printed": 14, "spanish_printed": 15,
        "english_canonical_nonempty": 10, "spanish_canonical_nonempty": 15,
        "english_only": 5, "spanish_only": 10, "both": 5,
        "dropped_shifted_chapters": 0, "dropped_uneven_verses": 0, "pairs": 5,
    }


def test_align_drops_a_verse_missing_or_empty_on_one_side():
    english = {"John 3:16": "For God so loved the world", "John 3:17": "For God didn’t send",
               "John 3:18": "He who believes"}
    spanish = {"John 3:16": "Porque de tal manera amó Dios al mundo", "John 3:18": ""}
    expected = [
        ("John", "John 3:16", "For God so loved the world", "Porque de tal manera amó Dios al mundo"),
    ]
    assert align(english, spanish) == expected
    assert align(english, spanish, check_versification=False) == expected


def words(n: int, word: str = "palabra") -> str:
    """A verse of n words of len(word) + 1 characters each, less the last space."""
    return " ".join([word] * n)


def test_align_drops_a_shifted_chapter():
    # Genesis 5: English verses alternate 4 and 6 words, the Spanish ones 6 and 4, as
    # when one side is shifted by a verse: |ln(47 / 31 characters)| = 0.42 > 0.3 each.
    # Genesis 6: the same lengths on both sides.
    english, spanish = {}, {}
    for v in range(1, 7):
        english[f"Genesis 5:{v}"] = words(4 if v % 2 else 6, "word123")
        spanish[f"Genesis 5:{v}"] = words(6 if v % 2 else 4, "palabra")
        english[f"Genesis 6:{v}"] = spanish[f"Genesis 6:{v}"] = words(5, "abcdefg")
    pairs = align(english, spanish)
    assert [r for _, r, _, _ in pairs] == [f"Genesis 6:{v}" for v in range(1, 7)]
    assert len(align(english, spanish, check_versification=False)) == 12
    counts = bible.alignment_counts(english, spanish)
    assert counts["dropped_shifted_chapters"] == 6 and counts["pairs"] == 6

    # Fewer than 5 pairs: no chapter test (and no pair is 2.5 times longer).
    short = {r: t for r, t in english.items() if r < "Genesis 5:5"}
    assert len(align(short, spanish)) == 4


def test_align_lower_bar_next_to_a_gap():
    # Every pair 9 words against 7: |ln(62 / 48 characters)| = 0.26, under 0.3 but over
    # 0.2, so the chapter stays unless it follows a chapter ending in verses on one side.
    english = {f"Ruth 2:{v}": words(9, "abcdef") for v in range(1, 6)}
    spanish = {f"Ruth 2:{v}": words(7, "abcdef") for v in range(1, 6)}
    assert len(align(english, spanish)) == 5
    english.update({"Ruth 1:1": "Naomi", "Ruth 1:2": "her husband", "Ruth 1:3": "died"})
    spanish.update({"Ruth 1:1": "Noemí", "Ruth 1:2": "su marido"})  # 1:3 on one side only
    assert [r for _, r, _, _ in align(english, spanish)] == ["Ruth 1:1", "Ruth 1:2"]
    assert bible._gap_chapters({(7, 1, 1), (7, 1, 3)}, {(7, 1, 1)}) == {(7, 1), (7, 2)}
    assert bible._gap_chapters({(7, 1, 1), (7, 1, 3)}, {(7, 1, 3)}) == {(7, 1)}  # not at the end


def test_align_drops_an_uneven_pair():
    english = {"Jude 1:1": words(10), "Jude 1:2": words(10), "Jude 1:3": words(10)}
    spanish = {"Jude 1:1": words(4), "Jude 1:2": words(5), "Jude 1:3": words(10)}
    # 10 words against 4: 79 / 31 characters, 2.55 times; against 5: 2.0 times.
    assert [r for _, r, _, _ in align(english, spanish)] == ["Jude 1:2", "Jude 1:3"]
    assert bible.alignment_counts(english, spanish)["dropped_uneven_verses"] == 1


def test_align_orders_by_book_chapter_verse():
    english = {"Matthew 1:1": "a", "Genesis 10:1": "b", "Genesis 2:1": "c", "Genesis 2:10": "d"}
    spanish = {"Genesis 2:10": "D", "Genesis 2:1": "C", "Genesis 10:1": "B", "Matthew 1:1": "A"}
    assert [(r, es) for _, r, _, es in align(english, spanish)] == [
        ("Genesis 2:1", "C"), ("Genesis 2:10", "D"), ("Genesis 10:1", "B"), ("Matthew 1:1", "A"),
    ]


# Verses per book in the KJV versification both modules follow (31,102 in all).
KJV_VERSES = (
    1533, 1213, 859, 1288, 959, 658, 618, 85, 810, 695, 816, 719, 942, 822, 280, 406, 167,
    1070, 2461, 915, 222, 117, 1292, 1364, 154, 1273, 357, 197, 73, 146, 21, 48, 105, 47, 56,
    53, 38, 211, 55,
    1071, 678, 1151, 879, 1007, 433, 437, 257, 149, 155, 104, 95, 89, 47, 113, 83, 46, 25, 303,
    108, 105, 61, 105, 13, 14, 25, 404,
)


def test_split_by_book_no_book_in_two_splits():
    pairs = [(book, f"{book} 1:{v}", f"en {v}", f"es {v}")
             for book, n in zip(BOOKS, KJV_VERSES) for v in range(1, n + 1)]
    assert len(pairs) == 31102
    splits = split_by_book(pairs)
    books = {s: {b for b, *_ in p} for s, p in splits.items()}
    assert books["val"] == {"Joshua", "Ecclesiastes", "Hosea", "Romans"}
    assert books["test"] == {"Judges", "Micah", "Hebrews", "I Peter", "Revelation of John"}
    assert books["train"] == set(BOOKS) - books["val"] - books["test"]
    assert {s: len(p) for s, p in splits.items()} == {"train": 28057, "val": 1510, "test": 1535}
    # Both evaluation splits draw on both Testaments.
    for s in ("val", "test"):
        assert books[s] & set(OLD_TESTAMENT) and books[s] - set(OLD_TESTAMENT)
    assert splits["val"][0] == ("Joshua", "Joshua 1:1", "en 1", "es 1")


def test_split_books_are_books():
    assert set(VAL_BOOKS) <= set(BOOKS) and set(TEST_BOOKS) <= set(BOOKS)
    assert not set(VAL_BOOKS) & set(TEST_BOOKS)


# ---------------------------------------------------------------------------------------
# prepare_bible


@pytest.fixture
def fake_diatheke(monkeypatch):
    """diatheke installed, printing ENGLISH and SPANISH; returns the list of modules run."""
    calls = []

    def run(module):
        calls.append(module)
        return {"engWEB2015eb": ENGLISH, "spaRV1909eb": SPANISH}[module]

    monkeypatch.setattr(bible, "run_diatheke", run)
    monkeypatch.setattr(bible, "_missing", lambda: [])
    monkeypatch.setattr(bible, "package_versions",
                        lambda: {"diatheke": "1.9.0", "sword-text-web": "426.0-1",
                                 "sword-text-sparv": "2.60-1"})
    return calls


def test_prepare_writes_the_splits(tmp_path, fake_diatheke):
    folder = prepare_bible(tmp_path)
    assert folder == tmp_path / "bible-en-es"
    assert sorted(p.name for p in folder.iterdir()) == ["info.json", "test.tsv", "train.tsv", "val.tsv"]
    train = (folder / "train.tsv").read_text(encoding="utf-8")
    assert train == (
        "In the beginning, God created the heavens and the earth.\t"
        "En el principio crió Dios los cielos y la tierra.\n"
        "The earth was formless and empty.\tY la tierra estaba desordenada.\n"
        "A Psalm by David, when he fled from Absalom his son. Yahweh, how my adversaries have "
        "increased!\tSalmo de David, cuando huía. ¡Oh Jehová, cuánto se han multiplicado!\n"
        "That which was from the beginning.\tLo que era desde el principio.\n"
    )
    assert (folder / "val.tsv").read_text(encoding="utf-8") == ""
    assert (folder / "test.tsv").read_text(encoding="utf-8") == (
        "The grace of the Lord be with all the saints. Amen.\t"
        "La gracia sea con todos vosotros. Amén.\n"
    )
    for line in (train + (folder / "test.tsv").read_text(encoding="utf-8")).splitlines():
        assert line.count("\t") == 1

    info = json.loads((folder / "info.json").read_text(encoding="utf-8"))
    assert info["columns"] == ["english", "spanish"]
    assert info["modules"] == {"english": "engWEB2015eb", "spanish": "spaRV1909eb"}
    assert info["packages"]["sword-text-sparv"] == "2.60-1"
    assert info["splits"] == {
        "train": {"pairs": 4, "books": ["Genesis", "Psalms", "I John"]},
        "val": {"pairs": 0, "books": []},
        "test": {"pairs": 1, "books": ["Revelation of John"]},
    }
    assert info["alignment"]["both"] == 5 and info["alignment"]["pairs"] == 5
    assert info["cleaning"]["spanish"]["enclitics_joined"] == 3
    assert info["files"]["train.tsv"] == {"pairs": 4, "bytes": len(train.encode("utf-8"))}
    assert fake_diatheke == ["engWEB2015eb", "spaRV1909eb"]


def test_prepare_second_call_uses_the_cache(tmp_path, fake_diatheke, monkeypatch):
    folder = prepare_bible(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("diatheke or apt-get run for a complete folder")

    monkeypatch.setattr(bible, "run_diatheke", fail)
    monkeypatch.setattr(bible, "ensure_installed", fail)
    assert prepare_bible(tmp_path) == folder
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name != "bible-en-es"]  # no temporary left


def test_prepare_redoes_an_incomplete_folder(tmp_path, fake_diatheke):
    folder = prepare_bible(tmp_path)
    good = (folder / "train.tsv").read_bytes()
    (folder / "train.tsv").write_bytes(good[:10])  # cut short
    assert prepare_bible(tmp_path) == folder
    assert (folder / "train.tsv").read_bytes() == good
    assert fake_diatheke == ["engWEB2015eb", "spaRV1909eb"] * 2

    (folder / "info.json").unlink()
    prepare_bible(tmp_path)
    assert len(fake_diatheke) == 6 and bible.is_complete(folder)


def test_prepare_refuses_a_module_with_no_verses(tmp_path, fake_diatheke, monkeypatch):
    monkeypatch.setattr(bible, "run_diatheke", lambda module: f"({module})\n")
    with pytest.raises(BibleError, match="spaRV1909eb|engWEB2015eb"):
        prepare_bible(tmp_path)
    assert not (tmp_path / "bible-en-es").exists()


# ---------------------------------------------------------------------------------------
# Installation


class FakeRun:
    """subprocess.run for apt-get, answering with `returncode` and `stderr`."""

    def __init__(self, returncode=100, stderr="E: Unable to locate package sword-text-sparv"):
        self.calls = []
        self.returncode, self.stderr = returncode, stderr

    def __call__(self, args, **kwargs):
        self.calls.append(list(args))
        return subprocess.CompletedProcess(args, self.returncode, stdout="", stderr=self.stderr)


@pytest.fixture
def no_diatheke(monkeypatch):
    monkeypatch.setattr(bible.shutil, "which", lambda name: None)
    run = FakeRun()
    monkeypatch.setattr(bible.subprocess, "run", run)
    return run


def test_install_failure_names_the_packages(tmp_path, no_diatheke, monkeypatch):
    monkeypatch.setattr(bible.os, "geteuid", lambda: 0)
    with pytest.raises(BibleError) as e:
        prepare_bible(tmp_path)
    message = str(e.value)
    assert all(p in message for p in ("diatheke", "sword-text-web", "sword-text-sparv"))
    assert INSTALL in message and "Unable to locate package" in message
    assert no_diatheke.calls == [["apt-get", "install", "-y", *PACKAGES]]
    assert isinstance(e.value, MemattnError)
    assert not (tmp_path / "bible-en-es").exists()


def test_install_needs_root(tmp_path, no_diatheke, monkeypatch):
    monkeypatch.setattr(bible.os, "geteuid", lambda: 1000)
    with pytest.raises(BibleError, match=f"needs root; run `sudo {INSTALL}`"):
        prepare_bible(tmp_path)
    assert no_diatheke.calls == []


def test_install_false_only_explains(tmp_path, no_diatheke, monkeypatch):
    monkeypatch.setattr(bible.os, "geteuid", lambda: 0)
    with pytest.raises(BibleError, match=f"install them with `sudo {INSTALL}`"):
        prepare_bible(tmp_path, install=False)
    assert no_diatheke.calls == []


def test_install_without_apt_get(tmp_path, monkeypatch):
    monkeypatch.setattr(bible.shutil, "which", lambda name: None)
    monkeypatch.setattr(bible.os, "geteuid", lambda: 0)

    def missing(args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", args[0])

    monkeypatch.setattr(bible.subprocess, "run", missing)
    with pytest.raises(BibleError, match="apt-get could not run"):
        bible.ensure_installed()


def test_install_success_then_modules_checked(monkeypatch):
    """apt-get succeeds, but a module is still not listed: the error says which."""
    installed = {"done": False}

    def run(args, **kwargs):
        if args[0] == "apt-get":
            installed["done"] = True
            return subprocess.CompletedProcess(args, 0, stdout="", stderr="")
        assert args == ["diatheke", "-b", "system", "-k", "modulelist"]
        listing = "Biblical Texts:\nengWEB2015eb : World English Bible with Deuterocanon\n"
        return subprocess.CompletedProcess(args, 0, stdout=listing, stderr="")

    monkeypatch.setattr(bible.shutil, "which",
                        lambda name: "/usr/bin/diatheke" if installed["done"] else None)
    monkeypatch.setattr(bible.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bible.subprocess, "run", run)
    with pytest.raises(BibleError, match=r"module spaRV1909eb \(package sword-text-sparv\) still missing"):
        bible.ensure_installed()


def test_run_diatheke_command(monkeypatch):
    run = FakeRun(returncode=0, stderr="")
    monkeypatch.setattr(bible.subprocess, "run", run)
    bible.run_diatheke("spaRV1909eb")
    assert run.calls == [["diatheke", "-b", "spaRV1909eb", "-l", "en", "-f", "OSIS", "-o", "h",
                          "-k", "Genesis 1:1-Revelation 22:21"]]
