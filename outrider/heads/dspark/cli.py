"""`outrider export dspark HEAD --out DIR ...`: the DSpark kind's export sub-command (heads/kinds.py
adds it to `outrider export`)."""

from __future__ import annotations

import sys


def add_export(kinds) -> None:
    ds = kinds.add_parser("dspark", help="a DSpark head: config.json (DeepSpec + speculators fields) + "
                          "model.safetensors + golden")
    ds.add_argument("head", help="head folder, or the name of a shipped DSpark head (its target's catalog name)")
    ds.add_argument("--format", default="speculators", help="speculators (the one layout; heads/dspark/format.py)")
    ds.add_argument("--out", required=True, help="output folder, new or empty")
    ds.add_argument("--target", default=None, help="catalog name or folder of the target (default: the recorded one)")
    ds.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 for the float tensors (default: as stored)")
    ds.add_argument("--max-new-tokens", type=int, default=32, help="tokens per golden prompt (default 32)")
    ds.add_argument("--device", default="cpu", help="where the golden is measured (default cpu)")
    ds.set_defaults(run=run_export)


def run_export(args) -> int:
    from ..catalog import resolve_head
    from ..cli import target_for
    from ..golden import GoldenSettings, read_golden
    from ..staging import check_out
    from .export import export_dspark

    check_out(args.out)
    head = resolve_head(args.head, "dspark")
    target = target_for(head, args.target, args.head, "dspark")
    settings = GoldenSettings(max_new_tokens=args.max_new_tokens, device=args.device)
    out = export_dspark(head, args.out, target, fmt=args.format, dtype=args.dtype, settings=settings,
                        log=lambda msg: print(msg, file=sys.stderr))
    golden = read_golden(out)
    print(f"wrote {out} ({args.format} layout) for {target}; golden tau {golden['tau']:.3f} "
          f"over {len(golden['prompts'])} prompts")
    return 0
