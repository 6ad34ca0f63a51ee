"""`--controller entropy[:MAX]`: stop drafting when the draft's entropy says one more is not worth it.

SparseSpec (arXiv 2512.01278) pairs its sparse self-draft with a draft length chosen on the fly;
this is our version of such a controller, written from that idea, not from the paper's code.
After each draft of a chain, the drafter reports the entropies (nats) of the distributions its
drafts so far came from (`Budget.stop`, honoured by the model drafters: draft-model, early-exit,
sparsespec, EAGLE-3 heads' chains). The controller turns an entropy into a chance of acceptance
with a table it learns from the rounds (six entropy bins; in each, drafts accepted over drafts the
verifier reached, decayed, with a prior of 1/2 worth one draft), so that after d drafts with
entropies h_1..h_d

    P_d = a(h_1) ... a(h_d)                the chance that all d are accepted
    E_d = 1 + P_1 + ... + P_d              tokens the round commits, in expectation
    T_d = V + A + d * S                    its seconds: the verify V, the drafting's fixed part A
                                           (a sparse self-draft's selection and gather), a step S

and it drafts one more exactly when that raises the expected step efficiency E / T:

    (E_d + P_d * a(h_d)) / (T_d + S)  >  E_d / T_d

(the next draft's entropy is not known yet; the last one's stands for it: consecutive entropies
are alike). V, A and S are measured as the run goes (A and S by a decayed least-squares line
through the proposals' times against their depths); until the first verify and proposal are
timed it drafts MAX deep. It drafts at most MAX (default 8).

Only chains from a model drafter stop early, so a tree shape with it is refused when the options are
checked (engine/speculator.py), in one line; drafters that report no entropy (suffix, n-grams) get
MAX every round, as `fixed:MAX`. A controller sees only round
statistics and never changes what is committed, so it is lossless with every drafter and
verifier; stopping depends on the distributions the drafts came from, not on the drafts drawn, so
a sampled chain's drafts are still draws from q.
"""

from __future__ import annotations

import bisect
from typing import Callable

from ..errors import ConfigError
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import PerSequence
from .controllers import register_controller

EDGES = (0.1, 0.3, 0.7, 1.5, 3.0)  # nats: six bins
DEFAULT_MAX = 8


class Line:
    """A decayed least-squares line seconds = A + S * depth through the proposals' times."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, depth: float, seconds: float) -> None:
        d = self.decay
        self.w, self.x, self.y = d * self.w + 1, d * self.x + depth, d * self.y + seconds
        self.xx, self.xy = d * self.xx + depth * depth, d * self.xy + depth * seconds

    def fit(self) -> tuple[float, float] | None:
        """(A, S): the fixed part and the seconds a step; None before a proposal is timed."""
        if self.w == 0:
            return None
        mean_x, mean_y = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mean_x * mean_x
        if var < 0.05 * max(mean_x, 1.0) ** 2 / max(self.w, 1.0) or var <= 1e-12:  # one depth seen: no slope
            return 0.0, mean_y / max(mean_x, 1.0)
        slope = (self.xy / self.w - mean_x * mean_y) / var
        if slope <= 0:
            return 0.0, mean_y / max(mean_x, 1.0)
        return max(mean_y - slope * mean_x, 0.0), slope


class EntropyController(PerSequence):
    def __init__(self, max_depth: int = DEFAULT_MAX, decay: float = 0.99):
        self.name = f"entropy:{max_depth}"
        self.chains_only = True  # SpecOptions.check refuses it with a tree shape (it would act as fixed:MAX)
        self.max_depth = max_depth
        self.decay = decay
        self.hits = [0.0] * (len(EDGES) + 1)  # decayed accepted drafts per entropy bin
        self.seen = [0.0] * (len(EDGES) + 1)  # decayed drafts the verifier reached
        self.draft = Line()
        self.verify_s: float | None = None
        self._records: dict[int, list[float]] = {}  # seq -> the entropies of its last proposal
        self._round: list[list[float]] = []

    # -- the estimates ------------------------------------------------------------------------
    def accept(self, entropy: float) -> float:
        b = bisect.bisect_right(EDGES, entropy)
        return (self.hits[b] + 0.5) / (self.seen[b] + 1.0)

    def more(self, entropies: list[float]) -> bool:
        """Whether one more draft after these raises the expected tokens per second."""
        if len(entropies) >= self.max_depth:
            return False
        fit = self.draft.fit()
        if fit is None or self.verify_s is None:
            return True
        fixed, step = fit
        p, expected = 1.0, 1.0
        for h in entropies:
            p *= self.accept(h)
            expected += p
        seconds = self.verify_s + fixed + len(entropies) * step
        gain = p * self.accept(entropies[-1])
        return (expected + gain) * seconds > expected * (seconds + step)

    # -- the controller's hooks ---------------------------------------------------------------
    def start(self, seq_id: int) -> None:
        self._records[seq_id] = []

    def finish(self, seq_id: int) -> None:
        self._records.pop(seq_id, None)

    def budgets(self, seq_ids: list[int], batch_size: int, nodes_for: Callable[[int], int]) -> list[Budget]:
        self._round = []
        return [self.budget(s) for s in seq_ids]

    def budget(self, seq_id: int) -> Budget:
        record: list[float] = []
        self._records[seq_id] = record
        self._round.append(record)

        def stop(entropies: list[float]) -> bool:
            record[:] = entropies
            return not self.more(entropies)

        return Budget(depth=self.max_depth, nodes=self.max_depth, stop=stop)

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        record = self._records.get(seq_id) or []
        drafted = tree.size - 1
        if not record or drafted < 1 or not tree.is_chain():
            return
        self.hits = [self.decay * h for h in self.hits]
        self.seen = [self.decay * s for s in self.seen]
        accepted = result.num_accepted
        for i, h in enumerate(record[:drafted]):
            if i > accepted:  # the verifier stopped before this draft
                break
            b = bisect.bisect_right(EDGES, h)
            self.seen[b] += 1.0
            self.hits[b] += 1.0 if i < accepted else 0.0

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        drafted = max((len(r) for r in self._round), default=0) or depth
        self.draft.add(drafted, seconds)

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        share = seconds / max(batch_size, 1)
        self.verify_s = share if self.verify_s is None else 0.8 * self.verify_s + 0.2 * share


def build(argument: str) -> EntropyController:
    if not argument:
        return EntropyController()
    if not argument.isdigit() or not 1 <= int(argument) <= 64:
        raise ConfigError("entropy[:MAX] takes the most drafts a round, a whole number 1-64 (entropy:8)")
    return EntropyController(int(argument))


register_controller("entropy", build, usage="entropy[:MAX]")
