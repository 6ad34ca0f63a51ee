"""prefix: cache-aware routing. A request goes to the replica holding the longest cached prefix of
its prompt, while that replica is not too busy; otherwise to the least-loaded replica.

    --policy prefix                      min_tokens 16, slack 4
    --policy prefix:min_tokens=64,slack=8

Each replica's engine keeps the K/V of the prompts it prefilled in blocks (engine/prefix_cache.py),
so a chat's next turn, or any prompt sharing a system prompt or tool schema with one a replica
served, prefills there only what it does not hold. The policy remembers, per replica, the prompts
it sent there (cluster/prefix_index.py: whole blocks, a chain per replica, LRU), and asks each live
replica's index how many leading tokens of the new prompt it holds. The replica of the longest
match of at least `min_tokens` takes the request unless its load (running + queued) is more than
`slack` above the least-loaded live replica's: a cached prefix saves a prefill, but not a long
wait in a queue. Among equal matches the less loaded wins, then the lower index. A replica seen
dead is forgotten (its restart begins with an empty cache). The request's prompt is remembered
where it went, and again where it finished (a retry or a move may end it elsewhere).

Requests without token ids (`RequestInfo.prompt_ids` empty, as in some simulations) go to the
least-loaded replica. Decision reasons: "prefix" (a cached prefix chose it), "least-load".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from ..policy import Decision, Outcome, PolicyBase, ReplicaView, RequestInfo
from ..prefix_index import BLOCK, PrefixIndex
from .least_load import least_loaded

DEFAULT_SLACK = 4


@dataclass
class PrefixHomes:
    """One PrefixIndex per replica (made as replicas are first seen), and the choice of a home."""

    block: int = BLOCK
    indexes: dict[int, PrefixIndex] = field(default_factory=dict)

    def index(self, replica: int) -> PrefixIndex:
        if replica not in self.indexes:
            self.indexes[replica] = PrefixIndex(self.block)
        return self.indexes[replica]

    def home(self, request: RequestInfo, replicas: list[ReplicaView], min_tokens: int
             ) -> tuple[ReplicaView | None, int]:
        """The live replica holding the longest cached prefix of the request's prompt (at least
        `min_tokens`; the less loaded, then the lower index, among equals) and the tokens it holds;
        (None, 0) when none holds that much. Dead replicas' indexes are cleared here."""
        best, best_key = None, None
        for view in replicas:
            if not view.alive:
                if view.index in self.indexes:
                    self.indexes[view.index].clear()
                continue
            held = self.index(view.index).match(request.prompt_ids) if request.prompt_ids else 0
            key = (-held, view.load, view.index)
            if held >= max(min_tokens, 1) and (best_key is None or key < best_key):
                best, best_key = view, key
        return (best, -best_key[0]) if best is not None else (None, 0)

    def sent(self, replica: int, request: RequestInfo) -> None:
        """`request` went to (or finished on) `replica`: its engine now holds the prompt's blocks."""
        if request.prompt_ids:
            self.index(replica).add(request.prompt_ids)


@dataclass
class PrefixRouting(PolicyBase):
    name: str = "prefix"
    min_tokens: int = BLOCK
    slack: int = DEFAULT_SLACK
    homes: PrefixHomes = field(default_factory=PrefixHomes)

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        least = least_loaded(replicas)
        home, _ = self.homes.home(request, replicas, self.min_tokens)
        if home is not None and home.load <= least.load + self.slack:
            decision = Decision(home.index, reason="prefix")
        else:
            decision = Decision(least.index, reason="least-load")
        self.homes.sent(decision.replica, request)
        return decision

    def observe(self, outcome: Outcome) -> None:
        if outcome.error is None:
            self.homes.sent(outcome.replica, outcome.request)


def integer_option(options: dict, key: str, default: int, policy: str) -> int:
    text = options.get(key, str(default))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"--policy {policy}: {key} must be an integer >= 0, got {text!r}")
    return value


def make(options: dict) -> PrefixRouting:
    unknown = set(options) - {"min_tokens", "slack"}
    if unknown:
        raise ConfigError(f"--policy prefix takes min_tokens=N and slack=N, got {', '.join(sorted(unknown))}")
    return PrefixRouting(options=dict(options), min_tokens=integer_option(options, "min_tokens", BLOCK, "prefix"),
                         slack=integer_option(options, "slack", DEFAULT_SLACK, "prefix"))
