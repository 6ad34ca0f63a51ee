"""LibraSpec: verify a drafted node only while its expected gain pays for its verify cost.

Lin, Feng, Lv et al., "LibraSpec: Dynamic Diffusion-Based Speculative Decoding via
Marginal-Gain-Driven Optimization", arXiv 2608.08721 (2026). The paper's question, for drafters
that propose a whole block at once (diffusion drafters such as DFlash), is not how many tokens to
draft but how many of the drafted ones are worth verifying. A round that verifies n drafts
besides the root commits, in expectation,

    E(n) = 1 + g_1 + ... + g_n          g_i: node i's *gain*, the chance it is accepted, estimated
                                        by its confidence (DraftTree.confidence: the drafter's
                                        probability of the node's path)

tokens in T(n) = T_draft + C(1 + n) seconds (C: the target's verify cost for that many tokens,
measured on this machine: profile.py and, for a batch, batch_cost.py, scaled by the verifies
timed lately; T_draft: the drafting, already spent, as recent rounds took it). One more node
raises the speed-up E / T exactly when

    g_{n+1} * T(n)  >=  E(n) * (C(n + 2) - C(n + 1))            (the marginal criterion)

and `trim` adds nodes best first while it holds, stopping at the first that fails (the paper's
iteration; with gains falling and costs convex it stops at the best length). A round of B
sequences is one forward padded to its widest tree: the batch form widens the round one token at
a time, weighing the gains that widening adds over all sequences against C(B, W + 1) - C(B, W)
with E = B + the gains kept so far; a node that fits in the padding costs nothing more. The
controller drafts up to MAX deep and trims what came back. A
drafter whose drafting grows with depth (a head or a draft model: one forward per depth) is also
told, through `Budget.min_confidence`, the path confidence below which drafting one more token
does not pay: the same criterion with the gain expected of the next draft against its drafting
step and its share of the wider verify, at the recent rounds' rate of committed tokens per
second (`floor`; chains stop after the first draft below it, trees stop expanding such nodes).
A block drafter (DFlash: one forward for the whole block) drafts its block and is trimmed, the
paper's setting: it needs nothing more than confidences on its trees.

Exactness. Trimming only removes drafts, keeping every kept node's ancestors, so greedy
verification and the tree walk (drafts chosen apart from the verifier's draws) stay exact for any
such subset. A tree whose verifier reads q (a sampled chain: rejection sampling; sampled siblings:
multi-draft) is trimmed by rules that never look at a node's own token: the verifiers assume each
kept child is a draw from q given its parent, and keeping a draw because of its own probability
would select among the draws (tests/test_libraspec_rule.py shows the bias). So there a node's
gain is its parent's confidence times Σ_x q(x)^2 (the expected q of a draw from the parent's
row), and a parent's children are kept or dropped together (one step: the family's gain is the
chance that one of its m draws is accepted at that rate, 1 - (1 - Σq²)^m); whether a family is
kept depends only on its ancestors and on nodes that are not its own descendants, so given that
it is kept its draws are still independent draws from q (a stopping rule). The trims themselves
(`Offer`, `marginal_trim`, `threshold_trim`) are in libraspec_trim.py; here, the controllers.

    libraspec[:MAX]      LibraSpec, drafting up to MAX deep (default 8)
    threshold:T[,MAX]    the plain confidence threshold it is compared with: verify nodes whose
                         gain is at least T (the same gains, so sampled trees stay exact)
"""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError
from ..spec.tree import depths
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import PerSequence
from .controllers import register_controller
from .cost import CostController
from .libraspec_trim import marginal_trim, threshold_trim

DEFAULT_MAX = 8


class _DraftFit:
    """seconds = fixed + depth * step over recent proposals (decayed least squares; depth: the
    deepest node the round drafted), for the drafting floor."""

    def __init__(self):
        self.sums = [0.0] * 5  # decayed sums of 1, d, t, d^2, d * t
        self.fixed = self.step = 0.0

    def add(self, depth: int, seconds: float) -> None:
        for i, value in enumerate((1.0, depth, seconds, depth * depth, depth * seconds)):
            self.sums[i] = 0.8 * self.sums[i] + value
        n, sd, st, sdd, sdt = self.sums
        spread = sdd / n - (sd / n) ** 2
        if spread > 0.05:
            self.step = max(0.0, (sdt / n - sd / n * st / n) / spread)
            self.fixed = max(0.0, st / n - self.step * sd / n)
        else:  # the depth has not varied: split as if the fixed part were one step
            self.step = self.fixed = st / n / (sd / n + 1.0)


class LibraSpecController(PerSequence):
    """`libraspec[:MAX]`: draft up to MAX deep, verify what pays (see the module's notes)."""

    def __init__(self, profile_factory, max_depth: int = DEFAULT_MAX, batch_profile_factory=None):
        """profile_factory() -> control.profile.VerifyCostProfile (called when first needed);
        batch_profile_factory(max_batch) -> a batch_cost.BatchCostProfile, or None (a batch priced
        from the one-sequence profile by rows)."""
        self.name = "libraspec" if max_depth == DEFAULT_MAX else f"libraspec:{max_depth}"
        self.max_depth = max_depth
        self._profile_factory = profile_factory
        self._batch_factory = batch_profile_factory
        self._prices: CostController | None = None  # its measured costs and their live scales
        self.draft = _DraftFit()
        self._draft_share = 0.0  # the last proposal's time, one sequence's share
        self._draft_mean = 0.0  # a moving average of it over the rounds before this one
        self._timed = False  # the first proposal is not fitted (it pays first touches)
        # what the drafting floor weighs (moving averages over recent rounds): the committed
        # tokens per second of round time, the share a drafted token adds to its path's
        # confidence, and the kept tree's size
        self.rate: float | None = None
        self.share = 0.5
        self.width = 1.0
        self._round = [0.0, 0.0, 0]  # this round: drafting seconds, verify seconds, tokens committed
        self.drafted = self.verified = 0  # nodes proposed and kept for verification, in all

    @property
    def prices(self) -> CostController:
        if self._prices is None:
            profile = self._profile_factory() if self._profile_factory else None
            if profile is None:
                raise ConfigError("--controller libraspec needs the target's verify-cost profile")
            self._prices = CostController(profile, self.max_depth, batch_profile=self._batch_factory)
        return self._prices

    def verify_cost(self, batch_size: int, width: float) -> float:
        """Seconds for this round's verify forward: `batch_size` sequences padded to `width` tokens
        (measured, scaled by what the recent verifies took against the measurement)."""
        prices = self.prices
        if batch_size <= 1:
            return prices.scale_one * prices.profile.cost(width)
        return prices.scale * prices.batch_cost(batch_size, width)

    # -- the protocol ---------------------------------------------------------------------------
    def start(self, seq_id: int) -> None:
        pass  # no per-sequence state: the rule reads each round's drafts

    def finish(self, seq_id: int) -> None:
        pass

    def budget(self, seq_id: int) -> Budget:
        return self.budgets([seq_id], 1, lambda depth: depth)[0]

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        return [Budget(self.max_depth, nodes_for(self.max_depth), self.floor(len(seq_ids), batch_size))
                ] * len(seq_ids)

    def floor(self, drafting: int, batch_size: int) -> float:
        """The path confidence c below which drafting one more token does not pay: the marginal
        criterion with the gain expected of the next draft (c times the share a drafted token
        has kept of its parent's confidence lately) against what it adds to the round, one
        sequence's share of a drafter step and of the wider verify, at the round's recent rate
        of committed tokens per second. 0 until a round has been timed. A block drafter's step
        costs nothing; the floor then only spares the trim nodes it would drop anyway."""
        if self.rate is None:
            return 0.0
        wider = self.verify_cost(batch_size, self.width + 1.0) - self.verify_cost(batch_size, self.width)
        return min(1.0, self.rate * (self.draft.step + wider / max(drafting, 1)) / max(self.share, 1e-3))

    def trim(self, seq_ids: list[int], trees: list[DraftTree], batch_size: int) -> list[DraftTree]:
        """LibraSpec's marginal rule over this round's trees. The drafting time it weighs is what
        recent rounds took per sequence, not this one's: this one's depends on how deep the
        drafter went, which depends on the very drafts being trimmed (a sampled chain stops at
        its own confidence), and no rule for a tree verified against q may look at those."""
        self._close_round()
        kept = marginal_trim(trees, batch_size, lambda width: self.verify_cost(batch_size, width),
                             self._draft_mean * len(trees))
        reached = max((int(depths(t.parents).max()) for t in trees if t.size > 1), default=0)
        if reached and self._timed:
            self.draft.add(reached, self._draft_share)
            self._draft_mean += (0.2 if self._draft_mean else 1.0) * (self._draft_share - self._draft_mean)
        self._timed = self._timed or reached > 0
        self._round[0] = self._draft_share * len(trees)
        shares = [c / p for t in trees if t.confidence is not None and t.size > 1
                  for c, p in zip(t.confidence[1:].tolist(), t.confidence[t.parents[1:]].tolist()) if p > 0]
        if shares:
            self.share += 0.2 * (sum(shares) / len(shares) - self.share)
        self.width += 0.2 * (sum(t.size for t in kept) / max(len(kept), 1) - self.width)
        self.drafted += sum(t.size - 1 for t in trees)
        self.verified += sum(t.size - 1 for t in kept)
        return kept

    def _close_round(self) -> None:
        """The last round's committed tokens per second into the moving average."""
        draft_s, verify_s, tokens = self._round
        if verify_s > 0 and tokens:
            rate = tokens / (draft_s + verify_s)
            self.rate = rate if self.rate is None else self.rate + 0.2 * (rate - self.rate)
        self._round = [0.0, 0.0, 0]

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        self._round[2] += len(result.tokens)  # training-free: the rule learns nothing else from acceptance

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        self._draft_share = seconds

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        self._round[1] += seconds
        self.prices.observe_verify_time(batch_size, width, seconds)

    def prepare(self, max_batch: int) -> None:
        if max_batch > 1:
            self.prices.prepare(max_batch)


class ThresholdController(PerSequence):
    """`threshold:T[,MAX]`: draft up to MAX deep, stopping a path below confidence T (drafters
    that read `Budget.min_confidence`), and verify the nodes whose gain is at least T."""

    def __init__(self, threshold: float, max_depth: int = DEFAULT_MAX):
        self.name = f"threshold:{threshold:g}" + ("" if max_depth == DEFAULT_MAX else f",{max_depth}")
        self.threshold = threshold
        self.max_depth = max_depth

    def start(self, seq_id: int) -> None:
        pass

    def finish(self, seq_id: int) -> None:
        pass

    def budget(self, seq_id: int) -> Budget:
        return Budget(self.max_depth, self.max_depth, self.threshold)

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        return [Budget(self.max_depth, nodes_for(self.max_depth), self.threshold)] * len(seq_ids)

    def trim(self, seq_ids: list[int], trees: list[DraftTree], batch_size: int) -> list[DraftTree]:
        return threshold_trim(trees, self.threshold)

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        pass

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        pass

    def prepare(self, max_batch: int) -> None:
        pass


def _depth(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise ConfigError(f"{what} takes a maximum depth from 1 to 64, got {text!r}")
    return int(text)


def parse_libraspec(argument: str, profile_factory=None, batch_profile_factory=None) -> LibraSpecController:
    """`libraspec` (up to 8 deep) or `libraspec:MAX`."""
    depth = _depth(argument, "libraspec:MAX") if argument else DEFAULT_MAX
    return LibraSpecController(profile_factory, depth, batch_profile_factory)


def parse_threshold(argument: str) -> ThresholdController:
    """`threshold:T` or `threshold:T,MAX`: T a confidence in (0, 1]."""
    text, _, depth = argument.partition(",")
    try:
        threshold = float(text)
    except ValueError:
        threshold = -1.0
    if not 0.0 < threshold <= 1.0:
        raise ConfigError(f"threshold:T[,MAX] takes a confidence T in (0, 1], got {text!r}")
    return ThresholdController(threshold, _depth(depth, "threshold:T,MAX") if depth else DEFAULT_MAX)


register_controller("libraspec", parse_libraspec, usage="libraspec[:MAX]", profiles=True)
register_controller("threshold", parse_threshold, usage="threshold:T[,MAX]")
