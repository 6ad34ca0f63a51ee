"""Paged K/V against today's slots at a fixed K/V memory (issue 42, item 1).

    .venv/bin/python scripts/bench_paged_kv.py --slots 2 --max-model-len 2048 --requests 48 \
        --prompt-tokens 100 --max-tokens 32 --threads 1

The slots arm is `outrider serve`'s engine as it stands without --kv-memory: `--slots` slots of
`--max-model-len` rows each. The paged arm gets the same bytes as a pool of pages (--kv-memory
with the pages those bytes hold) and `--max-running` slots of block table. Every request is
queued at once (short prompts cut from a stdlib source file, greedy, EOS ignored so that each
runs --max-tokens); each step records how many requests run at once. Printed per arm: the K/V
bytes, the most and the mean running at once, steps, wall time and output tokens a second, and
whether the arms' tokens are equal. Arms: slots and paged on the native layer (over pages it reads
each forward's span copied out in slot layout), and both on the torch layers (config
native_layer=off): slots-torch, paged-torch (pages gathered a layer at a time).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch


def prompts(llm, n: int, tokens: int) -> list[list[int]]:
    """n prompts of `tokens` tokens, windows of a stdlib source file at different offsets."""
    import json.decoder as source

    ids = llm.tokenizer(inspect.getsource(source) * 4)["input_ids"]
    step = max((len(ids) - tokens) // max(n, 1), 1)
    return [ids[i * step: i * step + tokens] for i in range(n)]


def run(llm, label: str, requests, *, max_running: int, max_len: int, pages: int | None, page: int,
        chunk: int) -> dict:
    from outrider.engine.loop import EngineLoop

    engine = EngineLoop(llm.target, set(), None, max_running=max_running, max_len=max_len, chunk_size=chunk,
                        kv_pages=pages, page_size=page)
    ids = [engine.add(r) for r in requests]
    done, running, steps = {}, [], 0
    start = time.perf_counter()
    while engine.has_work:
        for event in engine.step():
            if event.completion is not None:
                done[event.request_id] = event.completion.token_ids
        running.append(engine.num_running)
        steps += 1
    wall = time.perf_counter() - start
    out = sum(len(done[i]) for i in ids)
    return {"arm": label, "kv_mib": round(engine.cache.nbytes() / (1 << 20), 1), "max_running": max(running),
            "mean_running": round(sum(running) / len(running), 1), "steps": steps, "wall_s": round(wall, 1),
            "out_tok_s": round(out / wall, 1), "preemptions": engine.preemptions,
            "tokens": [done[i] for i in ids]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--slots", type=int, default=2, help="the slots arm's slots (its K/V memory)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-running", type=int, default=64, help="the paged arm's slots (block-table rows)")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arms", default="slots,paged,slots-torch,paged-torch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from outrider import LLM
    from outrider.engine.paging import page_bytes
    from outrider.engine.request import Request

    native = LLM(args.model, threads=args.threads)
    native.generate("warm up", 1)  # its first forward takes the native layer, whatever the config is later
    reqs = [Request(p, args.max_tokens) for p in prompts(native, args.requests, args.prompt_tokens)]
    # the slots arm's bytes: slots x (max_len + 1 rows, the scratch row) ...; the pool: as many pages
    # (and its scratch page) in the same bytes
    rows = args.slots * (args.max_model_len + 1)
    pages = rows // args.page - 1
    print(json.dumps({"model": args.model, "threads": args.threads, "slots": args.slots,
                      "max_model_len": args.max_model_len, "pages": pages, "page_rows": args.page,
                      "page_kib": page_bytes(native.target, args.page) / 1024, "requests": args.requests,
                      "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}), flush=True)
    results, torch_llm = [], None
    for arm in args.arms.split(","):
        if arm == "slots":  # the native layer (chosen at this model's first forward, above)
            r = run(native, arm, reqs, max_running=args.slots, max_len=args.max_model_len, pages=None, page=args.page,
                    chunk=args.chunk_size)
        elif arm == "paged":  # the native layer over each forward's span copied out of the pages
            r = run(native, arm, reqs, max_running=args.max_running, max_len=args.max_model_len, pages=pages,
                    page=args.page, chunk=args.chunk_size)
        else:
            torch_llm = torch_llm or LLM(args.model, threads=args.threads, config={"native_layer": False})
            if arm == "paged-torch":
                r = run(torch_llm, arm, reqs, max_running=args.max_running, max_len=args.max_model_len, pages=pages,
                        page=args.page, chunk=args.chunk_size)
            else:
                r = run(torch_llm, arm, reqs, max_running=args.slots, max_len=args.max_model_len, pages=None,
                        page=args.page, chunk=args.chunk_size)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    print(json.dumps({"tokens_equal_across_arms": same,
                      "differing_requests": {r["arm"]: sum(a != b for a, b in zip(r["tokens"], results[0]["tokens"]))
                                             for r in results}}))


if __name__ == "__main__":
    main()
