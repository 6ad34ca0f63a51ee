"""The named training sources of `--data` (train/data.py's SOURCES): each builder returns the
source's items (data.Item) and a line saying where they came from (paths, package pins, sha256).
"""

from __future__ import annotations

import ast
import json
import os
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from ..bench import datasets
from ..bench.workloads import CODE_EDIT_MODULES, ROLES, data_file, module_file, toolcall_messages
from ..errors import ConfigError
from .items import Item

TOOLCALL_TRAIN = ("bfcl_live_multiple", "bfcl_parallel", "bfcl_parallel_multiple")
TEST_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files(stdlib: Path) -> list[Path]:
    """The stdlib's .py files, test suites, installed packages and code-edit modules left out."""
    excluded = {p.resolve() for p in (module_file(stdlib, m) for m in CODE_EDIT_MODULES) if p is not None}
    found = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in TEST_DIRS and not d.startswith(("test", ".")))
        for name in sorted(files):
            path = Path(root) / name
            if name.endswith(".py") and not name.startswith("test") and path.resolve() not in excluded:
                found.append(path)
    return found


def _code(stdlib: Path, fixtures) -> tuple[list[Item], str]:
    files = stdlib_files(stdlib)
    items = [Item(f"code:{p.relative_to(stdlib)}", "text", path=str(p)) for p in files]
    return items, f"{stdlib} ({len(files)} .py files; tests and code-edit modules excluded)"


def _code_prompts(stdlib: Path, fixtures) -> tuple[list[Item], str]:
    items = []
    for path in stdlib_files(stdlib):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = _module_name(path, stdlib)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            summary = doc.strip().split("\n\n")[0].strip()
            user = (f"Write a Python function `{node.name}({ast.unparse(node.args)})` (as in the module "
                    f"`{module}`). What it does:\n\n{summary}\n\nReply with the function in one ```python block.")
            items.append(Item(f"code-prompts:{module}:{node.name}", "chat",
                              messages=({"role": "user", "content": user},)))
    return items, f"docstrings of public functions in {stdlib} (code-edit modules excluded)"


def _code_completions(stdlib: Path, fixtures) -> tuple[list[Item], str]:
    """HumanEval-shaped prompts: the def line(s) and docstring of every public function and method
    with a docstring, dedented; the response is the rest of the body as written."""
    items, seen = [], set()
    for path in stdlib_files(stdlib):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        module = _module_name(path, stdlib)
        for qualname, node in _public_defs(tree):
            body = node.body
            if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)) or len(body) < 2:
                continue  # no docstring, or nothing after it
            start = node.lineno - 1  # the def line (decorators left out)
            prompt = textwrap.dedent("".join(lines[start:body[0].end_lineno]))
            rest = textwrap.dedent("".join(lines[start:node.end_lineno]))[len(prompt):]
            if not prompt.endswith("\n") or not rest.strip():
                continue
            item_id = f"code-completions:{module}:{qualname}"
            if item_id not in seen:  # a name defined twice (a property's setter): the first
                seen.add(item_id)
                items.append(Item(item_id, "prompt", text=prompt, response=rest))
    return items, f"def lines and docstrings of public functions and methods in {stdlib} " \
                  "(code-edit modules excluded)"


def _module_name(path: Path, root: Path) -> str:
    """The dotted module of `path` under `root`; a root that is itself a package leads it."""
    parts = path.relative_to(root).with_suffix("").parts
    if (root / "__init__.py").is_file():
        parts = (root.name,) + parts
    return ".".join(parts).removesuffix(".__init__")


def _public_defs(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    """(qualified name, node) of the module's public functions and public classes' public methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for inner in node.body:
                if isinstance(inner, ast.FunctionDef) and not inner.name.startswith("_"):
                    yield f"{node.name}.{inner.name}", inner


def _toolcall(stdlib: Path, fixtures) -> tuple[list[Item], str]:
    items, where = [], []
    for name in TOOLCALL_TRAIN:
        path, source = data_file(name, fixtures)
        where.append(source)
        for entry in datasets.bfcl(name, path):
            items.append(Item(f"toolcall:{entry['id']}", "chat", messages=tuple(toolcall_messages(entry))))
    return items, "; ".join(where)


def _humaneval(stdlib: Path, fixtures) -> tuple[list[Item], str]:
    path, source = data_file("humaneval", fixtures)
    items = [Item(f"humaneval:{p['task_id']}", "prompt", text=p["prompt"], response=p["canonical_solution"])
             for p in datasets.humaneval(path)]
    return items, source + " (the bench workload itself: contaminated for it)"


def jsonl_items(path: Path) -> tuple[list[Item], str]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict) or sum(k in row for k in ("text", "prompt", "messages")) != 1:
            raise ConfigError(f"{where}: give one object with exactly one of 'text', 'prompt' or 'messages'")
        item_id = f"jsonl:{row.get('id', f'line{number}')}"
        if "text" in row:
            items.append(Item(item_id, "text", text=_string(row["text"], where, "text")))
        elif "prompt" in row:
            response = row.get("response")
            items.append(Item(item_id, "prompt", text=_string(row["prompt"], where, "prompt"),
                              response=None if response is None else _string(response, where, "response")))
        else:
            messages = _messages(row["messages"], where)
            response = None
            if messages[-1]["role"] == "assistant":
                response = messages.pop()["content"]
            if not messages:
                raise ConfigError(f"{where}: 'messages' holds only an assistant message; give the prompt too")
            items.append(Item(item_id, "chat", messages=tuple(messages), response=response))
    if not items:
        raise ConfigError(f"--data jsonl:{path} holds no lines")
    return items, f"{path} sha256:{datasets.sha256_of(path)}"


def _string(value, where: str, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: '{key}' must be a non-empty string")
    return value


def _messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of role/content objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] not in ROLES \
                or not isinstance(m["content"], str):
            raise ConfigError(f"{where}: messages[{i}] must be {{\"role\": one of {', '.join(ROLES)}, "
                              "\"content\": str}}")
    return [dict(m) for m in messages]


BUILDERS = {"code": _code, "code-prompts": _code_prompts, "code-completions": _code_completions,
             "toolcall": _toolcall, "humaneval": _humaneval}
CODE_SOURCES = ("code", "code-prompts", "code-completions")  # the ones that read the code roots


def build(base: str, roots: list[Path], fixtures) -> tuple[list[Item], str]:
    """The items of source `base`: a code source reads every root (each item id then names its
    root's folder when there are several), the others read none."""
    if base not in CODE_SOURCES or len(roots) == 1:
        return BUILDERS[base](roots[0], fixtures)
    items, where = [], []
    for root in roots:
        got, _ = BUILDERS[base](root, fixtures)
        prefix = f"{base}:"
        items += [replace(i, id=f"{prefix}{root.name}/{i.id[len(prefix):]}") for i in got]
        where.append(f"{root} ({len(got)})")
    return items, f"{len(roots)} folders (items in each; tests and code-edit modules excluded): {', '.join(where)}"
