"""`outrider export dflash HEAD --format zlab|vllm|sglang|gguf ...`: the DFlash kind's export sub-command
(heads/kinds.py adds it to `outrider export`)."""

from __future__ import annotations

import sys


def add_export(kinds) -> None:
    df = kinds.add_parser("dflash", help="a DFlash head: config.json + model.safetensors + golden tau")
    df.add_argument("head", help="head folder, or the name of a shipped DFlash head (its target's catalog name)")
    df.add_argument("--format", required=True, help="zlab (z-lab's DFlash), vllm or sglang (heads/dflash/format.py), "
                    "or gguf (llama.cpp: --spec-type draft-dflash; --out FILE.gguf)")
    df.add_argument("--out", required=True, help="output folder, new or empty")
    df.add_argument("--target", default=None, help="catalog name or folder of the target (default: the recorded one)")
    df.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 for the float tensors (default: as stored)")
    df.add_argument("--max-new-tokens", type=int, default=32, help="tokens per golden prompt (default 32)")
    df.add_argument("--device", default="cpu", help="where the golden tau is measured (default cpu)")
    df.add_argument("--target-gguf", default=None, help="gguf: the target's GGUF, whose tokenizer the draft "
                    "carries (default: the target folder's original.gguf)")
    df.set_defaults(run=run_export)



def run_export(args) -> int:
    from ..catalog import resolve_head
    from ..cli import run_export_gguf, target_for
    from ..golden import GoldenSettings, read_golden
    from ..staging import check_out
    from .export import export_dflash

    if args.format == "gguf":
        return run_export_gguf(args, "dflash")
    check_out(args.out)  # before anything is read
    head = resolve_head(args.head, "dflash")
    target = target_for(head, args.target, args.head, "dflash")
    settings = GoldenSettings(max_new_tokens=args.max_new_tokens, device=args.device)
    out = export_dflash(head, args.out, args.format, target, dtype=args.dtype, settings=settings,
                        log=lambda msg: print(msg, file=sys.stderr))
    golden = read_golden(out)
    print(f"wrote {out} ({args.format} layout) for {target}; golden tau {golden['tau']:.3f} "
          f"over {len(golden['prompts'])} prompts")
    return 0
