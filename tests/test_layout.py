"""The package's shape: no import cycles (deferred imports included), no module importing
another's private names, and every package saying its job in its docstring's first line."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "outrider"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.with_suffix("").relative_to(PACKAGE.parent).parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(imported module, imported name) for every `from ... import` of the package in `path`."""
    found = []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if not target.startswith("outrider"):
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            found.append((sub if sub in modules else target, alias.name))
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_and_no_private_imports():
    modules = _modules()
    edges, private = {}, []
    for name, path in modules.items():
        for target, imported in _imports(name, path, modules):
            if target in modules and target != name:
                edges.setdefault(name, set()).add(target)
            if imported.startswith("_") and not imported.startswith("__") and target != name:
                private.append(f"{name} imports {target}.{imported}")
    assert _cycles(edges) == []
    assert private == []


def test_the_checks_find_a_cycle_and_a_private_import(tmp_path):
    """Negative control: the two checks above do fire."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    probe = tmp_path / "x.py"
    probe.write_text("from .y import _hidden\n")
    modules = {"outrider.x": probe, "outrider.y": tmp_path / "y.py"}
    assert _imports("outrider.x", probe, modules) == [("outrider.y", "_hidden")]


def test_every_package_says_its_job_in_one_line():
    """The first line of each package's docstring says its job (a file map may follow)."""
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init} has no docstring"
        first = doc.splitlines()[0]
        assert first.strip() and len(first) <= 120 and (len(doc.splitlines()) == 1 or not doc.splitlines()[1].strip()), \
            f"{init}: the docstring's first line is the package's job, alone"
