"""One run's summary (a model x workload x method): the figures the report and table show."""

from __future__ import annotations

from .runner import PromptRun, aggregate


def summarize_run(model: str, workload, name: str, label: str, kind: str, runs: list[PromptRun],
                  prompt_ids: list[str], peer: str | None = None) -> dict:
    summary = aggregate(runs)
    diffs = [r.stats.get("first_difference") for r in runs]
    summary["mismatches"] = sum(d is not None for d in diffs)
    summary["lossless"] = summary["mismatches"] == 0
    if "draft_s" in summary:
        summary["other_s"] = max(summary["seconds"] - summary["draft_s"] - summary["verify_s"], 0.0)
    prompts = []
    for pid, r in zip(prompt_ids, runs):
        prompts.append({"id": pid, "new_tokens": len(r.output_ids), "seconds": r.seconds,
                        "tokens_per_s": len(r.output_ids) / max(r.seconds, 1e-9),
                        "first_difference": r.stats.get("first_difference"),
                        "output_ids": r.output_ids,
                        "stats": {k: v for k, v in r.stats.items() if k != "first_difference"}})
    out = {"model": model, "workload": workload.name, "method": name, "label": label, "kind": kind,
           "prompts": prompts, "summary": summary}
    if peer:
        out["peer"] = peer
    return out
