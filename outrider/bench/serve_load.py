"""Load on a live `outrider serve`: closed-loop clients and open-loop (Poisson) arrivals.

Every request is a streaming completion (`stream: true` with `stream_options.include_usage`),
so the client sees when the first text arrives and when the request ends:

    TTFT  send -> first chunk with text (queueing, prefill and the first round included)
    TPOT  (end - first text) / (output tokens - 1), output tokens from the usage chunk
    e2e   send -> the finishing chunk

A phase is bounded twice: at most `max_requests` requests are sent, and none after
`time_limit` seconds; requests already sent are waited for (up to `request_timeout` each).
Throughput is the phase's output tokens over its wall time (first send to last end).

Outcome of one request:
    ok      HTTP 200, a chunk with a finish_reason, the usage chunk and `data: [DONE]`
    error   another status, an error event in the stream, or a failed connection
    lost    sent, then neither: the stream stopped short or the client gave up waiting
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the phase's start."""

    index: int  # the phase's nth request
    prompt: int  # which prompt of the list it sent
    sent: float
    outcome: str = "lost"  # ok | error | lost
    first_text: float | None = None
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    rounds: int = 0  # engine rounds, from the response's `outrider` field
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_text is None else self.first_text - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first_text is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_text) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent


@dataclass
class Target:
    """Where and what to send: `prompts` are completion texts or chat message lists."""

    url: str  # http://127.0.0.1:PORT
    prompts: list
    chat: bool
    max_tokens: int
    extra: dict = field(default_factory=dict)  # e.g. {"speculate": False}
    request_timeout: float = 300.0
    offset: int = 0  # the phase's nth request sends prompt (offset + n) modulo their number

    def prompt_index(self, index: int) -> int:
        return (self.offset + index) % len(self.prompts)

    def body(self, index: int) -> dict:
        prompt = self.prompts[self.prompt_index(index)]
        body = {"max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra}
        body["messages" if self.chat else "prompt"] = prompt
        return body


async def send(client: httpx.AsyncClient, target: Target, index: int, t0: float) -> Record:
    """One streaming request; never raises (the outcome says what happened)."""
    path = "/v1/chat/completions" if target.chat else "/v1/completions"
    rec = Record(index, target.prompt_index(index), time.perf_counter() - t0)
    try:
        async with asyncio.timeout(target.request_timeout):
            await _stream(client, target.url + path, target.body(index), target.chat, rec, t0)
    except TimeoutError:
        rec.outcome, rec.error = "lost", f"no end within {target.request_timeout:g} s"
    except httpx.HTTPError as err:
        if rec.outcome != "ok":
            # before any byte of a response: an error; once streaming, a cut stream is a lost request
            started = rec.first_text is not None or rec.finish_reason is not None
            rec.outcome = "lost" if started else "error"
            rec.error = f"{type(err).__name__}: {err}"
    return rec


async def _stream(client: httpx.AsyncClient, url: str, body: dict, chat: bool, rec: Record, t0: float) -> None:
    usage_seen = done = False
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            rec.outcome, rec.end = "error", time.perf_counter() - t0
            rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            payload = json.loads(data)
            now = time.perf_counter() - t0
            if "error" in payload:
                rec.outcome, rec.end = "error", now
                rec.error = str(payload["error"].get("message"))[:200]
                return
            if payload.get("usage"):
                usage_seen = True
                rec.output_tokens = payload["usage"]["completion_tokens"]
                rec.prompt_tokens = payload["usage"]["prompt_tokens"]
            for choice in payload.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text and rec.first_text is None:
                    rec.first_text = now
                if choice.get("finish_reason"):
                    rec.finish_reason, rec.end = choice["finish_reason"], now
                    ext = payload.get("outrider") or {}
                    rec.rounds, rec.drafted = ext.get("rounds", 0), ext.get("drafted", 0)
                    rec.accepted = ext.get("accepted", 0)
            timings = payload.get("timings") or {}  # llama-server's: its drafts (bench/serve_peer.py)
            if "draft_n" in timings:
                rec.drafted, rec.accepted = int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0))
    if done and usage_seen and rec.finish_reason is not None:
        rec.outcome = "ok"
    else:
        rec.error = "the stream ended without " + ("[DONE]" if not done else "usage" if not usage_seen
                                                  else "a finish_reason")


def _client(connections: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30.0))


async def closed_loop(target: Target, concurrency: int, max_requests: int, time_limit: float,
                      min_requests: int = 1) -> tuple[list[Record], float]:
    """`concurrency` clients, each sending its next request as soon as the last one ends; the
    first `min_requests` are sent even past the time limit (one slow request is no figure).
    Returns the records (in sending order) and the phase's wall time."""
    records: list[Record] = []
    t0 = time.perf_counter()
    issued = 0

    async with _client(concurrency + 1, target.request_timeout) as client:
        async def user():
            nonlocal issued
            while issued < max_requests and (issued < min_requests or time.perf_counter() - t0 < time_limit):
                index = issued
                issued += 1
                records.append(await send(client, target, index, t0))

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0


async def open_loop(target: Target, rate: float, max_requests: int, time_limit: float,
                    seed: int = 0) -> tuple[list[Record], float]:
    """Requests arrive as a Poisson process of `rate` per second (seeded), whatever the server's
    state; the server queues what it cannot run. Returns the records and the phase's wall time."""
    gaps = random.Random(seed)
    t0 = time.perf_counter()
    tasks, at = [], 0.0
    async with _client(max_requests + 1, target.request_timeout) as client:
        for index in range(max_requests):
            at += gaps.expovariate(rate)
            if at >= time_limit:
                break
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            tasks.append(asyncio.create_task(send(client, target, index, t0)))
        records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - t0


def percentiles(values: list[float]) -> dict:
    """p50, p99 and mean (None for each when there are no values); p by linear interpolation."""
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    xs = sorted(values)

    def p(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"p50": p(0.50), "p99": p(0.99), "mean": sum(xs) / len(xs)}


def summarize(records: list[Record], wall_s: float) -> dict:
    """A phase's figures: counts by outcome, throughput, latency percentiles, tau."""
    ok = [r for r in records if r.outcome == "ok"]
    errors = [r for r in records if r.outcome == "error"]
    lost = [r for r in records if r.outcome == "lost"]
    tokens = sum(r.output_tokens for r in ok)
    rounds = sum(r.rounds for r in ok)
    return {
        "requests": len(records), "ok": len(ok), "errors": len(errors), "lost": len(lost),
        "error_messages": sorted({r.error for r in errors + lost if r.error})[:5],
        "output_tokens": tokens, "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "wall_s": wall_s, "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "tau": tokens / rounds if rounds else None,
        "acceptance": sum(r.accepted for r in ok) / max(sum(r.drafted for r in ok), 1),
        "finish_reasons": {k: sum(r.finish_reason == k for r in ok) for k in sorted({r.finish_reason for r in ok})},
    }


def records_json(records: list[Record]) -> list[dict]:
    return [asdict(r) for r in records]
