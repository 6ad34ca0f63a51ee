"""xPress's acceptance and head latency against its Jacobi passes, offline, on real blocks (docs/methods.md#xpress).

    python scripts/bench_xpress.py [--prompts 4] [--new-tokens 64] [--vocab 8192] [--repeats 3]

For each HumanEval prompt (the bench's workload, in its order) the target (float32) writes its
greedy continuation; then at every position a of the continuation (a round's root) the shipped
DFlash head drafts its block from the target's features of positions < a, exactly as the engine's
round does, and each proposal is scored by what a greedy verify would accept there: the longest
prefix of the proposal (or path of the tree) equal to the target's own continuation. tau = 1 +
that, averaged over every position (the engine's rounds visit a subset of these positions; the
bench preset `xpress` measures tau in the engine itself). Proposals: the block's own argmax chain
(xPress with 0 passes), xPress with 1..3 passes (and the sequential decode Jacobi converges to),
DDTree and LiLiCorr on the same node budget. Latency: the block forward (one sequence, as a round
drafts it) and each refiner's own time on the same block, one torch thread, median of `--repeats`
timings per block, methods interleaved block by block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def accepted(paths: list[list[int]], truth: list[int]) -> int:
    best = 0
    for p in paths:
        n = 0
        while n < len(p) and n < len(truth) and p[n] == truth[n]:
            n += 1
        best = max(best, n)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--head", default="smollm2-135m-instruct", help="a DFlash head (folder or shipped name) with "
                   "xpress.safetensors and lilicorr.safetensors beside it")
    p.add_argument("--xpress", default=None, help="an xpress.safetensors other than the head's")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192, help="the head's readout cut (dflash:NAME,vocab=N; 0: whole)")
    p.add_argument("--nodes", type=int, default=7, help="the trees' node budget (DDTree, LiLiCorr)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from outrider.bench.workloads import load_workload
    from outrider.catalog.resolve import resolve_model
    from outrider.drafters.block import Block, ddtree, greedy_chain
    from outrider.drafters.dflash import parse_argument
    from outrider.drafters.dflash_vocab import reduce_readout
    from outrider.drafters.refiners import make_refiner
    from outrider.drafters.refiners.base import paths_of
    from outrider.drafters.refiners.xpress import jacobi
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.heads.dflash.format import load_dflash
    from outrider.train.xpress import target_view
    from outrider.weights.loader import load_decoder
    from outrider.weights.tokenizer import load_tokenizer

    folder = resolve_model(args.target)
    target = load_decoder(folder, "cpu")
    tok = load_tokenizer(folder)
    head_dir = parse_argument(args.head.removeprefix("dflash:"))
    head = load_dflash(head_dir, target)
    if args.vocab:
        head = reduce_readout(head, folder, args.vocab)
    xp = make_refiner(f"xpress:{args.xpress}:0" if args.xpress else "xpress:0", head, head_dir)
    lili = make_refiner("lilicorr", head, head_dir)
    mask = head.config.mask_token_id
    B, K = head.block_size, head.block_size - 1
    taps = head.config.taps(target.config.num_layers)
    names = ["xpress0", "xpress1", "xpress2", "xpress3", "sequential", "ddtree", "lilicorr"]
    acc = {n: [] for n in names}
    ms = {n: [] for n in ["block"] + names[1:4] + ["ddtree", "lilicorr"]}
    passes_run = {p: [] for p in (1, 2, 3)}
    work = load_workload("humaneval", limit=args.prompts)
    for wp in work.prompts:
        prompt = tok(wp.text)["input_ids"]
        out = generate_ids(target, [Request(list(prompt), args.new_tokens)], set())[0].token_ids
        ids = list(prompt) + list(out)
        with torch.inference_mode():
            feats, _ = target_view(target, ids, taps)
            cache = head.new_cache(1, len(ids) + B)
            head.write_context(cache, 0, 0, head.fuse(feats))
        for a in range(len(prompt) - 1, len(ids) - 1):
            truth = ids[a + 1: a + 1 + K]
            blk_tokens = torch.full((1, B), mask, dtype=torch.long)
            blk_tokens[0, 0] = ids[a]
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                logits, hidden = head.block(cache, [0], [a], blk_tokens)
                times.append(time.perf_counter() - t0)
            ms["block"].append(statistics.median(times) * 1e3)
            blk = Block(ids[a], a, logits[0], hidden[0], head.config.vocab_size, head.w.draft_to_target,
                        committed=ids[: a + 1])
            acc["xpress0"].append(accepted([blk.argmax(K)], truth))
            for passes in (1, 2, 3):
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        chain, ran = jacobi(xp.head, blk, K, passes, mask)
                    times.append(time.perf_counter() - t0)
                ms[f"xpress{passes}"].append(statistics.median(times) * 1e3)
                acc[f"xpress{passes}"].append(accepted([chain], truth))
                passes_run[passes].append(ran)
            with torch.inference_mode():
                acc["sequential"].append(accepted([jacobi(xp.head, blk, K, K, mask)[0]], truth))
            for name, build in (("ddtree", lambda: ddtree(blk, K, args.nodes)),
                                ("lilicorr", lambda: lili.refine(blk, greedy_chain(blk, K), K, args.nodes, True))):
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    tree = build()
                    times.append(time.perf_counter() - t0)
                ms[name].append(statistics.median(times) * 1e3)
                acc[name].append(accepted([path for path, _ in paths_of(tree)], truth))
    report = {
        "blocks": len(acc["xpress0"]), "prompts": args.prompts, "new_tokens": args.new_tokens, "vocab": args.vocab,
        "block_size": B, "nodes": args.nodes,
        "tau": {n: round(1 + statistics.mean(v), 3) for n, v in acc.items()},
        "accept_rate_slot1": {n: round(statistics.mean(int(x >= 1) for x in v), 3) for n, v in acc.items()},
        "median_ms": {n: round(statistics.median(v), 3) for n, v in ms.items()},
        "mean_passes_run": {p: round(statistics.mean(v), 2) for p, v in passes_run.items()},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
