"""README.md: every ```python block runs as written; the two commands are the first ones."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_two_commands():
    first = re.search(r"```sh\n(.*?)```", README.read_text(), flags=re.S).group(1)
    assert [line.split("#")[0].strip() for line in first.strip().splitlines()] == ["make demo", "make test"]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_snippet_runs(index):
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
