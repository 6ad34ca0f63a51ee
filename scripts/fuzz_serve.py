"""Fuzz `outrider serve` with tools nobody here wrote: schemathesis against the server's own
OpenAPI schema, and hypothesis-generated sampling parameters, in one bounded run.

Starts the server in this process (uvicorn in a thread on a free 127.0.0.1 port; nothing leaves
the machine) and runs, one after the other:

1. schemathesis (`st run`, a subprocess): every operation of /openapi.json, positive and
   negative data, every check but positive_data_acceptance (the schema cannot express the rules
   across fields, such as prompt + max_tokens within the context, which are 400s by design);
   it checks status codes, content types, headers and bodies (each server-sent event too)
   against the schema, and that bad data is refused.
2. hypothesis: request bodies drawn from strategies of valid sampling parameters (each must
   get a 200) and of bodies with exactly one bad field (each must get a 400 whose `param`
   names that field), completions and chat, whole and streamed, sent --concurrency at a time;
   every answer validated against the response models (serve/schema.py).
3. with --inject-faults (after schemathesis, whose token ids may be any), the drafter raises
   for prompts that hold the token id vocab - 2 and the logits hold a NaN for prompts that hold
   vocab - 1 (token-id prompts, which the other hypothesis requests never use): those requests
   may get a 500 (or an error event); no other may.

Then it checks the server is healthy and still exact (a greedy request answers as before the
run), prints the statuses seen and writes --out (JSON) when given. Exit status 1 on any
failure.

    .venv/bin/python scripts/fuzz_serve.py --model smollm2-135m-instruct --requests 2000 --examples 300
    .venv/bin/python scripts/fuzz_serve.py --model PATH --requests 300 --examples 20 --inject-faults

`make test` runs a smoke version on a tiny model (tests/test_fuzz_serve.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def fault_ids(vocab: int) -> tuple[int, int]:
    """(drafter fault, NaN fault): a prompt holding one of these token ids meets that fault."""
    return vocab - 2, vocab - 1


# -- the server under test --------------------------------------------------------------------
class Statuses:
    """ASGI wrapper counting response statuses by route."""

    def __init__(self, app):
        self.app, self.counts, self.lock = app, Counter(), threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting(message):
            if message["type"] == "http.response.start":
                with self.lock:
                    self.counts[(scope["method"], scope["path"], message["status"])] += 1
            await send(message)

        return await self.app(scope, receive, counting)


class Server:
    def __init__(self, model: str, **options):
        import uvicorn

        from outrider.serve.server import ServeOptions, build

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app, self.state = build(ServeOptions(model=model, port=self.port, **options))
        self.statuses = Statuses(app)
        self.state.worker.start()
        self.server = uvicorn.Server(uvicorn.Config(self.statuses, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    @property
    def vocab(self) -> int:
        return self.state.vocab

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.state.worker.stop()


FAULTS = ("drafter", "nan")


def inject_faults(server: Server, kinds=FAULTS) -> None:
    """The drafter raises for prompts holding the first fault id; NaN logits for the second."""
    import torch

    state = server.state
    draft_id, nan_id = fault_ids(server.vocab)
    engine = state.worker.engine
    if "drafter" in kinds and state.llm.speculator is not None:
        drafter = state.llm.speculator.drafter
        start, propose, first = drafter.start, drafter.propose, {}

        def faulty_start(seq_id, prompt, params=None, **kw):
            first[seq_id] = draft_id in prompt
            return start(seq_id, prompt, params, **kw)

        def faulty_propose(seq_id, tokens, budget):
            if first.get(seq_id):
                raise RuntimeError("injected fault in the drafter")
            return propose(seq_id, tokens, budget)

        drafter.start, drafter.propose = faulty_start, faulty_propose
    if "nan" not in kinds:
        return
    target = state.llm.target
    forward = target.forward

    def poisoned(batch, cache):
        out = forward(batch, cache)
        if out.logits is None or batch.fills_only:
            return out
        bad = {s.slot for s in engine.scheduler.running if nan_id in s.request.prompt_ids and s.decoding}
        with torch.inference_mode():
            for b, slot in enumerate(batch.slot_ids):
                if slot in bad:
                    if batch.logits_flat is not None:
                        out.logits[batch.logits_flat // batch.tokens.shape[1] == b, 0] = float("nan")
                    else:
                        out.logits[b, ..., 0] = float("nan")
        return out

    target.forward = poisoned


# -- responses checked against the models ---------------------------------------------------------
@dataclass
class Outcome:
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    requests: int = 0
    faulted: int = 0  # 500s or error events on prompts that met an injected fault
    faulted_500: int = 0  # of which 500s

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)


def check_answer(r: httpx.Response, body: dict, chat: bool, events: list | None, expect: tuple, outcome: Outcome):
    """expect: ("ok",) or ("bad", param) or ("either",) (a prompt that meets an injected fault)."""
    from pydantic import ValidationError

    from outrider.serve.schema import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk,
                                       CompletionResponse, ErrorResponse)

    outcome.statuses[r.status_code] += 1
    show = json.dumps(body)[:300]
    try:
        if r.status_code != 200:
            error = ErrorResponse.model_validate_json(r.content).error
            if expect[0] == "bad" and (r.status_code != 400 or error.param != expect[1]):
                outcome.fail(f"expected a 400 naming {expect[1]}, got {r.status_code} {error}: {show}")
            elif expect[0] == "ok":
                outcome.fail(f"expected a 200, got {r.status_code} {error.message}: {show}")
            elif r.status_code >= 500:
                outcome.faulted += 1
                outcome.faulted_500 += 1
            return
        if expect[0] == "bad":
            outcome.fail(f"expected a 400 naming {expect[1]}, got 200: {show}")
            return
        if events is None:
            model = ChatCompletionResponse if chat else CompletionResponse
            answer = model.model_validate_json(r.content)
            choices = len(answer.choices)
            tokens = answer.usage.completion_tokens
        else:
            chunk_model = ChatCompletionChunk if chat else CompletionChunk
            if events[-1] != "[DONE]":
                outcome.fail(f"a stream did not end with [DONE]: {show}")
                return
            errors, indexes, tokens = 0, set(), None
            for data in events[:-1]:
                payload = json.loads(data)
                if "error" in payload:
                    ErrorResponse.model_validate(payload)
                    errors += 1
                    continue
                chunk = chunk_model.model_validate(payload)
                indexes |= {c.index for c in chunk.choices}
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            if errors:
                if expect[0] == "either":
                    outcome.faulted += 1
                else:
                    outcome.fail(f"a stream carried an error event: {events[-2][:200]}: {show}")
                return
            choices = len(indexes)
        n = body.get("n") or 1
        prompts = body["prompt"] if isinstance(body.get("prompt"), list) and body["prompt"] and \
            not isinstance(body["prompt"][0], int) else [None]
        if choices != n * len(prompts):
            outcome.fail(f"{choices} choices for n={n} and {len(prompts)} prompt(s): {show}")
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        if tokens is not None and limit is not None and tokens > limit * choices:
            outcome.fail(f"{tokens} output tokens for max_tokens {limit}: {show}")
    except (ValidationError, ValueError, KeyError) as err:
        outcome.fail(f"an answer that does not fit the schema ({str(err)[:300]}): {show}")


def send(client: httpx.Client, url: str, item: tuple, outcome: Outcome, lock: threading.Lock) -> None:
    chat, body, expect, raw = item
    path = url + ("/v1/chat/completions" if chat else "/v1/completions")
    content = raw if raw is not None else json.dumps(body)
    headers = {"Content-Type": "application/json"}
    try:
        if body.get("stream") and raw is None:
            with client.stream("POST", path, content=content, headers=headers) as r:
                r.read()
                events = None
                if r.status_code == 200:
                    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        else:
            r = client.post(path, content=content, headers=headers)
            events = None
    except httpx.HTTPError as err:
        with lock:
            outcome.fail(f"no answer ({type(err).__name__}: {err}): {content[:200]}")
        return
    with lock:
        outcome.requests += 1
        check_answer(r, body, chat, events, expect, outcome)


# -- hypothesis: sampling parameters ------------------------------------------------------------
def strategies(vocab: int, max_len: int, faults=()):
    """(valid, invalid): strategies of (chat, body, expect, raw body or None)."""
    from hypothesis import strategies as st

    word = st.integers(3, min(vocab, 96) - 3).map(lambda i: f"w{i}")  # never a fault id (tiny models' words)
    text = st.lists(word, min_size=1, max_size=8).map(" ".join)
    ids = st.lists(st.integers(0, vocab - 3), min_size=1, max_size=8)
    prompt = st.one_of(text, ids, st.lists(text, min_size=1, max_size=2), st.lists(ids, min_size=1, max_size=2))
    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_infinity=False)  # noqa: E731
    opt = lambda s: st.one_of(st.none(), s)  # noqa: E731

    @st.composite
    def valid(draw):
        chat = draw(st.booleans())
        temperature = draw(opt(st.one_of(st.just(0.0), floats(0.05, 2.0))))
        body = {
            "max_tokens": draw(st.integers(1, 4)), "temperature": temperature, "top_p": draw(opt(floats(0.01, 1.0))),
            "top_k": draw(opt(st.integers(-1, 200))), "min_p": draw(opt(floats(0.0, 1.0))),
            "presence_penalty": draw(opt(floats(-2, 2))), "frequency_penalty": draw(opt(floats(-2, 2))),
            "repetition_penalty": draw(opt(floats(0.05, 3.0))),
            "logit_bias": draw(opt(st.dictionaries(st.integers(0, vocab - 1).map(str), floats(-100, 100), max_size=4))),
            "seed": draw(opt(st.integers(-2**63, 2**63 - 1))),
            "stop": draw(opt(st.one_of(word, st.lists(st.text(min_size=1, max_size=4), max_size=3)))),
            "stop_token_ids": draw(opt(st.lists(st.integers(0, vocab - 1), max_size=3))),
            "ignore_eos": draw(opt(st.booleans())), "speculate": draw(opt(st.booleans())),
            "max_draft_tokens": draw(opt(st.integers(0, 6))), "user": draw(opt(st.text(max_size=5))),
        }
        if temperature != 0.0 and draw(st.booleans()):
            body["n"] = draw(st.integers(1, 3))
        body["stream"] = draw(st.booleans())
        if body["stream"] and draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans()),
                                      "continuous_usage_stats": draw(st.booleans())}
        if chat:
            body["messages"] = [{"role": draw(st.sampled_from(["user", "system", "assistant"])), "content": m}
                                for m in draw(st.lists(text, min_size=1, max_size=2))]
            body["messages"][-1]["role"] = "user"
            if draw(st.booleans()):
                body["logprobs"] = True
                body["top_logprobs"] = draw(opt(st.integers(0, 20)))
        else:
            body["prompt"] = draw(prompt)
            body["logprobs"] = draw(opt(st.integers(0, 20)))
            body["echo"] = draw(opt(st.booleans()))
            if body["echo"] and not body["stream"] and draw(st.booleans()):
                body["max_tokens"] = 0
        expect = ("ok",)
        if faults and not chat and draw(st.integers(0, 9)) == 0:  # hypothesis draws 0 more often than 1 in 10
            ids_of = dict(zip(FAULTS, fault_ids(vocab)))
            body["prompt"] = [ids_of[draw(st.sampled_from(sorted(faults)))]] + draw(ids)
            expect = ("either",)
        return chat, body, expect, None

    bad_values = {
        "temperature": st.one_of(floats(2.01, 1e6), floats(-1e6, -0.01), st.text(max_size=3), st.booleans()),
        "top_p": st.one_of(floats(-5, 0), floats(1.01, 10)), "top_k": st.integers(-10**6, -2),
        "min_p": st.one_of(floats(1.01, 9), floats(-9, -0.01)),
        "presence_penalty": st.one_of(floats(2.01, 1e9), floats(-1e9, -2.01)),
        "frequency_penalty": st.one_of(floats(2.01, 1e9), floats(-1e9, -2.01)),
        "repetition_penalty": floats(-9, 0), "seed": st.one_of(st.integers(2**63, 2**70), st.integers(-2**70, -2**63 - 1)),
        "logit_bias": st.one_of(st.integers(vocab, vocab + 10**6).map(lambda t: {str(t): 1}),
                                st.text(min_size=1, max_size=3).filter(lambda k: not k.isdigit()).map(lambda k: {k: 1}),
                                floats(100.5, 1e6).map(lambda b: {"3": b})),
        "n": st.one_of(st.integers(-5, 0), st.integers(129, 10**4)),
        "stop_token_ids": st.integers(vocab, vocab + 1000).map(lambda t: [t]),
        "max_tokens": st.one_of(st.integers(max_len, max_len * 4), st.integers(-100, -1)),
        "stop": st.just(["", "w5"]), "frobnicate": st.integers(),
    }

    @st.composite
    def invalid(draw):
        chat, body, _, _ = draw(valid())
        if draw(st.integers(0, 9)) == 0:  # a body that is not JSON at all, or NaN
            raw = draw(st.sampled_from(['{"prompt": "w5", "temperature": NaN}', "{", '["w5"]', '"w5"', "null"]))
            return chat, body, ("bad", None), raw
        name = draw(st.sampled_from(sorted(bad_values) + (["logprobs"] if not chat else ["top_logprobs"])))
        if name == "logprobs":
            value = draw(st.one_of(st.integers(21, 10**4), st.integers(-100, -1)))
        elif name == "top_logprobs":
            body["logprobs"] = True
            value = draw(st.integers(21, 10**4))
        else:
            value = draw(bad_values[name])
        if name == "max_tokens" and chat:
            body.pop("max_completion_tokens", None)
        if name == "n" and (body.get("temperature") == 0.0):
            body["temperature"] = 1.0
        body[name] = value
        if chat and name == "prompt":
            return chat, body, ("bad", "prompt"), None
        return chat, body, ("bad", name), None

    return valid, invalid


def draw_items(count: int, vocab: int, max_len: int, seed: int, faults=()) -> list[tuple]:
    """`count` items (about one in four invalid), drawn by hypothesis with a fixed seed."""
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st

    valid, invalid = strategies(vocab, max_len, faults)
    items: list[tuple] = []

    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(valid(), valid(), valid(), invalid()))
    def collect(item):
        items.append(item)

    from hypothesis import seed as fixed_seed

    fixed_seed(seed)(collect)()
    return items[:count]


def run_hypothesis(server: Server, count: int, concurrency: int, seed: int, faults, deadline: float,
                   log=print) -> Outcome:
    engine = server.state.worker.engine
    began = time.time()
    items = draw_items(count, server.vocab, engine.max_len, seed, faults)
    log(f"hypothesis: {len(items)} request bodies drawn in {time.time() - began:.1f} s; sending {concurrency} "
        "at a time")
    outcome, lock = Outcome(), threading.Lock()
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        with ThreadPoolExecutor(concurrency) as pool:
            futures = []
            for item in items:
                if time.time() > deadline:
                    break
                futures.append(pool.submit(send, client, server.url, item, outcome, lock))
            for f in futures:
                f.result()
    return outcome


# -- schemathesis ---------------------------------------------------------------------------------
# One schemathesis worker before Python 3.12: two worker threads make hypothesis parse lambdas' source
# concurrently, and CPython 3.11's AST constructor then fails at random with "SystemError: AST
# constructor recursion depth mismatch" (python/cpython#106905): seen twice in the smoke test.
ST_WORKERS = 2 if sys.version_info >= (3, 12) else 1


def run_schemathesis(server: Server, examples: int, seed: int, seconds: float, phases: str, out_dir: Path,
                     log=print) -> dict:
    """`st run` against the live schema; returns its JSON report's figures."""
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        raise SystemExit("schemathesis is not installed: .venv/bin/pip install -e '.[dev]'")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "schemathesis.json"
    cmd = [str(st), "run", server.url + "/openapi.json", "--checks", "all", "--exclude-checks",
           "positive_data_acceptance", "--max-examples", str(examples), "--seed", str(seed), "--no-shrink",
           "--phases", phases, "--workers", str(ST_WORKERS),
           "--request-timeout", "120", "--max-response-time", "120", "--report", "json", "--report-json-path", str(report)]
    log("schemathesis: " + " ".join(cmd[1:]))
    env = {**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"}
    try:  # not st's --max-time: its fuzzing repeats until that time is spent
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(10.0, seconds),
                              cwd=out_dir)  # its .schemathesis cache goes there, not into the checkout
    except subprocess.TimeoutExpired as err:
        proc = subprocess.CompletedProcess(cmd, 1, (err.stdout or b"").decode(errors="replace"),
                                           f"schemathesis did not finish within {seconds:.0f} s")
    text = report.read_text().strip() if report.exists() else ""
    data = json.loads(text) if text else {}  # schemathesis stopped by a timeout leaves an empty report
    cases = data.get("test_cases", {})
    result = {"exit_code": proc.returncode, "generated": cases.get("generated", 0),
              "unique_failures": cases.get("unique_failures", 0), "errored": cases.get("errored", 0),
              "failures": data.get("failures", []), "errors": data.get("errors", []),
              "running_time_s": data.get("running_time")}
    if proc.returncode != 0:
        result["output_tail"] = proc.stdout[-6000:] + proc.stderr[-2000:]
    return result


# -- the whole run --------------------------------------------------------------------------------
def probe(server: Server) -> str:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0},
                   timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def fuzz(model: str, *, requests: int, examples: int, concurrency: int = 8, seconds: float = 600, seed: int = 0,
         faults: tuple[str, ...] = (), phases: str = "examples,coverage,fuzzing", server_options: dict | None = None,
         out_dir: Path | None = None, log=print) -> dict:
    """The whole bounded run; returns its figures with `ok` (no failure anywhere)."""
    import tempfile

    start = time.time()
    deadline = start + seconds
    server = Server(model, **(server_options or {}))
    try:
        before = probe(server)
        out = Path(out_dir or tempfile.mkdtemp(prefix="fuzz-serve-"))
        st, times = {}, {"start_s": round(time.time() - start, 1)}
        if examples:  # before the faults: its token ids may be any, so it would meet them
            st = run_schemathesis(server, examples, seed, max(1.0, (deadline - time.time()) / 2), phases, out, log)
        times["schemathesis_s"] = round(time.time() - start - times["start_s"], 1)
        if faults:
            inject_faults(server, faults)
        outcome = run_hypothesis(server, requests, concurrency, seed, faults, deadline, log) if requests else Outcome()
        times["hypothesis_s"] = round(time.time() - start - times["start_s"] - times["schemathesis_s"], 1)
        failures = list(outcome.failures)
        if st and st["exit_code"] != 0:
            failures.append(f"schemathesis found {st['unique_failures']} failure(s) and {len(st['errors'])} "
                            f"error(s):\n{st.get('output_tail', '')}")
        drained = time.time() + 30
        while server.state.worker.engine.has_work and time.time() < drained:
            time.sleep(0.05)
        health = httpx.get(server.url + "/health").json()
        if health != {"status": "ok"}:
            failures.append(f"/health after the run: {health}")
        if server.state.worker.engine.has_work:
            failures.append("requests still in the engine 30 s after the run")
        after = probe(server)
        if after != before:
            failures.append(f"a greedy request answers {after!r} after the run, {before!r} before")
        statuses = {f"{m} {p} {s}": n for (m, p, s), n in sorted(server.statuses.counts.items())}
        server_errors = sum(n for (_, _, s), n in server.statuses.counts.items() if s >= 500)
        if server_errors > outcome.faulted_500:
            failures.append(f"{server_errors} answers with status >= 500, {outcome.faulted_500} of them to "
                            "requests that met an injected fault")
        result = {"ok": not failures, "seconds": round(time.time() - start, 1), "phases_s": times,
                  "requests": sum(server.statuses.counts.values()), "hypothesis_requests": outcome.requests,
                  "hypothesis_statuses": dict(sorted(outcome.statuses.items())), "injected_faults_answered": outcome.faulted,
                  "statuses": statuses, "schemathesis": {k: v for k, v in st.items() if k != "output_tail"},
                  "failures": failures}
        return result
    finally:
        server.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model folder")
    ap.add_argument("--requests", type=int, default=2000, help="hypothesis request bodies (default 2000)")
    ap.add_argument("--examples", type=int, default=200, help="schemathesis examples per operation (0: skip it)")
    ap.add_argument("--phases", default="examples,coverage,fuzzing", help="schemathesis phases")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=900, help="the run's bound: nothing is sent after it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inject-faults", nargs="?", const="drafter,nan", default="",
                    help="a raising drafter (drafter) and NaN logits (nan) for prompts holding the token ids "
                         "vocab-2 / vocab-1 (default with the flag: drafter,nan)")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--controller", default="fixed:3")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-queue", type=int, default=256, help="also the most choices (n x prompts) a request may ask")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="a folder for the figures (fuzz.json) and schemathesis' report")
    args = ap.parse_args(argv)
    options = dict(drafter=args.drafter or None, controller=args.controller, max_running=args.max_running,
                   max_queue=args.max_queue,
                   max_model_len=args.max_model_len, threads=args.threads, device="cpu", chunk_size=64)
    result = fuzz(args.model, requests=args.requests, examples=args.examples, concurrency=args.concurrency,
                  seconds=args.seconds, seed=args.seed, phases=args.phases,
                  faults=tuple(k.strip() for k in args.inject_faults.split(",") if k.strip()),
                  server_options=options, out_dir=Path(args.out) if args.out else None,
                  log=lambda *a: print(*a, file=sys.stderr))
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fuzz.json").write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
