"""Synthetic workloads at scale: heavy-tailed arrivals over requests resampled from real runs.

Every request starts from a real one: a record of `outrider bench rollout` (bench/rollout.py;
workload, prompt tokens, tau and drafts a round with the suffix drafter at temperature 1) drawn
at random, so prompts and acceptance are measured. Output lengths are synthetic: the records'
own were mostly cut at the bench's cap (docs/scheduling.md), so each distinct prompt gets a
median output length drawn once, log-normal around `median` with log-spread `spread`, and each
request a log-normal draw around its prompt's median with log-spread `sigma`, capped at
`max_tokens` (heavy-tailed across prompts, stable within one: what a length predictor can learn
from history). What is synthetic besides is when requests come and how they group:

    chat       open loop; Pareto inter-arrivals (shape `alpha`, heavy-tailed bursts) at `load`
               times the replicas' estimated capacity; what OUTLETS and the sweep plots use
    sessions   chat whose requests belong to `sessions` conversations per replica (Zipf
               popularity); on a replica that served the session before, its acceptance is
               `tau_hit` (WAR: the suffix index holds its history)
    memory     chat on replicas whose K/V rows hold only `slots` full requests and whose
               speculating requests also hold a draft model's cache (`draft_kv` rows per row)
    rollout    `groups` prompts per replica x `samples` samples each, all sent at t=0 (an RL
               rollout batch, TailSieve's setting); the figure is the makespan

Options are `name:key=value,...`; every generator is seeded (`seed`), so a workload is a pure
function of its spec and the records.
"""

from __future__ import annotations

import math
import random
import zlib

from ...errors import ConfigError
from ..policy import RequestInfo
from .costs import CostModel
from .workload import ReplicaSpec, SimRequest, Workload

LENGTHS = {"median": 64.0, "spread": 1.0, "sigma": 0.5, "max_tokens": 1024}
DEFAULTS = {
    "chat": {"load": 0.8, "alpha": 1.5, "per_replica": 48, "seed": 0, "max_running": 16, **LENGTHS},
    "sessions": {"load": 1.2, "alpha": 1.5, "per_replica": 48, "seed": 0, "max_running": 16,
                 "sessions": 4, "tau_hit": 3.21, **LENGTHS},
    "memory": {"load": 1.2, "alpha": 1.5, "per_replica": 48, "seed": 0, "max_running": 16,
               "slots": 6, "draft_kv": 0.5, **LENGTHS},
    "rollout": {"groups": 2, "samples": 8, "seed": 0, "max_running": 16, "low_latency": 0.125, **LENGTHS},
}


class Lengths:
    """Output tokens by prompt: a log-normal median per distinct prompt, a log-normal draw per request."""

    def __init__(self, o: dict, seed: int):
        self.o, self.rng, self.medians = o, random.Random(seed + 7919), {}

    def draw(self, record: dict) -> int:
        key = f"{record.get('workload')}/{record.get('prompt')}"
        if key not in self.medians:
            self.medians[key] = math.log(self.o["median"]) + self.o["spread"] * self.rng.gauss(0, 1)
        n = math.exp(self.medians[key] + self.o["sigma"] * self.rng.gauss(0, 1))
        return int(min(max(round(n), 1), self.o["max_tokens"]))


def parse_spec(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    if name not in DEFAULTS:
        raise ConfigError(f"unknown synthetic workload {name!r}: choose one of {', '.join(DEFAULTS)}")
    options = dict(DEFAULTS[name])
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in options:
            raise ConfigError(f"workload {name}: unknown option {item!r} (options: {', '.join(options)})")
        try:
            options[key] = type(options[key])(value)
        except ValueError:
            raise ConfigError(f"workload {name}: {key} takes a number, got {value!r}") from None
    return name, options


def capacity(costs: CostModel, max_running: int, mean_tokens: float, mean_prompt: float) -> float:
    """Requests a second one plain replica finishes when full: each costs its prefill and its
    share of `mean_tokens` rounds at `max_running` sequences."""
    return 1.0 / (costs.prefill(int(mean_prompt)) + mean_tokens * costs.step(max_running, 1) / max_running)


def make(text: str, records: list[dict], replicas: int, costs: CostModel) -> Workload:
    """The synthetic workload `text` names, for `replicas` replicas, drawn from `records`."""
    name, o = parse_spec(text)
    if not records:
        raise ConfigError("synthetic workloads resample a rollout bench's records: none given")
    rng = random.Random(o["seed"])
    lengths = Lengths(o, o["seed"])
    if name == "rollout":
        return _rollout(o, records, replicas, rng, lengths)
    mean_tokens = o["median"] * math.exp((o["spread"] ** 2 + o["sigma"] ** 2) / 2)  # the log-normal's mean
    mean_prompt = sum(r["prompt_tokens"] for r in records) / len(records)
    rate = o["load"] * replicas * capacity(costs, o["max_running"], mean_tokens, mean_prompt)
    n = int(o["per_replica"] * replicas)
    # Pareto gaps with mean 1/rate: scale x_m = (alpha - 1) / (alpha * rate)
    xm = (o["alpha"] - 1) / (o["alpha"] * rate)
    at, requests = 0.0, []
    sessions = max(1, int(o.get("sessions", 1) * replicas))
    weights = [1.0 / (k + 1) for k in range(sessions)]  # Zipf popularity of conversations
    for i in range(n):
        at += xm / (1.0 - rng.random()) ** (1.0 / o["alpha"])
        rec = rng.choice(records)
        session = f"s{rng.choices(range(sessions), weights)[0]}" if name == "sessions" else None
        info = RequestInfo(f"r{i}", rec["prompt_tokens"], int(o["max_tokens"]), at, session=session,
                           workload=rec.get("workload"), prompt_ids=_prompt_ids(rec))
        requests.append(SimRequest(info, lengths.draw(rec), rec["tau"], rec["width"], tau_hit=o.get("tau_hit")))
    replica = ReplicaSpec(max_running=o["max_running"], kv_rows_total=o["max_running"] * 2048)
    if name == "memory":
        full = max(r["prompt_tokens"] for r in records) + int(o["max_tokens"]) + 8
        replica = ReplicaSpec(max_running=o["max_running"], kv_rows_total=int(o["slots"] * full),
                              draft_kv=o["draft_kv"])
    return Workload(f"{name} (load {o['load']:g}, Pareto {o['alpha']:g})", requests, None, replica)


def _prompt_ids(record: dict) -> tuple[int, ...]:
    """A stand-in for the prompt's token ids: equal for the same prompt, so history keys match."""
    return (zlib.crc32(str(record.get("workload")).encode()), int(record.get("prompt", 0)), int(record["prompt_tokens"]))


def _rollout(o: dict, records: list[dict], replicas: int, rng: random.Random, lengths: Lengths) -> Workload:
    """Whole groups of one prompt's samples: a prompt's records are its samples, drawn again."""
    by_prompt: dict[str, list[dict]] = {}
    for r in records:
        by_prompt.setdefault(f"{r.get('workload')}/{r.get('prompt')}", []).append(r)
    prompts = sorted(by_prompt)
    requests = []
    for g in range(int(o["groups"] * replicas)):
        key = rng.choice(prompts)
        for s in range(int(o["samples"])):
            rec = rng.choice(by_prompt[key])
            info = RequestInfo(f"g{g}s{s}", rec["prompt_tokens"], int(o["max_tokens"]), 0.0, group=f"g{g}",
                               workload=rec.get("workload"), prompt_ids=_prompt_ids(rec))
            requests.append(SimRequest(info, lengths.draw(rec), rec["tau"], rec["width"]))
    low = max(1, math.ceil(o["low_latency"] * replicas)) if replicas > 1 and o["low_latency"] > 0 else 0
    replica = ReplicaSpec(max_running=o["max_running"], kv_rows_total=o["max_running"] * 2048,
                          speculative=False, low_latency=low)
    return Workload(f"rollout ({o['groups']:g} groups x {o['samples']:g} samples a replica)", requests, None,
                    replica, kind="rollout")
