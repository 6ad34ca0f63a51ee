"""`--drafter angelspec:MTP_HEAD+DFLY_HEAD[,vocab=N][,route=auto|mtp|dfly]`: AngelSpec's routing by domain (seed card 2.25).

AngelSpec specialises structure and data together: an MTP drafter for diverse chat, a
block-diffusion drafter (DFly) for code and math. Here each request is routed once, when it
starts, by the domain of its prompt (`domain`: code or math -> DFly, anything else -> MTP), and
drafts with that drafter alone for its whole life. MTP_HEAD is an MTP head (`mtp:`), DFLY_HEAD a
DFlash head whose folder holds dfly.safetensors (`dfly:`), each a folder or a shipped head's
name. `route=mtp|dfly` sends every request to one of them (the ablation). The router declares
the union of both drafters' target layers and hands each the columns it reads; greedy and
sampled chains are each drafter's own (lossless through the verifiers). Only `--tree chain`
(DFly drafts chains).

The domain rule reads the prompt's text (the target's tokenizer): code when it shows code
(`def `, `class `, `import `, `return`, a fenced block, braces and semicolons, `()` calls) or
tool-call JSON; math when most of its non-space characters are digits and operators; a count of
markers, not a model.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import ConfigError
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase
from .capabilities import Capabilities, Drafts
from .registry import DrafterEntry, register

USAGE = "angelspec:MTP_HEAD+DFLY_HEAD[,vocab=N][,route=auto|mtp|dfly]"
TREES = {"chain": Drafts("chain", gives_probs=True)}
ROUTES = ("auto", "mtp", "dfly")
CODE = re.compile(r"\bdef |\bclass |\bimport |\breturn\b|```|[{};]|\w\(|\"name\"\s*:|\"arguments\"")
MATH = re.compile(r"[0-9+\-*/=^()%.]")


def domain(text: str) -> str:
    """"code", "math" or "chat" (module docstring)."""
    if len(CODE.findall(text)) >= 2:
        return "code"
    visible = [c for c in text if not c.isspace()]
    if visible and sum(bool(MATH.match(c)) for c in visible) >= 0.5 * len(visible):
        return "math"
    return "chat"


class AngelSpecDrafter(DrafterBase):
    def __init__(self, mtp, dfly, decode, route: str = "auto", name: str = "angelspec"):
        self.mtp, self.dfly, self.decode, self.route, self.name = mtp, dfly, decode, route, name
        taps = tuple(sorted(set(mtp.capabilities.needs_hidden) | set(dfly.capabilities.needs_hidden)))
        self.capabilities = Capabilities(trees=TREES, needs_hidden=taps, couples=True)
        self._columns = {id(d): [taps.index(t) for t in d.capabilities.needs_hidden] for d in (mtp, dfly)}
        self._of: dict[int, object] = {}  # seq_id -> the drafter it was routed to
        self.routed = {"mtp": 0, "dfly": 0}  # requests each drafter took

    def choose(self, prompt: list[int]):
        if self.route != "auto":
            return self.mtp if self.route == "mtp" else self.dfly
        return self.dfly if domain(self.decode(prompt)) in ("code", "math") else self.mtp

    def _cols(self, drafter, hidden: torch.Tensor | None):
        return None if hidden is None else hidden[:, self._columns[id(drafter)]]

    def max_nodes(self, depth: int) -> int:
        return max(self.mtp.max_nodes(depth), self.dfly.max_nodes(depth))

    def start(self, seq_id: int, prompt: list[int], params=None, hidden: torch.Tensor | None = None,
              coupled: bool = False) -> None:
        drafter = self.choose(prompt)
        self.finish(seq_id, prompt)
        drafter.start(seq_id, prompt, params, hidden=self._cols(drafter, hidden), coupled=coupled)
        self._of[seq_id] = drafter
        self.routed["dfly" if drafter is self.dfly else "mtp"] += 1

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        drafter = self._of[seq_id]
        drafter.update(seq_id, result, self._cols(drafter, hidden))

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        drafter = self._of.pop(seq_id, None)
        if drafter is not None:
            drafter.finish(seq_id, tokens)

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        return self.propose_batch([seq_id], [tokens], [budget])[0]

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        """Each drafter's sequences in one batch call of its own."""
        trees: list[DraftTree | None] = [None] * len(seq_ids)
        for drafter in (self.mtp, self.dfly):
            mine = [i for i, s in enumerate(seq_ids) if self._of[s] is drafter]
            if mine:
                got = drafter.propose_batch([seq_ids[i] for i in mine], [tokens[i] for i in mine],
                                            [budgets[i] for i in mine])
                for i, tree in zip(mine, got):
                    trees[i] = tree
        return trees


def _split(argument: str) -> tuple[str, str, str]:
    """`MTP+DFLY[,vocab=N][,route=R]` -> (MTP, DFLY[,vocab=N], R): vocab= is DFly's."""
    from .window import parse_options

    heads, options = parse_options(argument, ("route",))
    route = options.get("route", "auto")
    if route not in ROUTES:
        raise ConfigError(f"angelspec takes route=auto|mtp|dfly after the heads, got route={route!r}")
    mtp, plus, dfly = heads.partition("+")
    if not plus or not mtp or not dfly:
        raise ConfigError(f"use {USAGE}: an MTP head and a DFlash head with DFly weights, joined by '+'")
    return mtp, dfly, route


def parse_argument(text: str) -> str:
    from .dfly import parse_argument as dfly_argument
    from .mtp import parse_argument as mtp_argument

    mtp, dfly, route = _split(text)
    return f"{mtp_argument(mtp)}+{dfly_argument(dfly)}" + (f",route={route}" if route != "auto" else "")


def check_fits(argument: str, target_config, target_path: Path) -> str | None:
    from .dfly import check_fits as dfly_fits
    from .mtp import check_fits as mtp_fits

    mtp, dfly, _ = _split(argument)
    return mtp_fits(mtp, target_config, target_path) or dfly_fits(dfly, target_config, target_path)


def build(argument: str, shape: TreeShape, target, target_path: Path) -> AngelSpecDrafter:
    from ..weights.tokenizer import load_tokenizer
    from .dfly import build as build_dfly
    from .mtp import build as build_mtp

    if shape.kind != "chain":
        raise ConfigError(f"angelspec routes between chain drafters: use --tree chain, not --tree {shape}")
    mtp, dfly, route = _split(argument)
    tokenizer = load_tokenizer(Path(target_path))
    return AngelSpecDrafter(build_mtp(mtp, shape, target, target_path), build_dfly(dfly, shape, target, target_path),
                            lambda ids: tokenizer.decode(ids), route, name=f"angelspec:{argument}")


register(DrafterEntry("angelspec", USAGE, Capabilities(trees=TREES, couples=True), build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
