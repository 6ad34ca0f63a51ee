"""The terminal summary of a bench run, and the small readers of results.json the report shares.

One table per model: a row per method (our autoregressive baseline first, then ours, then peers)
and, per workload, tokens/s, the speed-up over our autoregressive baseline ("x AR", measured in
the same process on the same prompts; "decode": the same with every prompt's prefill left out),
tau (tokens committed per round, bonus included) and the prefill's seconds a prompt. The
last column says whether the greedy output equalled the baseline's token for token:

    ok              every prompt matched
    MISMATCH@17     one of our methods differed, first at output token 17: a bug, said loudly
    differs@17      a peer differed (its numerics are not ours; peers are not audited)
    lossy: differs@17  a verifier lossy by name (verify-skip-lossy:T) differed, as it may: not counted
    -               not known
    FAILED          a peer that crashed (its reason is printed under the table)

A figure that does not apply (a peer has no tau) or was not measured is shown as "-".

A run under `--expert-budget` (bench/expert_budget.py) adds "MB/tok": the MiB of routed experts the
decode read from the file per output token (the prompt's prefill reads subtracted), every method
under the same resident budget.

A bench that samples (bench/sampling.py) adds "acc" (accepted draft depths over drafted ones) and
its last column is the distributional audit's verdict per method (bench/audit.py): "pass p=0.41"
(the Bonferroni-adjusted smallest p-value), "FAIL p=2e-07", "lossy: FAIL ..." (a lossy verifier,
expected to fail), "not audited" (peers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .expert_budget import ExpertBudget

KIND_ORDER = {"baseline": 0, "ours": 1, "peer": 2}
MISSING = "-"


@dataclass(frozen=True)
class Method:
    name: str  # the method's key in results.json
    label: str  # what people read, e.g. "suffix / chain / fixed:6"
    kind: str  # "baseline" | "ours" | "peer"


def model_names(results: dict) -> list[str]:
    """Models in the order they ran."""
    return list(dict.fromkeys(run["model"] for run in results.get("runs", [])))


def workload_names(results: dict, model: str) -> list[str]:
    """Workloads of one model, in the order they ran."""
    return list(dict.fromkeys(run["workload"] for run in results.get("runs", []) if run["model"] == model))


def methods(results: dict, model: str) -> list[Method]:
    """Methods of one model: the baseline, then ours, then peers, each group in the order run."""
    seen: dict[str, Method] = {}
    for run in results.get("runs", []):
        if run["model"] == model and run["method"] not in seen:
            kind = run.get("kind") or "ours"
            seen[run["method"]] = Method(run["method"], str(run.get("label") or run["method"]), kind)
    return sorted(seen.values(), key=lambda m: KIND_ORDER.get(m.kind, len(KIND_ORDER)))


def find_run(results: dict, model: str, workload: str, method: str) -> dict | None:
    for run in results.get("runs", []):
        if run["model"] == model and run["workload"] == workload and run["method"] == method:
            return run
    return None


def summary_of(run: dict | None) -> dict:
    return (run or {}).get("summary") or {}


def number(value) -> float | None:
    """A finite float, or None for anything missing, null or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def speedup(results: dict, run: dict | None) -> float | None:
    """tokens/s over our baseline's on the same model and workload (as recorded, else computed)."""
    s = summary_of(run)
    if number(s.get("speedup_vs_baseline")) is not None:
        return number(s["speedup_vs_baseline"])
    if run is None or number(s.get("tokens_per_s")) is None:
        return None
    base = next((summary_of(r) for r in results.get("runs", []) if r.get("kind") == "baseline"
                 and r["model"] == run["model"] and r["workload"] == run["workload"]), {})
    base_tps = number(base.get("tokens_per_s"))
    return number(s["tokens_per_s"]) / base_tps if base_tps else None


def decode_speedup(results: dict, run: dict | None) -> float | None:
    """Decode-only tokens/s (each prompt's prefill left out) over our baseline's, same model and
    workload: what speculation changes, without the prefill every method pays alike."""
    mine = number(summary_of(run).get("decode_tokens_per_s"))
    if run is None or mine is None:
        return None
    base = next((summary_of(r) for r in results.get("runs", []) if r.get("kind") == "baseline"
                 and r["model"] == run["model"] and r["workload"] == run["workload"]), {})
    base_tps = number(base.get("decode_tokens_per_s"))
    return mine / base_tps if base_tps else None


def prefill_per_prompt(run: dict | None) -> float | None:
    """Mean prefill seconds per prompt."""
    seconds = number(summary_of(run).get("prefill_s"))
    prompts = len((run or {}).get("prompts") or [])
    return seconds / prompts if seconds is not None and prompts else None


def tau(run: dict | None) -> float | None:
    return number(summary_of(run).get("mean_accepted_length"))


def first_difference(results: dict, run: dict | None) -> int | None:
    """The earliest output position where any prompt of this run differed from the baseline."""
    if run is None:
        return None
    diffs = [p.get("first_difference") for p in run.get("prompts", [])]
    diffs += [m.get("first_difference") for m in (results.get("audit") or {}).get("mismatches", [])
              if (m.get("model"), m.get("workload"), m.get("method"))
              == (run["model"], run["workload"], run["method"])]
    diffs = [d for d in diffs if isinstance(d, int) and not isinstance(d, bool)]
    return min(diffs) if diffs else None


def differs(results: dict, run: dict | None) -> bool:
    s = summary_of(run)
    return s.get("lossless") is False or bool(s.get("mismatches")) or first_difference(results, run) is not None


def lossless_mark(results: dict, run: dict | None) -> str:
    """"ok", "MISMATCH@17" (ours), "differs@17" (a peer), "lossy" / "lossy: differs@17" (a verifier
    lossy by name, whose differences are its own) or "-" (see the module docstring)."""
    if run is None:
        return MISSING
    if summary_of(run).get("lossy"):
        at = first_difference(results, run)
        return "lossy" if at is None else f"lossy: differs@{at}"
    if differs(results, run):
        word = "differs" if run.get("kind") == "peer" else "MISMATCH"
        at = first_difference(results, run)
        return word if at is None else f"{word}@{at}"
    return "ok" if summary_of(run).get("lossless") is True else MISSING


def row_mark(results: dict, model: str, method: str, workloads: list[str]) -> str:
    """One mark for a method over all workloads; a difference names its workload(s)."""
    marks = [(w, lossless_mark(results, find_run(results, model, w, method))) for w in workloads]
    bad = [f"{mark} {w}" for w, mark in marks if mark.startswith(("MISMATCH", "differs"))]
    if bad:
        return "; ".join(bad)
    if any(mark.startswith("lossy") for _, mark in marks):  # "lossy" or "lossy: differs@19 humaneval; differs@31 ..."
        diffs = [f"{mark.removeprefix('lossy: ')} {w}" for w, mark in marks if mark.startswith("lossy: ")]
        return "lossy: " + "; ".join(diffs) if diffs else "lossy"
    known = [mark for _, mark in marks if mark != MISSING]
    return "ok" if known and all(mark == "ok" for mark in known) else MISSING


def fmt(value, pattern: str) -> str:
    """`pattern` applied to a finite number, else "-"."""
    value = number(value)
    return MISSING if value is None else pattern.format(value)


def fmt_tps(value) -> str:
    return fmt(value, "{:.1f}")


def fmt_ratio(value) -> str:
    return fmt(value, "{:.2f}x")


def fmt_tau(value) -> str:
    return fmt(value, "{:.2f}")


def sampled(results: dict) -> bool:
    """Whether the run sampled (its audit is distributional)."""
    return (results.get("audit") or {}).get("kind") == "distributional"


def audit_mark(results: dict, model: str, method: str, kind: str) -> str:
    """The distributional audit's cell for one method (bench/audit.mark); the baseline is the reference."""
    from .audit import mark

    if kind == "baseline":
        return "reference"
    entry = (((results.get("audit") or {}).get("models") or {}).get(model) or {}).get("methods", {}).get(method)
    return mark(entry)


def summary_grid(results: dict, model: str, vs_transformers: bool = False):
    """The figures of one model's table as text.

    Returns (workloads, per_workload_columns, rows); a row is
    [label, kind, *per workload (tok/s, x AR[, x HF], decode, tau, prefill), lossless]: decode is the
    decode-only speed-up over our baseline's (prefill left out), prefill the mean seconds a prompt."""
    loads = workload_names(results, model)
    budgeted = bool((results.get("config") or {}).get("expert_budget"))  # bench/expert_budget.py
    per = ["tok/s", "x AR"] + (["x HF"] if vs_transformers else []) + ["decode", "tau"] + \
        (["acc"] if sampled(results) else []) + ["prefill"] + (["MB/tok"] if budgeted else [])
    rows = []
    for m in methods(results, model):
        row = [m.label, m.kind]
        for w in loads:
            run = find_run(results, model, w, m.name)
            s = summary_of(run)
            row += [fmt_tps(s.get("tokens_per_s")), fmt_ratio(speedup(results, run))]
            if vs_transformers:
                row.append(fmt_ratio(s.get("speedup_vs_transformers")))
            row += [fmt_ratio(decode_speedup(results, run)), fmt_tau(tau(run))]
            if sampled(results):
                row.append(fmt(s.get("acceptance_rate"), "{:.2f}"))
            row.append(fmt(prefill_per_prompt(run), "{:.2f}s"))
            if budgeted:  # the decode's expert bytes a token under the budget
                row.append(fmt(s.get("expert_mb_per_token"), "{:.2f}"))
        row.append(audit_mark(results, model, m.name, m.kind) if sampled(results) else
                   row_mark(results, model, m.name, loads))
        rows.append(row)
    for gone in failed(results, model):  # a peer that crashed: its row, no figures
        rows.append([f"{gone['method']} (peer)", "peer"] + [MISSING] * (len(per) * len(loads)) + ["FAILED"])
    return loads, per, rows


def failed(results: dict, model: str) -> list[dict]:
    """The peers that crashed on `model` (results["skipped"] entries marked failed)."""
    return [s for s in results.get("skipped") or [] if s.get("failed") and s.get("model") == model]


def _text_table(loads: list[str], per: list[str], rows: list[list[str]], last: str = "lossless") -> list[str]:
    header = ["method", "kind"] + per * len(loads) + [last]  # sampled: "audit", the distributional audit's verdict
    cells = [header] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    left = {0, 1, len(header) - 1}  # text columns; figures are right-aligned
    # A workload's name spans its columns; widen the last of them if the name is longer.
    span = len(per)
    for j, w in enumerate(loads):
        cols = range(2 + j * span, 2 + (j + 1) * span)
        short = len(w) - (sum(widths[i] for i in cols) + 2 * (span - 1))
        if short > 0:
            widths[cols[-1]] += short
    groups = " " * (widths[0] + widths[1] + 4)
    groups += "  ".join(w.ljust(sum(widths[i] for i in range(2 + j * span, 2 + (j + 1) * span)) + 2 * (span - 1))
                        for j, w in enumerate(loads))

    def line(row):
        return "  ".join(c.ljust(widths[i]) if i in left else c.rjust(widths[i]) for i, c in enumerate(row))

    rule = "-" * len(line(header))
    return [groups.rstrip(), line(header).rstrip(), rule] + [line(r).rstrip() for r in rows]


def summary_table(results: dict) -> str:
    """A plain-text table per model, aligned for a terminal, then the audit's verdict."""
    out = []
    for model in model_names(results):
        loads, per, rows = summary_grid(results, model)
        budget = (results.get("config") or {}).get("expert_budget")  # as the file or flag gave it
        out.append(f"{model}: tokens/s and x AR (speed-up over our autoregressive baseline, same run) over "
                   f"wall time, prefill included; decode = x AR without the prefill; tau = tokens per round; "
                   f"prefill = seconds a prompt" +
                   (f"; MB/tok = MiB of experts the decode read a token, under --expert-budget "
                    f"{ExpertBudget.parse(budget)}" if budget else ""))
        out += _text_table(loads, per, rows, "audit" if sampled(results) else "lossless")
        out += [f"FAILED: peer {s['method']}: {s.get('reason')}" for s in failed(results, model)] + [""]
    if not out:
        return "no runs"
    audit = results.get("audit") or {}
    bad = audit.get("mismatches") or []
    if sampled(results):
        out.append(audit_verdict(results))
    elif audit.get("ok") is False or bad:
        first = min((m["first_difference"] for m in bad if isinstance(m.get("first_difference"), int)),
                    default=None)
        at = "" if first is None else f", first at output token {first}"
        out.append(f"LOSSLESS AUDIT FAILED: {len(bad)} output(s) of our methods differ from "
                   f"autoregressive{at}")
    elif audit.get("ok") is True:
        lossy = any(summary_of(r).get("lossy") for r in results.get("runs") or [])
        out.append("lossless audit: ok (every output of our lossless methods equals autoregressive, token for token; "
                   "lossy methods are shown, not counted)" if lossy else
                   "lossless audit: ok (every output of our methods equals autoregressive, token for token)")
    return "\n".join(out).rstrip()


def audit_verdict(results: dict) -> str:
    """The distributional audit's line under the tables (bench/audit.py)."""
    audit = results.get("audit") or {}
    s = results.get("sampling") or {}
    failed_ = [f"{name} on {model}" for model, m in (audit.get("models") or {}).items()
               for name, e in m["methods"].items() if e.get("passed") is False and not e.get("lossy")]
    how = (f"temperature {s.get('temperature')}, top-p {s.get('top_p')}, seed {s.get('seed')}; each method's token "
           f"frequencies at each output position against our autoregressive sampling's, two-sample chi-square, "
           f"Bonferroni, alpha {audit.get('alpha')}")
    if audit.get("ok") is False:
        return f"DISTRIBUTIONAL AUDIT FAILED: {', '.join(failed_)} ({how})"
    return f"distributional audit: ok, every lossless method passed ({how}); lossy methods are shown, not counted"
