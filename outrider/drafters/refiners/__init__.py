"""Block refiners: what turns a block drafter's block into the draft tree that is verified.

A refiner takes the drafted block (drafters/block.py `Block`: its tokens' per-position
distributions, the drafter's hidden states, the previous round's verification result) and the
tree built so far, and returns a tree within the round's node budget. Refiners chain: `--refiner
cure,retrace` runs CURE on the block's argmax chain, then ReTrace on CURE's tree. They change
only what is proposed; the verifier is exact whatever they propose (the tree walk, or the greedy
tree verifier), so every refiner here is exact.

    ddtree      DDTree: the N best prefixes under the product of the marginals (drafters/block.py)
    retrace     ReTrace: the previous round's rejected suffix, realigned after the target's
                correction, offered again as a branch
    cure        CURE: branch only at the block's uncertain positions (entropy), budget-aware
    dartree     DARTree: a small autoregressive correction head over the block, grown as a tree
                one depth per batched forward (a trained head: `outrider train dartree`)
    lilicorr    LiLiCorr: a lattice of each position's top-k, paths scored with a learned
                pairwise correlator, the best paths packed into a tree
    xpress      xPress: a causal low-rank refiner head over the block, Jacobi passes over its
                argmax (`xpress[:P]`), a deterministic chain (a trained head: `outrider train xpress`)

`--refiner NAME[,NAME...]` is accepted wherever `--drafter` is (generate, serve, bench methods):
it is folded into the drafter's argument as `refine=NAME+NAME` (`with_refiners`), which only a
block drafter (dflash) accepts. Each refiner declares its cost (`RefinerCost`): the cost
controller measures draft time live (fixed + per depth), so a refiner's extra forwards and host
work are weighed in the depth it chooses; the declaration is reported with the method.
"""

from __future__ import annotations

import importlib

from ...errors import ConfigError
from .base import Refiner, RefinerCost  # noqa: F401  (the interface, for refiners written elsewhere)

__all__ = ["Refiner", "RefinerCost", "REFINERS", "parse_refiners", "make_refiner", "with_refiners"]

REFINERS = {
    "ddtree": "ddtree",
    "retrace": "retrace",
    "cure": "cure",
    "dartree": "dartree",
    "lilicorr": "lilicorr",
    "xpress": "xpress",
}


def parse_refiners(text: str) -> tuple[str, ...]:
    """`NAME[+NAME...]` or `NAME[,NAME...]` -> names, each known; ConfigError otherwise."""
    names = tuple(n.strip() for n in text.replace("+", ",").split(",") if n.strip())
    for name in names:
        base = name.partition(":")[0]
        if base not in REFINERS:
            raise ConfigError(f"unknown refiner {base!r}: choose from {', '.join(REFINERS)}")
    if not names:
        raise ConfigError("--refiner needs at least one refiner name: " + ", ".join(REFINERS))
    return names


def make_refiner(spec: str, head=None, folder=None) -> Refiner:
    """One refiner from `NAME[:ARG]`; `head`: the block drafter's head (a trained refiner loads its
    weights to fit it); `folder`: the head's folder, where a trained refiner's weights are looked
    for when ARG names none (a shipped head ships its refiners beside it)."""
    name, _, arg = spec.partition(":")
    module = importlib.import_module(f"{__name__}.{REFINERS[name]}")
    return module.make(arg, head, folder)


def with_refiners(drafter: str | None, refiner: str | None) -> str | None:
    """`--drafter D --refiner R1,R2` -> `D,refine=R1+R2` (what the block drafter parses); a
    one-line ConfigError when there is no drafter to refine."""
    if not refiner:
        return drafter
    if not drafter:
        raise ConfigError("--refiner refines a block drafter's drafts: give --drafter dflash:PATH_OR_NAME too")
    from ..registry import entries, lookup

    names = parse_refiners(refiner)
    name = drafter.partition(":")[0]
    entry = lookup(name)
    if entry is None or not entry.refinable:
        takers = ", ".join(sorted(f"--drafter {e.usage}" for e in entries().values() if e.refinable))
        raise ConfigError(f"--refiner {refiner}: refiners refine a block drafter's block; --drafter {name} "
                          f"drafts no block (use {takers})")
    return f"{drafter},refine={'+'.join(names)}"
