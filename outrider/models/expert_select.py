"""Routing restricted to eligible expert sets, and a count of the experts a forward reads: the
shared mechanics of the LOSSY verify-side expert selections (AcceptMoE: spec/acceptmoe.py;
EdgeXpert: models/edgexpert.py). Off unless one of them is named; never a default.

A forward's rows (moe_mlp flattens x [B, T, E] to [M = B T, E]) fall into **groups**: each group
gets one eligible set of experts per MoE layer, and each of its rows chooses its k experts among
that set only (moe_layer.route's `allowed`); a row of group -1 (padding, a sequence that did not
ask) is routed exactly. A selection's `allowed(key, w, cfg, scores, experts)` says which set each
group gets; `smallest_cover` is the usual rule:

    mass[g]  = sum over g's rows r of weight[r] * scores[r]            [G, N]
    eligible = the fewest experts, best mass first (preferred ones first of all), whose mass
               covers a share eta of the group's, at least k of them and at most `cap`

With eta >= 1 and no cap below N every expert is eligible: routing is exact, bit for bit (the
tests hold that). `smallest_cover_reference` is its slow form (one group, one expert at a time).

`ExpertTraffic` counts, per phase ("verify", "prefill"), the forwards, the distinct experts their
real rows chose summed over MoE layers (and what exact routing would have chosen, computed beside
it), those times each expert's bytes (the external-memory bytes of a forward that streams its
experts: EdgeXpert's model), and, with a per-layer LRU budget, the bytes a resident set of that
many experts a layer would have had to move in (misses times bytes). Under a real ExpertStore
(models/expert_store.py) its own counters are the measured ones.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from .moe_config import MoeConfig
from .moe_layer import MoeWeights, route, router_scores, selecting


@dataclass
class RowGroups:
    """A forward's rows as a selection sees them, in moe_mlp's flattened order (b * T + i)."""

    group: torch.Tensor  # [M] long: the row's group; -1: routed exactly
    weight: torch.Tensor  # [M] float32: the row's weight in its group's mass
    real: torch.Tensor  # [M] bool: a real token (counted); padding is not
    groups: int  # G
    phase: str = "verify"


def smallest_cover(mass: torch.Tensor, eta: float, k: int, cap: int | None = None,
                   preferred: torch.Tensor | None = None) -> torch.Tensor:
    """mass [G, N] >= 0 -> eligible [G, N] bool: per group the fewest experts, taken preferred
    ones first (preferred [G, N] or [N] bool: resident ones) then by mass, whose mass reaches eta
    of the group's total; at least k, at most max(cap, k). eta >= 1 (and cap >= N): every expert."""
    G, N = mass.shape
    cap = N if cap is None else max(min(cap, N), k)
    if eta >= 1.0 and cap >= N:
        return torch.ones(G, N, dtype=torch.bool, device=mass.device)
    key = mass.double()
    if preferred is not None:
        key = key + preferred.expand(G, N).double() * (2.0 * key.sum(-1, keepdim=True) + 1.0)
    order = torch.argsort(key, dim=-1, descending=True, stable=True)  # [G, N]
    cum = mass.double().gather(1, order).cumsum(-1)  # [G, N]
    total = cum[:, -1:]  # [G, 1]
    if eta >= 1.0:
        need = torch.full((G,), N, dtype=torch.long, device=mass.device)
    else:
        need = (cum < eta * total).sum(-1) + 1  # [G]: the prefix that first reaches eta
    need = need.clamp(min=min(k, N), max=cap)
    rank = torch.arange(N, device=mass.device).expand(G, N)
    eligible = torch.zeros(G, N, dtype=torch.bool, device=mass.device)
    return eligible.scatter_(1, order, rank < need[:, None])


def smallest_cover_reference(mass: list[float], eta: float, k: int, cap: int | None = None,
                             preferred: set[int] = frozenset()) -> set[int]:
    """The slow form of smallest_cover for one group: experts added one at a time."""
    n = len(mass)
    cap = n if cap is None else max(min(cap, n), k)
    if eta >= 1.0 and cap >= n:
        return set(range(n))
    ranked = sorted(range(n), key=lambda e: (e not in preferred, -mass[e], e))
    total, got, chosen = sum(mass), 0.0, []
    for e in ranked:
        if len(chosen) >= cap or (len(chosen) >= k and eta < 1.0 and got >= eta * total):
            break
        chosen.append(e)
        got += mass[e]
    return set(chosen)


def group_mass(scores: torch.Tensor, rows: RowGroups) -> torch.Tensor:
    """scores [M, N] -> [G, N]: each group's rows' scores summed, weighted."""
    mass = torch.zeros(rows.groups, scores.shape[1], dtype=torch.float64, device=scores.device)
    inside = rows.group >= 0  # [M]
    return mass.index_add_(0, rows.group[inside], (scores[inside] * rows.weight[inside, None]).double())


def rows_allowed(eligible: torch.Tensor, rows: RowGroups) -> torch.Tensor:
    """eligible [G, N] -> allowed [M, N]: each row its group's set; group -1 rows every expert."""
    allowed = eligible[rows.group.clamp(min=0)]  # [M, N]
    return allowed | (rows.group < 0)[:, None]


@dataclass
class PhaseCount:
    forwards: int = 0
    distinct: int = 0  # distinct experts chosen by real rows, summed over forwards and MoE layers
    distinct_exact: int = 0  # what exact routing would have chosen
    bytes: int = 0  # distinct times each expert's bytes: streamed once a forward
    bytes_exact: int = 0
    uses: int = 0  # LRU simulation (a budget set): experts used, misses, bytes moved in
    misses: int = 0
    moved: int = 0
    layers: int = 0  # MoE layer calls counted (forwards times MoE layers)


@dataclass
class ExpertTraffic:
    """What the selected forwards read; see the module's notes. budget: experts resident per MoE
    layer in the simulated LRU set (None: no simulation)."""

    budget: int | None = None
    phases: dict[str, PhaseCount] = field(default_factory=dict)
    _lru: dict[object, OrderedDict] = field(default_factory=dict, repr=False)
    _bytes: dict[object, int] = field(default_factory=dict, repr=False)

    def phase(self, name: str) -> PhaseCount:
        return self.phases.setdefault(name, PhaseCount())

    def resident(self, key) -> set[int]:
        """The simulated resident experts of layer `key`."""
        return set(self._lru.get(key, ()))

    def record(self, phase: str, key, nbytes: int, chosen: torch.Tensor, exact: torch.Tensor) -> None:
        """One MoE layer of one forward: chosen, exact [R, k] the experts of its real rows."""
        count = self.phase(phase)
        used = sorted(set(chosen.reshape(-1).tolist()))
        d, d_exact = len(used), int(exact.reshape(-1).unique().numel())
        count.layers += 1
        count.distinct += d
        count.distinct_exact += d_exact
        count.bytes += d * nbytes
        count.bytes_exact += d_exact * nbytes
        if self.budget is None:
            return
        lru = self._lru.setdefault(key, OrderedDict())
        for e in used:
            count.uses += 1
            if e in lru:
                lru.move_to_end(e)
            else:
                count.misses += 1
                count.moved += nbytes
                lru[e] = True
                while len(lru) > self.budget:
                    lru.popitem(last=False)

    def as_dict(self) -> dict:
        out = {"lru_budget_per_layer": self.budget}
        for name, c in self.phases.items():
            per = max(c.forwards, 1)
            out[name] = dict(c.__dict__, distinct_per_forward=c.distinct / per,
                             distinct_exact_per_forward=c.distinct_exact / per,
                             bytes_per_forward=c.bytes / per, bytes_exact_per_forward=c.bytes_exact / per,
                             moved_per_forward=c.moved / per)
        return out


def layer_key(w: MoeWeights):
    """A key for w's layer: (the store, its layer) for experts in an ExpertStore, else the weights' id."""
    store = getattr(w.gate_up, "store", None)
    return (id(store), w.gate_up.layer_index) if store is not None else id(w)


def store_resident(w: MoeWeights) -> set[int] | None:
    """The experts of w's layer resident in its ExpertStore, or None (experts not in a store)."""
    store = getattr(w.gate_up, "store", None)
    if store is None or not hasattr(store, "resident"):
        return None
    layer = w.gate_up.layer_index
    return {e for (l, e) in store.resident() if l == layer}


def expert_bytes(w: MoeWeights, cfg: MoeConfig, hidden: int) -> int:
    """One routed expert's bytes (gate, up and down): from expert 0's tensors where they are in
    memory, else (experts in a store) counted at 4 bytes a weight."""
    if getattr(w.gate_up, "store", None) is not None:
        return 3 * cfg.expert_size * hidden * 4
    return _nbytes(w.gate_up[0]) + _nbytes(w.down[0])


def _nbytes(m) -> int:
    if torch.is_tensor(m):
        return m.numel() * m.element_size()
    return sum(t.numel() * t.element_size() for t in vars(m).values() if torch.is_tensor(t))


class Selection:
    """A LOSSY routing of selected forwards. Subclasses say `allowed`; this routes, counts, and
    runs forwards under it (`forward`), optionally beside an exact forward for the quality counts
    (`compare`: KL(exact || selected) and top-1 agreement over the compared rows' logits)."""

    def __init__(self, budget: int | None = None):
        self.traffic = ExpertTraffic(budget)
        self.rows: RowGroups | None = None
        self._last: tuple[list[float], list[bool]] | None = None
        self.compare = False
        self.quality = {"rows": 0, "kl_sum": 0.0, "top1_agree": 0, "path_rows": 0, "path_kl_sum": 0.0, "path_agree": 0}
        self._pending: dict[int, tuple[list[float], list[bool]]] = {}  # id(tree) -> its rows' KL, agreement

    def reset(self) -> None:
        """Counters back to zero (a new measurement)."""
        self.traffic = ExpertTraffic(self.traffic.budget)
        self.quality = {key: 0 for key in self.quality}
        self._pending.clear()

    # -- per MoE layer ------------------------------------------------------------------------
    def allowed(self, key, w: MoeWeights, cfg: MoeConfig, scores: torch.Tensor,
                exact: torch.Tensor) -> torch.Tensor | None:
        """scores [M, N], exact [M, k] (route()'s choice) -> allowed [M, N] bool, or None (exact)."""
        raise NotImplementedError

    def route(self, w: MoeWeights, cfg: MoeConfig, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows
        exact_weights, exact = route(flat, w.router, cfg, w.score_bias)  # [M, k]
        if rows is None or rows.group.shape[0] != flat.shape[0]:
            return exact_weights, exact  # a forward the selection was not set up for: exact
        key = layer_key(w)
        allowed = self.allowed(key, w, cfg, router_scores(flat, w.router, cfg), exact)
        weights, experts = (exact_weights, exact) if allowed is None else route(flat, w.router, cfg, w.score_bias,
                                                                                allowed=allowed)
        self.traffic.record(rows.phase, key, expert_bytes(w, cfg, flat.shape[1]), experts[rows.real],
                            exact[rows.real])
        return weights, experts

    # -- per forward --------------------------------------------------------------------------
    name = "expert selection"

    def verify_rows(self, shape: tuple[int, int], trees: list, selected: list[bool], device=None
                    ) -> tuple[RowGroups, torch.Tensor]:
        """A verify batch's RowGroups and compared rows (verify_groups)."""
        raise NotImplementedError

    def prefill_rows(self, shape: tuple[int, int], sizes: list[int], selected: list[bool], device=None
                     ) -> RowGroups | None:
        """A prefill batch's RowGroups, or None: prefill is routed exactly (the default)."""
        return None

    def check_target(self, target) -> None:
        config = target.config
        if getattr(config, "moe", None) is None or "moe" not in (getattr(config, "mlp_kinds", None) or ()):
            raise ConfigError(f"{self.name} selects a mixture of experts' experts, and this target has no MoE layers")

    def verify_forward(self, target, batch, cache, trees: list, selected: list[bool], **asked):
        """The round's verify forward (engine/verify.py) with this routing for the selected trees."""
        self.check_target(target)
        rows, compare = self.verify_rows(tuple(batch.tokens.shape), trees, selected, batch.tokens.device)
        out = self.forward(target, batch, cache, rows, compare, **asked)
        if self._last is not None:  # each selected tree's rows, in order, for `committed`
            at = 0
            for tree in (t for t, chosen in zip(trees, selected) if chosen):
                self._pending[id(tree)] = (self._last[0][at: at + tree.size], self._last[1][at: at + tree.size])
                at += tree.size
        return out

    def prefill_forward(self, target, batch, cache, sizes: list[int], selected: list[bool]):
        """A prompt chunk's forward (engine/loop.py) with this routing, or exact where prefill_rows is None."""
        rows = self.prefill_rows(tuple(batch.tokens.shape), sizes, selected, batch.tokens.device)
        if rows is None:
            return target.forward(batch, cache)
        self.check_target(target)
        return self.forward(target, batch, cache, rows)

    def forward(self, target, batch, cache, rows: RowGroups, compare_rows: torch.Tensor | None = None, **asked):
        """target.forward(batch, cache) with this routing for `rows`. With `compare` on, an exact
        forward runs first over the same rows (the selected one then writes the cache) and
        compare_rows [R] long (indices into the logits' rows) are compared."""
        exact, self._last = None, None
        if self.compare and compare_rows is not None and compare_rows.numel():
            exact = target.forward(batch, cache, **asked).logits
        self.rows = rows
        self.traffic.phase(rows.phase).forwards += 1
        try:
            with selecting(self):
                out = target.forward(batch, cache, **asked)
        finally:
            self.rows = None
        if exact is not None and out.logits is not None:
            self._compare(exact[compare_rows], out.logits[compare_rows])
        return out

    def _compare(self, exact: torch.Tensor, selected: torch.Tensor) -> None:
        """exact, selected [R, vocab] logits."""
        p = torch.log_softmax(exact.float(), -1)
        q = torch.log_softmax(selected.float(), -1)
        kl = (p.exp() * (p - q)).sum(-1)  # [R]
        agree = exact.argmax(-1) == selected.argmax(-1)  # [R]
        self.quality["rows"] += exact.shape[0]
        self.quality["kl_sum"] += float(kl.sum())
        self.quality["top1_agree"] += int(agree.sum())
        self._last = kl.tolist(), agree.tolist()

    def committed(self, tree, accepted_nodes: list[int]) -> None:
        """The verifier's walk on `tree` committed after the root and `accepted_nodes`: those rows'
        comparison (when compared) counts as the committed path's."""
        pending = self._pending.pop(id(tree), None)
        if pending is None:
            return
        for i in [0, *accepted_nodes]:
            self.quality["path_rows"] += 1
            self.quality["path_kl_sum"] += pending[0][i]
            self.quality["path_agree"] += int(pending[1][i])

    def report(self) -> dict:
        q = self.quality
        out = {"traffic": self.traffic.as_dict()}
        if q["rows"]:
            out["quality"] = {"rows": q["rows"], "kl_mean": q["kl_sum"] / q["rows"],
                              "top1_agreement": q["top1_agree"] / q["rows"]}
        if q["path_rows"]:  # the rows whose argmax was committed (the root and the accepted nodes)
            out["quality"] |= {"path_rows": q["path_rows"], "path_kl_mean": q["path_kl_sum"] / q["path_rows"],
                               "path_top1_agreement": q["path_agree"] / q["path_rows"]}
        return out


def verify_groups(shape: tuple[int, int], trees: list, selected: list[bool], groups_of, weights_of,
                  device=None) -> tuple[RowGroups, torch.Tensor]:
    """The rows of a verify batch [B, T] of `trees` (batch row j: trees[j], its nodes at rows
    j * T + i), for the selected ones: groups_of(tree) [n] long (-1: exact; a tree's own numbering,
    offset here so trees never share a group), weights_of(tree) [n] float. Returns the RowGroups
    and the selected nodes' indices into the forward's real-row logits (pack's logits="real")."""
    B, T = shape
    group = torch.full((B * T,), -1, dtype=torch.long)
    weight = torch.zeros(B * T, dtype=torch.float32)
    real = torch.zeros(B * T, dtype=torch.bool)
    compare, offset, base = [], 0, 0
    for j, (tree, chosen) in enumerate(zip(trees, selected)):
        n = tree.size
        real[j * T: j * T + n] = True
        if chosen:
            g = groups_of(tree).long()  # [n]
            group[j * T: j * T + n] = torch.where(g >= 0, g + base, g)
            weight[j * T: j * T + n] = weights_of(tree).float()
            base += int(g.max()) + 1 if int(g.max()) >= 0 else 0
            compare.extend(range(offset, offset + n))
        offset += n
    rows = RowGroups(group.to(device), weight.to(device), real.to(device), base, "verify")
    return rows, torch.tensor(compare, dtype=torch.long, device=device)


def selected_by(verifiers: list, selection) -> list[bool]:
    """Which of the sequences' verifiers carry `selection` (a batch may mix requests)."""
    return [getattr(v, "selection", None) is selection for v in verifiers]


def selection_of(verifiers: list):
    """The first LOSSY expert selection among the sequences' verifiers (spec/verify_routed.py), or None."""
    for v in verifiers:
        selection = getattr(v, "selection", None)
        if selection is not None:
            return selection
    return None
