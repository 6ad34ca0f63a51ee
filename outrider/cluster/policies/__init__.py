"""Routing and scheduling policies by name (`--policy NAME[:OPTIONS]`), one file each.

    least_load.py   fewest running + queued sequences (vLLM's data-parallel default)
    sticky.py       session-sticky: a session's requests go where its history is, else least-load
    prefix.py       cache-aware: to the replica holding the longest cached prefix of the prompt
    war.py          WAR: suffix decoding at low load, cache-aware routing of sessions at high load
    outlets.py      OUTLETS: shortest predicted output first (a learned length regressor), with aging
    balance.py      BALANCE: speculate or not, and where, under each replica's K/V memory limit
    tailsieve.py    TailSieve: spot a rollout batch's long tail early, move it to low-latency replicas

Each module defines `make(options: dict) -> Policy`; modules load on first use, so a policy's
optional dependencies cost nothing until it is chosen.
"""

from __future__ import annotations

import importlib

from ...errors import ConfigError

POLICIES = {
    "least-load": "least_load",
    "sticky": "sticky",
    "prefix": "prefix",
    "war": "war",
    "outlets": "outlets",
    "balance": "balance",
    "tailsieve": "tailsieve",
}


def parse(text: str) -> tuple[str, dict]:
    """`NAME[:key=value,...]` -> (name, options); values stay strings for the policy to read."""
    name, _, rest = text.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--policy {text}: options are key=value pairs, got {item!r}")
        options[key.strip()] = value.strip()
    return name.strip(), options


def make_policy(text: str):
    """The policy `--policy` names; unknown names are refused in one line."""
    name, options = parse(text)
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    module = importlib.import_module(f"{__name__}.{POLICIES[name]}")
    return module.make(options)
