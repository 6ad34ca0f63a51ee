"""The head kinds: a kind is one package under heads/ and one `HeadKind` registered here.

A kind's package holds its model (head.py; reference.py the slow one it is tested against), its
trainable module and training job (trainable.py), its layout on disk (format.py), export.py,
check.py, golden.py and its `outrider export KIND` sub-command (cli.py), over the base every kind
shares (heads/: files.py, vocab_map.py, taps.py, layer.py, trainable.py, golden.py,
golden_compute.py, checks.py, staging.py, catalog.py). Registering it names those parts for
what every kind goes through: the shipped-head catalog (catalog.py: `shipped/<kind>/<target>/`),
`outrider check-head` (which kind a config.json is, then its checks), `outrider export <kind>`,
`outrider train <kind>` (train/trainables.py), the golden's re-measurement
(scripts/rerecord_golden.py) and, for a kind llama.cpp loads, `--format gguf` (its gguf.py).
The drafter that runs the kind registers in drafters/registry.py under the same name
(`--drafter eagle3:NAME`). Parts are named "module:attribute" within the package and imported
when used, so the registry imports no model code. docs/adding-a-method.md shows a new kind.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class HeadKind:
    name: str  # the --drafter name, `outrider export NAME`, the shipped folder shipped/NAME/
    title: str  # its name in messages
    package: str  # "outrider.heads.eagle3"
    claims: str | None  # "module:function(config.json as a dict) -> bool"; None: a config no other kind claims
    check: str = "check:check"  # (folder, target, *, device, golden) -> [checks.Check]
    measure: str = "golden:measure"  # (folder, target, settings, prompts) -> the golden's measured part
    add_export: str = "cli:add_export"  # (the `export` sub-parsers) -> adds `outrider export NAME`
    train_job: str = "trainable:job"  # (options, target, tokenizer, used, layer_ids) -> its `outrider train` job
    gguf: str | None = None  # its GGUF module (heads/<kind>/gguf.py), when llama.cpp loads the kind

    def module(self, part: str):
        """The kind's module `part` ("golden": heads/<kind>/golden.py), imported."""
        return importlib.import_module(f"{self.package}.{part}")

    def part(self, field: str):
        """The attribute a "module:attribute" field names (`kind.part("check")` -> the function)."""
        module, _, attribute = getattr(self, field).partition(":")
        return getattr(self.module(module), attribute)


KINDS: dict[str, HeadKind] = {}


def register_kind(kind: HeadKind) -> None:
    if kind.name in KINDS:
        raise ValueError(f"head kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind


def kind_named(name: str) -> HeadKind:
    try:
        return KINDS[name]
    except KeyError:
        raise ConfigError(f"unknown head kind {name!r}; known: {', '.join(KINDS)}") from None


def kind_of(raw: dict) -> HeadKind:
    """The kind a head's config.json (as a dict) is: the first kind claiming it, else the kind
    that claims whatever no other does."""
    default = None
    for kind in KINDS.values():
        if kind.claims is None:
            default = default or kind
        elif kind.part("claims")(raw):
            return kind
    return default


register_kind(HeadKind("eagle3", "EAGLE-3", "outrider.heads.eagle3", claims=None, check="check:check_head",
                       gguf="gguf"))
register_kind(HeadKind("dflash", "DFlash", "outrider.heads.dflash", claims="format:is_dflash",
                       check="check:check_dflash", gguf="gguf"))
register_kind(HeadKind("mtp", "MTP", "outrider.heads.mtp", claims="format:is_mtp", check="check:check_mtp"))
register_kind(HeadKind("dspark", "DSpark", "outrider.heads.dspark", claims="format:is_dspark"))
