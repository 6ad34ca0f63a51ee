"""How an EAGLE-3 head's acceptance grows with training: tau of each snapshot of a training run.

    python scripts/eagle3_tau_curve.py RUN_DIR [--workload humaneval] [--prompts 4] [--max-new-tokens 64]
           [--depth 5] [--out DIR]

RUN_DIR is an `outrider train eagle3 ... --snapshot-every N` folder: its snapshots/step-N heads and
the final head. Every head becomes a method of one `outrider bench` run (same target, prompts and
process; greedy; a chain of --depth drafts a round), so the taus are measured the way bench
measures every method, and the lossless audit covers them. Writes DIR/tau_curve.json (tokens,
step, tau, speed-up over our autoregressive run per head) and DIR/tau_curve.png, beside the bench
report.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def heads(run: Path) -> list[dict]:
    """Snapshots in step order, then the final head (train_info.json's step and tokens)."""
    found = []
    for snap in sorted((run / "snapshots").glob("step-*")):
        meta = json.loads((snap / "snapshot.json").read_text())
        found.append({"path": str(snap), "step": meta["step"], "tokens": meta["tokens"]})
    info = run / "train_info.json"
    if info.is_file() and (run / "config.json").is_file():
        meta = json.loads(info.read_text())
        if not found or found[-1]["step"] != meta["steps"]:
            found.append({"path": str(run), "step": meta["steps"], "tokens": meta["tokens"]})
    return found


def methods_toml(found: list[dict], depth: int) -> str:
    lines = []
    for h in found:
        lines += ["[[method]]", f'name = "step-{h["step"]}"', f'drafter = "eagle3:{h["path"]}"',
                  'tree = "chain"', f'controller = "fixed:{depth}"', ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    found = heads(args.run)
    if not found:
        print(f"error: {args.run} holds no snapshots/step-N heads and no final head; train with --snapshot-every",
              file=sys.stderr)
        return 2
    out = args.out or args.run / "tau-curve"
    out.mkdir(parents=True, exist_ok=True)
    methods = out / "methods.toml"
    methods.write_text(methods_toml(found, args.depth))
    bench = out / "bench"
    command = [sys.executable, "-m", "outrider.cli", "bench", "--methods", str(methods), "--model", args.target,
               "--workload", args.workload, "--prompts", str(args.prompts), "--max-new-tokens",
               str(args.max_new_tokens), "--out", str(bench), "--no-progress"]
    print(" ".join(command), flush=True)
    done = subprocess.run(command)
    if done.returncode != 0:
        return done.returncode
    results = json.loads((bench / "results.json").read_text())
    runs = {r["method"]: r for r in results["runs"]}
    base = runs["autoregressive"]

    def seconds(run):
        return sum(p["seconds"] for p in run["prompts"])

    def tokens(run):
        return sum(p["new_tokens"] for p in run["prompts"])

    curve = []
    for h in found:
        run = runs[f"step-{h['step']}"]
        rounds = sum(p["stats"]["rounds"] for p in run["prompts"])
        curve.append({**h, "tau": round(tokens(run) / max(rounds, 1), 3),
                      "speedup": round((tokens(run) / seconds(run)) / (tokens(base) / seconds(base)), 3)})
        print(f"step {h['step']:>6}  tokens {h['tokens']:>9}  tau {curve[-1]['tau']:.2f}  "
              f"speed-up {curve[-1]['speedup']:.2f}x")
    (out / "tau_curve.json").write_text(json.dumps({"workload": args.workload, "prompts": args.prompts,
                                                    "max_new_tokens": args.max_new_tokens, "depth": args.depth,
                                                    "audit": results["audit"], "machine": results["machine"],
                                                    "curve": curve}, indent=1))
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.4), dpi=110)
    ax = fig.add_subplot()
    ax.plot([c["tokens"] / 1e6 for c in curve], [c["tau"] for c in curve], marker="o", label="tau (bench)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel(f"tau ({args.workload}, chain of {args.depth})")
    ax.set_title("EAGLE-3 head for the target: acceptance vs training")
    ax.grid(alpha=0.3)
    log = args.run / "train_log.jsonl"
    if log.is_file():  # the training batches' own first-draft accuracy, a running mean of 50 steps
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        acc = [r["step_acc"][0] for r in rows]
        mean = [sum(acc[max(0, i - 49):i + 1]) / len(acc[max(0, i - 49):i + 1]) for i in range(len(acc))]
        right = ax.twinx()
        right.plot([r["tokens"] / 1e6 for r in rows], mean, color="tab:orange", alpha=0.7,
                   label="first-draft accuracy on training batches")
        right.set_ylabel("training accuracy, step 0")
        right.set_ylim(0, 1)
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tau_curve.png")
    print(f"wrote {out / 'tau_curve.json'} and {out / 'tau_curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
