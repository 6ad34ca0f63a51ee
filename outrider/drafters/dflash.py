"""`--drafter dflash:PATH_OR_NAME`: a DFlash block head (heads/dflash/head.py) drafts a whole block per forward.

PATH is a head folder in z-lab's DFlash layout (config.json + model.safetensors,
heads/dflash/format.py); NAME a head shipped for that target (heads/catalog.py). The head reads
several target layers, declared as `needs_hidden`, so the verify forward of each round returns
them at no extra target pass.

The head's context K/V follows the committed prefix. With n committed tokens its cache holds the
context rows of positions 0..n-2 (each written from the target's features of that position,
`DFlashHead.write_context`: no attention); the features of newly committed positions wait in
`pending` until the next proposal:

    start(prompt x_0..x_{n-1}, features f_0..f_{n-2})      pending = those n-1 rows
    propose: write pending rows; one block forward for every sequence: [x_{n-1}, MASK x (B-1)]
             at positions n-1 .. n+B-2 over its n-1 context rows; position k's logits -> tree
    update(accepted path a nodes, features f_{n-1}..f_{n-1+a})  pending = those a+1 rows

The block's own K/V is never cached, so a rejection rolls nothing back. Trees (drafters/block.py):
`--tree chain` (greedy: the block's argmax; sampling: each position's token drawn from its own
q, q kept for the chain verifier's rejection sampling) and `--tree ddtree:N` (DDTree, verified by
the tree walk). `dflash:PATH,refine=R1+R2` (or `--refiner R1,R2`) passes the block through block
refiners (refiners/) into a tree of at most N nodes: they need `--tree ddtree:N`.
`--tree glance:N[,K[,E]]` builds GLANCE's budget tree, with its optional extra draft pass past the
block (glance_tree.py). `dflash:PATH,vocab=N` reads out only N tokens of the target's output head (dflash_vocab.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.random import PositionalRandom
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import DrafterBase
from .block import Block, greedy_chain, sampled_chain
from .capabilities import Capabilities, Drafts
from .refiners import make_refiner, parse_refiners
from .registry import DrafterEntry, register
from .dflash_vocab import parse_vocab, reduce_readout
from .glance_tree import glance_tree
from .pending import PendingRows
from .slots import SlotCache
from .window import parse_options

TREES = {
    "chain": Drafts("chain", gives_probs=True),  # sampled: each position's draft drawn from its own q
    "ddtree": Drafts("tree"),  # best prefixes by the product of marginals (and refiners' trees): not draws
    "glance": Drafts("tree"),  # GLANCE's budget tree (+ its extra pass past the block): not draws
}


@dataclass
class _State:
    slot: int
    params: SamplingParams
    rng: PositionalRandom  # the request's drafting streams (coupled: its TOKEN draws, capabilities.py)
    pending: PendingRows  # [m, H] context rows of committed positions not yet written (pending.py)
    rows: int = 0  # context rows in the cache (positions 0 .. rows-1)
    previous: VerifyResult | None = None
    previous_tree: DraftTree | None = None


class DFlashDrafter(DrafterBase):
    """Drafts with a DFlash head; `refiners` (refiners/) turn each block into the verified tree."""

    def __init__(self, head, shape: TreeShape, taps: tuple[int, ...], refiners: tuple = (), name: str = "dflash"):
        if refiners and shape.kind != "ddtree":
            raise ConfigError(f"refiners ({', '.join(r.name for r in refiners)}) build trees: use --tree ddtree:N "
                              f"(N: the tree's node budget), not --tree {shape}")
        self.head = head
        self.shape = shape
        self.name = name
        self.refiners = tuple(refiners)
        if shape.kind == "ddtree" and not self.refiners:
            self.refiners = (make_refiner("ddtree"),)
        self.capabilities = Capabilities(trees=TREES, needs_hidden=tuple(taps), couples=True)
        self.vocab = head.config.vocab_size
        self.slots = SlotCache(head.new_cache)
        self._states: dict[int, _State] = {}

    @property
    def cache(self):
        return self.slots.cache

    # -- protocol -----------------------------------------------------------------------------
    def max_nodes(self, depth: int) -> int:
        depth = min(depth, self.head.block_size - 1)
        return depth if self.shape.is_chain else self.shape.max_drafts(depth)

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None,
              hidden: torch.Tensor | None = None, coupled: bool = False) -> None:
        """hidden: [len(prompt) - 1, n, Ht] the prompt's features at the declared layers (the
        last prompt token is the first root); None for a one-token prompt. coupled: draw the
        sampled chain with the verifier's own token uniforms (capabilities.py `couples`)."""
        params = params or SamplingParams()
        rows = 0 if hidden is None else hidden.shape[0]
        if rows != len(prompt) - 1:
            got = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"dflash start needs the prompt's features [{len(prompt) - 1}, n, Ht], got {got}")
        self.finish(seq_id, prompt)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**63 - 1, ()))
        c = self.head.config
        pending = self.head.fuse(hidden) if rows else self.head.w.norm.new_zeros(0, c.hidden_size)
        rng = PositionalRandom(seed) if coupled else PositionalRandom(seed).drafting()  # else apart from the verifier's
        self._states[seq_id] = _State(self.slots.take(), params, rng, PendingRows(pending))

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        """hidden: [1 + num_accepted, n, Ht] the target's features of the root and accepted nodes."""
        if hidden is None or hidden.shape[0] != 1 + result.num_accepted:
            got = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"dflash update needs the accepted path's features [{1 + result.num_accepted}, n, Ht], "
                             f"got {got}")
        st = self._states[seq_id]
        st.pending.add(self.head.fuse(hidden))
        st.previous = result

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        st = self._states.pop(seq_id, None)
        if st is not None:
            self.slots.give(st.slot)

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        return self.propose_batch([seq_id], [tokens], [budget])[0]

    def propose_batch(self, seq_ids: list[int], tokens: list[list[int]], budgets: list[Budget]) -> list[DraftTree]:
        """Write each sequence's pending context, then one block forward for all that draft."""
        states = [self._states[s] for s in seq_ids]
        self.slots.ensure_rows(max(st.rows + st.pending.rows for st in states) + 1)
        for st, toks in zip(states, tokens):
            self._catch_up(st, toks)
        trees: list[DraftTree | None] = [None] * len(states)
        drafting = []
        for i, (st, toks, b) in enumerate(zip(states, tokens, budgets)):
            if min(b.depth, self.head.block_size - 1) < 1 or b.nodes < 1:
                trees[i] = DraftTree.root_only(toks[-1])
            else:
                drafting.append(i)
        if drafting:
            B, mask = self.head.block_size, self.head.config.mask_token_id
            block_tokens = torch.full((len(drafting), B), mask, dtype=torch.long)  # [S, B]
            block_tokens[:, 0] = torch.tensor([tokens[i][-1] for i in drafting])
            logits, hidden = self.head.block(self.cache, [states[i].slot for i in drafting],
                                             [states[i].rows for i in drafting], block_tokens)  # [S, B-1, Vd], [S, B, H]
            for j, i in enumerate(drafting):
                st = states[i]
                block = Block(tokens[i][-1], st.rows, logits[j], hidden[j], self.vocab, self.head.w.draft_to_target,
                              tokens[i], st.previous, st.previous_tree)
                trees[i] = self._tree(st, block, tokens[i], budgets[i])
        for st, tree in zip(states, trees):
            st.previous_tree = tree
        return trees

    def _catch_up(self, st: _State, tokens: list[int]) -> None:
        m = st.pending.rows
        if st.rows + m != len(tokens) - 1:
            raise ValueError(f"dflash drafter out of step: {st.rows} context rows + {m} pending for "
                             f"{len(tokens)} committed tokens (expected {len(tokens) - 1})")
        if m:
            self.head.write_context(self.cache, st.slot, st.rows, st.pending.joined())
            st.rows += m
            self.cache.set_length(st.slot, st.rows)
            st.pending.clear()

    def _tree(self, st: _State, block: Block, tokens: list[int], budget: Budget) -> DraftTree:
        depth = min(budget.depth, block.size)
        if self.shape.kind == "glance":
            nodes = min(budget.nodes, self.shape.max_nodes)
            return glance_tree(block, depth, nodes, self.shape.top_k, self.shape.extra,
                               lambda spine: self._past_block(st, block.root, spine))
        if not self.refiners:
            if st.params.greedy:
                return greedy_chain(block, min(depth, budget.nodes), budget.min_confidence, budget.stop)
            return sampled_chain(block, min(depth, budget.nodes), st.params, st.rng.at(len(tokens)),
                                 budget.min_confidence, budget.stop)
        nodes = min(budget.nodes, self.shape.max_nodes)
        tree = greedy_chain(block, min(depth, nodes))
        for refiner in self.refiners:
            tree = refiner.refine(block, tree, depth, nodes, st.params.greedy)
        return tree

    def _past_block(self, st: _State, root: int, spine: list[int]) -> torch.Tensor:
        """GLANCE's extra pass: one block forward of width 2B, [root, the spine (B-1 target ids),
        MASK x B], over the same context rows -> [B, Vd] logits of the B positions past the block."""
        B, mask = self.head.block_size, self.head.config.mask_token_id
        block_tokens = torch.full((1, 2 * B), mask, dtype=torch.long)  # [1, 2B]
        block_tokens[0, : B] = torch.tensor([root, *spine])
        logits, _ = self.head.block(self.cache, [st.slot], [st.rows], block_tokens)  # [1, 2B-1, Vd]
        return logits[0, B - 1:]


# -- registration ---------------------------------------------------------------------------------
USAGE = "dflash:PATH_OR_NAME[,vocab=N][,refine=R1+R2]"


def _split(argument: str) -> tuple[str, int | None, tuple[str, ...]]:
    """`FOLDER[,vocab=N][,refine=A+B]` -> (folder, N or None, refiner names); a folder whose own
    name holds ',' stays whole."""
    if Path(argument).expanduser().is_dir():
        return argument, None, ()
    folder, options = parse_options(argument, ("vocab", "refine"))
    names = parse_refiners(options["refine"]) if "refine" in options else ()
    return folder, parse_vocab(options.get("vocab")), names


def _join(folder: str, vocab: int | None, names: tuple[str, ...]) -> str:
    return folder + (f",vocab={vocab}" if vocab else "") + (f",refine={'+'.join(names)}" if names else "")


def _resolve(name: str) -> Path:
    from ..heads.catalog import resolve_head

    return resolve_head(name, kind="dflash")  # a folder, or a shipped DFlash head by its target's name


def parse_argument(text: str) -> str:
    folder, vocab, refiners = _split(text)
    if not folder:
        raise ConfigError("dflash:PATH needs the folder of a DFlash head (config.json + model.safetensors) "
                          "or the name of a shipped head")
    return _join(str(_resolve(folder)), vocab, refiners)


def check_fits(argument: str, target_config, target_path: Path) -> str | None:
    from ..heads.dflash.format import misfit, read_config

    return misfit(read_config(_split(argument)[0]), target_config)


def build(argument: str, shape: TreeShape, target, target_path: Path) -> DFlashDrafter:
    from ..heads.dflash.format import load_dflash

    folder, vocab, names = _split(argument)
    head = load_dflash(folder, target)
    if vocab is not None:
        head = reduce_readout(head, Path(target_path), vocab)
    refiners = tuple(make_refiner(n, head, folder) for n in names)
    label = "dflash:" + _join(folder, vocab, names)
    return DFlashDrafter(head, shape, head.config.taps(target.config.num_layers), refiners, name=label)


register(DrafterEntry("dflash", USAGE, Capabilities(trees=TREES, couples=True), build=build,
                      parse_argument=parse_argument, check_fits=check_fits, refinable=True))
