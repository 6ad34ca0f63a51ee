"""`outrider bench` and `outrider bench rollout`: the sub-commands' handlers (the parser is
outrider/cli.py's). Errors the user can fix are ConfigErrors: one line, exit 2."""

from __future__ import annotations

import json
import sys

def bench_command(args) -> int:
    """`outrider bench [rollout]`: the methods side by side (or a rollout's makespan), a report."""
    import time
    from pathlib import Path

    from .report import write_report
    from .run import needs_exit_failure, plan, run_bench, write_results
    from .settings import config_for, saved_threads
    from .store import BenchInterrupted, check_out
    from .table import summary_table
    from ..errors import ConfigError

    rollout_only = [f"--{k.replace('_', '-')}" for k in ROLLOUT_FLAGS if getattr(args, k) is not None]
    if args.mode == "rollout":
        return rollout_command(args)
    if rollout_only:
        raise ConfigError(f"{', '.join(rollout_only)} belong to `outrider bench rollout`")
    if args.preset and args.methods:
        raise ConfigError("give --preset or --methods, not both")
    if args.resume and not args.out:
        raise ConfigError("--resume needs --out FOLDER: the folder of the interrupted run")
    if args.resume:
        check_out(Path(args.out), True)  # an unfinished run is there to read its settings from
    config = config_for(args, Path(args.out) if args.out else None)
    out = Path(args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"))
    check_out(out, args.resume)  # before anything is pulled or loaded
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    the_plan = plan(config, log=log)
    try:
        threads = config.threads or (saved_threads(out) if args.resume else None)
        results = run_bench(the_plan, threads=threads, log=log, progress=not args.no_progress,
                            out=out, resume=args.resume)
    except BenchInterrupted as stop:
        again = "--resume" if args.out else f"--out {out} --resume"
        print(f"interrupted: {stop.done} of {stop.total} prompts are saved in {out}; to finish, run the same "
              f"command with {again}", file=sys.stderr)
        return 130
    results["preset"] = config.preset
    write_results(results, out)
    files = write_report(results, out)
    print(summary_table(results))
    print(f"\nresults: {out / 'results.json'}\nreport:  {files.get('html', out / 'report.html')}")
    if needs_exit_failure(results):
        print("error: the lossless audit failed (see the report); this is a bug in a method", file=sys.stderr)
        return 1
    return 0


ROLLOUT_FLAGS = ("samples", "drafter", "controller", "max_running")  # --temperature is both modes


def rollout_command(args) -> int:
    """`outrider bench rollout`: many samples a prompt at temperature 1, speculation off and on."""
    import time
    from pathlib import Path

    from .rollout import RolloutPlan, run_rollout
    from ..errors import ConfigError

    sampling_only = [getattr(args, k, None) for k in ("top_p", "seed", "audit_samples", "audit_positions",
                                                      "audit_context", "audit_batch", "audit_workload")]
    if args.preset or args.methods or args.resume or args.dtype or args.kv_dtype or args.config or \
            any(v is not None for v in sampling_only):
        raise ConfigError("`outrider bench rollout` takes --model, --workload, --prompts, --samples, --temperature, "
                          "--max-new-tokens, --drafter, --controller, --max-running, --threads and --out")
    given = {"model": (args.model or [None])[0], "workloads": tuple(args.workload) if args.workload else None,
             "prompts": args.prompts, "samples": args.samples, "temperature": args.temperature,
             "max_new_tokens": args.max_new_tokens, "drafter": args.drafter, "controller": args.controller,
             "max_running": args.max_running, "threads": args.threads}
    plan = RolloutPlan(**{k: v for k, v in given.items() if v is not None}).check()
    out = Path(args.out or Path("bench-results") / ("rollout-" + time.strftime("%Y%m%d-%H%M%S")))
    out.mkdir(parents=True, exist_ok=True)
    results = run_rollout(plan, log=lambda msg: print(msg, file=sys.stderr))
    results["command"] = "outrider " + " ".join(sys.argv[1:])
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    for mode, fig in results["modes"].items():
        print(f"speculation {mode}: makespan {fig['makespan_s']:.2f} s, {fig['throughput_tok_s']:.1f} tok/s, "
              f"tau {fig['tau']:.2f}, output tokens p50 {fig['output_tokens']['p50']:.0f} / max "
              f"{fig['output_tokens']['max']}")
    if {"off", "on"} <= set(results["modes"]):
        print(f"makespan on / off: {results['modes']['on']['makespan_s'] / results['modes']['off']['makespan_s']:.2f}x")
    print(f"results: {out / 'results.json'}")
    return 0
