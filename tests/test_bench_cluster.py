"""scripts/bench_cluster.py's request bodies: per-prompt max_tokens and repeating sessions."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cluster.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_cluster", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_lengths_follow_the_prompt():
    t = _script().MixTarget("http://x", ["a", "b", "c", "d", "e"], False, 32, lengths=(16, 128))
    bodies = [t.body(i) for i in range(5)]
    assert [b["prompt"] for b in bodies] == ["a", "b", "c", "d", "e"]
    assert [b["max_tokens"] for b in bodies] == [16, 128, 16, 128, 16]
    assert all("user" not in b for b in bodies)


def test_sessions_repeat_their_prompt():
    t = _script().MixTarget("http://x", ["a", "b", "c"], False, 32, sessions=4, offset=2)
    bodies = [t.body(i) for i in range(6)]
    assert [b["user"] for b in bodies] == ["session-2", "session-3", "session-0", "session-1", "session-2", "session-3"]
    # session s sends prompt s mod 3 on every turn
    assert [b["prompt"] for b in bodies] == ["c", "a", "a", "b", "c", "a"]
    assert all(b["max_tokens"] == 32 for b in bodies)


def test_plain_target_unchanged():
    t = _script().MixTarget("http://x", [[{"role": "user", "content": "hi"}]], True, 8)
    assert t.body(0)["max_tokens"] == 8 and "messages" in t.body(0) and "user" not in t.body(0)
