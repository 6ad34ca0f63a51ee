"""`outrider bench` and `outrider bench rollout`: the sub-commands' handlers (the parser is
outrider/cli.py's). Errors the user can fix are ConfigErrors: one line, exit 2."""

from __future__ import annotations

import json
import sys

def bench_command(args) -> int:
    """`outrider bench [rollout]`: the methods side by side (or a rollout's makespan), a report."""
    import dataclasses
    import time
    from pathlib import Path

    from .methods import load_config, preset_path
    from .report import write_report
    from .run import needs_exit_failure, plan, run_bench, write_results
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
    preset = None if args.methods else (args.preset or "quick")
    config = load_config(args.methods or preset_path(preset))
    overrides = {}
    if args.model:
        overrides["models"] = tuple(args.model)
    if args.workload:
        overrides["workloads"] = tuple(args.workload)
    for key in ("prompts", "max_new_tokens", "threads"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
            overrides[key] = value
    if args.dtype is not None:
        from ..weights.loader import parse_dtype

        parse_dtype(args.dtype)
        overrides["dtype"] = args.dtype
    if args.kv_dtype is not None:
        from ..weights.loader import parse_kv_dtype

        parse_kv_dtype(args.kv_dtype)
        overrides["kv_dtype"] = args.kv_dtype
    config = dataclasses.replace(config, **overrides)
    out = Path(args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"))
    check_out(out, args.resume)  # before anything is pulled or loaded
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    the_plan = plan(config, log=log)
    try:
        results = run_bench(the_plan, threads=config.threads, log=log, progress=not args.no_progress,
                            out=out, resume=args.resume)
    except BenchInterrupted as stop:
        again = "--resume" if args.out else f"--out {out} --resume"
        print(f"interrupted: {stop.done} of {stop.total} prompts are saved in {out}; to finish, run the same "
              f"command with {again}", file=sys.stderr)
        return 130
    results["preset"] = preset
    write_results(results, out)
    files = write_report(results, out)
    print(summary_table(results))
    print(f"\nresults: {out / 'results.json'}\nreport:  {files.get('html', out / 'report.html')}")
    if needs_exit_failure(results):
        print("error: the lossless audit failed (see the report); this is a bug in a method", file=sys.stderr)
        return 1
    return 0


ROLLOUT_FLAGS = ("samples", "temperature", "drafter", "controller", "max_running")


def rollout_command(args) -> int:
    """`outrider bench rollout`: many samples a prompt at temperature 1, speculation off and on."""
    import time
    from pathlib import Path

    from .rollout import RolloutPlan, run_rollout
    from ..errors import ConfigError

    if args.preset or args.methods or args.resume or args.dtype or args.kv_dtype or args.config:
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
