"""docs/adding-a-method.md runs (issue 24 item 5).

Its ```python test blocks run in order in one fresh module: the example drafter and controller,
registered through the public hooks (drafters/registry.py `register`, control/controllers.py
`register_controller`), and the doc's own checks. Then, independently of what the doc asserts:

- every method of its ```toml test block parses (bench/methods.py), and at least one of them uses
  the doc's drafter and one the doc's controller;
- each of those methods' greedy output on a tiny random model is the autoregressive output, token
  for token, and drafts something;
- the methods file runs as a bench on that model (tests/fixtures/prompts.jsonl): the audit passes.

A traceback from a block names docs/adding-a-method.md and the doc's own line.
"""

from __future__ import annotations

import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
from enumerate_law import one_thread

from outrider.bench.methods import parse_config
from outrider.control import controllers
from outrider.drafters import registry

DOC = Path(__file__).resolve().parent.parent / "docs" / "adding-a-method.md"
FIXTURES = Path(__file__).parent / "fixtures"
FENCE = re.compile(r"^```(\w+)[ \t]+test[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of every ```LANGUAGE test block, in order."""
    return [(text.count("\n", 0, m.start(2)), m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


def run_blocks(text: str) -> types.ModuleType:
    """Execute the ```python test blocks in one fresh module; its line numbers are the doc's."""
    module = types.ModuleType("adding_a_method_doc")
    module.__file__ = str(DOC)
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        for line, code in blocks(text, "python"):
            exec(compile("\n" * line + code, str(DOC), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


@pytest.fixture(scope="module")
def doc():
    """The doc's text, after its blocks ran; the drafters and controllers it registered are
    removed afterwards."""
    text = DOC.read_text()
    before = set(registry.entries())
    try:
        with one_thread():
            run_blocks(text)
        yield text, sorted(set(registry.entries()) - before)
    finally:
        for name in set(registry.entries()) - before:
            registry.unregister(name)
        for _, toml in blocks(text, "toml"):
            for method in tomllib.loads(toml).get("method", []):
                kind = str(method.get("controller", "")).partition(":")[0]
                if kind not in controllers.BUILT_IN:
                    controllers.unregister_controller(kind)


def methods_file(text: str) -> dict:
    (_, toml), = blocks(text, "toml")  # exactly one methods file
    return tomllib.loads(toml)


def test_the_doc_marks_its_runnable_blocks():
    text = DOC.read_text()
    assert len(blocks(text, "python")) >= 4 and len(blocks(text, "toml")) == 1
    assert "```python test" in text.split("## 1.")[0]  # the convention is stated at the top


def test_the_methods_file_parses_and_uses_the_doc_drafter_and_controller(doc):
    text, added = doc
    config = parse_config(methods_file(text), "docs/adding-a-method.md")
    ours = [m for m in config.methods if m.spec]
    assert added and {m.spec.kind for m in ours} & set(added)  # the drafter registered by the doc
    assert any(m.spec.controller.partition(":")[0] not in controllers.BUILT_IN for m in ours)
    assert "suffix" in {m.spec.kind for m in ours}


def test_greedy_speculative_output_is_autoregressive(doc, tiny_folders):
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import Speculator
    from outrider.weights.loader import load_decoder

    text, _ = doc
    folder = tiny_folders["llama"]
    target = load_decoder(folder, "cpu")
    prompts = [[10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [40, 41, 7, 40, 41, 9, 40, 41]]
    requests = [Request(p, 16) for p in prompts]
    with one_thread():
        plain = [c.token_ids for c in generate_ids(target, requests, set())]
        for method in parse_config(methods_file(text), "doc").methods:
            spec = Speculator.build(method.spec, target, folder)
            done = generate_ids(target, requests, set(), speculation=spec)
            assert [c.token_ids for c in done] == plain, method.name
            assert sum(c.round_stats.drafted for c in done) > 0, method.name


def test_the_methods_file_runs_as_a_bench_on_a_tiny_model(doc, tiny_folders):
    from outrider.bench.run import plan, run_bench
    from outrider.bench.table import summary_table

    text, _ = doc
    raw = methods_file(text) | {"models": [str(tiny_folders["llama"])], "prompts": 2, "max_new_tokens": 8,
                                "workloads": [f"jsonl:{FIXTURES / 'prompts.jsonl'}"]}
    config = parse_config(raw, "docs/adding-a-method.md")
    results = run_bench(plan(config, log=lambda msg: None), threads=1, progress=False)
    assert [r["method"] for r in results["runs"]] == ["autoregressive"] + [m.name for m in config.methods]
    assert results["audit"]["ok"] and "lossless audit: ok" in summary_table(results)


def test_the_controller_hook_refuses_taken_names_and_lists_registered_ones(doc):
    from outrider.control.controllers import parse_controller, register_controller
    from outrider.errors import ConfigError

    text, _ = doc
    ours = {m.spec.controller.partition(":")[0] for m in parse_config(methods_file(text), "doc").methods}
    (name,) = ours - set(controllers.BUILT_IN)  # the doc's controller
    for taken in (name, "fixed", "cost"):
        with pytest.raises(ValueError, match="already registered"):
            register_controller(taken, lambda argument: None)
    with pytest.raises(ValueError, match="without ':'"):
        register_controller("a:b", lambda argument: None)
    with pytest.raises(ConfigError, match=rf"^--controller 'warp': use fixed:N \(0-64\), .* or {name}"):
        parse_controller("warp")
