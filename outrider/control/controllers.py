"""Speculation-length controllers: how deep to draft this round.

    fixed:N     always N deep
    adaptive    a moving average of the acceptance rate, with hysteresis: one deeper after
                rounds that accept most drafts, one shallower after rounds that accept few
    cost        the marginal criterion (after LibraSpec): draft one token more only while the
                expected extra committed tokens pay for the extra verify (and draft) time, using
                per-position acceptance estimates, the drafter's own confidence where it has one,
                and the target's verify-cost profile measured on this machine

A controller sees only round statistics: it never changes what is committed, so every
controller is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..drafters.base import Budget
from ..errors import ConfigError
from ..spec.tree import depths
from ..spec.types import DraftTree, VerifyResult


class Controller(Protocol):
    name: str
    max_depth: int

    def start(self, seq_id: int) -> None: ...

    def budget(self, seq_id: int) -> Budget: ...

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None: ...

    def observe_draft_time(self, seconds_per_depth: float) -> None:
        """A proposal took this long per depth drafted (measured by the speculator)."""


class FixedController:
    def __init__(self, depth: int):
        self.name = f"fixed:{depth}"
        self.max_depth = depth

    def start(self, seq_id: int) -> None:
        pass

    def budget(self, seq_id: int) -> Budget:
        return Budget(depth=self.max_depth, nodes=self.max_depth)

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def observe_draft_time(self, seconds_per_depth: float) -> None:
        pass  # the depth is fixed


@dataclass
class _Moving:
    depth: int
    rate: float = 0.5


class AdaptiveController:
    """Depth follows an exponential moving average of the per-round acceptance rate."""

    def __init__(self, max_depth: int = 8, start: int = 4, alpha: float = 0.3,
                 raise_above: float = 0.75, lower_below: float = 0.35):
        self.name = "adaptive"
        self.max_depth = max_depth
        self.start_depth, self.alpha = start, alpha
        self.raise_above, self.lower_below = raise_above, lower_below
        self._seqs: dict[int, _Moving] = {}

    def start(self, seq_id: int) -> None:
        self._seqs[seq_id] = _Moving(self.start_depth)

    def budget(self, seq_id: int) -> Budget:
        depth = self._seqs.setdefault(seq_id, _Moving(self.start_depth)).depth
        return Budget(depth=depth, nodes=depth)

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        state = self._seqs.setdefault(seq_id, _Moving(self.start_depth))
        drafted = tree.size - 1
        if drafted == 0:
            return
        depth_reached = int(depths(tree.parents).max()) if drafted else 0
        rate = result.num_accepted / max(depth_reached, 1)
        state.rate = (1 - self.alpha) * state.rate + self.alpha * rate
        if state.rate > self.raise_above and result.num_accepted == depth_reached:
            state.depth = min(self.max_depth, state.depth + 1)
        elif state.rate < self.lower_below:
            state.depth = max(1, state.depth - 1)

    def observe_draft_time(self, seconds_per_depth: float) -> None:
        pass  # acceptance alone moves the depth


@dataclass
class _PerPosition:
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)


class CostController:
    """Draft to the depth that maximises expected committed tokens per second of round time.

    expected(d) = 1 + sum_{i<=d} prod_{j<=i} a_j   (a_j: acceptance at depth j given depth j-1
    was accepted; a decayed count per depth, prior 0.5). round_time(d) = verify_cost(d + 1) +
    d * draft_step. The depth grows while the marginal tokens per marginal second beat the
    current tokens per second (LibraSpec's marginal rule); the drafter may stop earlier on its own
    confidence through `Budget.min_confidence`.
    """

    def __init__(self, profile, max_depth: int = 12, decay: float = 0.95, prior: float = 0.5):
        self.name = "cost"
        self.profile = profile  # control.profile.VerifyCostProfile
        self.max_depth = max_depth
        self.decay, self.prior = decay, prior
        self.draft_step_s = 0.0  # drafting time per depth: a moving average of observe_draft_time
        self._seqs: dict[int, _PerPosition] = {}

    def start(self, seq_id: int) -> None:
        self._seqs[seq_id] = _PerPosition()

    def acceptance(self, seq_id: int) -> list[float]:
        """Estimated acceptance at each depth, given the depth before it was accepted.

        A depth with (almost) no observations inherits the estimate of the deepest one that has
        them, so a controller that drafted shallow so far can still find that deeper pays."""
        st = self._seqs.setdefault(seq_id, _PerPosition())
        out = []
        for d in range(self.max_depth):
            reached = st.reached[d] if d < len(st.reached) else 0.0
            accepted = st.accepted[d] if d < len(st.accepted) else 0.0
            if reached < 1.0 and out:
                out.append(out[-1])
            else:
                out.append((accepted + self.prior) / (reached + 1.0))
        return out

    def best_depth(self, accept: list[float]) -> int:
        def cost(d: int) -> float:
            return self.profile.cost(d + 1) + d * self.draft_step_s

        depth, survive, expected = 0, 1.0, 1.0
        for d in range(1, self.max_depth + 1):
            gain = survive * accept[d - 1]
            marginal = gain / max(cost(d) - cost(d - 1), 1e-9)
            if marginal < expected / cost(d - 1):
                break
            depth, survive, expected = d, gain, expected + gain
        return depth

    def budget(self, seq_id: int) -> Budget:
        accept = self.acceptance(seq_id)
        depth = self.best_depth(accept)
        # the drafter may stop where its own confidence (path probability) falls below the
        # break-even of the next marginal step
        return Budget(depth=depth, nodes=depth, min_confidence=self._break_even(depth))

    def _break_even(self, depth: int) -> float:
        if depth == 0:
            return 1.0
        c0, c1 = self.profile.cost(1), self.profile.cost(depth + 1)
        return max(0.0, min(1.0, (c1 - self.profile.cost(depth)) / max(c0, 1e-9) * 0.5))

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        st = self._seqs.setdefault(seq_id, _PerPosition())
        reached = int(depths(tree.parents).max()) if tree.size > 1 else 0
        for lst in (st.reached, st.accepted):
            lst.extend([0.0] * (self.max_depth - len(lst)))
            for i in range(len(lst)):
                lst[i] *= self.decay
        for d in range(min(reached, result.num_accepted + 1, self.max_depth)):
            st.reached[d] += 1.0
            if d < result.num_accepted:
                st.accepted[d] += 1.0

    def observe_draft_time(self, seconds_per_depth: float) -> None:
        self.draft_step_s = 0.8 * self.draft_step_s + 0.2 * seconds_per_depth


def parse_controller(text: str, profile_factory=None) -> Controller:
    """`fixed:N`, `adaptive[:MAX]` or `cost[:MAX]`; `profile_factory()` gives the cost profile."""
    kind, _, arg = text.partition(":")
    try:
        number = int(arg) if arg else None
    except ValueError:
        number = -1
    if kind == "fixed" and number is not None and 0 <= number <= 64:
        return FixedController(number)
    if kind == "adaptive" and (number is None or 1 <= number <= 64):
        return AdaptiveController(max_depth=number or 8)
    if kind == "cost" and (number is None or 1 <= number <= 64):
        if profile_factory is None:
            raise ConfigError("--controller cost needs the target's verify-cost profile")
        return CostController(profile_factory(), max_depth=number or 12)
    raise ConfigError(f"--controller {text!r}: use fixed:N (0-64), adaptive[:MAX] or cost[:MAX]")
