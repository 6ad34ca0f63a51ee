"""`outrider serve`: its flags and the command, which checks them before anything loads and starts
one engine, an engine on pipeline stages, or Ray replicas behind one front end."""

from __future__ import annotations

from ..cli_options import (CONFIG_HELP, CONTROLLER_DEFAULT, CONTROLLERS, DRAFTERS, DTYPE_HELP, KV_HELP,
                           REFINER_HELP, TREE_DEFAULT, HelpFormatter, speculation)


def add_parser(sub) -> None:
    """The `serve` sub-command on the CLI's sub-parsers."""
    from .fields import MAX_BODY_MB

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
    srv.set_defaults(run=serve_command)


def serve_command(args) -> int:
    """Check every flag before anything loads, then serve until stopped; the exit status."""
    tree, controller = speculation(args)
    from .server import ServeOptions, serve

    if args.drafter:  # a bad --tree, --controller or --verifier is refused before anything loads
        from ..engine.speculator import SpecOptions

        SpecOptions(args.drafter, tree, controller, args.max_tree_nodes, args.verifier).check()
    keys = ("model", "drafter", "verifier", "max_tree_nodes", "host", "port", "api_key", "max_running",
            "max_queue", "max_model_len", "max_kv_rows", "chunk_size", "max_body_mb", "device", "dtype", "threads",
            "kv_dtype", "replicas", "address", "policy", "replica_restarts", "prefix_cache", "prefix_cache_mb",
            "prefix_cache_block", "kv_memory", "kv_page")
    keys += ("pipeline_stages", "pipeline_hop_ms", "pipeline_rewind", "pipeline_micro_batches")
    options = ServeOptions(**{k: getattr(args, k) for k in keys}, tree=tree, controller=controller)
    if options.check().replicas is None and (options.address is None or options.pipeline_stages is not None):
        return serve(options)  # one engine (its layers on --pipeline-stages Ray actors, --address: on that cluster)
    from ..cluster.backend import build as cluster

    return serve(options, builder=cluster)
