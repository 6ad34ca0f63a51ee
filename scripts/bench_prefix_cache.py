"""Time to first token and throughput, the prefix cache on against off (issue 42, item 7).

Two loads (`--load`), each `--clients` closed-loop clients sending `--turns` requests one after
another (a client sends its next when its last one ends):

    chat     multi-turn chats: turn 1 is a code-edit workload prompt (chat mode), each later turn
             the history so far (earlier messages and the model's greedy answers) plus a
             follow-up request, so every turn's prompt starts with the whole previous one
    system   a shared system prompt of `--system-tokens` tokens (the source of the standard
             library's textwrap module, cut there), each request a different HumanEval function
             to complete after it: every prompt of every client starts with the same ~1,000 tokens

Both arms run the server's engine (EngineLoop, `--chunk-size` tokens prefilled a step) in this
process, on one loaded model, the arms taking turns client set by client set; TTFT is the time
from a request's `add` to the step that gives its first token; throughput is the arm's output
tokens over its wall time. The greedy answers of the two arms must be equal, request for
request (else the run fails).

The cache keeps only exact bits: on a CPU whose prefill takes the float GEMM (Intel) pass
`--config gemm_prefill=off` (both arms then prefill in the native layer).

    .venv/bin/python scripts/bench_prefix_cache.py --clients 1 --turns 8 --max-tokens 48 \\
        --config gemm_prefill=off --threads 2
    .venv/bin/python scripts/bench_prefix_cache.py --load system --clients 4 --turns 3 --max-tokens 32 \\
        --config gemm_prefill=off --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from outrider import config as runtime
from outrider.bench.workloads import load_workload
from outrider.engine.loop import EngineLoop
from outrider.engine.prefix_cache import PrefixCache
from outrider.engine.request import Request
from outrider.llm import LLM

FOLLOW_UPS = ["Now add type hints to every argument.", "Explain the change in two sentences.",
              "Rename the function to something clearer and show it again.", "Add a short docstring.",
              "Write one unit test for it.", "Make the test cover an empty input too.",
              "Summarise everything we changed, as a list."]


def encode(llm: LLM, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def system_prompt(llm: LLM, tokens: int) -> str:
    """About `tokens` tokens of a system prompt: an instruction and textwrap's source, cut at a line."""
    import inspect
    import textwrap

    text = "You are a careful Python programmer. Answer questions using this module as a reference:\n\n```python\n"
    for line in inspect.getsource(textwrap).splitlines(keepends=True):
        if len(llm.tokenizer(text + line, add_special_tokens=False)["input_ids"]) > tokens - 2:
            break
        text += line
    return text + "```"


def openings_for(llm: LLM, load: str, count: int, offset: int, system_tokens: int) -> list[list[dict]]:
    """Each client's first messages (chat: code-edit prompts; system: the shared system prompt
    and a HumanEval function), the workload's prompts from `offset` on."""
    if load == "chat":
        work = load_workload("code-edit", limit=offset + count)
        return [list(p.messages) for p in work.prompts[offset:offset + count]]
    system = system_prompt(llm, system_tokens)
    return [[{"role": "system", "content": system}, {"role": "user", "content": "Complete this function:\n" + task}]
            for task in humaneval_tasks(offset, count)]


def humaneval_tasks(offset: int, count: int) -> list[str]:
    work = load_workload("humaneval")
    texts = [p.text for p in work.prompts]
    return [texts[i % len(texts)] for i in range(offset, offset + count)]


def run_arm(llm: LLM, openings: list[list[dict]], turns: int, max_tokens: int, chunk: int,
            cache: PrefixCache | None, load: str = "chat", tasks: list[str] | None = None) -> dict:
    """Every client to its end in one engine; per turn, each client's TTFT, cached tokens,
    prompt length and answer; the output tokens and wall time of the whole arm. chat: each turn
    the history so far and a follow-up; system: each turn the system prompt and the next of
    `tasks` (a list per client of its later turns' user messages)."""
    eng = EngineLoop(llm.target, llm.eos_ids, None, decode=llm.decode, max_running=len(openings),
                     max_len=2048, chunk_size=chunk, prefix_cache=cache)
    if cache is not None and eng.prefix_cache is None:
        raise SystemExit(f"the prefix cache is off: {eng.prefix_cache_note}")
    history = [list(m) for m in openings]
    turn_of = [0] * len(openings)
    out = {"ttft": [[None] * turns for _ in openings], "cached": [[0] * turns for _ in openings],
           "prompt": [[0] * turns for _ in openings], "answers": [[None] * turns for _ in openings],
           "output_tokens": 0}
    started = time.perf_counter()
    live: dict[int, tuple[int, float]] = {}  # request id -> (conversation, added at)

    def send(c: int) -> None:
        ids = encode(llm, history[c])
        out["prompt"][c][turn_of[c]] = len(ids)
        live[eng.add(Request(ids, max_tokens))] = (c, time.perf_counter())

    for c in range(len(openings)):
        send(c)
    while live:
        events = eng.step()
        now = time.perf_counter()
        for ev in events:
            c, added = live[ev.request_id]
            t = turn_of[c]
            if ev.new_tokens and out["ttft"][c][t] is None:
                out["ttft"][c][t] = now - added
            if ev.completion is None:
                continue
            del live[ev.request_id]
            out["answers"][c][t] = ev.completion.token_ids
            out["cached"][c][t] = ev.completion.cached_tokens
            out["output_tokens"] += len(ev.completion.token_ids)
            turn_of[c] += 1
            if turn_of[c] < turns and load == "chat":
                history[c] += [{"role": "assistant", "content": ev.completion.text},
                               {"role": "user", "content": FOLLOW_UPS[(turn_of[c] - 1) % len(FOLLOW_UPS)]}]
            elif turn_of[c] < turns:  # the same system prompt, the client's next task
                history[c] = [history[c][0], {"role": "user", "content": "Complete this function:\n"
                                              + tasks[c][turn_of[c] - 1]}]
            if turn_of[c] < turns:
                send(c)
    out["wall_s"] = time.perf_counter() - started
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--load", choices=("chat", "system"), default="chat")
    ap.add_argument("--system-tokens", type=int, default=1000, help="the system load's shared prompt")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1, help="on/off pairs, each on new conversations")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--write-jsonl", default=None, metavar="PATH",
                    help="only write the system load's first --clients x --turns prompts as a jsonl workload "
                         "of completion prompts, the system prompt and the task as one text (for "
                         "scripts/load_test.py or scripts/guidellm_serve.py --workload jsonl:PATH)")
    args = ap.parse_args()
    if args.config:
        runtime.use({k: v for k, _, v in (c.partition("=") for c in args.config)})
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, threads=args.threads, prefix_cache_mb=0)
    if args.write_jsonl:
        system = system_prompt(llm, args.system_tokens)
        with open(args.write_jsonl, "w") as f:
            for i, task in enumerate(humaneval_tasks(0, args.clients * args.turns)):
                text = system + "\n\nComplete this function:\n" + task  # guidellm reads text prompts only
                f.write(json.dumps({"id": f"shared{i}", "prompt": text}) + "\n")
        print(f"{args.clients * args.turns} prompts sharing a {args.system_tokens}-token system prompt: "
              f"{args.write_jsonl}")
        return
    results = []
    for r in range(args.repeats):
        first = r * args.clients * args.turns  # every client set its own prompts
        openings = openings_for(llm, args.load, args.clients, first, args.system_tokens)
        later = humaneval_tasks(first + args.clients, args.clients * (args.turns - 1))
        tasks = [later[c * (args.turns - 1):(c + 1) * (args.turns - 1)] for c in range(args.clients)]
        arms = {}
        for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
            cache = PrefixCache(16, 512 << 20) if arm == "on" else None
            arms[arm] = run_arm(llm, openings, args.turns, args.max_tokens, args.chunk_size, cache, args.load, tasks)
        if arms["on"]["answers"] != arms["off"]["answers"]:
            raise SystemExit("the greedy answers differ with the cache and without it")
        results.append(arms)
    report(results, args)


def report(results: list[dict], args) -> None:
    print(f"load {args.load}: {args.clients} client(s) x {args.turns} turns, {args.max_tokens} tokens a turn, "
          f"chunk {args.chunk_size}, threads {args.threads}, {args.repeats} on/off pair(s); greedy answers equal: yes")
    print("turn | prompt tokens | cached (on) | TTFT off ms | TTFT on ms | off / on")
    rows = []
    for t in range(args.turns):
        pick = lambda arm, key: [v for res in results for conv in res[arm][key] for v in [conv[t]]]  # noqa: E731
        prompt, cached = statistics.median(pick("on", "prompt")), statistics.median(pick("on", "cached"))
        off, on = statistics.median(pick("off", "ttft")), statistics.median(pick("on", "ttft"))
        rows.append({"turn": t + 1, "prompt": prompt, "cached": cached, "ttft_off": off, "ttft_on": on})
        print(f"{t + 1:4d} | {prompt:13.0f} | {cached:11.0f} | {off * 1e3:11.1f} | {on * 1e3:10.1f} | {off / on:6.2f}x")
    later_off = statistics.median([r["ttft_off"] for r in rows[1:]]) if len(rows) > 1 else float("nan")
    later_on = statistics.median([r["ttft_on"] for r in rows[1:]]) if len(rows) > 1 else float("nan")
    print(f"turns 2..{args.turns}: median TTFT off {later_off * 1e3:.1f} ms, on {later_on * 1e3:.1f} ms, "
          f"{later_off / later_on:.2f}x lower with the cache")
    every = {arm: statistics.median([t for res in results for conv in res[arm]["ttft"] for t in conv])
             for arm in ("off", "on")}
    speed = {arm: sum(res[arm]["output_tokens"] for res in results) / sum(res[arm]["wall_s"] for res in results)
             for arm in ("off", "on")}
    print(f"every request: median TTFT off {every['off'] * 1e3:.1f} ms, on {every['on'] * 1e3:.1f} ms "
          f"({every['off'] / every['on']:.2f}x); output tokens/s off {speed['off']:.1f}, on {speed['on']:.1f} "
          f"({speed['on'] / speed['off']:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "turns": rows, "ttft_all": every, "tokens_per_s": speed}, f, indent=1)


if __name__ == "__main__":
    main()
