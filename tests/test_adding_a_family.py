"""docs/adding-a-family.md runs: its ```python test blocks, in order, in one fresh module (the
doc's own checks: Mistral against transformers, speculation exact on it, its sliding window read (refused for Llama),
a family registered from user code, a hybrid's state that is held and not cut back). Then,
independently of what the doc asserts: Mistral is a built-in family, the family the doc registered
is gone again, and the doc states its convention before its first step.

A traceback from a block names docs/adding-a-family.md and the doc's own line."""

from __future__ import annotations

import sys
import types
from pathlib import Path

from enumerate_law import one_thread
from test_adding_a_method import blocks

from outrider.models import families

DOC = Path(__file__).resolve().parent.parent / "docs" / "adding-a-family.md"


def test_the_doc_runs(tmp_path):
    text = DOC.read_text()
    module = types.ModuleType("adding_a_family_doc")
    module.__file__ = str(DOC)
    module.WORK = tmp_path
    sys.modules[module.__name__] = module
    try:
        with one_thread():
            for line, code in blocks(text, "python"):
                exec(compile("\n" * line + code, str(DOC), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
        families.unregister_family("mylab")
    assert len(blocks(text, "python")) >= 5
    assert "```python test" in text.split("## 1.")[0]


def test_mistral_is_built_in_and_the_docs_family_is_not_left_behind():
    import pytest

    from outrider.errors import ModelError

    assert families.family_for("MistralForCausalLM").name == "mistral"
    with pytest.raises(ModelError, match="'MyLabForCausalLM' is not supported"):
        families.family_for("MyLabForCausalLM")
