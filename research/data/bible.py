r"""An English–Spanish parallel corpus: the Bible verse by verse, from Debian packages.

    folder = prepare_bible(".cache/memattn")    # <cache_dir>/bible-en-es/
    # train.tsv, val.tsv, test.tsv: one verse pair a line, "english<TAB>spanish"
    # info.json: pairs and books per split, modules, package versions, cleaning counts

Sources: the World English Bible (SWORD module `engWEB2015eb`, Debian package
`sword-text-web`) and the Spanish Reina-Valera 1909 (`spaRV1909eb`, `sword-text-sparv`),
printed by the SWORD command-line reader `diatheke` (package `diatheke`). All three install
offline from the Debian archive; `prepare_bible` runs `apt-get install` when they are
missing. A verse pair is one verse of the 66 books of the Protestant canon present and
non-empty in both translations (31,077 of the 31,102 verses), less the 219 where the two
divide the text differently (see `align`): 30,858 pairs. The English module also holds
the deuterocanonical books; the Spanish one does not, so they are left out.

What diatheke prints. Each module is read as
`diatheke -b MODULE -l en -f OSIS -o h -k "Genesis 1:1-Revelation 22:21"`: one line a
verse, `Genesis 1:1: <w>In</w> <w>the</w> ...<milestone type="line"/>`, the book named
in English whatever the module's language (`-l en`), then one last line naming the module,
`(engWEB2015eb)`. The OSIS form is read rather than `-f plain` because the plain form
loses what is needed to clean the text:

- Words glued where markup was. The modules tag words as `<w>...</w>` and in places put
  no space between two of them (`<w>God</w><w>created</w>`) or between a tag and the
  untagged next word (`fringes<w>of</w>`, `sacrifice,’<w>for</w>`); `-f plain` prints
  "Godcreated". In OSIS the tags show where a word ended, so a space is put back there
  (see `parse_diatheke` for the rule and its one exception, Spanish enclitic pronouns,
  which the Spanish module also tags apart: `díjo</w>le` is the one word "díjole").
- Headings. Diatheke prints a heading before the reference of the verse it precedes
  (`A Psalm by David.  Psalms 3:1: ...`). Without `-o h` it repeats the last heading
  before every later verse, even in other books; with `-o h` each appears once. Psalm
  titles (and the letters ALEPH, BETH, ... of Psalm 119) are kept as the start of their
  verse, because the Reina-Valera prints them inside verse 1; other headings are dropped.
  The speaker labels of the Song of Solomon that the WEB prints inside verses between
  wide gaps ("rooms.  Friends  We will be glad") are dropped too.
- Strong's numbers. The Reina-Valera tags some words with Strong's numbers,
  `<w lemma="H2416">hay vida</w>`, which `-f plain` prints as "hay vida <H2416>"; with
  the tags they go.
- An appendix. The WEB glossary (about 30,000 characters) follows the last verse of
  Revelation after a gap of nine spaces; the text of a verse ends at a gap of 8 or more.
- Chapter capitals. The Reina-Valera sets the first word of a chapter in capitals
  ("EN el principio", "Y DE aquí"); it is written as the text writes that word elsewhere
  ("En el principio", "Y de aquí", "Y Jehová").
- Subscriptions. The Reina-Valera ends the last verse of 14 letters of Paul with a note
  on where it was written ("... Amén. Escrita de Roma con Epafrodito."); it goes.

Footnotes are not printed (no `-o f`); the text keeps the translations' own spelling and
punctuation (curly quotes, the accents of 1909 Spanish such as "á" and "fué"). Some words
are glued in the modules' text itself, with no markup between them ("y en" printed "yen");
nothing shows where, so they stay.

Splits are by book, so that no book is in two splits. Validation: Joshua, Ecclesiastes,
Hosea and Romans (1,510 verses in the KJV versification, 1,491 pairs); test: Judges,
Micah, Hebrews, I Peter and Revelation (1,535 verses, 1,533 pairs); each about 5 % of the
verses, from narrative, poetry or prophecy and letters of both Testaments. Train holds the
other 57 books (27,834 pairs). Pairs keep canonical order within a split.

Cache: `prepare_bible` writes the folder under a temporary name and renames it into
place, so a reader never sees a partial one; a later call returns it as soon as it has
checked that `info.json` reads and every split file has the size recorded there.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import unicodedata
from collections import Counter
from pathlib import Path

from memattn.errors import ConfigError, MemattnError

FORMAT_VERSION = 1  # bump when the cleaning, the alignment or the split rule changes
FOLDER = "bible-en-es"
SPLITS = ("train", "val", "test")
LANGUAGES = ("en", "es")
MODULES = {"en": "engWEB2015eb", "es": "spaRV1909eb"}
MODULE_PACKAGES = {"engWEB2015eb": "sword-text-web", "spaRV1909eb": "sword-text-sparv"}
PACKAGES = ("diatheke", "sword-text-web", "sword-text-sparv")
INSTALL_COMMAND = "apt-get install -y " + " ".join(PACKAGES)
VERSE_RANGE = "Genesis 1:1-Revelation 22:21"

# The 66 books as diatheke names them with `-l en`, in canonical order; 39 + 27.
BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "I Samuel", "II Samuel", "I Kings", "II Kings", "I Chronicles", "II Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi",
    "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "I Corinthians", "II Corinthians",
    "Galatians", "Ephesians", "Philippians", "Colossians", "I Thessalonians",
    "II Thessalonians", "I Timothy", "II Timothy", "Titus", "Philemon", "Hebrews", "James",
    "I Peter", "II Peter", "I John", "II John", "III John", "Jude", "Revelation of John",
)
OLD_TESTAMENT = BOOKS[:39]
SHIFTED_CHAPTER_RATIO = 0.3  # mean |ln(length ratio)| above which a chapter counts as shifted
SHIFTED_CHAPTER_MIN = 5  # verse pairs a chapter needs for that mean to be trusted
NEAR_GAP_RATIO = 0.2  # the same, for a chapter next to a verse that one side leaves empty
VERSE_RATIO = 2.5  # a verse pair with one side longer than this many times the other goes
VAL_BOOKS = ("Joshua", "Ecclesiastes", "Hosea", "Romans")
TEST_BOOKS = ("Judges", "Micah", "Hebrews", "I Peter", "Revelation of John")

_BOOK_INDEX = {name: i for i, name in enumerate(BOOKS)}
_KNOWN_REF = re.compile(
    r"(?<!\w)(?P<book>" + "|".join(re.escape(b) for b in sorted(BOOKS, key=len, reverse=True))
    + r") (?P<chapter>\d+):(?P<verse>\d+): ?"
)
# Any other book diatheke prints (the deuterocanon of the WEB: "Esther (Greek)", "Bel and
# the Dragon", ...): words of letters and brackets, after a tag, a space or the line start.
_OTHER_REF = re.compile(
    r"(?:^|(?<=\s)|(?<=>))(?P<book>[\w()]+(?: [\w()]+)*?) (?P<chapter>\d+):(?P<verse>\d+): ?"
)
_MODULE_LINE = re.compile(r"^\([\w.-]+\)\s*$")
_REF_KEY = re.compile(r"^(?P<book>.+) (?P<chapter>\d+):(?P<verse>\d+)$")

_NOTE = re.compile(r"<(note|title)\b[^>]*>.*?</\1>", re.DOTALL)  # with their text
_TAGS = re.compile(r"(?:<[^>]*>)+")
_TITLE_TAG = re.compile(r"</?title\b[^>]*>")
_APPENDIX_GAP = re.compile(r" {8,}\S.*", re.DOTALL)  # nine spaces before the WEB glossary
_SPEAKER = re.compile(r"(?:^|(?<=\s\s))(?:Beloved|Lover|Friends)(?=\s\s|\s*$)")
_SPACES = re.compile(r"\s+")
# The note closing a Pauline epistle in the Reina-Valera: "... Amén. Escrita de Roma con
# Epafrodito." It is no part of the verse, and the WEB has none.
_SUBSCRIPTION = re.compile(r"(?<=Amén\.) [^.]*\b(?:[Ee]scrita|[Ee]nviada)\b[^.]*\.$")
# After these, a word that follows markup directly starts a new word ("sacrifice,’for").
_CLOSING = set(",.;:!?)]»”’")

# Spanish enclitic pronouns, alone or chained ("díjo</w>le", "dános</w>lo", "sáca</w>lo").
_CLITICS = re.compile(r"(?:me|te|se|nos|os|les?|los?|las?)+", re.IGNORECASE)
# Infinitive, gerund, plural imperative.
_VERB_ENDINGS = ("ar", "er", "ir", "ndo", "ad", "ed", "id")
_PREPOSITIONS = frozenset("á a al en de del por con para sin sobre entre hasta desde contra".split())
_WORD = re.compile(r"[^\W_]+")
_WORD_END = re.compile(r"[^\W_]+$")
_MARKED_WORD = re.compile(r"[^\W_]+(?:\0+[^\W_]+)*")  # tags replaced by NUL
_NEXT_WORD = re.compile(r"(?:\s|<[^>]*>)*([^\W_]*)")
_CAPS_WORD = re.compile(r"(?<![^\W_])[^\W\d_]{2,}(?![^\W_])")


class BibleError(MemattnError, RuntimeError):
    """The Bible corpus cannot be prepared: its Debian packages are missing and could not
    be installed, or diatheke printed no verses."""


# ---------------------------------------------------------------------------------------
# Entry point


def prepare_bible(cache_dir: str | os.PathLike, *, install: bool = True) -> Path:
    """The folder `<cache_dir>/bible-en-es/`, prepared on the first call.

    It holds `train.tsv`, `val.tsv` and `test.tsv` (one verse pair a line,
    "english<TAB>spanish", UTF-8, no tab or line break inside a field) and `info.json`
    (pairs and books per split, the modules, the package versions, the alignment and
    cleaning counts). A complete folder is returned at once, without running diatheke.

    install: when diatheke or a module is missing, run `apt-get install -y diatheke
        sword-text-web sword-text-sparv` (needs root); False raises instead.

    Raises BibleError, naming the three packages and the command, when they are missing
    and cannot be installed, or when diatheke prints no verses.
    """
    cache_dir = Path(cache_dir)
    folder = cache_dir / FOLDER
    if is_complete(folder):
        return folder

    ensure_installed(install=install)
    parsed, stats = {}, {}
    for language in LANGUAGES:
        module = MODULES[language]
        parsed[language], stats[language] = _parse(run_diatheke(module), language)
        if not parsed[language]:
            raise BibleError(f"diatheke printed no verses for the module {module}; reinstall "
                             f"it with `{INSTALL_COMMAND}`")
    pairs = align(parsed["en"], parsed["es"])
    splits = split_by_book(pairs)
    info = {
        "format": FORMAT_VERSION,
        "columns": ["english", "spanish"],
        "command": diatheke_command("MODULE"),
        "modules": {"english": MODULES["en"], "spanish": MODULES["es"]},
        "packages": package_versions(),
        "alignment": alignment_counts(parsed["en"], parsed["es"]),
        "cleaning": {"english": stats["en"], "spanish": stats["es"]},
        "splits": {
            s: {"pairs": len(p), "books": sorted({b for b, *_ in p}, key=_BOOK_INDEX.__getitem__)}
            for s, p in splits.items()
        },
    }
    _write_folder(folder, splits, info)
    return folder


def is_complete(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds an `info.json` of this format version and every split file
    with the size in bytes that `info.json` records for it."""
    folder = Path(folder)
    try:
        info = json.loads((folder / "info.json").read_text(encoding="utf-8"))
        files = info["files"]
        return info.get("format") == FORMAT_VERSION and all(
            (folder / f"{s}.tsv").stat().st_size == files[f"{s}.tsv"]["bytes"] for s in SPLITS
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_folder(folder: Path, splits: dict[str, list[tuple[str, str, str, str]]], info: dict) -> None:
    """Write the split files and info.json (last) into a temporary folder beside `folder`,
    then rename it to `folder`, replacing an incomplete one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        files = {}
        for split, pairs in splits.items():
            data = "".join(f"{en}\t{es}\n" for _, _, en, es in pairs).encode("utf-8")
            (tmp / f"{split}.tsv").write_bytes(data)
            files[f"{split}.tsv"] = {"pairs": len(pairs), "bytes": len(data)}
        info = {**info, "files": files}
        (tmp / "info.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes folders readable by their owner only
        if folder.exists() and not is_complete(folder):
            shutil.rmtree(folder)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not is_complete(folder):  # not another process that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# diatheke and the Debian packages


def diatheke_command(module: str) -> list[str]:
    """The diatheke command that prints the whole Bible of `module` as `parse_diatheke`
    reads it: OSIS markup, headings once each, English book names."""
    return ["diatheke", "-b", module, "-l", "en", "-f", "OSIS", "-o", "h", "-k", VERSE_RANGE]


def run_diatheke(module: str) -> str:
    """The text diatheke prints for `module` (see `diatheke_command`). Raises BibleError
    when diatheke fails."""
    try:
        proc = subprocess.run(diatheke_command(module), capture_output=True, text=True,
                              encoding="utf-8", errors="replace", check=False)
    except OSError as e:
        raise BibleError(f"could not run diatheke ({e}); install it with `{INSTALL_COMMAND}`") from None
    if proc.returncode != 0:
        raise BibleError(f"diatheke failed on the module {module} (exit status {proc.returncode}): "
                         f"{proc.stderr.strip()[-500:]}")
    return proc.stdout


def installed_modules() -> set[str]:
    """Names of the SWORD modules diatheke lists (`diatheke -b system -k modulelist`), or
    the empty set when diatheke is not installed."""
    if shutil.which("diatheke") is None:
        return set()
    proc = subprocess.run(["diatheke", "-b", "system", "-k", "modulelist"], capture_output=True,
                          text=True, encoding="utf-8", errors="replace", check=False)
    # Lines "engWEB2015eb : World English Bible with Deuterocanon" under section titles.
    return {line.split(" : ", 1)[0].strip() for line in proc.stdout.splitlines() if " : " in line}


def ensure_installed(*, install: bool = True) -> None:
    """Make sure diatheke and both modules are there, running `apt-get install -y
    diatheke sword-text-web sword-text-sparv` if not and `install` allows it.

    Raises BibleError naming the packages and the command when they are missing and
    `install` is False, the process is not root, or apt-get fails.
    """
    missing = _missing()
    if not missing:
        return
    need = (f"the English-Spanish Bible corpus needs the Debian packages {', '.join(PACKAGES)} "
            f"({', '.join(missing)} missing)")
    if not install:
        raise BibleError(f"{need}; install them with `sudo {INSTALL_COMMAND}`")
    if os.geteuid() != 0:
        raise BibleError(f"{need}, and installing them needs root; run `sudo {INSTALL_COMMAND}`")
    try:
        proc = subprocess.run(["apt-get", "install", "-y", *PACKAGES], capture_output=True, text=True,
                              check=False, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except OSError as e:
        raise BibleError(f"{need}; apt-get could not run ({e}); install them with "
                         f"`{INSTALL_COMMAND}` or your system's equivalent") from None
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()[-500:]
        raise BibleError(f"{need}; `{INSTALL_COMMAND}` failed (exit status {proc.returncode}; "
                         f"if it cannot find them, run `apt-get update` first): {detail}")
    missing = _missing()
    if missing:
        raise BibleError(f"{need}; after `{INSTALL_COMMAND}`, {', '.join(missing)} still missing")


def _missing() -> list[str]:
    """What is missing of diatheke and the two modules, by name."""
    if shutil.which("diatheke") is None:
        return ["diatheke"]
    have = installed_modules()
    return [f"module {m} (package {MODULE_PACKAGES[m]})" for m in MODULES.values() if m not in have]


def package_versions() -> dict[str, str | None]:
    """Installed version of each of PACKAGES, by `dpkg-query`; None where unknown."""
    versions: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            proc = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package],
                                  capture_output=True, text=True, check=False)
            versions[package] = (proc.stdout.strip() or None) if proc.returncode == 0 else None
        except OSError:
            versions[package] = None
    return versions


# ---------------------------------------------------------------------------------------
# Parsing and cleaning


def parse_diatheke(text: str, *, language: str = "en") -> dict[str, str]:
    """Verse reference ("Genesis 1:1") -> cleaned verse text, from diatheke's output.

    text: what `diatheke_command` prints: one verse a line, `[heading]  Book C:V: text`
        with OSIS markup; a line with no reference continues the verse before it; the
        closing `(module)` line is skipped.
    language: "en" or "es"; "es" keeps Spanish enclitic pronouns joined (see below).

    Cleaning: notes and titles inside a verse go with their text, and every other tag
    goes. Where a tag stood between a letter or digit, or one of `, . ; : ! ? ) ] » ” ’`,
    and a following letter or digit, a space is put in its place: the modules have words
    there that diatheke's plain output glues ("God" "created"). In Spanish the exception
    is a pronoun me, te, se, nos, os, le(s), lo(s), la(s) (or a chain of them) that the
    module tags apart from the verb it belongs to: no space when the joined word is
    written elsewhere in `text` ("di|les": "diles"), or the word before never stands
    alone in `text` (1909 spellings such as "díjo|le", "sáca|lo"), or it ends in -ar,
    -er, -ir, -ndo, -ad, -ed, -id in lower case (infinitive, gerund, imperative:
    "sacar|la"), or the pronoun is followed by punctuation or a preposition, which
    neither a pronoun before a verb nor an article before a noun is ("da|lo á los
    pobres"). Otherwise a space ("no|lo hizo", "vi|las almas"). The words counted are
    the whole words of `text` with no markup inside them.

    Then: text after a gap of 8 or more spaces goes (an appendix), the speaker labels
    Beloved / Lover / Friends between gaps of two spaces go, whitespace runs become one
    space, and a sentence after a closing "Amén." that says where a letter was "escrita"
    or "enviada" goes (the Reina-Valera's subscriptions). The heading before a verse of
    Psalms is kept at the start of the verse; other headings go. In the first verse of a
    chapter, the first word written in capitals (not followed by ".", which marks the
    letters of Psalm 119) and the capital words right after it are written as `text` most
    often writes each, with a capital at the start of a sentence ("EN el" -> "En el",
    "Y JEHOVÁ" -> "Y Jehová", "YO DIJE:" -> "Yo dije:").

    Returns every reference printed, in order, canonical or not; a verse with no text
    maps to "". Raises ConfigError for an unknown language.
    """
    return _parse(text, language)[0]


def _parse(text: str, language: str) -> tuple[dict[str, str], dict[str, int]]:
    """parse_diatheke, and counts of what the cleaning changed (verses and places)."""
    if language not in LANGUAGES:
        raise ConfigError(f"language: expected one of {', '.join(LANGUAGES)}, got {language!r}")
    records = _records(text)
    vocab = _vocabulary(body for _, _, body in records)
    vocab_lower: Counter[str] = Counter()
    for word, n in vocab.items():
        vocab_lower[word.lower()] += n

    stats: Counter[str] = Counter()
    verses: dict[str, str] = {}
    for ref, heading, body in records:
        counts: Counter[str] = Counter()
        verse = _clean(body, language, vocab_lower, counts)
        if ref.rsplit(":", 1)[1] == "1":
            verse = _chapter_capitals(verse, vocab, counts)
        if heading and ref.startswith("Psalms "):
            title = _clean(_TITLE_TAG.sub(" ", heading), language, vocab_lower, Counter())
            if title:
                verse = f"{title} {verse}".strip()
                counts["psalm_titles"] += 1
        for key, n in counts.items():
            stats[key] += n
            stats[f"verses_{key}"] += 1
        verses[ref] = verse
    stats["verses"] = len(verses)
    return verses, dict(sorted(stats.items()))


def _records(text: str) -> list[tuple[str, str, str]]:
    """(reference, heading before it, raw verse text) of each verse line of `text`."""
    records: list[list[str]] = []
    for line in text.splitlines():
        if _MODULE_LINE.match(line):
            continue
        m = _KNOWN_REF.search(line) or _OTHER_REF.search(line)
        if m is None:
            if records:
                records[-1][2] += "\n" + line
            continue
        ref = f"{m.group('book')} {int(m.group('chapter'))}:{int(m.group('verse'))}"
        records.append([ref, line[: m.start()], line[m.end():]])
    return [(r, h, b) for r, h, b in records]


def _vocabulary(bodies) -> Counter[str]:
    """Words of the verses as written (case kept); a word with markup between two of its
    letters is left out, as it may be two words."""
    vocab: Counter[str] = Counter()
    for body in bodies:
        for word in _MARKED_WORD.findall(_TAGS.sub("\0", _NOTE.sub(" ", body))):
            if "\0" not in word:
                vocab[word] += 1
    return vocab


def _clean(raw: str, language: str, vocab_lower: Counter[str], counts: Counter[str]) -> str:
    """Plain text of one raw verse (or heading); `counts` gets what was changed."""
    text = _NOTE.sub(" ", raw)
    text = _TAGS.sub(lambda m: _markup_gap(m, language, vocab_lower, counts), text)
    text, cut = _APPENDIX_GAP.subn("", text)
    if cut:
        counts["appendix_cut"] += 1
    text, n = _SPEAKER.subn(" ", text)
    if n:
        counts["speaker_labels"] += n
    text = _SPACES.sub(" ", text).strip()
    text, n = _SUBSCRIPTION.subn("", text)
    if n:
        counts["subscriptions"] += 1
    return text


def _markup_gap(m: re.Match, language: str, vocab_lower: Counter[str], counts: Counter[str]) -> str:
    """What replaces the run of tags `m`: a space where it separated two words, else ""."""
    text = m.string
    if m.start() == 0 or m.end() == len(text):
        return ""
    left, right = text[m.start() - 1], text[m.end()]
    if not right.isalnum() or not (left.isalnum() or left in _CLOSING):
        return ""
    if left.isalnum() and language == "es":
        word_before = _WORD_END.search(text, max(0, m.start() - 40), m.start())
        word_after = _WORD.match(text, m.end())
        if word_before and word_after and _enclitic(
            word_before.group(0), word_after.group(0),
            _NEXT_WORD.match(text, word_after.end()).group(1), vocab_lower
        ):
            counts["enclitics_joined"] += 1
            return ""
    counts["spaces_at_markup"] += 1
    return " "


def _enclitic(left: str, right: str, following: str, vocab_lower: Counter[str]) -> bool:
    """Whether Spanish `right`, glued to `left` by markup, is a pronoun attached to the
    verb `left` (one word) rather than a word of its own, by the rule of `parse_diatheke`.
    `following` is the word after `right` ("" at punctuation or the end)."""
    if not _CLITICS.fullmatch(right):
        return False
    low = left.lower()
    if vocab_lower[low + right.lower()] > 0 or vocab_lower[low] == 0:
        return True
    if left.islower() and _unaccented(low).endswith(_VERB_ENDINGS):
        return True
    # A pronoun before a verb or an article before a noun is not followed by these.
    return following == "" or following.lower() in _PREPOSITIONS


def _unaccented(word: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFD", word) if not unicodedata.combining(c))


def _chapter_capitals(verse: str, vocab: Counter[str], counts: Counter[str]) -> str:
    """`verse` with its first word in capitals, and the capital words right after it (the
    chapter's opening: "EN el", "YO DIJE:"), written as the text most often writes each;
    a word followed by "." (ALEPH. of Psalm 119) is skipped."""
    for m in _CAPS_WORD.finditer(verse):
        if not m.group(0).isupper() or verse[m.end():m.end() + 1] == ".":
            continue
        end = m.end()
        while (nxt := _CAPS_WORD.match(verse, end + 1)) and verse[end] == " " and nxt.group(0).isupper():
            end = nxt.end()
        words = [_usual_case(w, vocab) for w in verse[m.start():end].split(" ")]
        before = verse[: m.start()].rstrip().rstrip("¡¿(“‘\"'").rstrip()
        if not before or before[-1] in ".:!?":
            words[0] = words[0][0].upper() + words[0][1:]
        counts["chapter_capitals"] += 1
        return verse[: m.start()] + " ".join(words) + verse[end:]
    return verse


def _usual_case(word: str, vocab: Counter[str]) -> str:
    """`word` in lower case, or with a capital first letter if `vocab` holds it more often so."""
    lower = word.lower()
    title = lower[0].upper() + lower[1:]
    return title if vocab[title] > vocab[lower] else lower


# ---------------------------------------------------------------------------------------
# Alignment and splits


def verse_key(ref: str) -> tuple[int, int, int] | None:
    """(book index in BOOKS, chapter, verse) of a reference such as "I John 3:16", or None
    for a book outside the 66 (the deuterocanon) or a malformed reference."""
    m = _REF_KEY.match(ref)
    if m is None or m.group("book") not in _BOOK_INDEX:
        return None
    return _BOOK_INDEX[m.group("book")], int(m.group("chapter")), int(m.group("verse"))


def align(english: dict[str, str], spanish: dict[str, str], *,
          check_versification: bool = True) -> list[tuple[str, str, str, str]]:
    """(book, reference, english, spanish) of each verse of the 66 books that both sides
    hold with non-empty text, in canonical order. The sides are matched by `verse_key`
    (book index, chapter, verse); the reference and book are the English side's.

    check_versification: also leave out the verses where the two translations divide the
        text differently (rules below); False keeps every verse both hold.

    The modules share one verse numbering, but the Reina-Valera's own division of the text
    differs in places, and its text then sits under other numbers: its Numbers 13 starts
    with the verse the WEB prints as 12:16 (leaving 12:16 empty), its Job 39 with 38:39,
    its Jonah 2 with 1:17; elsewhere a verse is split or merged differently (the WEB
    moves Romans 16:25-27 into 14:23). Such a shift makes the verse pairs of a chapter
    differ in length, which the rules measure by the mean over the chapter's pairs of
    |ln(characters English / characters Spanish)|: the median chapter scores 0.11 and the
    99th percentile 0.20, shifted ones 0.25 to 0.53. A chapter of at least
    SHIFTED_CHAPTER_MIN pairs is left out whole if it scores above SHIFTED_CHAPTER_RATIO,
    or above NEAR_GAP_RATIO when it is next to a gap (`_gap_chapters`: a verse with text on
    one side only, in the chapter or at the end of the chapter before). A single pair is
    left out if one side is more than VERSE_RATIO times as long as the other.
    `alignment_counts` says how many pairs each rule left out.
    """
    return _align(english, spanish, check_versification)[0]


def alignment_counts(english: dict[str, str], spanish: dict[str, str]) -> dict[str, int]:
    """How many verses each side printed and holds with text in the 66 books, how many
    of them are on one side only, how many are on both, how many of those the checks of
    `align` leave out (by rule), and how many pairs remain."""
    return _align(english, spanish, True)[1]


def _align(english: dict[str, str], spanish: dict[str, str],
           check: bool) -> tuple[list[tuple[str, str, str, str]], dict[str, int]]:
    en = {k: (ref, text) for ref, text in english.items() if text and (k := verse_key(ref)) is not None}
    es = {k: text for ref, text in spanish.items() if text and (k := verse_key(ref)) is not None}
    both = sorted(en.keys() & es.keys())
    counts = {
        "english_printed": len(english),
        "spanish_printed": len(spanish),
        "english_canonical_nonempty": len(en),
        "spanish_canonical_nonempty": len(es),
        "english_only": len(en.keys() - es.keys()),
        "spanish_only": len(es.keys() - en.keys()),
        "both": len(both),
    }
    if check:
        near_gap = _gap_chapters(set(en), set(es))
        ratio = {k: abs(math.log(len(en[k][1]) / len(es[k]))) for k in both}
        by_chapter: dict[tuple[int, int], list[float]] = {}
        for k in both:
            by_chapter.setdefault(k[:2], []).append(ratio[k])
        shifted = {
            c for c, r in by_chapter.items()
            if len(r) >= SHIFTED_CHAPTER_MIN
            and sum(r) / len(r) > (NEAR_GAP_RATIO if c in near_gap else SHIFTED_CHAPTER_RATIO)
        }
        kept = [k for k in both if k[:2] not in shifted]
        counts["dropped_shifted_chapters"] = len(both) - len(kept)
        both = [k for k in kept if ratio[k] <= math.log(VERSE_RATIO)]
        counts["dropped_uneven_verses"] = len(kept) - len(both)
    counts["pairs"] = len(both)
    return [(BOOKS[k[0]], en[k][0], en[k][1], es[k]) for k in both], counts


def _gap_chapters(en: set[tuple[int, int, int]], es: set[tuple[int, int, int]]) -> set[tuple[int, int]]:
    """(book, chapter) of the chapters next to a gap: those with a verse on one side only,
    and those after a chapter whose last verses are on one side only."""
    one_side = en ^ es
    last: dict[tuple[int, int], int] = {}
    for b, c, v in en | es:
        last[b, c] = max(last.get((b, c), 0), v)
    chapters = set()
    for b, c, v in one_side:
        chapters.add((b, c))
        if all((b, c, w) in one_side for w in range(v, last[b, c] + 1)):
            chapters.add((b, c + 1))
    return chapters


def split_of(book: str) -> str:
    """'val' for VAL_BOOKS, 'test' for TEST_BOOKS, 'train' for any other book."""
    if book in VAL_BOOKS:
        return "val"
    if book in TEST_BOOKS:
        return "test"
    return "train"


def split_by_book(pairs: list[tuple[str, str, str, str]]) -> dict[str, list[tuple[str, str, str, str]]]:
    """The pairs of `align` by split (`split_of` their book), in their order."""
    splits: dict[str, list[tuple[str, str, str, str]]] = {s: [] for s in SPLITS}
    for pair in pairs:
        splits[split_of(pair[0])].append(pair)
    return splits
