"""`--time-budget`: the step count of a run planned from the speed of its first steps.

The warmup is a fixed number of steps (BUDGET_WARMUP unless given), at least PLAN_AFTER, so the
learning rate of every step before the plan does not depend on the step count; after PLAN_AFTER
steps the count is fixed (`plan_steps`), and the run is exactly the run of `--steps N
--warmup-steps W` (`reproduce`, written to train_info.json).
"""

from __future__ import annotations

BUDGET_WARMUP = 50  # --time-budget's warmup steps (the lr before them does not depend on the step count)
PLAN_AFTER = 12  # the step count is fixed after this many steps, timed from step 2 on


def plan_steps(o, step: int, per_step: float, elapsed: float) -> int:
    """--time-budget: fix the step count (and so the cosine schedule after the warmup) so that the
    steps end within the budget, at the rate of the steps timed so far. The run is then the run
    of `--steps N --warmup-steps W` (train_info.json's `reproduce`)."""
    left = max(0.0, o.time_budget - elapsed)
    o.steps = step + int(0.97 * left / per_step)  # 3% for checkpoints and snapshots
    return o.steps


def reproduce(command: list[str], steps: int, warmup: int) -> list[str]:
    """`command` with its --time-budget replaced by the planned --steps and --warmup-steps."""
    return _without_budget(command) + ["--steps", str(steps), "--warmup-steps", str(warmup)]


def _without_budget(command: list[str]) -> list[str]:
    """`command` without its --time-budget and --warmup-steps arguments."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg in ("--time-budget", "--warmup-steps"):
            skip = True
        elif not arg.startswith(("--time-budget=", "--warmup-steps=")):
            out.append(arg)
    return out
