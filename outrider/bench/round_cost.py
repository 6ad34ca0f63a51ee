"""What a round costs, per method: the report's "Time per round" table (issue 43, the `blocks` preset).

    nodes a round     drafted nodes over rounds (a chain's depth, a tree's size without its root)
    draft ms          drafting's seconds over rounds (a block drafter's one forward, a chain's steps)
    verify ms         the target's verify over rounds: how verify cost grows with the tree
    verify / AR step  that over our autoregressive baseline's round (one token through the same path)
    llama.cpp acc     a llama-server peer's draft_n_accepted / draft_n (its own timings; peers
                      report no rounds, so no tau or times)

From results.json alone (the summary's rounds, drafted, draft_s, verify_s; a peer's prompts' stats).
"""

from __future__ import annotations

from .table import MISSING, fmt, fmt_tau, find_run, methods, number, summary_of, tau

HEADER = ["method", "tau", "nodes a round", "draft ms", "verify ms", "verify / AR step", "llama.cpp acc"]


def per_round(run: dict | None) -> dict:
    """{nodes, draft_ms, verify_ms} a round of one run (each None where not measured)."""
    s = summary_of(run)
    rounds = number(s.get("rounds"))
    if not rounds:
        return {"nodes": None, "draft_ms": None, "verify_ms": None}
    drafted, draft, verify = number(s.get("drafted")), number(s.get("draft_s")), number(s.get("verify_s"))
    return {"nodes": None if drafted is None else drafted / rounds,
            "draft_ms": None if draft is None else 1000 * draft / rounds,
            "verify_ms": None if verify is None else 1000 * verify / rounds}


def peer_acceptance(run: dict | None) -> str:
    """"accepted/drafted = rate" over a peer's prompts, from its stats' draft_n (llama-server)."""
    stats = [p.get("stats") or {} for p in (run or {}).get("prompts", [])]
    if not stats or not all("draft_n" in s for s in stats):
        return MISSING
    drafted = sum(int(s["draft_n"]) for s in stats)
    accepted = sum(int(s.get("draft_n_accepted") or 0) for s in stats)
    return f"{accepted}/{drafted} = {accepted / drafted:.3f}" if drafted else "0/0"


def round_cost_table(results: dict, model: str, workload: str) -> list[tuple]:
    """The report's blocks for one model and workload: a paragraph and the table (empty when no
    method drafted and no peer reported drafts)."""
    ms = methods(results, model)
    baseline = next((m for m in ms if m.kind == "baseline"), None)
    ar = per_round(find_run(results, model, workload, baseline.name)) if baseline else {}
    ar_step = ar.get("verify_ms")
    rows = []
    for m in ms:
        run = find_run(results, model, workload, m.name)
        cost, acc = per_round(run), peer_acceptance(run)
        if m.kind != "baseline" and cost["nodes"] is None and acc == MISSING:
            continue
        steps = cost["verify_ms"] / ar_step if cost["verify_ms"] is not None and ar_step else None
        rows.append([m.label, fmt_tau(tau(run)), fmt(cost["nodes"], "{:.2f}"), fmt(cost["draft_ms"], "{:.2f}"),
                     fmt(cost["verify_ms"], "{:.2f}"), fmt(steps, "{:.2f}"), acc])
    if len(rows) <= 1:
        return []
    return [("p", f"{workload}: time per round (draft and verify ms over rounds; verify / AR step: the verify "
                  f"against the baseline's one-token round, its cost by tree size)."), ("table", HEADER, rows)]
