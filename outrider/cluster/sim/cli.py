"""`outrider simulate`: measure a cost profile, replay a real run, or sweep policies over replicas.

    outrider simulate --measure-profile profile.json --threads 1
    outrider simulate --profile profile.json --workload load:results.json            # real vs simulated
    outrider simulate --profile profile.json --workload chat:load=0.8 --records rollout.json \
        --replicas 8,64,512 --policy fcfs --policy outlets --json out.json --plot sweep.png

`load:PATH` replays every phase of a load test's results.json (scripts/load_test.py) and prints
its measured figures beside the simulated ones; the synthetic workloads (synth.py) resample the
records of `outrider bench rollout` (`--records`: its results.json).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ...errors import ConfigError


def add_parser(sub) -> None:
    sim = sub.add_parser("simulate", help="replay a workload against N simulated replicas per policy "
                         "(costs measured on this machine; docs/scheduling.md)")
    sim.add_argument("--profile", default=None, help="a cost profile JSON (write one with --measure-profile)")
    sim.add_argument("--measure-profile", default=None, metavar="FILE",
                     help="measure this machine's engine step and prefill costs into FILE, then stop")
    sim.add_argument("--model", default=None, help="with --measure-profile: the model (default smollm2-135m-instruct)")
    sim.add_argument("--threads", type=int, default=None, help="with --measure-profile: CPU threads")
    sim.add_argument("--workload", default="chat",
                     help="load:RESULTS.json (replay a load test) | chat | sessions | memory | rollout "
                          "(synthetic, NAME:key=value,...; docs/scheduling.md) (default: chat)")
    sim.add_argument("--records", default=None,
                     help="a rollout bench's results.json whose requests the synthetic workloads resample")
    sim.add_argument("--replicas", default="1", help="comma-separated replica counts (default 1)")
    sim.add_argument("--policy", action="append", default=None,
                     help="a policy (repeatable): fcfs | always-spec | never-spec | least-load | war | outlets | "
                          "balance | tailsieve, with :key=value options (default: fcfs)")
    sim.add_argument("--json", default=None, metavar="FILE", help="write every summary and the provenance here")
    sim.add_argument("--plot", default=None, metavar="PNG", help="throughput and p50/p99 latency per policy")
    sim.set_defaults(run=run)


def _counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--replicas takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--replicas needs positive integers, got {text!r}")
    return values


def run(args) -> int:
    if args.measure_profile:
        from .measure import measure_profile

        profile = measure_profile(args.model, args.threads, log=lambda m: print(m, file=sys.stderr))
        profile["command"] = "outrider " + " ".join(sys.argv[1:])
        Path(args.measure_profile).write_text(json.dumps(profile, indent=1) + "\n")
        print(f"profile: {args.measure_profile}")
        return 0
    if not args.profile:
        raise ConfigError("--profile FILE is needed (measure one with --measure-profile FILE)")
    from .baseline import load_policy
    from .costs import load_profile
    from .engine import simulate
    from .report import plot_sweep, summarize, table

    costs = load_profile(args.profile)
    counts = _counts(args.replicas)
    texts = args.policy or ["fcfs"]
    for text in texts:
        load_policy(text)  # refuse a bad name or option before any work
    rows = []
    if args.workload.startswith("load:"):
        from .workload import from_load_run

        for workload in from_load_run(args.workload[len("load:"):]):
            for n in counts:
                for text in texts:
                    s = summarize(simulate(workload, load_policy(text), costs, n), start=0.0)
                    s["measured"], s["policy"] = workload.measured, text
                    rows.append(s)
        print(compare_table(rows))
    else:
        from .synth import make

        records = load_records(args.records)
        for n in counts:
            for text in texts:
                workload = make(args.workload, records, n, costs)
                rows.append({**summarize(simulate(workload, load_policy(text), costs, n)), "policy": text})
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        print(table(rows))
    provenance = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "command": "outrider " + " ".join(sys.argv[1:]), "profile": args.profile,
                  "profile_machine": _profile_field(args.profile, "machine"), "cpus": os.cpu_count()}
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance, "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot_sweep(rows, args.plot, f"{args.workload} (simulated; profile: {provenance['profile_machine']}); "
                                    f"{provenance['date']}")
    return 0


def load_records(path: str | None) -> list[dict]:
    """The per-request records of a rollout bench's results.json (bench/rollout.py), speculating ones."""
    if not path:
        raise ConfigError("synthetic workloads resample a rollout bench's requests: give --records "
                          "RESULTS.json (from `outrider bench rollout`)")
    try:
        raw = json.loads(Path(path).read_text())
        records = raw["records"]
        if any(r.get("mode") == "on" for r in records):  # the same samples run twice: keep the
            records = [r for r in records if r.get("mode") == "on"]  # speculating ones (their acceptance)
        for r in records:
            r["prompt_tokens"], r["output_tokens"], r["max_tokens"] = (int(r["prompt_tokens"]),
                                                                      int(r["output_tokens"]), int(r["max_tokens"]))
            r["tau"], r["width"] = float(r.get("tau") or 1.0), float(r.get("width") or 1.0)
    except OSError as err:
        raise ConfigError(f"--records {path}: cannot read it ({err.strerror or err})") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--records {path}: not a rollout bench's results.json (records with prompt_tokens, "
                          "output_tokens, max_tokens)") from None
    return records


def _profile_field(path: str, key: str):
    try:
        return json.loads(Path(path).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def compare_table(rows: list[dict]) -> str:
    """Replayed phases: measured against simulated throughput and p50 latency."""
    out = ["| phase | policy | replicas | tok/s real / sim | ratio | e2e p50 real / sim (s) | ratio "
           "| TTFT p50 real / sim (s) |", "|---|---|---|---|---|---|---|---|"]
    for s in rows:
        m = s["measured"]
        t_ratio = s["throughput_tok_s"] / m["throughput_tok_s"] if m["throughput_tok_s"] else float("nan")
        p_ratio = s["e2e_s"]["p50"] / m["e2e_p50_s"] if m["e2e_p50_s"] else float("nan")
        out.append(f"| {s['workload']} | {s['policy']} | {s['replicas']} | {m['throughput_tok_s']:.1f} / "
                   f"{s['throughput_tok_s']:.1f} | {t_ratio:.2f} | {m['e2e_p50_s']:.2f} / {s['e2e_s']['p50']:.2f} | "
                   f"{p_ratio:.2f} | {m['ttft_p50_s']:.2f} / {s['ttft_s']['p50']:.2f} |")
    return "\n".join(out)
