"""What a policy knows of a request (`RequestInfo`), made by the router from the job the front end hands it.

    session    the `X-Session-Id` header, or else the OpenAI `user` field (serve/api.py reads both)
    group      the `X-Rollout-Group` header: requests of one RL rollout batch (TailSieve)
    workload   the `X-Workload` header: a label such as a bench workload's name (OUTLETS' length model
               knows humaneval, code-edit, toolcall; any other name reads as none of them)
    prompt_tokens, prompt_ids, max_tokens   from the job's engine requests

Headers, not body fields: the request body is checked field by field (serve/protocol.py refuses a
field it does not know), while a header reaches the router without touching the OpenAI API, works
the same on /v1/completions and /v1/chat/completions, and is what a proxy or an RL framework's HTTP
client can add to every request of a batch. A value is free text up to MAX_LABEL characters of
printable ASCII or Unicode (no control characters); anything else is refused with a 400 naming
the header. An empty value is the same as no header.

`features` are what OUTLETS' length model (length.py) was fitted on besides the prompt's length
and the workload: the tokens each of a request's first `FEATURE_ROUNDS` rounds committed while it
speculated (bench/rollout.py records them). Only the replica running a request knows them, after
those rounds, so a request arrives, and waits in its replica's queue, without them (the shipped
model was fitted without them for that reason). The router fills them from the engine's round
counters when the request ends (`with_features`), so the `Outcome` a policy observes carries them.
"""

from __future__ import annotations

import dataclasses

from ..serve.errors import ApiError
from .length import FEATURE_ROUNDS
from .policy import RequestInfo

GROUP_HEADER = "x-rollout-group"
WORKLOAD_HEADER = "x-workload"
MAX_LABEL = 256  # characters of a group or workload label
SHOWN = {GROUP_HEADER: "X-Rollout-Group", WORKLOAD_HEADER: "X-Workload"}


def label(headers, name: str) -> str | None:
    """The header `name` as a routing label: None when absent or empty; a 400 (one line) when it
    is too long or holds control characters."""
    value = headers.get(name) if headers else None
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"the {_shown(name)} header must be text, got {type(value).__name__}",
                       code="invalid_header")
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_LABEL:
        raise ApiError(400, f"the {_shown(name)} header is {len(value)} characters long; at most {MAX_LABEL}",
                       code="invalid_header")
    if not value.isprintable():
        raise ApiError(400, f"the {_shown(name)} header holds a control character: send printable text",
                       code="invalid_header")
    return value


def request_info(job, now: float) -> RequestInfo:
    """The RequestInfo of a checked job (all its choices: n samples of a prompt share one prefill)."""
    headers = getattr(job, "headers", None) or {}
    group, workload = label(headers, GROUP_HEADER), label(headers, WORKLOAD_HEADER)
    first = job.requests[0]
    prompts = [r for r, source in zip(job.requests, job.prefill_from) if source is None]  # n samples: one prefill
    return RequestInfo(f"{id(job):x}", sum(len(r.prompt_ids) for r in prompts),
                       sum(r.max_new_tokens for r in job.requests), now, session=job.session,
                       prompt_ids=tuple(first.prompt_ids), group=group, workload=workload)


def with_features(info: RequestInfo, completions: list, speculated: bool) -> RequestInfo:
    """`info` with the first choice's drafter features, as bench/rollout.py records them: the
    tokens each of its first rounds committed, when it speculated (plain decoding has none)."""
    if not speculated or not completions or info.features:
        return info
    rounds = completions[0].round_stats.committed_by_round[:FEATURE_ROUNDS]
    return dataclasses.replace(info, features=tuple(float(t) for t in rounds)) if rounds else info


def _shown(name: str) -> str:
    return SHOWN.get(name, name)
