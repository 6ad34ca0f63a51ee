"""The drafter registry: every drafter by name, with how its argument is parsed and what it declares.

`--drafter NAME[:ARGUMENT]` is looked up here and nowhere else. Each drafter is one module that
registers a `DrafterEntry` when it is imported; the built-in modules are listed in `BUILT_IN`
and imported on the first look-up. Adding a drafter is its file plus its line in `BUILT_IN` (or
a `register(...)` call from outside the package; docs/adding-a-method.md works one through). The
rest of the engine reads only the entry:

    parse_argument(text)                         -> argument   (ConfigError saying what to pass)
    models_needed(argument)                      -> models to pull before anything is checked
    check_fits(argument, target_config, path)    -> None, or why it cannot serve this target
    build(argument, shape, target, target_path)  -> the drafter (drafters/base.py)
    capabilities                                 -> tree kinds, gives_probs, siblings, needs_hidden

Worked example, `--drafter early-exit:8 --tree static:2,2`: the entry "early-exit" parses "8" to
8, finds that the target has more than 8 layers, builds a ModelDrafter on the target's first 8
layers, and declares for static trees Drafts("tree", gives_probs=False): sampling is verified
by the tree walk, greedy decoding by the greedy tree verifier.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .capabilities import Capabilities

BUILT_IN = ("ngram", "suffix", "draft_model", "early_exit", "eagle3", "hybrid", "oilbird", "ooo", "sparsespec", "dflash", "dblast", "toolspec", "s2moe", "draftexpert", "matryoshka", "adaflash", "dspark", "mtp", "dfly", "angelspec")  # modules of this package that register


def no_argument(text: str) -> None:
    """The parser of drafters that take no argument: `--drafter ngram`, not `ngram:3`."""
    if text:
        raise ConfigError("this drafter takes no argument; drop the ':' and what follows")


def no_models(argument) -> tuple[str, ...]:
    return ()


def fits_any(argument, target_config, target_path: Path) -> str | None:
    return None


@dataclass(frozen=True)
class DrafterEntry:
    """One drafter, as `--drafter` names it.

    name: the part before the colon; usage: how to spell it, for messages ("early-exit:K");
    parse_argument(text) -> argument: the text after the colon, parsed ("" when absent); raises
        ConfigError with what to pass (the registry prefixes "--drafter 'TEXT': ");
    models_needed(argument): catalog names or folders the drafter loads (pulled beforehand by
        the bench);
    check_fits(argument, target_config, target_path) -> reason or None: can it serve this target
        (layers, tokenizer), decided before the target's weights or the drafter load;
    build(argument, shape, target, target_path) -> Drafter;
    windowed: it takes Windowed-MTP's `window=W,sink=S` (drafters/window.py): a drafter with an
        attention and a K/V cache of its own; any other is refused those options in one line.
    refinable: it drafts blocks and takes block refiners (`--refiner`, `refine=R1+R2`,
        drafters/refiners/); any other is refused them in one line.
    """

    name: str
    usage: str
    capabilities: Capabilities
    build: Callable
    parse_argument: Callable[[str], object] = no_argument
    models_needed: Callable[[object], tuple[str, ...]] = no_models
    check_fits: Callable[[object, object, Path], str | None] = fits_any
    windowed: bool = False
    refinable: bool = False

    def __post_init__(self):
        if not self.name or ":" in self.name or self.name != self.name.strip():
            raise ValueError(f"a drafter name is a non-empty word without ':', got {self.name!r}")
        if not isinstance(self.capabilities, Capabilities):
            raise TypeError(f"capabilities must be a drafters.capabilities.Capabilities, "
                            f"got {type(self.capabilities).__name__}")


_ENTRIES: dict[str, DrafterEntry] = {}
_loaded = False


def register(entry: DrafterEntry) -> DrafterEntry:
    """Add a drafter; ValueError if another drafter has its name. Returns `entry`."""
    if not isinstance(entry, DrafterEntry):
        raise TypeError(f"register takes a DrafterEntry, got {type(entry).__name__}")
    old = _ENTRIES.get(entry.name)
    if old is not None and old is not entry:
        raise ValueError(f"a drafter called {entry.name!r} is already registered; pick another name")
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a drafter added with `register` (tests and experiments)."""
    _ENTRIES.pop(name, None)


def entries() -> dict[str, DrafterEntry]:
    """Every registered drafter by name, the built-in ones first."""
    global _loaded
    if not _loaded:
        _loaded = True  # before the imports: a module that looks a drafter up while it loads sees the rest
        try:
            for module in BUILT_IN:
                importlib.import_module(f"{__package__}.{module}")
        except BaseException:
            _loaded = False
            raise
    return dict(_ENTRIES)


def lookup(name: str) -> DrafterEntry | None:
    """The drafter registered as `name`, or None."""
    return entries().get(name)


def parse_drafter(text: str) -> tuple[DrafterEntry, object]:
    """`NAME[:ARGUMENT]` -> (its entry, the parsed argument); a one-line ConfigError for an
    unknown name (listing the registered ones) or a bad argument."""
    name, _, argument = str(text).partition(":")
    entry = lookup(name)
    if entry is None:
        known = ", ".join(e.usage for e in entries().values())
        raise ConfigError(f"--drafter {text!r}: unknown drafter; use one of the registered drafters: {known}")
    if not entry.windowed and ":" not in argument and re.search(r"(^|,)(window|sink)=", argument):
        takers = ", ".join(sorted(e.name for e in entries().values() if e.windowed))
        raise ConfigError(f"--drafter {text!r}: window=/sink= restrict a drafter's own attention, and {name} "
                          f"has none of its own to restrict; they apply to {takers}")
    try:
        return entry, entry.parse_argument(argument)
    except ConfigError as err:
        raise ConfigError(f"--drafter {text!r}: {err}") from None


def builders_of(shape_kind: str) -> list[str]:
    """Names of the drafters that build `--tree` of this kind."""
    return [e.name for e in entries().values() if e.capabilities.builds(shape_kind)]


def declared(name: str, drafter) -> Capabilities:
    """What the drafter named `name` declares: its registered capabilities (or, when the built
    drafter declares the same trees, its own: a head's layers are known only once it is loaded), or, for a drafter
    object made by hand under a name that is not registered (tests, experiments), the
    `capabilities` its class declares."""
    entry = lookup(name)
    if entry is not None:
        own = getattr(drafter, "capabilities", None)
        if isinstance(own, Capabilities) and own.trees == entry.capabilities.trees:
            return own  # the built drafter refines its entry: needs_hidden read from its weights (eagle3)
        return entry.capabilities
    try:
        capabilities = drafter.capabilities
    except AttributeError:
        raise TypeError(f"drafter {name!r} is not registered and {type(drafter).__name__} declares no "
                        "capabilities; register it (drafters/registry.py) or give it a `capabilities` "
                        "attribute") from None
    if not isinstance(capabilities, Capabilities):
        raise TypeError(f"{type(drafter).__name__}.capabilities must be a Capabilities, "
                        f"got {type(capabilities).__name__}")
    return capabilities
