"""TreeWY against per-node state snapshots for one gated-delta layer at Qwen3.5-0.8B's shapes
(random weights): speculative state bytes per node, verify time per tree, the fold at commit, and
the lossless audit (both give the same outputs and the same accepted state on every tree).

    .venv/bin/python scripts/bench_treewy.py [--quick] [--repeats 7] [--threads 1,2] [--out FILE.json]

Shapes (Qwen3.5-0.8B text config): 16 value heads and 16 key heads of dk = dv = 128, a causal
convolution of 4 taps over conv_dim = 2*16*128 + 16*128 = 6144 channels; 18 of its 24 layers are
gated-delta layers. A tree's nodes are those of Outrider's verify forward: node 0 is the root (the
last committed token), then the drafts (`static:2,2,2` holds 1 + 14 nodes).

What is counted:
- TreeWY: the rows `DeltaState.hold` keeps per node (models/delta_state.py), read off the tensors
  it holds: the convolution input x (model dtype, a copy), the stash's k (float32: exact) and u,
  gamma (float64). "logical" is numel * element_size of the held tensors; "pinned" is the
  storage those tensors keep alive (u[i] is a view of the solve's U, which holds only the nodes).
- Snapshots: the [HV, dk, dv] state per node as `snapshot_tree` returns it (float64, ours), and
  the float32 / bfloat16 figures of a runtime keeping its state in that dtype; plus the
  convolution window [K - 1, conv_dim] per node a snapshotting runtime keeps beside it (counted by
  formula: `snapshot_tree` keeps no convolution).
- Time: the median of `--repeats` calls of `tree_step` and of `snapshot_tree` per tree and torch
  thread count, and of `fold` over the tree's deepest root-to-leaf path (the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from outrider.models.config import DeltaConfig
from outrider.models.delta_state import DeltaState
from outrider.models.gated_delta import Stash, chunked, fold, snapshot_tree, tree_step

MiB = 1 << 20
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Shapes:
    HV: int = 16  # value heads
    HK: int = 16  # key heads
    dk: int = 128
    dv: int = 128
    K: int = 4  # convolution taps
    delta_layers: int = 18  # gated-delta layers in the whole model

    @property
    def conv_dim(self) -> int:
        return 2 * self.HK * self.dk + self.HV * self.dv


QWEN35_08B = Shapes()

# name -> widths per depth (a chain: width 1 at every depth)
TREES = {**{f"chain:{d}": [1] * d for d in range(1, 9)},
         **{f"static:{w}": [int(x) for x in w.split(",")]
            for w in ("2,2", "2,2,1", "2,2,2", "3,3", "4,4", "2,2,2,2", "3,4,4")}}
QUICK = ("chain:1", "chain:4", "static:2,2,2", "static:4,4")


def tree_parents(widths: list[int]) -> list[int]:
    """A static tree in breadth-first order, root first: every node at depth d has widths[d]
    children. parents[i] < i, parents[0] == -1."""
    parents, level = [-1], [0]
    for w in widths:
        nxt = []
        for p in level:
            for _ in range(w):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def strict_ancestors(parents: list[int]) -> torch.Tensor:
    """bool [N, N]: [i, j] when j is a strict ancestor of i."""
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            out[i] = out[p]
            out[i, p] = True
    return out


def deepest_path(parents: list[int]) -> list[int]:
    """The first deepest node's root-to-node path."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        depth[i] = depth[p] + 1
    node, path = depth.index(max(depth)), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def layer_inputs(s: Shapes, n: int, gen: torch.Generator):
    """Float32 inputs as delta_layer.py hands them to the recurrence for n tokens: the in_proj
    output proj [n, conv_dim + HV dv + 2 HV] whose first conv_dim columns are the convolution's
    inputs x; q, k [n, HV, dk] (l2-normed, q scaled by dk^-0.5), v [n, HV, dv]; the log-decay
    g = -A softplus(a + dt_bias) [n, HV] (A ~ U(0.1, 1), dt_bias ~ U(-4, 0) per head: e^g in
    about (0.1, 1)); beta = sigmoid(b) [n, HV]."""
    HV, HK, dk, dv = s.HV, s.HK, s.dk, s.dv
    proj = torch.randn(n, s.conv_dim + HV * dv + 2 * HV, generator=gen)  # [n, C + HV dv + 2 HV]
    rep = HV // HK
    q = F.normalize(torch.randn(n, HK, dk, generator=gen), dim=-1).repeat_interleave(rep, 1) * dk ** -0.5
    k = F.normalize(torch.randn(n, HK, dk, generator=gen), dim=-1).repeat_interleave(rep, 1)  # [n, HV, dk]
    v = torch.randn(n, HV, dv, generator=gen)  # [n, HV, dv]
    A = torch.rand(HV, generator=gen) * 0.9 + 0.1  # [HV]
    dt_bias = -4 * torch.rand(HV, generator=gen)  # [HV]
    g = -A * F.softplus(torch.randn(n, HV, generator=gen) + dt_bias)  # [n, HV]
    beta = torch.sigmoid(torch.randn(n, HV, generator=gen))  # [n, HV]
    return proj, q, k, v, g, beta


def committed_state(s: Shapes, gen: torch.Generator, tokens: int = 64) -> torch.Tensor:
    """A state [HV, dk, dv] (float64) as a prefill of `tokens` random tokens leaves it."""
    _, q, k, v, g, beta = layer_inputs(s, tokens, gen)
    return chunked(q, k, v, g, beta, torch.zeros(s.HV, s.dk, s.dv))[1]


def held_bytes(s: Shapes, x: torch.Tensor, stash: Stash) -> dict:
    """Hold the nodes' rows in a DeltaState as the layer does and read back what it keeps: per
    held tensor its dtype and bytes per node, the logical total and the storage pinned."""
    cfg = DeltaConfig(num_k_heads=s.HK, num_v_heads=s.HV, k_head_dim=s.dk, v_head_dim=s.dv, conv_kernel=s.K)
    state = DeltaState([0], 1, cfg, x.dtype, "cpu")
    n = x.shape[0]
    state.hold(0, 0, list(range(n)), x, stash.k, stash.u, stash.gamma)
    base = sum(t.numel() * t.element_size() for t in (state.S[0][0], state.conv[0][0]))
    rows = list(state.held[0][0].rows.values())  # [(x [C], k [HV, dk], u [HV, dv], gamma [HV])] * n
    parts = {}
    for name, i in (("x", 0), ("k", 1), ("u", 2), ("gamma", 3)):
        t = rows[0][i]
        parts[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "bytes": sum(r[i].numel() * r[i].element_size() for r in rows) // n}
    storages = {r[i].untyped_storage().data_ptr(): r[i].untyped_storage().nbytes() for r in rows for i in range(4)}
    logical = sum(p["bytes"] for p in parts.values())
    assert (state.nbytes(0) - base) == logical * n, "DeltaState.nbytes disagrees with the held tensors"
    return {"parts": parts, "logical": logical, "pinned": sum(storages.values()) / n}


def snapshot_bytes(s: Shapes, states: torch.Tensor) -> dict:
    """Per node: the state snapshot as snapshot_tree keeps it (states [N, HV, dk, dv]), in the
    other dtypes, and the convolution window [K - 1, conv_dim] a snapshotting runtime adds."""
    per_state = states[0].numel()
    ours = states.numel() * states.element_size() // states.shape[0]
    window = (s.K - 1) * s.conv_dim
    return {"state": {"float64 (ours)": ours, **{d: per_state * b for d, b in DTYPE_BYTES.items() if d != "float64"}},
            "conv_window": {d: window * b for d, b in DTYPE_BYTES.items() if d != "float64"}}


def predicted(s: Shapes, state_bytes: int, x_bytes: int, snap_conv_bytes: int) -> dict:
    """What the algebra says: per head dk dv against dk + dv + 1 values (k, u, gamma) in the same
    dtype; with the convolution, K - 1 inputs per node against one."""
    state_only = s.dk * s.dv / (s.dk + s.dv + 1)
    snap = s.HV * s.dk * s.dv * state_bytes + (s.K - 1) * s.conv_dim * snap_conv_bytes
    ours = s.HV * (s.dk + s.dv + 1) * state_bytes + s.conv_dim * x_bytes
    return {"state_only": state_only, "with_conv": snap / ours}


def median_ms(fns: dict, repeats: int) -> tuple[dict, dict]:
    """The median (and the least) time in ms of each function, the functions taken in turn within each repetition
    (so load from elsewhere hits them alike); one warm call each first."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return ({name: statistics.median(ts) for name, ts in times.items()},
            {name: min(ts) for name, ts in times.items()})


def measure_tree(s: Shapes, name: str, widths: list[int], threads=(1, 2), repeats: int = 5, seed: int = 0) -> dict:
    """One tree: bytes, the audit (asserted) and the times. The core of the bench."""
    gen = torch.Generator().manual_seed(seed)
    parents = tree_parents(widths)
    n = len(parents)
    anc = strict_ancestors(parents)  # [N, N]
    S0 = committed_state(s, gen)  # [HV, dk, dv] float64
    proj, q, k, v, g, beta = layer_inputs(s, n, gen)
    x = proj[:, : s.conv_dim]  # [N, C] float32, a view of proj as delta_layer.py's split gives it

    o_tree, stash = tree_step(q, k, v, g, beta, S0, anc)  # [N, HV, dv], Stash
    o_snap, states = snapshot_tree(q, k, v, g, beta, S0, parents)  # [N, HV, dv], [N, HV, dk, dv]
    path = deepest_path(parents)
    accepted = Stash(stash.k[path], stash.u[path], stash.gamma[path])  # [L, HV, ...]
    out_diff = float((o_tree - o_snap).abs().max())
    state_diff = float((fold(S0, accepted) - states[path[-1]]).abs().max())
    scale = float(o_snap.abs().max())
    assert out_diff <= 1e-10 * max(1.0, scale), f"{name}: outputs differ by {out_diff}"
    assert state_diff <= 1e-10 * max(1.0, float(states.abs().max())), f"{name}: states differ by {state_diff}"
    f32_mismatch = int((o_tree.float() != o_snap.float()).sum())  # what the layer goes on with

    held = held_bytes(s, x, stash)
    snap = snapshot_bytes(s, states)
    row = {"tree": name, "nodes": n, "drafts": n - 1, "depth": len(widths), "accepted_path": len(path),
           "held": held, "snapshot": snap, "max_abs_diff_out": out_diff, "max_abs_out": scale,
           "max_abs_diff_state": state_diff, "float32_outputs_differing": f32_mismatch,
           "times_ms": {}, "times_min_ms": {}}
    saved = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            row["times_ms"][str(t)], row["times_min_ms"][str(t)] = median_ms({
                "tree_step": lambda: tree_step(q, k, v, g, beta, S0, anc),
                "snapshot_tree": lambda: snapshot_tree(q, k, v, g, beta, S0, parents),
                "fold": lambda: fold(S0, accepted)}, repeats)
    finally:
        torch.set_num_threads(saved)
    return row


def whole_model(s: Shapes, held: dict, snap: dict, nodes: int = 14) -> dict:
    """Bytes for the model's gated-delta layers per node and per `nodes`-node tree, in MiB."""
    state, window = snap["state"], snap["conv_window"]
    per_node = {"TreeWY held (logical)": held["logical"], "TreeWY held (pinned)": held["pinned"],
                "TreeWY stash k, u, gamma only": sum(held["parts"][p]["bytes"] for p in ("k", "u", "gamma")),
                "snapshot float64 state": state["float64 (ours)"],
                "snapshot float64 state + float32 conv window": state["float64 (ours)"] + window["float32"],
                "snapshot float32 state": state["float32"],
                "snapshot float32 state + conv window": state["float32"] + window["float32"],
                "snapshot bfloat16 state": state["bfloat16"],
                "snapshot bfloat16 state + conv window": state["bfloat16"] + window["bfloat16"]}
    return {k: {"MiB_per_node": v * s.delta_layers / MiB, f"MiB_per_{nodes}_nodes": v * s.delta_layers * nodes / MiB}
            for k, v in per_node.items()}


def markdown(s: Shapes, rows: list[dict], threads) -> str:
    first = rows[0]
    held, snap = first["held"], first["snapshot"]
    pred = predicted(s, 8, DTYPE_BYTES[held["parts"]["x"]["dtype"]], 4)
    stash_state = sum(held["parts"][p]["bytes"] for p in ("k", "u", "gamma"))
    snap64 = snap["state"]["float64 (ours)"]
    lines = [f"Shapes: HV={s.HV}, HK={s.HK}, dk={s.dk}, dv={s.dv}, conv {s.K} taps x {s.conv_dim} channels; "
             f"{s.delta_layers} gated-delta layers in the model.", "",
             "Bytes per node, one layer:", "", "| what | dtype | bytes/node |", "|---|---|---|"]
    for name, p in held["parts"].items():
        lines.append(f"| TreeWY held {name} {p['shape']} | {p['dtype']} | {p['bytes']:,} |")
    lines += [f"| TreeWY held, logical (DeltaState.nbytes) | | {held['logical']:,} |",
              f"| TreeWY held, storage pinned (views) | | {held['pinned']:,.0f} |",
              f"| snapshot state [HV, dk, dv] (snapshot_tree) | float64 | {snap64:,} |",
              f"| snapshot state | float32 | {snap['state']['float32']:,} |",
              f"| snapshot state | bfloat16 | {snap['state']['bfloat16']:,} |",
              f"| snapshot conv window [K-1, C] | float32 | {snap['conv_window']['float32']:,} |",
              f"| snapshot conv window [K-1, C] | bfloat16 | {snap['conv_window']['bfloat16']:,} |", "",
              "| ratio (snapshot / TreeWY) | measured | predicted |", "|---|---|---|",
              f"| state only: float64 snapshot / (k, u, gamma) | {snap64 / stash_state:.2f} | "
              f"{pred['state_only']:.2f} (dk dv / (dk + dv + 1)) |",
              f"| with conv: float64 state + float32 window / logical held | "
              f"{(snap64 + snap['conv_window']['float32']) / held['logical']:.2f} | {pred['with_conv']:.2f} |",
              f"| with conv: same, / pinned held | "
              f"{(snap64 + snap['conv_window']['float32']) / held['pinned']:.2f} | |",
              f"| float32 state + window / logical held | "
              f"{(snap['state']['float32'] + snap['conv_window']['float32']) / held['logical']:.2f} | |",
              f"| bfloat16 state + window / logical held | "
              f"{(snap['state']['bfloat16'] + snap['conv_window']['bfloat16']) / held['logical']:.2f} | |",
              f"| with conv, both sides in one dtype (any) | | {predicted(s, 1, 1, 1)['with_conv']:.2f} |", "",
              "Whole model (the gated-delta layers only):", "",
              "| what | MiB/node | MiB per 14 nodes |", "|---|---|---|"]
    for k, v in whole_model(s, held, snap).items():
        lines.append(f"| {k} | {v['MiB_per_node']:.2f} | {v['MiB_per_14_nodes']:.1f} |")
    head = "| tree | nodes | TreeWY KiB | snapshot KiB (f64) |"
    rule = "|---|---|---|---|"
    for t in threads:
        head += f" TreeWY ms ({t}t) | snapshot ms ({t}t) | snap/TreeWY ({t}t) | fold ms ({t}t) |"
        rule += "---|---|---|---|"
    lines += ["", "Verify time per tree, median (least) of the repeats, the ratio of medians; the audit:", "",
              head + " max abs diff (out) | float32 outputs differing |", rule + "---|---|"]
    for r in rows:
        line = (f"| {r['tree']} | {r['nodes']} | {r['held']['logical'] * r['nodes'] / 1024:,.0f} | "
                f"{r['snapshot']['state']['float64 (ours)'] * r['nodes'] / 1024:,.0f} |")
        for t in threads:
            tm, lo = r["times_ms"][str(t)], r["times_min_ms"][str(t)]
            line += (f" {tm['tree_step']:.2f} ({lo['tree_step']:.2f}) | {tm['snapshot_tree']:.1f} "
                     f"({lo['snapshot_tree']:.1f}) | {tm['snapshot_tree'] / tm['tree_step']:.1f}x | {tm['fold']:.2f} |")
        differing = f"{r['float32_outputs_differing']} of {r['nodes'] * s.HV * s.dv}"
        lines.append(line + f" {r['max_abs_diff_out']:.1e} | {differing} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="four trees, 2 repeats: a few seconds")
    ap.add_argument("--trees", help=f"tree names separated by ';' (they hold commas), from {list(TREES)}")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", default="1,2", help="torch thread counts to time, e.g. 1,2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    names = args.trees.split(";") if args.trees else (QUICK if args.quick else list(TREES))
    repeats = 2 if args.quick and args.repeats == 7 else args.repeats
    threads = tuple(int(t) for t in args.threads.split(","))
    s = QWEN35_08B
    load = [round(x, 2) for x in os.getloadavg()]
    print(f"# load average before: {load}", flush=True)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        rows.append(measure_tree(s, name, TREES[name], threads, repeats, args.seed))
        print(f"# {name}: {rows[-1]['nodes']} nodes, {time.perf_counter() - t0:.1f} s", flush=True)
    load_after = [round(x, 2) for x in os.getloadavg()]
    print(f"# load average after: {load_after}", flush=True)
    print(markdown(s, rows, threads))
    if args.out:
        meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                "shapes": asdict(s), "repeats": repeats, "threads": list(threads), "seed": args.seed,
                "load_before": load, "load_after": load_after}
        whole = whole_model(s, rows[0]["held"], rows[0]["snapshot"])
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "whole_model": whole, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
