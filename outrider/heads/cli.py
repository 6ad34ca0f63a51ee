"""`outrider export eagle3|dflash ...` and `outrider check-head ...`: the sub-commands of learned heads.

outrider/cli.py registers them with `add_parsers(sub)`; each `run_*` returns the exit status.

    outrider export eagle3 HEAD --format eagle|speculators --out DIR [--target NAME] [--dtype bf16]
    outrider export dflash HEAD --format zlab|vllm|sglang --out DIR [--target NAME] [--dtype bf16]
    outrider export eagle3|dflash HEAD --format gguf --out FILE.gguf [--target-gguf FILE]   (llama.cpp)
    outrider check-head DIR [--target NAME_OR_PATH]

HEAD is a head folder or a shipped head's name (heads/catalog.py); check-head takes `dflash:NAME`
for a shipped DFlash head and tells the kinds apart by config.json. --target defaults to the
target recorded in the head's outrider_golden.json, else in its train_info.json (a head
`outrider train` wrote), else to a shipped head's name.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import OutriderError


def add_parsers(sub) -> None:
    export = sub.add_parser("export", help="write a learned head in the layouts vLLM and SGLang load")
    kinds = export.add_subparsers(dest="export_kind", required=True)
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
    df.set_defaults(run=run_export_dflash)

    check = sub.add_parser("check-head", help="check an EAGLE-3 or DFlash head folder: config, tensors and dtypes, "
                           "vocab map, layer ids, block size, golden logits and tau")
    check.add_argument("dir", help="the head folder (or a shipped head's name; dflash:NAME for a shipped DFlash head)")
    check.add_argument("--target", default=None, help="catalog name or folder (default: the one recorded in "
                       "outrider_golden.json or train_info.json)")
    check.add_argument("--device", default=None, help="where to re-measure the golden (default: as recorded)")
    check.add_argument("--no-golden", action="store_true", help="skip re-measuring the golden logits and tau")
    check.set_defaults(run=run_check)


def _target_for(head: Path, given: str | None, name: str, kind: str = "eagle3") -> str:
    from ..errors import ConfigError
    from .catalog import shipped_heads
    from .golden import read_golden

    if given:
        return given
    try:
        golden = read_golden(head)
    except (ValueError, OSError):
        golden = None
    if golden and golden["target"].get("name"):
        return golden["target"]["name"]
    trained = _trained_target(head)
    if trained:
        return trained
    if shipped_heads(kind).get(name) == head:
        return name
    raise ConfigError(f"{head} records no target (no outrider_golden.json or train_info.json): pass --target "
                      "NAME_OR_PATH")


def _trained_target(head: Path) -> str | None:
    """The --target of the training run that wrote `head` (its train_info.json), or None; one that
    does not resolve here (a folder named relative to another directory, a model not pulled) is
    refused in one line, saying what to pass."""
    import json

    from ..catalog.resolve import resolve_model
    from ..errors import ConfigError, OutriderError

    try:
        target = json.loads((head / "train_info.json").read_text()).get("target")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(target, str) or not target:
        return None
    try:
        resolve_model(target)
        return target
    except OutriderError as err:
        raise ConfigError(f"{head}/train_info.json records the target {target!r}, which is not usable here "
                          f"({err}); pass --target NAME_OR_PATH") from None


def run_export(args) -> int:
    from .catalog import resolve_head
    from .staging import check_out
    from .eagle3.export import export_eagle3
    from .golden import GoldenSettings

    if args.format == "gguf":
        return run_export_gguf(args, "eagle3")
    check_out(args.out)  # before anything is read
    head = resolve_head(args.head)
    target = _target_for(head, args.target, args.head)
    if args.depth < 1:
        from ..errors import ConfigError

        raise ConfigError(f"--depth must be a positive integer, got {args.depth}")
    settings = GoldenSettings(depth=args.depth, max_new_tokens=args.max_new_tokens, device=args.device)
    out = export_eagle3(head, args.out, args.format, target, dtype=args.dtype, verifier=args.verifier,
                        settings=settings, log=lambda msg: print(msg, file=sys.stderr))
    from .golden import read_golden

    golden = read_golden(out)
    print(f"wrote {out} ({args.format} layout) for {target}; golden tau {golden['tau']:.3f} "
          f"over {len(golden['prompts'])} prompts")
    return 0


def run_export_dflash(args) -> int:
    from .catalog import resolve_head
    from .dflash.export import export_dflash
    from .staging import check_out
    from .golden import GoldenSettings, read_golden

    if args.format == "gguf":
        return run_export_gguf(args, "dflash")
    check_out(args.out)  # before anything is read
    head = resolve_head(args.head, "dflash")
    target = _target_for(head, args.target, args.head, "dflash")
    settings = GoldenSettings(max_new_tokens=args.max_new_tokens, device=args.device)
    out = export_dflash(head, args.out, args.format, target, dtype=args.dtype, settings=settings,
                        log=lambda msg: print(msg, file=sys.stderr))
    golden = read_golden(out)
    print(f"wrote {out} ({args.format} layout) for {target}; golden tau {golden['tau']:.3f} "
          f"over {len(golden['prompts'])} prompts")
    return 0


def run_export_gguf(args, kind: str) -> int:
    from .catalog import resolve_head
    from .gguf_export import check_out_file, export_gguf

    check_out_file(args.out)  # before anything is read
    head = resolve_head(args.head, kind)
    target = _target_for(head, args.target, args.head, kind)
    out = export_gguf(kind, head, args.out, target, dtype=args.dtype, target_gguf=args.target_gguf,
                      log=lambda msg: print(msg, file=sys.stderr))
    print(f"wrote {out} (gguf, llama.cpp --spec-type draft-{kind}) for {target}")
    return 0


def run_check(args) -> int:
    from .catalog import resolve_head
    from .dflash.check import check_dflash
    from .dflash.format import is_dflash
    from .eagle3.check import check_head
    from .files import read_raw

    kind, _, name = args.dir.partition(":") if args.dir.startswith("dflash:") else ("eagle3", "", args.dir)
    head = resolve_head(name, kind)
    target = _target_for(head, args.target, name, kind)
    try:
        dflash = is_dflash(read_raw(head))
    except OutriderError:
        dflash = kind == "dflash"  # the check itself says what is wrong with config.json
    run = check_dflash if dflash else check_head
    checks = run(head, target, device=args.device, golden=not args.no_golden)
    for c in checks:
        print(c.line())
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"{len(failed)} check(s) failed" if failed else f"{head}: conforms ({target})")
    return 1 if failed else 0
