"""The simulator's reference policies: least-load with FCFS order, speculating as told.

    fcfs          least-load routing, first come first served, each replica's default speculation
    always-spec   the same, every request speculating (WAR's "always suffix decoding")
    never-spec    the same, no request speculating

They keep the policy contract (policy.py) and are what each seed policy is measured against in
the simulator. `least-load` is the registry's policy (policies/least_load.py) where it exists;
it routes as `fcfs` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..policies.least_load import least_loaded
from ..policy import Decision, PolicyBase, ReplicaView, RequestInfo

BASELINES = {"fcfs": None, "always-spec": True, "never-spec": False}


@dataclass
class LeastLoadFCFS(PolicyBase):
    speculate: bool | None = None

    def route(self, request: RequestInfo, replicas: list[ReplicaView], now: float) -> Decision:
        best = least_loaded(replicas)
        return Decision(best.index, self.speculate, request.arrived, "least-load")


def load_policy(text: str):
    """A baseline by name, else the registry's policy (`--policy NAME[:OPTIONS]`)."""
    from ..policies import POLICIES, make_policy, parse

    name, options = parse(text)
    if name not in BASELINES and name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}: choose one of {', '.join([*BASELINES, *POLICIES])}")
    if name in BASELINES:
        if options:
            raise ConfigError(f"policy {name}: a baseline takes no options, got {', '.join(options)}")
        return LeastLoadFCFS(name=name, speculate=BASELINES[name])
    try:
        return make_policy(text)
    except ModuleNotFoundError:
        if name == "least-load":  # the registry's file is not there yet: the same routing
            return LeastLoadFCFS(name="least-load")
        raise
