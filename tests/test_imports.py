"""No import cycles in the package: the imports each module runs when it is imported (at its
top level, in `try` and `if` blocks but not under `if TYPE_CHECKING`), importing a module
also running its packages' __init__, form a graph without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "memattn"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def top_level_imports(tree: ast.Module):
    """The import statements run when the module is imported."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in top_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names}
        deps = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # the module and the packages above it
                dep = ".".join(parts[:i])
                if dep in names and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_walk_sees_the_package():
    graph = import_graph()
    assert "memattn.train" in graph and "memattn.tasks" in graph["memattn.train"]
    assert {"memattn.layers.base", "memattn.errors"} <= graph["memattn.layers.abc.mlp"]
    assert "memattn.integrations.hf_cache" in graph["memattn.integrations.convert"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []
