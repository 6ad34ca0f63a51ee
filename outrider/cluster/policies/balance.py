"""BALANCE: per request, speculate or not, and where, under each replica's K/V memory limit.

    --policy balance[:tree=ROWS,draft_kv=F,batch=N]

Speculation costs memory as well as compute: a speculating sequence reserves a round's tree
(`tree` rows) and, with a draft model, the drafter's own cache (`draft_kv` rows per target row),
so on a replica whose K/V rows are the limit, every speculating sequence keeps another one
waiting. For each request BALANCE computes the rows it reserves both ways,

    plain        prompt + max_tokens + 1
    speculating  (prompt + max_tokens) x (1 + draft_kv) + tree

and picks, among live replicas with a free slot, the least-loaded one where speculating fits
after the rows its waiting requests will need (one plain request's rows each); failing that,
the least-loaded one where plain decoding fits, decoding plainly; failing that (every replica
full), the one with the shortest queue, plainly. So a decision never puts a request where its
rows exceed what is free when any replica has room for it. `batch` (0: off) also turns
speculation off on a replica already running that many sequences, where a wide verify costs the
whole batch more than it saves.

Decision reasons: "speculate", "plain-memory", "plain-batch", "wait".
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..policy import Decision, PolicyBase, ReplicaView, RequestInfo, alive


@dataclass
class BALANCE(PolicyBase):
    name: str = "balance"
    tree: int = 8  # rows a round's draft tree reserves
    draft_kv: float = 0.0  # a draft model's cache rows per target row (0: suffix, n-gram, early exit)
    batch: int = 0  # no speculation on a replica running this many (0: no such limit)

    def rows(self, request: RequestInfo, speculate: bool) -> int:
        base = request.prompt_tokens + request.max_tokens
        return int(base * (1 + self.draft_kv)) + self.tree if speculate else base + 1

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        live = alive(replicas)
        plain, spec = self.rows(request, False), self.rows(request, True)
        open_ = [r for r in live if r.running < r.max_running]
        key = lambda r: (r.load, -r.kv_free, r.index)  # noqa: E731
        fits_spec = [r for r in open_ if r.speculative and r.kv_free - r.queued * plain >= spec]
        if fits_spec:
            best = min(fits_spec, key=key)
            if self.batch and best.running >= self.batch:
                return Decision(best.index, False, request.arrived, "plain-batch")
            return Decision(best.index, True, request.arrived, "speculate")
        fits_plain = [r for r in open_ if r.kv_free - r.queued * plain >= plain] or [r for r in live if r.kv_free >= plain]
        if fits_plain:
            return Decision(min(fits_plain, key=key).index, False, request.arrived, "plain-memory")
        best = min(live, key=lambda r: (r.queued, r.load, r.index))
        return Decision(best.index, False, request.arrived, "wait")


def make(options: dict) -> BALANCE:
    unknown = set(options) - {"tree", "draft_kv", "batch"}
    if unknown:
        raise ConfigError(f"policy balance: unknown option {sorted(unknown)[0]!r} (options: tree, draft_kv, batch)")
    try:
        tree, draft_kv, batch = int(options.get("tree", 8)), float(options.get("draft_kv", 0.0)), int(options.get("batch", 0))
    except ValueError:
        raise ConfigError("policy balance: tree and batch take integers, draft_kv a number") from None
    if tree < 0 or draft_kv < 0 or batch < 0:
        raise ConfigError(f"policy balance: tree, draft_kv and batch must be >= 0, got {tree}, {draft_kv:g}, {batch}")
    return BALANCE(tree=tree, draft_kv=draft_kv, batch=batch, options=dict(options))
