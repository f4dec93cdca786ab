"""README.md and docs/*.md: every ```python block runs as written, every relative link points
at a file or folder that is there, the two commands open the README, and the README's table of
mechanisms says what the registry declares."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# packages of memattn's extras that a block may import; `make test` installs them all
OPTIONAL = {"transformers", "peft", "lm_eval", "accelerate", "datasets", "tokenizers", "matplotlib"}

FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


SNIPPETS = [(page, i) for page in PAGES for i in range(len(blocks(page)))]


def test_the_pages_are_there():
    assert README.is_file() and len(PAGES) > 1, "README.md and docs/*.md"


def test_readme_opens_with_the_two_commands():
    first = re.search(r"```sh\n(.*?)```", README.read_text(), flags=re.S).group(1)
    assert [line.split("#")[0].strip() for line in first.strip().splitlines()] == ["make demo", "make test"]


@pytest.mark.parametrize(("page", "index"), SNIPPETS, ids=[f"{name(p)}[{i}]" for p, i in SNIPPETS])
def test_python_snippet_runs(page, index):
    code = compile(blocks(page)[index], f"{name(page)}[python block {index}]", "exec")
    try:
        exec(code, {"__name__": f"snippet_{index}"})
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{name(page)} block {index} needs {e.name} (one of memattn's extras)")
        raise


def links(page: Path) -> list[str]:
    """The targets of page's markdown links and images, outside code."""
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_relative_links_point_at_something(page):
    broken = []
    for target in links(page):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{name(page)}: links to nothing: {', '.join(broken)}"


def test_links_are_found():
    assert "docs/front_page.png" in links(README) and "docs/mechanisms.md" in links(README)


def test_readme_lists_every_mechanism_and_what_the_registry_says_of_its_state_and_streaming():
    """One row per registered mechanism; its state column says what the registry declares
    (fixed, grows, or grows unless an option bounds it; — for a mechanism that is not causal),
    its last column what `memattn info --mechanisms` prints: yes, with options, not shown, or —."""
    from memattn.layers.base import mechanisms

    section = README.read_text().split("## Mechanisms", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            rows[cells[0].strip("`")] = (cells[-2].split(" (")[0], cells[-1])
    expected = {}
    for key, mech in mechanisms().items():
        if not mech.causal:
            expected[key] = ("—", "—")
            continue
        fixed = mech.fixed_size(mech.options())
        state = "fixed" if fixed else "grows"
        if mech.streams(mech.options()):
            expected[key] = (state, "yes")
        elif callable(mech.streaming):
            expected[key] = (state, "with options")
        else:
            expected[key] = (state, "not shown")
    assert rows == expected
    # a state that an option bounds says so beside "grows"
    bounded = [key for key, mech in mechanisms().items() if callable(mech.fixed_state)]
    assert all("(fixed with" in section.split(f"| `{key}` |", 1)[1].split("\n", 1)[0] for key in bounded)


def test_the_mechanisms_page_lists_every_mechanism_with_its_state_and_options():
    """docs/mechanisms.md's table: each registered mechanism in one row, every name of a row
    registered; the decoding-state column says what the registry declares (grows, fixed size, a
    bound by an option beside "grows", — with "encoders only" for a mechanism that is not
    causal); every `attention.OPTION` a row names is an option of each of its mechanisms, with
    the choices its type allows where it lists them (`=a|b`)."""
    import dataclasses
    import typing

    from memattn.layers.base import mechanisms

    page = ROOT / "docs" / "mechanisms.md"
    table = page.read_text().split("| config string |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        for key in re.findall(r"`([^`]+)`", cells[0]):
            assert key not in rows, f"{key}: two rows"
            rows[key] = cells[1].replace("\\|", "|"), cells[-1]
    registered = mechanisms()
    assert set(rows) == set(registered)
    for key, (what, state) in rows.items():
        mech = registered[key]
        if not mech.causal:
            assert state == "—" and "encoders only" in what, key
        elif mech.fixed_size(mech.options()):
            assert "fixed size" in state and "grows" not in state, key
        else:
            assert "grows" in state, key
            assert ("(fixed size with" in state) == callable(mech.fixed_state), key
        fields = {f.name: f for f in dataclasses.fields(mech.options())}
        types = typing.get_type_hints(type(mech.options()))
        for option, choices in re.findall(r"`attention\.(\w+)(?:=([\w|+-]+))?", what):
            assert option in fields, f"{key}: attention.{option} is not one of its options"
            if choices and "|" in choices:
                assert set(choices.split("|")) == set(typing.get_args(types[option])), (key, option)
