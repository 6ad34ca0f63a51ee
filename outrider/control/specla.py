"""SpecLA: the speculative runtime for stateful linear-attention models (seed #30, ../shared
seed-methods.md 2.30): `--controller specla[:MAX[,T]]`, with a target-aligned EAGLE-style drafter
(`--drafter eagle3:HEAD`, a head trained on the target's own features: `outrider train eagle3`)
drafting a tree (`--tree dynamic:K,N`) or a chain.

What the paper describes, and where each part is in Outrider:

- verification of chains and trees along the recurrent dependencies, topology-aware: a gated-delta
  layer verifies every node of a tree from the committed state by TreeWY's one triangular solve
  over the ancestor relation (models/gated_delta.py `tree_step`, models/delta_layer.py);
- only the accepted trajectory updated, from compact factors stored during verification: each
  node's stash (k, u, gamma) is held, nothing folded, and the commit folds the accepted path alone
  into the state (models/delta_state.py, `gated_delta.fold`);
- **confidence pruning** (here): before verification, every drafted node whose path confidence
  (the drafter's probability of its path, `DraftTree.confidence`) is below T is dropped with its
  whole subtree, so no stateful verify work (a stash row per gated-delta layer, a K/V row per
  attention layer, the products of a row) is spent on it; the drafter is also told T
  (`Budget.min_confidence`) and expands no node below it, and drafts one deeper than the trees
  the cost model kept lately (a moving average of their depth), not deeper;
- **a cost model where state bytes dominate** (here and specla_cost.py): of the nodes left, the
  tree verified is the best-first prefix (by confidence) of the size N that maximises

      (B + c * sum of the kept nodes' confidences) / (T_draft + s * roofline(bytes(N), flops(N)))

  B the round's sequences, c the calibration of the drafter's confidences against what was
  accepted lately, bytes(N) the verify's traffic counting each node's state bytes read and
  written (specla_cost.StateBytes, per layer kind), the roofline calibrated on this machine's
  measured verify profile, s the measured verify time over the roofline's (a moving average);
- a target-aligned EAGLE-style drafter: the EAGLE-3 drafter (drafters/eagle3.py), on a hybrid
  target too (tests/test_hybrid_eagle3.py).

Lossless: pruning and sizing only remove draft nodes, keeping every kept node's parent, and
greedy verification and the tree walk are exact for any such subtree. Trees whose verifier reads
q (sampled chains and siblings) are pruned by families whose gain never looks at a node's own
token (libraspec_trim.threshold_trim: the reason is in libraspec.py) and not sized further.
"""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError
from ..spec.tree import depths
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import PerSequence
from .controllers import register_controller
from .libraspec_trim import Offer, subtree, threshold_trim
from .specla_cost import Roofline, StateBytes, calibrate

DEFAULT_MAX, DEFAULT_THRESHOLD = 6, 0.05
CONTEXT = 256  # the context the cost model prices (the verify profile's: control/profile.py)


def prune(tree: DraftTree, threshold: float) -> DraftTree:
    """Confidence pruning: the nodes whose path confidence is at least `threshold` and whose
    parent is kept (so a node below it goes with its whole subtree). The tree itself when it has
    no confidences."""
    if tree.confidence is None or tree.size == 1:
        return tree
    confidence, parents = tree.confidence.tolist(), tree.parents.tolist()
    kept = [True] + [False] * (tree.size - 1)
    for node in range(1, tree.size):  # parents come first
        kept[node] = kept[parents[node]] and confidence[node] >= threshold
    return subtree(tree, [n for n in range(tree.size) if kept[n]])


def best_first(tree: DraftTree) -> list[int]:
    """A tree's drafted nodes best first by confidence, each after its parent (every prefix a
    subtree)."""
    if tree.size == 1:
        return []
    offer, order = Offer(tree), []
    while offer.best is not None:
        order.extend(offer.take().nodes)
    return order


class SpecLAController(PerSequence):
    """`specla[:MAX[,T]]`: draft up to MAX deep, expanding no node below confidence T; verify the
    nodes at or above T that the state-bytes cost model finds worth their verify cost."""

    def __init__(self, state: StateBytes | None, profile_factory, max_depth: int = DEFAULT_MAX,
                 threshold: float = DEFAULT_THRESHOLD, layout: str = "factors"):
        self.name = "specla" + ("" if (max_depth, threshold) == (DEFAULT_MAX, DEFAULT_THRESHOLD)
                                else f":{max_depth}" + ("" if threshold == DEFAULT_THRESHOLD else f",{threshold:g}"))
        self.max_depth = max_depth
        self.threshold = threshold
        self.state = state
        self.layout = layout
        self._profile_factory = profile_factory
        self._roofline: Roofline | None = None
        self.scale = 1.0  # measured verify time / the roofline's, a moving average
        self.calibration = [4.0, 4.0]  # decayed accepted drafts, decayed sum of their confidences (prior 1)
        self._draft_s = 0.0  # the last proposal's time, one sequence's share
        self._draft_mean = 0.0  # its moving average over earlier rounds
        # what the runtime did with the drafts, in all: drafted, pruned below T, left out by the
        # cost model, verified; and the last round's chosen width and the bound that priced it
        self.drafted = self.pruned = self.sized_out = self.verified = 0
        self.last_width, self.last_bound = 1, ""
        self.kept_depth = float(max_depth)  # a moving average of the verified trees' depth

    # -- the cost model ---------------------------------------------------------------------------
    @property
    def roofline(self) -> Roofline:
        if self._roofline is None:
            profile = self._profile_factory() if self._profile_factory else None
            if profile is None or self.state is None:
                raise ConfigError("--controller specla needs the target and its verify-cost profile")
            self._roofline = calibrate(self.state, profile, CONTEXT)
        return self._roofline

    def verify_seconds(self, batch_size: int, width: int) -> float:
        """A verify of `batch_size` sequences padded to `width` nodes: the roofline over the
        batch's bytes (the weights once, each sequence's state) and flops, scaled by what verifies
        took lately."""
        nbytes, flops = self._traffic(batch_size, width)
        return self.scale * self.roofline.time(nbytes, flops)

    def _traffic(self, batch_size: int, width: int) -> tuple[float, float]:
        s = self.state
        per_sequence = s.bytes(width, CONTEXT, self.layout) - s.weight_bytes
        return s.weight_bytes + batch_size * per_sequence, batch_size * s.flops(width, CONTEXT)

    @property
    def confidence_scale(self) -> float:
        """Accepted drafts per unit of the verified nodes' confidence lately (clamped 0.2-5)."""
        accepted, predicted = self.calibration
        return min(5.0, max(0.2, accepted / max(predicted, 1e-9)))

    # -- the protocol -----------------------------------------------------------------------------
    def start(self, seq_id: int) -> None:
        pass

    @property
    def depth(self) -> int:
        """How deep to draft: one deeper than the trees verified lately, at most MAX."""
        return max(1, min(self.max_depth, round(self.kept_depth) + 1))

    def budget(self, seq_id: int) -> Budget:
        return Budget(self.depth, self.depth, self.threshold)

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        return [Budget(self.depth, nodes_for(self.depth), self.threshold)] * len(seq_ids)

    def trim(self, seq_ids: list[int], trees: list[DraftTree], batch_size: int) -> list[DraftTree]:
        """Prune each tree at T, then choose the round's width by the cost model."""
        if self._draft_s:
            self._draft_mean += (0.2 if self._draft_mean else 1.0) * (self._draft_s - self._draft_mean)
        pruned = [threshold_trim([t], self.threshold)[0] if t.draft_probs is not None else prune(t, self.threshold)
                  for t in trees]
        kept = self.size(pruned, batch_size)
        self.drafted += sum(t.size - 1 for t in trees)
        self.pruned += sum(t.size - p.size for t, p in zip(trees, pruned))
        self.sized_out += sum(p.size - k.size for p, k in zip(pruned, kept))
        self.verified += sum(k.size - 1 for k in kept)
        deepest = max((int(depths(k.parents).max()) for k in kept), default=0)
        self.kept_depth += 0.2 * (deepest - self.kept_depth)
        return kept

    def size(self, trees: list[DraftTree], batch_size: int) -> list[DraftTree]:
        """The width W (nodes per sequence, the root counted; the batch is padded to it) of most
        expected committed tokens a second; each tree keeps its best W - 1 drafts. Trees with q
        or without confidences are kept whole (their size is the least width)."""
        sizable = [t.confidence is not None and t.draft_probs is None and t.size > 1 for t in trees]
        if not any(sizable):
            return trees
        orders = [best_first(t) if ok else [] for t, ok in zip(trees, sizable)]
        gains = [[float(t.confidence[n]) for n in order] for t, order in zip(trees, orders)]
        least = max([t.size for t, ok in zip(trees, sizable) if not ok] + [1])
        most = max(least, max(t.size for t in trees))
        c, draft = self.confidence_scale, self._draft_mean * len(trees)
        best_rate, best_width = -1.0, least
        for width in range(least, most + 1):
            expected = batch_size + c * sum(sum(g[: width - 1]) for g in gains)
            rate = expected / (draft + self.verify_seconds(batch_size, width))
            if rate > best_rate:
                best_rate, best_width = rate, width
        self.last_width = best_width
        self.last_bound = self.roofline.bound(*self._traffic(batch_size, best_width))
        return [subtree(t, [0] + order[: best_width - 1]) if ok else t
                for t, order, ok in zip(trees, orders, sizable)]

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        if tree.confidence is None or tree.size == 1:
            return
        accepted, predicted = self.calibration
        self.calibration = [0.95 * accepted + result.num_accepted,
                            0.95 * predicted + float(tree.confidence[1:].sum())]

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        self._draft_s = seconds

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        if seconds <= 0 or self.state is None:
            return
        ratio = seconds / max(self.roofline.time(*self._traffic(batch_size, width)), 1e-12)
        self.scale = 0.8 * self.scale + 0.2 * min(20.0, max(0.05, ratio))


def parse_specla(argument: str, profile_factory=None, batch_profile_factory=None, model=None) -> SpecLAController:
    """`specla`, `specla:MAX` or `specla:MAX,T`: MAX from 1 to 64, T a confidence in [0, 1)."""
    depth_text, _, threshold_text = argument.partition(",")
    if depth_text and (not depth_text.isdigit() or not 1 <= int(depth_text) <= 64):
        raise ConfigError(f"specla:MAX[,T] takes a maximum depth from 1 to 64, got {depth_text!r}")
    try:
        threshold = float(threshold_text) if threshold_text else DEFAULT_THRESHOLD
    except ValueError:
        threshold = -1.0
    if not 0.0 <= threshold < 1.0:
        raise ConfigError(f"specla:MAX,T takes a confidence threshold T in [0, 1), got {threshold_text!r}")
    state = StateBytes.of_model(model) if model is not None else None
    return SpecLAController(state, profile_factory, int(depth_text) if depth_text else DEFAULT_MAX, threshold)


register_controller("specla", parse_specla, usage="specla[:MAX[,T]]", reads_model=True)
