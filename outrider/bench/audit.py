"""The distributional audit of a bench that samples: token equality cannot say a sampled method is
exact, so its tokens' frequencies are compared with our autoregressive sampling's.

Per audited prompt (the first prompt of each workload in `audit_workloads`, by default the first
workload only; cut to its last `audit_context` tokens so that each sample's prefill is short),
`audit_samples` continuations of `audit_positions` tokens are drawn by our autoregressive baseline
(the reference) and, independently (other seeds: bench/sampling.py), by each of our methods, each
method's drafter and controller built fresh for the audit. They run `audit_batch` requests at a
time (default 1: one at a time, as the timed runs do; a batch's requests draw their seeds from
torch's generator seeded with its first sample's seed). A larger batch is faster, but a `cost`
controller drafts by the batch's verify cost, so it may draft less or nothing: exactness does not
depend on it, but what the audit exercises does. A continuation that ends early (an
end-of-generation token) reads END at the positions after it.

The test, per method and output position t (1..positions): a two-sample chi-square test of
homogeneity between the reference's tokens at t and the method's (the marginal law of the token
at t, prefix integrated out; an exact method has the same marginal law as plain sampling at every
position). Tokens seen fewer than LEAST times expected in either sample are pooled into one bin
("other"; if that bin is itself expected fewer than LEAST times it joins the smallest bin); a
position where every sample agrees has nothing to test (p = 1). The method's p-values over its
positions and audited prompts are corrected for multiple comparisons by Bonferroni (the smallest
p-value times the number of tests, at most 1), and the method passes when that adjusted p-value is
at least ALPHA. An exact method therefore fails with probability at most ALPHA a run (seeds are
fixed by the run seed, so a run is repeatable); a method whose law differs fails once enough
samples show it (the power grows with `audit_samples`; `drafted` / `accepted` say how much
speculation the audit's samples exercised: a method that drafted nothing was not tested).

Lossy methods (a named verifier marked lossy, spec/verifiers.py: `resispec-lossy`) are audited too
and expected to fail; their verdict does not fail the run. Peers are not audited (they run in
another process, on other numerics).
"""

from __future__ import annotations

from collections import Counter

import torch

from ..engine.generate import generate_ids
from ..engine.request import Request
from .sampling import REFERENCE, BenchSampling

ALPHA = 1e-3  # a method fails when its Bonferroni-adjusted smallest p-value is below this
LEAST = 5.0  # smallest expected count of a chi-square bin
END = -1  # the token a continuation reads after it ended
SAMPLES = 100  # audit_samples' default: continuations per prompt, reference and each method
POSITIONS = 8  # audit_positions' default: the first output tokens compared
CONTEXT = 64  # audit_context' default: the prompt's last tokens the continuations follow (0: all)
BATCH = 1  # audit_batch's default: requests a batch


# -- the statistics -------------------------------------------------------------------------------
def chi_square_sf(stat: float, dof: int) -> float:
    """P(chi2 with `dof` degrees of freedom >= stat)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(max(stat, 0.0) / 2, dtype=torch.float64)))


def two_sample_chi_square(a: Counter, b: Counter, least: float = LEAST) -> tuple[float, int, float]:
    """Homogeneity of two samples of categories: (statistic, degrees of freedom, p-value).

    a, b: counts by category. Bins: categories expected at least `least` times in both samples
    (expected = the pooled count times the sample's share), the rest pooled (see the module
    docstring). Fewer than two bins: (0, 0, 1.0)."""
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        return 0.0, 0, 1.0
    share = min(na, nb) / (na + nb)
    pooled = a + b
    bins = [(a[k], b[k]) for k in pooled if pooled[k] * share >= least]
    rare = [k for k in pooled if pooled[k] * share < least]
    rest = (sum(a[k] for k in rare), sum(b[k] for k in rare))
    if sum(rest) * share >= least or not bins:
        bins.append(rest)
    elif sum(rest):
        i = min(range(len(bins)), key=lambda j: sum(bins[j]))
        bins[i] = (bins[i][0] + rest[0], bins[i][1] + rest[1])
    bins = [x for x in bins if sum(x)]
    if len(bins) < 2:
        return 0.0, 0, 1.0
    stat = 0.0
    for x, y in bins:
        c = x + y
        ea, eb = c * na / (na + nb), c * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    dof = len(bins) - 1
    return stat, dof, chi_square_sf(stat, dof)


def by_position(samples: list[tuple[int, ...]], positions: int) -> list[Counter]:
    """Counts of the token at each position: [positions] of Counter(token -> samples)."""
    return [Counter(s[t] for s in samples) for t in range(positions)]


def compare(reference: list[tuple[int, ...]], samples: list[tuple[int, ...]], positions: int) -> list[float]:
    """The p-value of each position's two-sample test: [positions]."""
    ref, mine = by_position(reference, positions), by_position(samples, positions)
    return [two_sample_chi_square(ref[t], mine[t])[2] for t in range(positions)]


def verdict(p_values: list[float], alpha: float = ALPHA) -> dict:
    """Bonferroni over all of a method's tests: {tests, min_p, adjusted_p, worst, passed}."""
    if not p_values:
        return {"tests": 0, "min_p": None, "adjusted_p": None, "worst": None, "passed": None}
    worst = min(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = min(1.0, p_values[worst] * len(p_values))
    return {"tests": len(p_values), "min_p": p_values[worst], "adjusted_p": adjusted, "worst": worst,
            "passed": adjusted >= alpha}


# -- the samples ----------------------------------------------------------------------------------
def draw(target, spec, prompt_ids: list[int], eos: set[int], sampling: BenchSampling, workload: str,
         prompt_id: str, samples: int, positions: int, role: str, batch: int = BATCH
         ) -> tuple[list[tuple[int, ...]], int, int]:
    """`samples` continuations of `positions` tokens, `batch` requests at a time, each batch seeded by
    (workload, prompt, its first sample, role) -> (the continuations, padded with END; drafts
    accepted; drafted)."""
    params = sampling.params()
    out, accepted, drafted = [], 0, 0
    for first in range(0, samples, batch):
        sampling.seed_torch(workload, prompt_id, first, role)
        requests = [Request(list(prompt_ids), positions, params) for _ in range(min(batch, samples - first))]
        for done in generate_ids(target, requests, set(eos), speculation=spec):
            ids = list(done.token_ids[:positions])
            out.append(tuple(ids + [END] * (positions - len(ids))))
            accepted += sum(done.round_stats.accepted_by_position)
            drafted += sum(done.round_stats.proposed_by_position)
    return out, accepted, drafted


def audit_prompt(target, specs: dict, prompt_ids: list[int], eos: set[int], sampling: BenchSampling, workload: str,
                 prompt_id: str, samples: int = SAMPLES, positions: int = POSITIONS, log=None,
                 batch: int = BATCH) -> dict:
    """The reference's and every method's continuations of one prompt, and each method's p-values.
    specs: method name -> its Speculator (built fresh for the audit)."""
    ref, _, _ = draw(target, None, prompt_ids, eos, sampling, workload, prompt_id, samples, positions, REFERENCE,
                     batch)
    methods = {}
    for name, spec in specs.items():
        if log:
            log(f"audit: {name} on {workload} {prompt_id} ({samples} samples x {positions} tokens)")
        mine, accepted, drafted = draw(target, spec, prompt_ids, eos, sampling, workload, prompt_id, samples,
                                       positions, f"audit:{name}", batch)
        methods[name] = {"p_values": compare(ref, mine, positions), "accepted": accepted, "drafted": drafted}
    return {"workload": workload, "prompt": prompt_id, "context_tokens": len(prompt_ids), "samples": samples,
            "positions": positions, "batch": batch, "reference_distinct": [len(c) for c in by_position(ref, positions)],
            "methods": methods}


def summarize(audits: list[dict], lossy: set[str], alpha: float = ALPHA) -> dict:
    """The verdict per method over its audited prompts (one model's): {method: verdict + accepted,
    drafted, lossy}, and whether every lossless method passed (`ok`)."""
    names = list(dict.fromkeys(n for a in audits for n in a["methods"]))
    methods = {}
    for name in names:
        runs = [a["methods"][name] for a in audits if name in a["methods"]]
        v = verdict([p for r in runs for p in r["p_values"]], alpha)
        worst = v["worst"]
        if worst is not None:  # which prompt and position the smallest p-value came from
            flat = [(a["workload"], t + 1) for a in audits if name in a["methods"] for t in range(a["positions"])]
            v["worst"] = {"workload": flat[worst][0], "position": flat[worst][1]}
        methods[name] = {**v, "accepted": sum(r["accepted"] for r in runs), "drafted": sum(r["drafted"] for r in runs),
                         "lossy": name in lossy}
    ok = all(m["passed"] is not False for m in methods.values() if not m["lossy"])
    return {"ok": ok, "methods": methods}


def mark(entry: dict | None) -> str:
    """The table's cell for one method's audit: "pass p=0.41", "FAIL p=2e-07", "lossy: FAIL ..."."""
    if entry is None:
        return "not audited"
    if entry.get("passed") is None:
        return "-"
    word = "pass" if entry["passed"] else "FAIL"
    text = f"{word} p={entry['adjusted_p']:.2g}"
    return f"lossy: {text}" if entry.get("lossy") else text
