"""`outrider export eagle3 HEAD --format eagle|speculators|gguf ...`: the EAGLE-3 kind's export sub-command
(heads/kinds.py adds it to `outrider export`)."""

from __future__ import annotations

import sys


def add_export(kinds) -> None:
    e3 = kinds.add_parser("eagle3", help="an EAGLE-3 head: config.json + model.safetensors + golden tau")
    e3.add_argument("head", help="head folder, or the name of a shipped head (its target's catalog name)")
    e3.add_argument("--format", required=True, help="eagle (EAGLE / SpecForge: vLLM and SGLang), speculators "
                    "(vllm-project/speculators: vLLM) or gguf (llama.cpp: --spec-type draft-eagle3; --out FILE.gguf)")
    e3.add_argument("--out", required=True, help="output folder, new or empty")
    e3.add_argument("--target", default=None, help="catalog name or folder of the target (default: the one in the head's "
                    "outrider_golden.json or train_info.json, else a shipped head's name)")
    e3.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 for the float tensors (default: as stored)")
    e3.add_argument("--depth", type=int, default=4,
                    help="drafts per round: the golden run's chain and speculators' speculative_tokens (default 4)")
    e3.add_argument("--max-new-tokens", type=int, default=32, help="tokens per golden prompt (default 32)")
    e3.add_argument("--device", default="cpu", help="where the golden tau is measured (default cpu)")
    e3.add_argument("--verifier", default=None, help="speculators verifier name_or_path, where vLLM loads the "
                    "target from (default: the target's folder here, absolute: loads offline; for another machine "
                    "give a Hugging Face id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    e3.add_argument("--target-gguf", default=None, help="gguf: the target's GGUF, whose tokenizer the draft "
                    "carries (default: the target folder's original.gguf)")
    e3.set_defaults(run=run_export)


def run_export(args) -> int:
    from ..catalog import resolve_head
    from ..cli import run_export_gguf, target_for
    from ..golden import GoldenSettings, read_golden
    from ..staging import check_out
    from .export import export_eagle3

    if args.format == "gguf":
        return run_export_gguf(args, "eagle3")
    check_out(args.out)  # before anything is read
    head = resolve_head(args.head)
    target = target_for(head, args.target, args.head)
    if args.depth < 1:
        from ...errors import ConfigError

        raise ConfigError(f"--depth must be a positive integer, got {args.depth}")
    settings = GoldenSettings(depth=args.depth, max_new_tokens=args.max_new_tokens, device=args.device)
    out = export_eagle3(head, args.out, args.format, target, dtype=args.dtype, verifier=args.verifier,
                        settings=settings, log=lambda msg: print(msg, file=sys.stderr))
    golden = read_golden(out)
    print(f"wrote {out} ({args.format} layout) for {target}; golden tau {golden['tau']:.3f} "
          f"over {len(golden['prompts'])} prompts")
    return 0
