"""AcceptMoE (seed #18, card 2.18): acceptance-aware verifier-side expert selection. LOSSY:
`--verifier acceptmoe-lossy[:ETA][,resident=R][,prior=PATH]`, off by default, refused by any
other name (docs/methods.md#acceptmoe).

A tree verify on an MoE target activates the union of every node's experts, though few nodes end
on the accepted path. Per verify forward, sequence (the verification block) and MoE layer:

    w_i      = P(node i is committed | its depth, its draft confidence)   (the commitment prior,
               fitted offline on real text: `CommitPrior`, shipped as
               models/shipped/acceptmoe_prior.json;
               the root's is 1)
    mass     = sum over the block's nodes i of w_i * router_scores_i      [N]
    eligible = the fewest experts, best mass first, covering a share ETA of the mass (at least k)
    each node routes its top k within `eligible`                         (moe_layer.route, allowed)

`resident=R` is the residency-following variant under offloading: every MoE layer keeps R experts
resident (an LRU set: the simulated one of expert_select.ExpertTraffic, or the real ExpertStore's
where the experts live in one), and eligibility takes the resident experts first, adding
non-resident ones only until ETA of the mass is covered: nothing is predicted or prefetched.
ETA >= 1 makes every expert eligible: exact greedy decoding, bit for bit (the tests hold that).
The committed tokens are the walk of the target's greedy argmax (greedy_tree's) under the
selected routing; greedy only.

The prior (`CommitPrior`): the depth d (1..D, deeper clipped to D) and the node's path confidence
(tree.confidence) in buckets cut at `edges` give a table [D][len(edges) + 1] of committed shares;
trees without confidences use the per-depth share. `fit` counts it from recorded rounds
(scripts/fit_acceptmoe_prior.py: an S2-MoE tree drafter on held-out stdlib text).
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.expert_select import Selection, group_mass, rows_allowed, smallest_cover, store_resident, verify_groups
from .tree import depths
from .verify_routed import RoutedGreedyVerifier

NAME = "acceptmoe-lossy"
USAGE = "acceptmoe-lossy[:ETA][,resident=R][,prior=PATH]"
DEFAULT_ETA = 0.9
PRIOR_PATH = Path(__file__).parent.parent / "models" / "shipped" / "acceptmoe_prior.json"  # fitted, small


@dataclass(frozen=True)
class CommitPrior:
    """P(a node is committed) by depth (rows, depth 1..D) and path-confidence bucket (columns)."""

    edges: tuple[float, ...]  # confidence bucket edges, ascending
    table: tuple[tuple[float, ...], ...]  # [D][len(edges) + 1]
    by_depth: tuple[float, ...]  # [D]: trees without confidences
    source: str = ""

    def weights(self, tree) -> torch.Tensor:
        """[n] float32: the root 1, node i the share its depth and confidence bucket committed."""
        d = depths(tree.parents).tolist()
        conf = tree.confidence.tolist() if tree.confidence is not None else None
        deepest = len(self.table)
        out = []
        for i, depth in enumerate(d):
            if depth == 0:
                out.append(1.0)
                continue
            row = min(depth, deepest) - 1
            out.append(self.by_depth[row] if conf is None else self.table[row][bisect_right(self.edges, conf[i])])
        return torch.tensor(out, dtype=torch.float32)

    @staticmethod
    def fit(records, depth: int = 6, edges=(0.05, 0.2, 0.5), smoothing: float = 1.0) -> "CommitPrior":
        """records: (depth >= 1, confidence or None, committed bool) per drafted node -> the shares,
        Laplace-smoothed toward the depth's share (a bucket with no nodes takes the depth's)."""
        counts = [[[0, 0] for _ in range(len(edges) + 1)] for _ in range(depth)]
        per_depth = [[0, 0] for _ in range(depth)]
        for d, conf, committed in records:
            row = min(d, depth) - 1
            per_depth[row][0] += int(committed)
            per_depth[row][1] += 1
            if conf is not None:
                cell = counts[row][bisect_right(edges, conf)]
                cell[0] += int(committed)
                cell[1] += 1
        by_depth = tuple((a + 0.5 * smoothing) / (n + smoothing) if n + smoothing else 0.5 for a, n in per_depth)
        table = tuple(tuple((a + smoothing * by_depth[r]) / (n + smoothing) if n + smoothing else by_depth[r]
                            for a, n in counts[r]) for r in range(depth))
        return CommitPrior(tuple(edges), table, by_depth)

    def save(self, path: Path, source: str = "") -> None:
        Path(path).write_text(json.dumps({"edges": list(self.edges), "table": [list(r) for r in self.table],
                                          "by_depth": list(self.by_depth), "source": source or self.source},
                                         indent=1) + "\n")

    @staticmethod
    def load(path: Path) -> "CommitPrior":
        try:
            raw = json.loads(Path(path).read_text())
            prior = CommitPrior(tuple(raw["edges"]), tuple(tuple(r) for r in raw["table"]), tuple(raw["by_depth"]),
                                raw.get("source", ""))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{NAME}: cannot read the commitment prior {path}: {err}") from None
        if not prior.table or any(len(r) != len(prior.edges) + 1 for r in prior.table) or \
                len(prior.by_depth) != len(prior.table):
            raise ConfigError(f"{NAME}: the commitment prior {path} has a table of the wrong shape")
        return prior


class AcceptMoeSelection(Selection):
    """The verify forward's routing (module notes). eta: the covered share; resident: the LRU
    budget per MoE layer of the residency-following variant (None: off)."""

    name = NAME

    def __init__(self, eta: float = DEFAULT_ETA, resident: int | None = None, prior: CommitPrior | None = None):
        super().__init__(budget=resident)
        self.eta, self.resident = eta, resident
        self.prior = prior if prior is not None else CommitPrior.load(PRIOR_PATH)

    def verify_rows(self, shape, trees, selected, device=None):
        return verify_groups(shape, trees, selected, lambda t: torch.zeros(t.size, dtype=torch.long),
                             self.prior.weights, device)

    def allowed(self, key, w, cfg, scores, exact):
        if self.eta >= 1.0 and self.resident is None:
            return None
        preferred = None
        if self.resident is not None:
            resident = store_resident(w)
            resident = self.traffic.resident(key) if resident is None else resident
            preferred = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
            preferred[list(resident)] = True
        eligible = smallest_cover(group_mass(scores, self.rows), self.eta, cfg.top_k, preferred=preferred)
        return rows_allowed(eligible, self.rows)


def parse(argument: str) -> AcceptMoeSelection:
    """"" -> the defaults; "0.8" -> eta 0.8; "0.8,resident=2,prior=PATH"."""
    eta, resident, prior = DEFAULT_ETA, None, None
    for i, part in enumerate(p for p in argument.split(",") if p):
        key, eq, value = part.partition("=")
        try:
            if not eq and i == 0:
                eta = float(part)
            elif key == "resident":
                resident = int(value)
            elif key == "prior":
                prior = CommitPrior.load(Path(value))
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--verifier {USAGE}: cannot read {part!r}") from None
    if not 0.0 < eta <= 1.0 or (resident is not None and resident < 1):
        raise ConfigError(f"--verifier {USAGE}: ETA must be in (0, 1] and R at least 1")
    return AcceptMoeSelection(eta, resident, prior)


def verifier(argument: str) -> RoutedGreedyVerifier:
    return RoutedGreedyVerifier(parse(argument))
