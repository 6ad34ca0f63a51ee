"""`outrider bench rollout` refuses bad plans in one line before any model loads; its records
feed the simulator (sim/cli.load_records keeps the speculating ones)."""

from __future__ import annotations

import json

import pytest

from outrider.bench.rollout import RolloutPlan
from outrider.cli import main
from outrider.cluster.sim.cli import load_records
from outrider.errors import ConfigError


@pytest.mark.parametrize("plan, words", [
    (RolloutPlan(samples=0), "--samples"), (RolloutPlan(temperature=0.0), "temperature"),
    (RolloutPlan(max_running=0), "--max-running"), (RolloutPlan(modes=("sideways",)), "--modes"),
])
def test_bad_rollout_plans_are_refused(plan, words):
    with pytest.raises(ConfigError, match=words):
        plan.check()


def test_rollout_flags_belong_to_rollout_mode(capsys):
    assert main(["bench", "--samples", "3"]) == 2
    assert "belong to `outrider bench rollout`" in capsys.readouterr().err
    assert main(["bench", "rollout", "--preset", "quick"]) == 2


def test_records_keep_the_speculating_runs(tmp_path):
    rec = {"workload": "w", "prompt": 0, "sample": 0, "prompt_tokens": 5, "max_tokens": 8, "output_tokens": 8}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"records": [{**rec, "mode": "off", "tau": 1.0}, {**rec, "mode": "on", "tau": 1.5}]}))
    assert [r["tau"] for r in load_records(str(path))] == [1.5]
    path.write_text('{"records": [{"prompt_tokens": 1}]}')
    with pytest.raises(ConfigError, match="not a rollout bench"):
        load_records(str(path))
