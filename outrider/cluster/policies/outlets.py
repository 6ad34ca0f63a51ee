"""OUTLETS: shortest predicted output first, with aging so that nothing starves.

    --policy outlets[:model=PATH,aging=TOKENS_PER_S,history=N]

Each request's output length is predicted when it arrives (cluster/length.py: a least-squares
regression trained from bench runs, `scripts/train_outlets_length.py`), and a replica admits the
waiting request with the lowest

    priority(request, now) = predicted tokens - aging x (now - arrived)

so a short job goes before a long one, and a long one that has waited (predicted difference) /
aging seconds goes before a short one that just came (aging 0: pure shortest-job-first, which
can starve). Routing is least-load, so OUTLETS against FCFS differs only in queue order.

What it hears back corrects the model online: a prompt seen before (its token ids, else its
workload and length) is predicted as the mean of the model and its `history` last observed
lengths (in log space), weighted by how many there are.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ...errors import ConfigError
from ..length import LengthModel
from ..policy import Decision, Outcome, PolicyBase, ReplicaView, RequestInfo
from .least_load import least_loaded


@dataclass
class OUTLETS(PolicyBase):
    name: str = "outlets"
    model: LengthModel | None = None
    aging: float = 8.0  # predicted tokens forgiven per second waited
    history: int = 4  # observed lengths kept per prompt (0: no online correction)
    seen: dict = field(default_factory=dict)  # prompt key -> deque of log(1 + output tokens)

    def _key(self, request: RequestInfo):
        return hash(request.prompt_ids) if request.prompt_ids else (request.workload, request.prompt_tokens)

    def predicted(self, request: RequestInfo) -> float:
        """Expected output tokens: the model's, pulled toward what this prompt produced before."""
        mu = self.model.log_length(request)
        past = self.seen.get(self._key(request)) if self.history else None
        if past:
            mu = (mu + sum(past)) / (1 + len(past))
        return min(max(math.expm1(mu), 1.0), float(max(request.max_tokens, 1)))

    def priority(self, request: RequestInfo, now: float) -> float:
        return self.predicted(request) - self.aging * max(0.0, now - request.arrived)

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        best = least_loaded(replicas)
        return Decision(best.index, None, self.priority(request, now), "shortest-predicted")

    def observe(self, outcome: Outcome) -> None:
        if self.history and outcome.error is None:
            key = self._key(outcome.request)
            self.seen.setdefault(key, deque(maxlen=self.history)).append(math.log1p(outcome.output_tokens))


def make(options: dict) -> OUTLETS:
    unknown = set(options) - {"model", "aging", "history"}
    if unknown:
        raise ConfigError(f"policy outlets: unknown option {sorted(unknown)[0]!r} (options: model, aging, history)")
    try:
        aging = float(options.get("aging", 8.0))
        history = int(options.get("history", 4))
    except ValueError:
        raise ConfigError("policy outlets: aging takes a number (tokens per second), history an integer") from None
    if aging < 0 or history < 0:
        raise ConfigError(f"policy outlets: aging and history must be >= 0, got {aging:g} and {history}")
    return OUTLETS(model=LengthModel.load(options.get("model")), aging=aging, history=history, options=dict(options))
