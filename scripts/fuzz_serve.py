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
   every answer validated against the response models (serve/schema.py); the strategies and
   the checks are scripts/fuzz_serve_bodies.py.
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_serve_bodies import FAULTS, Outcome, check_answer, draw_items, fault_ids  # noqa: E402  (scripts/ is not a package)


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


# -- hypothesis: the drawn bodies sent, each answer checked ---------------------------------------
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
        if health.get("status") != "ok" or set(health) - {"status", "prefix_cache"}:
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
