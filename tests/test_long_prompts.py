"""scripts/long_prompts.py writes a jsonl workload the bench reads: one chat prompt per module."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
SCRIPT = Path(__file__).parent.parent / "scripts" / "long_prompts.py"


def test_long_prompts_make_a_jsonl_workload(tmp_path, smollm2_path):
    from outrider.bench.workloads import load_workload

    out = tmp_path / "long.jsonl"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--tokens", "40"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    workload = load_workload(f"jsonl:{out}")
    assert [p.id for p in workload.prompts] == ["textwrap.py", "fnmatch.py", "shlex.py"] and workload.chat
    assert all("```python" in p.messages[0]["content"] for p in workload.prompts)
