"""The `cost` controller: the depth of most expected committed tokens per second of round time.

Per-position acceptance estimates (shrunk towards the sequence's rate, the pool of earlier
sequences, then a prior), live draft times fitted as fixed + depth * step, and the target's
verify-cost profile measured on this machine (profile.py; for a batch, batch_cost.py), scaled by
the verify times seen lately. Now and then one round drafts one deeper (`_Exploration`), so an
estimate gone stale is seen again. `--controller cost[:MAX]` builds it (controllers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..spec.tree import depths
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import PerSequence


@dataclass
class _PerPosition:
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)


_POOL_DECAY = 0.99  # the pooled prior forgets over ~100 rounds (a sequence's own counts: `decay`)
SHRINK = 4.0  # the weight, in counts, of an acceptance estimate's prior (CostController.acceptance)


def _shrunk(accepted: float, reached: float, prior: float) -> float:
    return (accepted + SHRINK * prior) / (reached + SHRINK)


EXPLORE_EVERY, EXPLORE_MOST = 16, 256  # rounds between tries one deeper: the first interval, the longest


@dataclass
class _Exploration:
    """Every `interval` rounds one round drafts one deeper than the chosen depth. A depth that is
    not drafted is not observed, so without it an estimate gone low (a rejection or two at depth
    2) or a draft time fitted from one slow proposal kept the controller shallow, or from drafting
    at all, for good (seen on the Qwen pair:
    docs/benchmarks/2026-12-01-amd-epyc-zen5-avx512.md, Draft model: the Qwen pair with int8
    activations). The interval doubles, up to EXPLORE_MOST, while
    trying brings no deeper choice, so a try costs a drafter that never pays ~1/256 of a round."""
    interval: int = EXPLORE_EVERY
    since: int = 0
    tried_from: int | None = None  # the depth chosen when the last try went one deeper

    def depth(self, best: int, most: int, could_pay: bool = True) -> int:
        """This round's depth: `best`, or one deeper when a try is due. `could_pay` False: even
        every draft accepted would not make one deeper pay (the batch rule's bound), so no try
        is made or counted: it would cost a dear round and could not change the choice."""
        if self.tried_from is not None:  # the round after a try, whose outcome `best` has seen
            self.interval = EXPLORE_EVERY if best > self.tried_from else min(2 * self.interval, EXPLORE_MOST)
            self.tried_from = None
        if best >= most or not could_pay:
            return best
        self.since += 1
        if self.since < self.interval:
            return best
        self.since, self.tried_from = 0, best
        return best + 1


class CostController(PerSequence):
    """Draft to the depth that maximises expected committed tokens per second of round time.

    expected(d) = 1 + sum_{i<=d} prod_{j<=i} a_j   (a_j: acceptance at depth j given depth j-1
    was accepted; decayed counts per depth, shrunk towards the sequence's rate over all depths,
    that towards what earlier sequences of this controller saw, that towards 0.5: `acceptance`).
    round_time(d) = s * verify_cost(d + 1) + draft_fixed + d * draft_step (d >= 1; draft_fixed:
    what a proposal costs whatever its depth, such as a draft model's forward over the tokens
    accepted since its last one, fitted apart from the per-depth step so that it does not make
    every depth look dearer; s: measured verify time over the profile's, a moving average, since
    the draft times are measured live). The depth is the one of highest expected(d) /
    round_time(d), all depths weighed (not only while each next one pays, LibraSpec's marginal
    rule: where acceptance rises with depth the two differ); every EXPLORE_EVERY rounds or more
    (`_Exploration`) one round drafts one deeper; the drafter may stop earlier on its own
    confidence through `Budget.min_confidence`.

    A round of B > 1 sequences is one forward padded to its widest tree (models/batch.py), so the
    batch takes one depth d, the one that maximises
        (B + sum_i sum_{j<=d} prod_{l<=j} a_i,l) / (scale * batch_cost(B, 1 + nodes(d)) + d * n * draft_step)
    (n drafting sequences; `scale`: measured verify time over the table's, a moving average that
    follows the machine's load), and none unless that beats no drafting by `margin`.
    """

    def __init__(self, profile, max_depth: int = 12, decay: float = 0.95, prior: float = 0.5,
                 batch_profile=None, margin: float = 0.03):
        """profile: control.profile.VerifyCostProfile (one sequence); batch_profile: a
        batch_cost.BatchCostProfile, or a function max_batch -> one (called when a batch first
        needs it), or None: priced from `profile` by rows, cost(B, T) ~ profile.cost(B * T)."""
        self.name = "cost"
        self.profile = profile
        self.max_depth = max_depth
        self.decay, self.prior, self.margin = decay, prior, margin
        self.draft_step_s = 0.0  # drafting time per depth, and a proposal's fixed part: observe_draft_time
        self.draft_fixed_s = 0.0
        self._fit = [0.0] * 5  # decayed sums of 1, depth, seconds, depth^2, depth * seconds
        self.scale = 1.0  # measured batch verify time / the table's
        # measured one-sequence verify time / the profile's: the draft times are measured live, so
        # the verify costs they are weighed against must be too (a profile measured on a quieter
        # machine made every draft look dearer, and the depths shallower)
        self.scale_one = 1.0
        self._batch_source = batch_profile
        self._batch_table = None if callable(batch_profile) else batch_profile
        self._seqs: dict[int, _PerPosition] = {}
        # every sequence's observations, decayed slowly: a new sequence's prior. Without it each
        # sequence starts at 0.5, and beside a costly drafter (a draft model's step is ~half a
        # target step) 0.5 never pays for a first draft, so the controller never learned that
        # this pair agrees 90% of the time (the pair's tau at fixed depths:
        # docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md, Draft model: the Qwen pair).
        self._pool_reached = self._pool_accepted = 0.0  # over all depths (acceptance shrinks towards their rate)
        self._explore: dict[int, _Exploration] = {}  # per sequence; -1: the batch rounds'
        self._timed = False  # whether a proposal's time was seen (the first is not fitted)
        self.bounded_tries = True  # False: batch tries deeper even where they cannot pay (scripts/bench_backoff.py)

    def start(self, seq_id: int) -> None:
        self._seqs[seq_id] = _PerPosition()

    def finish(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._explore.pop(seq_id, None)

    def acceptance(self, seq_id: int) -> list[float]:
        """Estimated acceptance at each depth, given the depth before it was accepted: each
        depth's decayed counts shrunk towards the sequence's rate over all its depths, that towards
        the rate every sequence of this controller saw lately (the pool), and that towards `prior`
        (each by a weight of SHRINK counts). A depth seldom drafted so takes the rate of those
        that are: one rejection at depth 2 moves its estimate a little, not to half, and one
        accepted first round does not make every depth look certain (it did, per depth with a
        one-count prior: a first draft 12 deep, then, after one miss, drafting 1 deep for good)."""
        st = self._seqs.setdefault(seq_id, _PerPosition())
        pool = _shrunk(self._pool_accepted, self._pool_reached, self.prior)
        overall = _shrunk(sum(st.accepted), sum(st.reached), pool)
        return [_shrunk(st.accepted[d] if d < len(st.accepted) else 0.0,
                        st.reached[d] if d < len(st.reached) else 0.0, overall) for d in range(self.max_depth)]

    def best_depth(self, accept: list[float]) -> int:
        def cost(d: int) -> float:
            verify = self.scale_one * self.profile.cost(d + 1)
            return verify + (self.draft_fixed_s + d * self.draft_step_s if d else 0.0)

        depth, survive, expected = 0, 1.0, 1.0
        best = expected / max(cost(0), 1e-12)
        for d in range(1, self.max_depth + 1):
            survive *= accept[d - 1]
            expected += survive
            rate = expected / max(cost(d), 1e-12)
            if rate > best:
                depth, best = d, rate
        return depth

    def budget(self, seq_id: int) -> Budget:
        accept = self.acceptance(seq_id)
        depth = self._explore.setdefault(seq_id, _Exploration()).depth(self.best_depth(accept), self.max_depth)
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
        self._pool_reached *= _POOL_DECAY
        self._pool_accepted *= _POOL_DECAY
        for d in range(min(reached, result.num_accepted + 1, self.max_depth)):
            st.reached[d] += 1.0
            self._pool_reached += 1.0
            if d < result.num_accepted:
                st.accepted[d] += 1.0
                self._pool_accepted += 1.0

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        """Fit seconds = fixed + depth * step over the recent proposals (least squares, decayed);
        while the depths have not varied, split as if the fixed part were one step. The first
        proposal is not fitted: it pays what only a first one does (its memory's first touches)."""
        if depth < 1:
            return
        if not self._timed:
            self._timed = True
            return
        fit = self._fit
        for i, value in enumerate((1.0, depth, seconds, depth * depth, depth * seconds)):
            fit[i] = 0.8 * fit[i] + value
        n, sd, st, sdd, sdt = fit
        mean_d, mean_t = sd / n, st / n
        spread = sdd / n - mean_d * mean_d
        if spread > 0.05:
            self.draft_step_s = max(0.0, (sdt / n - mean_d * mean_t) / spread)
            self.draft_fixed_s = max(0.0, mean_t - self.draft_step_s * mean_d)
        else:
            self.draft_step_s = self.draft_fixed_s = mean_t / (mean_d + 1.0)

    # -- a batch of sequences -----------------------------------------------------------------
    def prepare(self, max_batch: int) -> None:
        if max_batch > 1:
            self._table(max_batch)

    def _table(self, batch_size: int):
        table = self._batch_table
        if callable(self._batch_source) and (table is None or table.batches[-1] < batch_size):
            table = self._batch_table = self._batch_source(batch_size)
        return table

    def batch_cost(self, batch_size: int, width: int) -> float:
        """Seconds for a verify forward of `batch_size` sequences, `width` tokens each (unscaled)."""
        table = self._table(batch_size)
        if table is None:
            return self.profile.cost(batch_size * width)
        return table.cost(batch_size, width)

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        if batch_size <= 1:
            return [self.budget(s) for s in seq_ids]
        accepts = [self.acceptance(s) for s in seq_ids]
        n = len(seq_ids)

        def round_time(d: int) -> float:
            drafting = n * (self.draft_fixed_s + d * self.draft_step_s) if d else 0.0
            return self.scale * self.batch_cost(batch_size, 1 + nodes_for(d)) + drafting

        survive = [1.0] * n
        tokens = float(batch_size)  # every sequence commits one token without drafts
        base = tokens / round_time(0)
        depth, best = 0, base
        for d in range(1, self.max_depth + 1):
            for i in range(n):
                survive[i] *= accepts[i][d - 1]
                tokens += survive[i]
            rate = tokens / round_time(d)
            if rate > best:
                depth, best = d, rate
        if best < base * (1 + self.margin):
            depth, best = 0, base
        # a try one deeper only where it could pay: where every drafting sequence accepting all
        # depth + 1 drafts (the most any estimate could turn out to be) beats the chosen rate.
        # Where the batch's wider verify alone forbids that (many sequences on a CPU), a try
        # costs a dear round and teaches nothing (issue 42, item 6: 16 sequences on the Xeon,
        # where a round 3 rows wide costs about 3 of 1 row, tried one every 16-256 rounds)
        deeper = min(depth + 1, self.max_depth)
        could_pay = (batch_size + n * deeper) / round_time(deeper) > best * (1 + self.margin) or not self.bounded_tries
        depth = self._explore.setdefault(-1, _Exploration()).depth(depth, self.max_depth, could_pay)
        confidence = 1.0
        if depth:
            c0 = self.batch_cost(batch_size, 1)
            step = self.batch_cost(batch_size, 1 + nodes_for(depth)) - self.batch_cost(batch_size, nodes_for(depth))
            confidence = max(0.0, min(1.0, step / max(c0, 1e-9) * 0.5))
        return [Budget(depth=depth, nodes=nodes_for(depth) if depth else 0, min_confidence=confidence)] * n

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        """A round's verify took `seconds`: the scale of the batch table (batch_size > 1) or of
        the one-sequence profile follows it (moving averages, each ratio clamped to 0.2-5)."""
        if seconds <= 0:
            return
        if batch_size <= 1:
            ratio = seconds / max(self.profile.cost(width), 1e-9)
            self.scale_one = 0.8 * self.scale_one + 0.2 * min(5.0, max(0.2, ratio))
            return
        ratio = seconds / max(self.batch_cost(batch_size, width), 1e-9)
        self.scale = 0.8 * self.scale + 0.2 * min(5.0, max(0.2, ratio))
