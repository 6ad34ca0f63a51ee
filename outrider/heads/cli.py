"""`outrider export eagle3|dflash ...` and `outrider check-head ...`: the sub-commands of learned heads.

outrider/cli.py registers them with `add_parsers(sub)`; each `run_*` returns the exit status. Each
kind adds its own `export KIND` (heads/<kind>/cli.py, named in heads/kinds.py); what they share
(the target a head was made for, the GGUF export) and check-head, for every kind, are here.

    outrider export eagle3 HEAD --format eagle|speculators --out DIR [--target NAME] [--dtype bf16]
    outrider export dflash HEAD --format zlab|vllm|sglang --out DIR [--target NAME] [--dtype bf16]
    outrider export eagle3|dflash HEAD --format gguf --out FILE.gguf [--target-gguf FILE]   (llama.cpp)
    outrider check-head DIR [--target NAME_OR_PATH]

HEAD is a head folder or a shipped head's name (heads/catalog.py); check-head takes `KIND:NAME`
for a shipped head of another kind than EAGLE-3 (`dflash:NAME`) and tells the kinds apart by
config.json (heads/kinds.py `kind_of`). --target defaults to the
target recorded in the head's outrider_golden.json, else in its train_info.json (a head
`outrider train` wrote), else to a shipped head's name.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import OutriderError
from .kinds import KINDS


def add_parsers(sub) -> None:
    export = sub.add_parser("export", help="write a learned head in the layouts vLLM and SGLang load")
    kinds = export.add_subparsers(dest="export_kind", required=True)
    for kind in KINDS.values():  # each kind's `outrider export KIND` (heads/<kind>/cli.py)
        kind.part("add_export")(kinds)

    check = sub.add_parser("check-head", help="check an EAGLE-3 or DFlash head folder: config, tensors and dtypes, "
                           "vocab map, layer ids, block size, golden logits and tau")
    check.add_argument("dir", help="the head folder (or a shipped head's name; KIND:NAME for a shipped head of "
                       "another kind, dflash:NAME for a DFlash head)")
    check.add_argument("--target", default=None, help="catalog name or folder (default: the one recorded in "
                       "outrider_golden.json or train_info.json)")
    check.add_argument("--device", default=None, help="where to re-measure the golden (default: as recorded)")
    check.add_argument("--no-golden", action="store_true", help="skip re-measuring the golden logits and tau")
    check.set_defaults(run=run_check)


def target_for(head: Path, given: str | None, name: str, kind: str = "eagle3") -> str:
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


def run_export_gguf(args, kind: str) -> int:
    from .catalog import resolve_head
    from .gguf_export import check_out_file, export_gguf

    check_out_file(args.out)  # before anything is read
    head = resolve_head(args.head, kind)
    target = target_for(head, args.target, args.head, kind)
    out = export_gguf(kind, head, args.out, target, dtype=args.dtype, target_gguf=args.target_gguf,
                      log=lambda msg: print(msg, file=sys.stderr))
    print(f"wrote {out} (gguf, llama.cpp --spec-type draft-{kind}) for {target}")
    return 0


def run_check(args) -> int:
    from .catalog import resolve_head
    from .files import read_raw
    from .kinds import kind_of

    named, _, rest = args.dir.partition(":")
    kind, name = (KINDS[named], rest) if rest and named in KINDS else (KINDS["eagle3"], args.dir)  # dflash:NAME
    head = resolve_head(name, kind.name)
    target = target_for(head, args.target, name, kind.name)
    try:
        kind = kind_of(read_raw(head))
    except OutriderError:
        pass  # the check itself says what is wrong with config.json
    checks = kind.part("check")(head, target, device=args.device, golden=not args.no_golden)
    for c in checks:
        print(c.line())
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"{len(failed)} check(s) failed" if failed else f"{head}: conforms ({target})")
    return 1 if failed else 0
