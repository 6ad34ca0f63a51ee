"""`--drafter dspark:PATH_OR_NAME[,schedule=on]`: a DSpark head (heads/dspark/head.py) drafts a
block with one backbone pass, then a chain left to right through its Markov head.

The context K/V and the pending feature rows are DFlash's (drafters/dflash.py, whose drafter this
one extends): the backbone is a DFlash head whose every slot is read out. Per round, with the
block's base logits U_1..U_gamma and normed hidden states hbar_1..hbar_gamma:

    x_0 = the root (last committed token); for k = 1 .. depth:
        logits_k = U_k + markov(x_{k-1}, hbar_k, s_{k-1})       (one rank-r step)
        greedy:  x_k = argmax logits_k;   sampling: x_k ~ q_k = warp(logits_k), q_k kept
        c_k = the calibrated confidence;  survival a_k = c_1 ... c_k  (the tree's `confidence`)

A chain's q_k depends on the drafts before it, as any autoregressive draft model's does: the
chain verifier's rejection sampling is exact for it (the q's are those the drafts were drawn
from). The chain stops early on `Budget.min_confidence` (survival below it) or `Budget.stop`
(the entropies so far). `schedule=on` adds the prefix scheduler (dspark_schedule.py): after every
sequence of the batch drafted, each chain is cut to the depth the scheduler admits by survival
against the target's measured steps per second (control/profile.py). Cutting a chain before the
verify is exact: how many drafts are verified may depend on the drafts.
`--tree pctree:N` builds PCTree's tree from the same block (pctree.py: the N most probable
prefixes, children scored per concrete parent by the Markov head); `--tree ddtree:N` DDTree on the
base marginals U_k alone (its baseline). Both are verified by the tree walk.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError
from ..sampling import warp_probs
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree
from .block import Block
from .capabilities import Capabilities, Drafts
from .dflash import DFlashDrafter
from .dspark_schedule import admit
from .pctree import pctree
from .registry import DrafterEntry, register
from .window import parse_options

TREES = {"chain": Drafts("chain", gives_probs=True),
         "ddtree": Drafts("tree"),  # DDTree on the base marginals U_k (the Markov head unread): PCTree's baseline
         "pctree": Drafts("tree")}  # PCTree (pctree.py): children scored per concrete parent; both not draws


def markov_chain(head, block: Block, depth: int, params=None, rng=None, min_confidence: float = 0.0,
                 stop=None) -> DraftTree:
    """The chain of one block (module docstring): greedy when `params` is None or greedy, else
    each draft drawn from its warped q_k by `rng` (already `.at(len(committed))`) at offset k-1."""
    depth = min(depth, block.size)
    if depth < 1:
        return DraftTree.root_only(block.root)
    greedy = params is None or params.greedy
    prev = torch.tensor([block.root])
    state, drafts, qs, survival, entropies = None, [], [], [1.0], []
    for k in range(depth):
        logits, state = head.step(block.logits[k:k + 1], block.hidden[k:k + 1], prev, state)  # [1, Vd]
        if greedy:
            token = int(head.target_ids(logits.argmax(-1))[0])
            logp = torch.log_softmax(logits[0], -1)
            probs = None
        else:
            probs = warp_probs(head.target_logits(logits[0]), params)  # [V]
            token = rng.categorical(probs, offset=k)
            qs.append(probs)
        c = head.confidence(block.hidden[k:k + 1], prev, k)
        survival.append(survival[-1] * (float(c[0]) if c is not None else 1.0))
        drafts.append(token)
        if stop is not None:
            if probs is None:
                entropies.append(float(-(logp.exp() * logp).sum()))
            else:
                live = probs[probs > 0]
                entropies.append(float(-(live * live.log()).sum()))
        if survival[-1] < min_confidence or (stop is not None and stop(entropies)):
            break
        prev = torch.tensor([token])
    probs_rows = None
    if qs:
        probs_rows = torch.zeros(len(drafts) + 1, block.vocab)
        probs_rows[: len(drafts)] = torch.stack(qs).cpu()
    tree = DraftTree.chain(block.root, drafts, probs_rows)
    return DraftTree(tree.tokens, tree.parents, tree.draft_probs, torch.tensor(survival))


def cut_chain(tree: DraftTree, depth: int) -> DraftTree:
    """The chain's first `depth` drafts (the root kept); q rows of the cut drafts dropped."""
    if depth >= tree.size - 1:
        return tree
    n = depth + 1
    probs = None
    if tree.draft_probs is not None:
        probs = torch.zeros(n, tree.draft_probs.shape[1])
        probs[:depth] = tree.draft_probs[:depth]
    confidence = tree.confidence[:n] if tree.confidence is not None else None
    return DraftTree(tree.tokens[:n], tree.parents[:n], probs, confidence)


class DSparkDrafter(DFlashDrafter):
    """DFlashDrafter's context handling; the chain drawn through the Markov head; `sps` (B tokens
    -> target steps per second) turns on the prefix scheduler."""

    def __init__(self, head, shape: TreeShape, taps: tuple[int, ...], sps=None, name: str = "dspark"):
        if shape.kind not in TREES:
            raise ConfigError(f"dspark drafts --tree chain, pctree:N or ddtree:N; --tree {shape} is not one")
        if sps is not None and shape.kind != "chain":
            raise ConfigError(f"dspark's schedule=on cuts chains; it does not take --tree {shape}")
        super().__init__(head, shape, taps, (), name=name)
        self.capabilities = Capabilities(trees=TREES, needs_hidden=tuple(taps), couples=True)
        self.sps = sps
        self.admitted: list[int] = []  # every depth the scheduler admitted, round by round (tests, the bench)

    def max_nodes(self, depth: int) -> int:
        depth = min(depth, self.head.gamma)
        return depth if self.shape.is_chain else self.shape.max_drafts(depth)

    def _tree(self, st, block: Block, tokens: list[int], budget: Budget) -> DraftTree:
        if self.shape.kind == "pctree":
            return pctree(block.root, block.logits, block.hidden, self.head.step, self.head.target_ids,
                          min(budget.depth, block.size), min(budget.nodes, self.shape.max_nodes), budget.min_confidence)
        if self.shape.kind == "ddtree":
            return super()._tree(st, block, tokens, budget)
        depth = min(budget.depth, budget.nodes, block.size)
        rng = None if st.params.greedy else st.rng.at(len(tokens))
        return markov_chain(self.head, block, depth, st.params, rng, budget.min_confidence, budget.stop)

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        trees = super().propose_batch(seq_ids, tokens, budgets)
        if self.sps is None:
            return trees
        survival = [t.confidence[1:].tolist() if t.confidence is not None else [] for t in trees]
        depths = admit(survival, self.sps)
        self.admitted.extend(depths)
        cut = [cut_chain(t, d) for t, d in zip(trees, depths)]
        for s, t in zip(seq_ids, cut):
            self._states[s].previous_tree = t
        return cut


# -- registration ---------------------------------------------------------------------------------
USAGE = "dspark:PATH_OR_NAME[,schedule=on]"


def _split(argument: str) -> tuple[str, bool]:
    if Path(argument).expanduser().is_dir():
        return argument, False
    folder, options = parse_options(argument, ("schedule",))
    value = options.get("schedule", "off")
    if value not in ("on", "off"):
        raise ConfigError(f"schedule={value}: use schedule=on (the prefix scheduler) or schedule=off")
    return folder, value == "on"


def parse_argument(text: str) -> str:
    from ..heads.catalog import resolve_head

    folder, schedule = _split(text)
    if not folder:
        raise ConfigError("dspark:PATH needs the folder of a DSpark head (config.json + model.safetensors) "
                          "or the name of a shipped head")
    return str(resolve_head(folder, kind="dspark")) + (",schedule=on" if schedule else "")


def check_fits(argument: str, target_config, target_path: Path) -> str | None:
    from ..heads.dspark.format import misfit, read_config

    return misfit(read_config(_split(argument)[0]), target_config)


def measured_sps(target, target_path: Path):
    """B -> steps per second of the target's forward over B new tokens (control/profile.py: measured
    once per machine and cached)."""
    from ..config import cache_dir
    from ..control.profile import load_or_measure

    profile = load_or_measure(Path(target_path), target, cache_dir() / "profiles")
    return lambda b: 1.0 / profile.cost(b)


def build(argument: str, shape: TreeShape, target, target_path: Path) -> DSparkDrafter:
    from ..heads.dspark.format import load_dspark

    folder, schedule = _split(argument)
    head = load_dspark(folder, target)
    sps = measured_sps(target, target_path) if schedule else None
    label = "dspark:" + folder + (",schedule=on" if schedule else "")
    return DSparkDrafter(head, shape, head.config.taps(target.config.num_layers), sps, name=label)


register(DrafterEntry("dspark", USAGE, Capabilities(trees=TREES, couples=True), build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
