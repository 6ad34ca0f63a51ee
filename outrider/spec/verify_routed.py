"""A greedy verifier whose verify forward routes the target's experts by a LOSSY selection
(AcceptMoE: spec/acceptmoe.py; EdgeXpert: models/edgexpert.py).

The walk is greedy_tree's (any tree, chains too): the target's argmax at each node, so with the
selection's every-expert setting the committed tokens are exactly plain greedy decoding's. What
makes it lossy is `selection`: the round's verify forward (engine/verify.py, `Forward.run`) runs
under it, each node's MoE routing restricted to an eligible expert set, and a selection with a
`prefill_rows` runs the sequence's prompt prefill under it too (engine/loop.py). Named `-lossy`,
reached only through `--verifier NAME[:ARGS]` (spec/verifiers.py's PARAMETERIZED), never a default.
"""

from __future__ import annotations

from .verify_greedy import GreedyVerifier, follow_tree


class RoutedGreedyVerifier(GreedyVerifier):
    """greedy_tree's walk; `selection` (an expert_select.Selection) routes the verify forward."""

    lossy = True

    def __init__(self, selection):
        super().__init__(follow_tree)
        self.selection = selection

    def __call__(self, tree, target_logits, params=None, rng=None):
        result = super().__call__(tree, target_logits, params, rng)
        self.selection.committed(tree, result.accepted_nodes)
        return result

    def from_choices(self, tree, choice):
        """The walk; the selection learns which rows were committed (its quality counts, when compared)."""
        result = super().from_choices(tree, choice)
        self.selection.committed(tree, result.accepted_nodes)
        return result
