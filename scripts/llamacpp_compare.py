"""Ours against llama-server from a bench run's results.json (the llamacpp preset; issue 45).

    .venv/bin/python scripts/llamacpp_compare.py RUN/results.json [RUN2/results.json ...]

One markdown row per (model, workload): our autoregressive tok/s, our best method's, llama-server's
plain decoding and its best spec type (end to end: prefill included, each row's wall time), the
two goal ratios (our best / its best, our plain / its plain), the time per output token after the
prompt (ours: wall time less our prefill; llama-server: its own timings, predicted_ms over the
tokens), and how far llama-server's plain output agrees with our autoregressive output token for
token (the agreed prefix of each prompt, over its length: greedy outputs of two implementations
part where their arithmetic differs at a near-tie; equality is not expected).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SERVER = "llama-server"


def decode_ms(run: dict) -> float | None:
    """Milliseconds per output token after the prompt."""
    tokens = sum(p["new_tokens"] for p in run["prompts"])
    if not tokens:
        return None
    if run.get("peer", "").startswith(SERVER):
        return 1000 * sum(p["stats"]["server_s"] - p["stats"]["prefill_s"] for p in run["prompts"]) / tokens
    prefill = sum(p["stats"].get("prefill_s", 0.0) for p in run["prompts"])
    return 1000 * (sum(p["seconds"] for p in run["prompts"]) - prefill) / tokens


def agreement(run: dict) -> str:
    """Each prompt's agreed prefix with our autoregressive output, over its own length."""
    parts = []
    for p in run["prompts"]:
        agreed = p["new_tokens"] if p["first_difference"] is None else p["first_difference"]
        parts.append(f"{agreed}/{p['new_tokens']}")
    return ", ".join(parts)


def rows(results: dict) -> list[str]:
    out = []
    keys = sorted({(r["model"], r["workload"]) for r in results["runs"]}, key=lambda k: (k[0], k[1]))
    for model, workload in keys:
        same = [r for r in results["runs"] if r["model"] == model and r["workload"] == workload]
        speed = {r["method"]: r["summary"]["tokens_per_s"] for r in same}
        base = next(r for r in same if r["kind"] == "baseline")
        ours = max((r for r in same if r["kind"] == "ours"), key=lambda r: speed[r["method"]], default=base)
        plain = next((r for r in same if r.get("peer") == SERVER), None)
        spec = max((r for r in same if r.get("peer", "").startswith(SERVER + ":")), key=lambda r: speed[r["method"]],
                   default=None)

        def cell(r):
            return "-" if r is None else f"{speed[r['method']]:.1f}"

        def ms(r):
            value = None if r is None else decode_ms(r)
            return "-" if value is None else f"{value:.1f}"

        best_ratio = f"{speed[ours['method']] / speed[spec['method']]:.2f}x" if spec else "-"
        plain_ratio = f"{speed[base['method']] / speed[plain['method']]:.2f}x" if plain else "-"
        threads = results["machine"]["threads"]
        out.append(f"| {Path(model).name}, {workload}, {threads} thr | {cell(base)} | {cell(ours)} ({ours['method']}) | "
                   f"{cell(plain)} | {cell(spec)} ({spec['peer'].split(':', 1)[1] if spec else '-'}) | {best_ratio} | "
                   f"{plain_ratio} | {ms(base)} / {ms(ours)} / {ms(plain)} / {ms(spec)} | "
                   f"{agreement(plain) if plain else '-'} |")
    return out


HEADER = ("| model, workload | our AR tok/s | our best tok/s | llama-server plain | its best spec type | "
          "our best / its best | our AR / its plain | ms/token after the prompt (our AR / our best / its plain / its best) | "
          "its plain agrees with our AR (tokens) |\n|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    args = ap.parse_args()
    print(HEADER)
    for path in args.results:
        results = json.loads(path.read_text())
        for line in rows(results):
            print(line)
        for s in results.get("skipped", []):
            print(f"\n{'FAILED' if s.get('failed') else 'skipped'}: {s['method']} on {Path(s['model']).name}: "
                  f"{s['reason']}")
        for n in results.get("peer_notes", []):
            print(f"\n{n['method']} on {Path(n['model']).name}: {n['note']}")


if __name__ == "__main__":
    main()
