"""`outrider export mtp HEAD --format outrider|vllm ...`: the MTP kind's export sub-command
(heads/kinds.py adds it to `outrider export`); `--format gguf` is refused in one line (export.py)."""

from __future__ import annotations

import sys


def add_export(kinds) -> None:
    p = kinds.add_parser("mtp", help="an MTP head: config.json + model.safetensors + golden tau")
    p.add_argument("head", help="head folder, or the name of a shipped MTP head (its target's catalog name)")
    p.add_argument("--format", required=True, help="outrider (the shipped layout: the target's embedding and "
                   "lm_head shared) or vllm (with them; heads/mtp/export.py says who loads what); gguf is refused")
    p.add_argument("--out", required=True, help="output folder, new or empty")
    p.add_argument("--target", default=None, help="catalog name or folder of the target (default: the recorded one)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per golden prompt (default 32)")
    p.add_argument("--device", default="cpu", help="where the golden tau is measured (default cpu)")
    p.set_defaults(run=run_export)


def run_export(args) -> int:
    from ..catalog import resolve_head
    from ..cli import target_for
    from ..golden import GoldenSettings, read_golden
    from ..staging import check_out
    from .export import export_mtp

    if args.format != "gguf":
        check_out(args.out)
    head = resolve_head(args.head, "mtp")
    target = target_for(head, args.target, args.head, "mtp")
    out = export_mtp(head, args.out, args.format, target,
                     settings=GoldenSettings(max_new_tokens=args.max_new_tokens, device=args.device),
                     log=lambda msg: print(msg, file=sys.stderr))
    golden = read_golden(out)
    print(f"wrote {out} ({args.format} layout) for {target}; golden tau {golden['tau']:.3f} "
          f"over {len(golden['prompts'])} prompts")
    return 0
