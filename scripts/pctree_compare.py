"""PCTree against DDTree on DSpark's marginals and DSpark's chain, at equal node budgets (issue 43 item 3).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/pctree_compare.py --head HEAD [--target smollm2-135m-instruct]
        [--workloads humaneval,code-edit] [--prompts 3] [--max-new-tokens 64] [--budgets 4,8,16] [--json out.json]

HEAD: a DSpark head folder (config.json + model.safetensors, heads/dspark/format.py) or a shipped
head's target name. For each prompt the target generates greedily (plain decoding), one target
forward over prompt + output gives the tapped hidden states, and each drafting policy is replayed
along that text as greedy speculative decoding with it would run: each round, with the last
committed token at position a, ONE DSpark backbone pass over the block [x_a, MASK...] (context rows
0..a-1) gives U [gamma, Vd] and hbar [gamma, H] (shared by every policy at that anchor), then

    chain:N    DSpark's own chain: position k's token the argmax of U_k + Markov bias given the
               token drafted before it, min(N, gamma) deep
    ddtree:N   DDTree on the marginals U_k alone (drafters/block.py; what `--tree ddtree:N` builds
               from a block that ignores the Markov head)
    pctree:N   PCTree (drafters/pctree.py): children scored per concrete parent with the Markov head

the tree's path that follows the text is accepted, plus the bonus token; a moves on. So rounds and
tau = committed / rounds are those greedy decoding with that policy gets on these prompts (the
text is the target's own, so every policy commits the same tokens), without a drafter in the
engine. Also timed: the tree's build (host side, after the backbone pass) in ms a round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def chain(head, anchor: int, U, hbar, depth: int):
    """DSpark's greedy chain: each position's argmax given the token drafted before it."""
    import torch

    from outrider.spec.types import DraftTree

    tokens, prev, state = [], anchor, None
    for k in range(min(depth, U.shape[0])):
        logits, state = head.step(U[k: k + 1], hbar[k: k + 1], torch.tensor([prev]), state)
        prev = int(head.target_ids(logits[0].argmax(-1, keepdim=True))[0])
        tokens.append(prev)
    return DraftTree.chain(anchor, tokens)


def build(policy: str, nodes: int, head, anchor: int, a: int, U, hbar):
    from outrider.drafters.block import Block, ddtree
    from outrider.drafters.pctree import pctree

    gamma = U.shape[0]
    if policy == "chain":
        return chain(head, anchor, U, hbar, min(nodes, gamma))
    if policy == "ddtree":
        block = Block(anchor, a, U, hbar, head.config.vocab_size, head.w.draft_to_target)
        return ddtree(block, gamma, nodes)
    return pctree(anchor, U, hbar, head.step, head.target_ids, gamma, nodes)


def accepted_along(tree, text: list[int], a: int) -> int:
    """Drafts of `tree` (rooted at text[a]) that the text follows, root down."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, n = 0, 0
    while a + 1 + n < len(text):
        child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == text[a + 1 + n]), None)
        if child is None:
            break
        node, n = child, n + 1
    return n


def replay(head, target, text: list[int], prompt_len: int, policies: list[tuple[str, int]]) -> dict:
    """Per policy: rounds, committed and the tree build's seconds along `text` (module docstring)."""
    import torch

    from outrider.models.batch import causal_batch

    n = len(text)
    taps = head.config.taps(target.config.num_layers)
    with torch.inference_mode():
        cache = target.new_cache(1, n)
        out = target.forward(causal_batch([torch.tensor(text)], hidden_layers=tuple(sorted(set(taps))),
                                          scratch_row=cache.scratch_row, device=target.device), cache)
        features = torch.stack([out.hidden[t][0] for t in taps], dim=1)  # [n, taps, Ht]
        own = head.new_cache(1, n + head.block_size)
        head.write_context(own, 0, 0, head.fuse(features))
    blocks: dict[int, tuple] = {}

    def block_at(a: int):
        if a not in blocks:
            tokens = torch.full((1, head.block_size), head.config.mask_token_id, dtype=torch.long)
            tokens[0, 0] = text[a]
            U, hbar = head.block(own, [0], [a], tokens)  # [1, gamma, Vd], [1, gamma, H]
            blocks[a] = (U[0], hbar[0])
        return blocks[a]

    results = {}
    for policy, nodes in policies:
        rounds = committed = 0
        build_s, a = 0.0, prompt_len  # the first generated token comes from the prefill: the first root
        while a < n - 1:
            U, hbar = block_at(a)
            start = time.perf_counter()
            tree = build(policy, nodes, head, text[a], a, U, hbar)
            build_s += time.perf_counter() - start
            step = min(accepted_along(tree, text, a) + 1, n - 1 - a)
            rounds, committed, a = rounds + 1, committed + step, a + step
        results[f"{policy}:{nodes}"] = {"rounds": rounds, "committed": committed, "build_s": build_s}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", required=True, help="a DSpark head folder or a shipped head's target name")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", default="humaneval,code-edit")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="4,8,16", help="node budgets N (the chain: min(N, gamma) deep)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from outrider.bench.run import encode_prompt
    from outrider.bench.workloads import load_workload
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.heads.catalog import resolve_head
    from outrider.heads.dspark.format import load_dspark
    from outrider.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(args.target)
    head = load_dspark(resolve_head(args.head, "dspark"), llm.target)
    budgets = [int(b) for b in args.budgets.split(",")]
    policies = [(p, n) for n in budgets for p in ("chain", "ddtree", "pctree")]
    gamma = getattr(head, "gamma", head.block_size)  # positions drafted (DSparkHead.gamma)
    report = {"target": args.target, "head": args.head, "gamma": gamma,
              "markov": f"{head.spec.markov_variant} r={head.spec.markov_rank}", "workloads": {}}
    for name in args.workloads.split(","):
        w = load_workload(name, limit=args.prompts, max_new_tokens=args.max_new_tokens)
        totals: dict[str, dict] = {}
        for q in w.prompts:
            ids = encode_prompt(llm.tokenizer, w, q)
            [done] = generate_ids(llm.target, [Request(list(ids), args.max_new_tokens)], set(llm.eos_ids))
            text = list(ids) + list(done.token_ids)
            for key, r in replay(head, llm.target, text, len(ids), policies).items():
                t = totals.setdefault(key, {"rounds": 0, "committed": 0, "build_s": 0.0})
                for field in t:
                    t[field] += r[field]
        print(f"\n{name}: {len(w.prompts)} prompts x {args.max_new_tokens} tokens, gamma {gamma}, "
              f"Markov head {report['markov']}")
        print(f"{'policy':>10} {'rounds':>7} {'tau':>6} {'build ms':>9}")
        for key, t in totals.items():
            t["tau"] = t["committed"] / max(t["rounds"], 1)
            t["build_ms"] = 1000 * t["build_s"] / max(t["rounds"], 1)
            print(f"{key:>10} {t['rounds']:>7} {t['tau']:>6.3f} {t['build_ms']:>9.2f}")
        report["workloads"][name] = totals
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
