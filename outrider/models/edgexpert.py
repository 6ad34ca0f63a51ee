"""EdgeXpert (seed #16, card 2.16), the algorithm only: prompt-wise expert reuse in prefill and
depth-aware expert coalescing in decode, with an external-memory byte counter. LOSSY:
`--verifier edgexpert-lossy[:C][,important=P][,budget=R]`, off by default, refused by any other
name (docs/methods.md#edgexpert). The paper's accelerator (Samsung 28 nm, its latency and energy)
is out of scope: nothing here models hardware; the bytes are counted, not timed.

Prefill (prompt-wise expert reuse), per prompt chunk, sequence and MoE layer:

    important = the ceil(P n) of the chunk's n tokens with the highest router top score
    S         = the union of the important tokens' own top-k experts (their exact routes)
    the other tokens route their top k within S                        (moe_layer.route, allowed)

The paper's importance encoder is a small learned network whose features the abstract does not
give; ours is the router's own top score in each layer (a token that prefers its experts sharply
keeps them; a token with flat scores loses least by routing within S). P >= 1: exact.

Decode (depth-aware expert coalescing), per verify forward, tree and MoE layer: the nodes at one
depth are alternatives (at most one of them is committed), so each depth with two or more nodes
gets one coalesced set, the best C experts by the depth's summed router scores (C >= k; default
k, the experts one token reads), and its nodes route their top k within it; a lone node and the
root route exactly. The paper loads only salient channels of the union and calibrates; we coalesce
whole experts (no channel saliency, no calibration term): said in docs/methods.md. C >= N: exact.

The byte counter (expert_select.ExpertTraffic, phases "prefill" and "verify"): each forward is taken
to stream the distinct experts its real rows chose from external memory (EdgeXpert's model: no
expert cache), counted beside what exact routing would have streamed; `budget=R` also simulates an
LRU set of R resident experts a layer and counts the bytes it moves in.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ..spec.tree import depths
from ..spec.verify_routed import RoutedGreedyVerifier
from .expert_select import RowGroups, Selection, group_mass, rows_allowed, smallest_cover, verify_groups

NAME = "edgexpert-lossy"
USAGE = "edgexpert-lossy[:C][,important=P][,budget=R]"
DEFAULT_IMPORTANT = 0.25


def sibling_groups(tree) -> torch.Tensor:
    """[n] long: each node's depth where two or more nodes share it (depth - 1, so groups start at
    0), else -1 (the root, a lone node: routed exactly)."""
    d = depths(tree.parents)  # [n]
    count = torch.bincount(d)  # [max depth + 1]
    shared = (count[d] >= 2) & (d > 0)  # [n]
    return torch.where(shared, d - 1, torch.full_like(d, -1))


class EdgeXpertSelection(Selection):
    """Prefill reuse and decode coalescing (module notes). cap: C (None: the model's k);
    important: P; budget: the simulated LRU's experts a layer (None: off)."""

    name = NAME

    def __init__(self, cap: int | None = None, important: float = DEFAULT_IMPORTANT, budget: int | None = None):
        super().__init__(budget=budget)
        self.cap, self.important = cap, important

    def verify_rows(self, shape, trees, selected, device=None):
        return verify_groups(shape, trees, selected, sibling_groups, lambda t: torch.ones(t.size), device)

    def prefill_rows(self, shape, sizes, selected, device=None) -> RowGroups:
        B, T = shape
        group = torch.full((B * T,), -1, dtype=torch.long)
        real = torch.zeros(B * T, dtype=torch.bool)
        for j, (n, chosen) in enumerate(zip(sizes, selected)):
            real[j * T: j * T + n] = True
            if chosen:
                group[j * T: j * T + n] = j
        return RowGroups(group.to(device), torch.ones(B * T, device=device), real.to(device), B, "prefill")

    def allowed(self, key, w, cfg, scores, exact):
        rows = self.rows
        if rows.phase == "prefill":
            return self._reuse(scores, exact, cfg.top_k)
        cap = cfg.top_k if self.cap is None else self.cap
        if cap >= cfg.num_experts:
            return None
        eligible = smallest_cover(group_mass(scores, rows), 1.0, cfg.top_k, cap=cap)
        return rows_allowed(eligible, rows)

    def _reuse(self, scores: torch.Tensor, exact: torch.Tensor, k: int) -> torch.Tensor | None:
        """scores [M, N], exact [M, k] -> allowed [M, N]: each group's rows its shared set S (an
        important row's own top k are in S, so it routes exactly)."""
        if self.important >= 1.0:
            return None
        rows = self.rows
        allowed = torch.ones_like(scores, dtype=torch.bool)  # [M, N]
        top = scores.max(-1).values  # [M]: the importance of each row
        for g in range(rows.groups):
            members = torch.nonzero(rows.group == g).flatten()  # [n]
            if members.numel() == 0:
                continue
            keep = max(1, math.ceil(self.important * members.numel()))
            important = members[torch.topk(top[members], keep).indices]  # [keep]
            shared = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
            shared[exact[important].reshape(-1)] = True  # [N]: S, which holds the important rows' own top k
            allowed[members] = shared
        return allowed


def parse(argument: str) -> EdgeXpertSelection:
    """"" -> the defaults; "4" -> C 4; "4,important=0.5,budget=2"."""
    cap, important, budget = None, DEFAULT_IMPORTANT, None
    for i, part in enumerate(p for p in argument.split(",") if p):
        key, eq, value = part.partition("=")
        try:
            if not eq and i == 0:
                cap = int(part)
            elif key == "important":
                important = float(value)
            elif key == "budget":
                budget = int(value)
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--verifier {USAGE}: cannot read {part!r}") from None
    if (cap is not None and cap < 1) or not 0.0 < important <= 1.0 or (budget is not None and budget < 1):
        raise ConfigError(f"--verifier {USAGE}: C and R must be at least 1 and P in (0, 1]")
    return EdgeXpertSelection(cap, important, budget)


def verifier(argument: str) -> RoutedGreedyVerifier:
    return RoutedGreedyVerifier(parse(argument))
