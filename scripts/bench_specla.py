"""SpecLA (docs/methods.md#specla) against autoregressive decoding and plain EAGLE-3 on a
gated-delta hybrid, and its cost model's accounting at Qwen3.5-0.8B's shapes.

    python scripts/bench_specla.py run --model smollm2-135m-gdn --head HEAD [--dtype q8_0]
           [--workloads humaneval,code-edit] [--prompts 3] [--max-new-tokens 64] [--depth 4]
           [--tree dynamic:4,12] [--threshold 0.05] [--other-head OTHER] [--threads 1] [--repeats 2]
           [--json OUT]
    python scripts/bench_specla.py accounting [--model smollm2-135m-gdn] [--dtype q8_0] [--json OUT]

`run`: one engine per method, all loaded at once; each repeat runs every prompt through every
method in a rotated order (A/B interleaved, so a load that comes and goes on a shared machine
falls on all of them alike). Greedy. Reported per method: tau (committed tokens per round, the
bonus included), tokens a second over the whole generate call (prefill included) and its ratio
to AR's, whether every output equals AR's token for token, and for SpecLA what its controller did
with the drafts (drafted, pruned below T, left out by the cost model, verified) and which floor
of the roofline priced its last round.

    ar               plain decoding
    eagle3-chain     --drafter eagle3:HEAD --controller fixed:DEPTH
    eagle3-tree      --drafter eagle3:HEAD --tree TREE --controller fixed:DEPTH
    specla           --drafter eagle3:HEAD --tree TREE --controller specla:DEPTH,T
    specla-unpruned  the same with T = 0 (the cost model alone)
    specla-chain     --drafter eagle3:HEAD --controller specla:DEPTH,T (a chain, pruned and sized)
    other-head-chain with --other-head OTHER: --drafter eagle3:OTHER --controller fixed:DEPTH

`accounting`: the cost model's bytes and flops of one verify (control/specla_cost.py) at
Qwen3.5-0.8B's shapes (QWEN35_08B below: the shapes scripts/bench_treewy.py takes for its
gated-delta layers, the rest as we take them, not read from a downloaded config) for trees of 1
to 64 nodes, compact factors against per-node snapshots, and the time this machine's roofline
gives them, calibrated on --model's measured verify profile.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from outrider import LLM
from outrider.bench.workloads import load_workload
from outrider.control.specla_cost import StateBytes, calibrate
from outrider.models.config import ModelConfig

QWEN35_08B = {
    "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}
NODES = (1, 2, 4, 8, 16, 32, 64)


def methods(head: str, depth: int, tree: str, threshold: float, other: str | None = None) -> dict[str, dict]:
    e3 = f"eagle3:{head}"
    return {
        "ar": {},
        **({"other-head-chain": dict(drafter=f"eagle3:{other}", controller=f"fixed:{depth}")} if other else {}),
        "eagle3-chain": dict(drafter=e3, controller=f"fixed:{depth}"),
        "eagle3-tree": dict(drafter=e3, tree=tree, controller=f"fixed:{depth}"),
        "specla": dict(drafter=e3, tree=tree, controller=f"specla:{depth},{threshold:g}"),
        "specla-unpruned": dict(drafter=e3, tree=tree, controller=f"specla:{depth},0"),
        "specla-chain": dict(drafter=e3, controller=f"specla:{depth},{threshold:g}"),
    }


def run(args) -> dict:
    prompts = []
    for name in args.workloads.split(","):
        w = load_workload(name, limit=args.prompts, max_new_tokens=args.max_new_tokens)
        prompts += [(name, p.text if p.text is not None else p.messages[-1]["content"], w.chat) for p in w.prompts]
    engines = {name: LLM(args.model, dtype=args.dtype, threads=args.threads, **kw)
               for name, kw in methods(args.head, args.depth, args.tree, args.threshold, args.other_head).items()}
    names = list(engines)
    rows = {n: {"tokens": 0, "rounds": 0, "seconds": 0.0, "committed": 0, "equal": True} for n in names}
    outputs: dict[tuple, list[int]] = {}
    for r in range(args.repeats):
        for i, (workload, prompt, chat) in enumerate(prompts):
            order = names[(r + i) % len(names):] + names[: (r + i) % len(names)]
            for name in order:
                start = time.perf_counter()
                out = engines[name].generate(prompt, args.max_new_tokens, chat=chat)
                seconds = time.perf_counter() - start
                row = rows[name]
                row["tokens"] += len(out.token_ids)
                row["seconds"] += seconds
                if name != "ar":
                    row["rounds"] += out.stats["rounds"]
                    row["committed"] += out.stats["committed"]
                outputs.setdefault((name, i), out.token_ids)
    for name in names:
        row = rows[name]
        row["equal"] = all(outputs[(name, i)] == outputs[("ar", i)] for i in range(len(prompts)))
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["speedup"] = row["tokens_per_s"] / (rows["ar"]["tokens"] / rows["ar"]["seconds"])
        row["tau"] = row["committed"] / row["rounds"] if row["rounds"] else 1.0
        ctl = engines[name].speculator.controller if engines[name].speculator else None
        if ctl is not None and type(ctl).__name__ == "SpecLAController":
            row["controller"] = dict(drafted=ctl.drafted, pruned=ctl.pruned, sized_out=ctl.sized_out,
                                     verified=ctl.verified, last_width=ctl.last_width, last_bound=ctl.last_bound,
                                     scale=ctl.scale, confidence_scale=ctl.confidence_scale,
                                     bandwidth=ctl.roofline.bandwidth, flop_rate=ctl.roofline.rate)
    for name in names:
        row = rows[name]
        extra = ""
        if "controller" in row:
            c = row["controller"]
            extra = (f"  drafted {c['drafted']}, pruned {c['pruned']}, sized out {c['sized_out']}, verified "
                     f"{c['verified']}; last round {c['last_width']} nodes, {c['last_bound']}-bound")
        print(f"{name:16s} tau {row['tau']:.2f}  {row['tokens_per_s']:6.2f} tok/s  x{row['speedup']:.2f}  "
              f"equal to AR: {row['equal']}{extra}", flush=True)
    return {"prompts": len(prompts), "rows": rows}


def accounting(args) -> dict:
    llm = LLM(args.model, dtype=args.dtype, threads=args.threads)
    from outrider.config import cache_dir
    from outrider.control.profile import load_or_measure

    here = StateBytes.of_model(llm.target)
    profile = load_or_measure(llm.path, llm.target, cache_dir() / "profiles")
    roof = calibrate(here, profile)
    print(f"roofline on this machine ({args.model}, {args.dtype}, {args.threads} thread(s)): "
          f"{roof.bandwidth / 1e9:.2f} GB/s, {roof.rate / 1e9:.2f} GFLOP/s")
    out = {"roofline": {"bandwidth": roof.bandwidth, "rate": roof.rate, "profile": dict(zip(profile.sizes, profile.seconds))},
           "models": {}}
    cfg = ModelConfig.from_dict(QWEN35_08B)
    for label, state in ((args.model, here),
                         ("qwen3.5-0.8b float32, float64 state (ours)", StateBytes.of_config(cfg)),
                         ("qwen3.5-0.8b bfloat16, bfloat16 state", StateBytes.of_config(cfg, weight_element=2, state=2,
                                                                                          act=2, kv=2))):
        table = []
        print(f"\n{label}: weights {state.weight_bytes / 2**20:.1f} MiB, per node: factors "
              f"{state.node_bytes('factors') / 2**10:.1f} KiB, snapshots {state.node_bytes('snapshots') / 2**10:.1f} KiB "
              f"({state.node_bytes('snapshots') / state.node_bytes('factors'):.1f}x)")
        for context in (256, 4096):
            for n in NODES:
                f, s, fl = state.bytes(n, context), state.bytes(n, context, "snapshots"), state.flops(n, context)
                row = dict(context=context, nodes=n, factors_bytes=f, snapshot_bytes=s, flops=fl,
                           state_share_factors=state.state_share(n, context),
                           state_share_snapshots=state.state_share(n, context, "snapshots"),
                           seconds_factors=roof.time(f, fl), seconds_snapshots=roof.time(s, fl),
                           bound_factors=roof.bound(f, fl), bound_snapshots=roof.bound(s, fl))
                table.append(row)
                print(f"  ctx {context:5d} N {n:3d}: factors {f / 2**20:8.1f} MiB ({100 * row['state_share_factors']:4.1f}% "
                      f"state) {1e3 * row['seconds_factors']:8.2f} ms {row['bound_factors']:10s} | snapshots "
                      f"{s / 2**20:8.1f} MiB ({100 * row['state_share_snapshots']:4.1f}% state) "
                      f"{1e3 * row['seconds_snapshots']:8.2f} ms {row['bound_snapshots']}")
        out["models"][label] = table
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("run", "accounting"))
    ap.add_argument("--model", default="smollm2-135m-gdn")
    ap.add_argument("--head", default=None, help="an EAGLE-3 head folder for the model (run)")
    ap.add_argument("--other-head", default=None, help="another head, run as a chain beside (run): e.g. the "
                    "base model's, unchanged")
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--workloads", default="humaneval,code-edit")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--tree", default="dynamic:4,12")
    ap.add_argument("--threshold", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.mode == "run" and not args.head:
        ap.error("run needs --head")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
              platform.machine(), "argv": sys.argv, **(run(args) if args.mode == "run" else accounting(args))}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
