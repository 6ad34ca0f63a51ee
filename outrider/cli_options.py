"""What `generate` and `serve` share on the command line: the help texts of the speculation and
dtype flags, a help formatter that lists the registered drafters and controllers when help is shown,
and the reading of --tree / --controller / --refiner into what the engine takes."""

from __future__ import annotations

import argparse

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

REFINER_HELP = ("block refiners, chained in order: ddtree, retrace[:SHARE], cure[:H], dartree[:PATH], "
                "lilicorr[:PATH], xpress[:P] (needs --drafter dflash:... and --tree ddtree:N; default: none: the block "
                "as drafted; "
                "docs/block-drafters.md)")
TREE_DEFAULT = "chain"
CONTROLLER_DEFAULT = {"generate": "fixed:4", "serve": "cost"}
DRAFTERS = "{drafters}"  # in a help string: the registered drafters, read from the registry when help is shown
CONTROLLERS = "{controllers}"  # the same for the controllers (control/controllers.py)


class HelpFormatter(argparse.HelpFormatter):
    """Fills DRAFTERS and CONTROLLERS in a help string with the drafters registered in
    drafters/registry.py and the controllers of control/controllers.py (their usage, as
    `--drafter` / `--controller` spell them), only when help is shown: one list, no copy to keep
    in step. Lines wrap at spaces only, so a name such as `batch-verify:K` stays whole."""

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

    def _split_lines(self, text, width):  # a name such as batch-verify:K is never cut at its hyphen
        import textwrap

        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


CONFIG_HELP = "a runtime config key (repeatable): KEY=VALUE, e.g. linear=chunked; `outrider config` lists them"


def speculation(args) -> tuple[str, str]:
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
