"""Speculation-length controllers: how deep to draft this round.

    fixed:N     always N deep
    adaptive    a moving average of the acceptance rate, with hysteresis: one deeper after
                rounds that accept most drafts, one shallower after rounds that accept few
    cost        the depth of most expected committed tokens per second of round time, all
                depths weighed (not LibraSpec's marginal rule, which goes deeper only while the
                next depth pays), using per-position acceptance estimates, the drafter's own
                confidence where it has one, live draft times, and the target's verify-cost
                profile measured on this machine; now and then one deeper, so that
                an estimate gone stale is seen again. With several
                sequences in a round it prices the whole batch's verify forward (batch_cost.py)
                and picks one depth for the round, backing off as the batch grows

A controller sees only round statistics: it never changes what is committed, so every
controller is lossless.

Another controller is a class with the `Controller` methods (`PerSequence` gives the batch hooks
of one whose depth is each sequence's own business) and one `register_controller(NAME, factory)`
call, after which `--controller NAME[:ARGUMENT]` builds it (docs/adding-a-method.md). The
package's own registered controllers live in the modules of `REGISTERED_BUILT_IN`, imported before
the first registration or look-up:

    libraspec[:MAX]      LibraSpec (libraspec.py): drafts up to MAX deep, then verifies a drafted
                         node only while its confidence pays for its share of the verify cost
    threshold:T[,MAX]    the plain confidence threshold beside it: verifies nodes of confidence >= T
    entropy[:MAX]        (entropy.py) a model drafter's chain stops once, by the drafts' entropies and
                         the measured step and verify times, one more draft would lower the
                         expected tokens per second (SparseSpec-L's controller)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

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

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        """A proposal `depth` deep took `seconds` (one sequence's share; measured by the speculator)."""

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        """Budgets for the drafting sequences of one round whose verify forward carries
        `batch_size` sequences (drafting or not); nodes_for(depth): the tree nodes at that depth."""

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        """A verify forward over `batch_size` sequences padded to `width` tokens took this long."""

    def prepare(self, max_batch: int) -> None:
        """Rounds of up to `max_batch` sequences are coming: measure what that needs now."""

    def finish(self, seq_id: int) -> None:
        """The sequence ended: forget its state (a server sees an unbounded stream of them)."""

    # Optional (the speculator calls it where it exists):
    # def trim(self, seq_ids: list[int], trees: list[DraftTree], batch_size: int) -> list[DraftTree]:
    #     """The drafter's trees for these sequences -> the trees to verify, each a subtree of its own
    #     (parents before children; draft_probs and confidence rows kept with their nodes). Called
    #     after every proposal, before verification, for a round of `batch_size` sequences."""


class PerSequence:
    """The batch hooks of a controller whose budget is each sequence's own business: a round's
    budgets are each sequence's `budget`, and verify times, batch sizes and endings are ignored
    (a subclass that keeps per-sequence state overrides `finish` to drop it)."""

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        return [self.budget(s) for s in seq_ids]

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        pass

    def prepare(self, max_batch: int) -> None:
        pass

    def finish(self, seq_id: int) -> None:
        pass


class FixedController(PerSequence):
    def __init__(self, depth: int):
        self.name = f"fixed:{depth}"
        self.max_depth = depth

    def start(self, seq_id: int) -> None:
        pass

    def budget(self, seq_id: int) -> Budget:
        return Budget(depth=self.max_depth, nodes=self.max_depth)

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        pass  # the depth is fixed


@dataclass
class _Moving:
    depth: int
    rate: float = 0.5


class AdaptiveController(PerSequence):
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

    def finish(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

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

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        pass  # acceptance alone moves the depth


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

    def depth(self, best: int, most: int) -> int:
        if self.tried_from is not None:  # the round after a try, whose outcome `best` has seen
            self.interval = EXPLORE_EVERY if best > self.tried_from else min(2 * self.interval, EXPLORE_MOST)
            self.tried_from = None
        if best >= most:
            return best
        self.since += 1
        if self.since < self.interval:
            return best
        self.since, self.tried_from = 0, best
        return best + 1


class CostController:
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
            depth = 0
        depth = self._explore.setdefault(-1, _Exploration()).depth(depth, self.max_depth)
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


BUILT_IN = ("fixed", "adaptive", "cost")  # parsed by parse_controller itself
REGISTERED_BUILT_IN = ("libraspec", "entropy")  # modules of this package that call register_controller
_REGISTERED: dict[str, tuple[str, Callable[..., Controller], bool]] = {}  # name -> (usage, factory, profiles)
_LOADED = [False]


def _load_built_in() -> None:
    """Import the package's registering modules once, before any other registration (so their
    names come first in messages and cannot be taken)."""
    if not _LOADED[0]:
        _LOADED[0] = True
        for module in REGISTERED_BUILT_IN:
            importlib.import_module(f"{__package__}.{module}")


def register_controller(name: str, factory: Callable[..., Controller], usage: str | None = None,
                        profiles: bool = False) -> None:
    """Make `--controller NAME[:ARGUMENT]` build `factory(ARGUMENT)` ("" when there is no colon).

    The factory parses its argument and raises ConfigError saying what to pass (parse_controller
    prefixes "--controller 'TEXT': "); `usage` spells the name for messages, e.g. "aimd[:MAX]"
    (default: `name`). With `profiles`, the factory is called as
    `factory(ARGUMENT, profile_factory, batch_profile_factory)` (parse_controller's; either may be
    None, and the profile one may return None when options are only being checked: call them when
    first needed). The module that defines the controller calls this when it is imported.
    ValueError if another controller, built-in or registered, has the name."""
    _load_built_in()
    if not name or ":" in name or name != name.strip():
        raise ValueError(f"a controller name is a non-empty word without ':', got {name!r}")
    old = _REGISTERED.get(name)
    if name in BUILT_IN or (old is not None and old[1] is not factory):
        raise ValueError(f"a controller called {name!r} is already registered; pick another name")
    _REGISTERED[name] = (usage or name, factory, profiles)


def unregister_controller(name: str) -> None:
    """Remove a controller added with `register_controller` (tests and experiments)."""
    _REGISTERED.pop(name, None)


def parse_controller(text: str, profile_factory=None, batch_profile_factory=None) -> Controller:
    """`fixed:N`, `adaptive[:MAX]`, `cost[:MAX]` or a registered `NAME[:ARGUMENT]`;
    `profile_factory()` gives the cost profile, `batch_profile_factory(max_batch)` the batch one
    (batch_cost.py) when a batch first needs it."""
    _load_built_in()
    kind, _, arg = text.partition(":")
    if kind in _REGISTERED:
        _, factory, profiles = _REGISTERED[kind]
        try:
            return factory(arg, profile_factory, batch_profile_factory) if profiles else factory(arg)
        except ConfigError as err:
            raise ConfigError(f"--controller {text!r}: {err}") from None
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
        return CostController(profile_factory(), max_depth=number or 12, batch_profile=batch_profile_factory)
    usages = ["fixed:N (0-64)", "adaptive[:MAX]", "cost[:MAX]"] + [usage for usage, _, _ in _REGISTERED.values()]
    raise ConfigError(f"--controller {text!r}: use {', '.join(usages[:-1])} or {usages[-1]}")
