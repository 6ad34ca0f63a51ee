"""`--drafter dfly:PATH_OR_NAME`: a DFly head (heads/dflash/dfly.py) drafts a block, its slots read out one after another.

PATH_OR_NAME names a DFlash head (a folder or a shipped head's name, as `dflash:`) whose folder
holds `dfly.safetensors` (`outrider train dfly`); a shipped DFlash head's DFly weights are shipped
beside it, in heads/shipped/dfly/<target>/ (with their recipe, dfly_train.json). The block forward, the context cache and the
pending rows are DFlashDrafter's (drafters/dflash.py); DFly changes what goes into the cache (one
context per draft layer) and the readout: slot k's logits are corrected by the token drafted at
slot k-1, so the chain is read slot by slot: greedy, each slot's argmax feeds the next; sampled,
each slot's draw (the request's drafting stream at offset k-1, as drafters/block.py
`sampled_chain` draws) feeds the next, and the q of every slot, given the drafts before it, is
kept for the chain verifier's rejection sampling. Only `--tree chain`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..errors import ConfigError
from ..sampling import warp_probs
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree
from .block import Block, greedy_chain, sampled_chain
from .capabilities import Capabilities, Drafts
from .dflash import DFlashDrafter
from .dflash import check_fits as dflash_fits
from .dflash import parse_argument as dflash_argument
from .dflash_vocab import parse_vocab, reduce_readout
from .registry import DrafterEntry, register
from .window import parse_options

USAGE = "dfly:PATH_OR_NAME[,vocab=N]"
TREES = {"chain": Drafts("chain", gives_probs=True)}


class DFlyDrafter(DFlashDrafter):
    def __init__(self, head, shape: TreeShape, name: str = "dfly"):
        if shape.kind != "chain":
            raise ConfigError(f"dfly drafts chains (each slot read out after the one before): use --tree chain, "
                              f"not --tree {shape}")
        super().__init__(head, shape, head.taps, name=name)
        self.capabilities = Capabilities(trees=TREES, needs_hidden=head.taps, couples=True)

    def _tree(self, st, block: Block, tokens: list[int], budget: Budget) -> DraftTree:
        depth = min(budget.depth, block.size, budget.nodes)
        if depth < 1:
            return DraftTree.root_only(block.root)
        rng = st.rng.at(len(tokens))
        previous, rows = block.root, []
        with torch.inference_mode():
            for d in range(depth):
                logits = self.head.correct(block.hidden[d + 1], torch.tensor(previous))  # [Vd]
                rows.append(logits)
                if st.params.greedy:
                    previous = int(block.target_ids(torch.log_softmax(logits, -1).max(-1).indices))
                else:
                    previous = rng.categorical(warp_probs(self.head.target_logits(logits), st.params), offset=d)
        chained = dataclasses.replace(block, logits=torch.stack(rows), _logp=None)  # [depth, Vd]
        if st.params.greedy:
            return greedy_chain(chained, depth, budget.min_confidence, budget.stop)
        return sampled_chain(chained, depth, st.params, rng, budget.min_confidence, budget.stop)


def _split(argument: str) -> tuple[str, int | None]:
    if Path(argument).expanduser().is_dir():
        return argument, None
    folder, options = parse_options(argument, ("vocab",))
    return folder, parse_vocab(options.get("vocab"), "dfly")


def parse_argument(text: str) -> str:
    folder, vocab = _split(text)
    if "," in folder:
        raise ConfigError(f"use {USAGE}: a DFlash head whose folder holds dfly.safetensors, and vocab=N at most")
    return dflash_argument(folder) + (f",vocab={vocab}" if vocab else "")


def check_fits(argument: str, target_config, target_path: Path) -> str | None:
    return dflash_fits(_split(argument)[0], target_config, target_path)


def weights_file(folder: Path) -> Path:
    """The DFly weights of the DFlash head in `folder`: its own dfly.safetensors, else (a shipped
    DFlash head) the one shipped for the same target in heads/shipped/dfly/<target>/."""
    from ..heads.catalog import SHIPPED_DIR
    from ..heads.dflash.dfly import FILE

    own = folder / FILE
    shipped = Path(SHIPPED_DIR) / "dfly" / folder.name / FILE
    return own if own.is_file() or folder.parent != Path(SHIPPED_DIR) / "dflash" else shipped


def build(argument: str, shape: TreeShape, target, target_path: Path) -> DFlyDrafter:
    from ..heads.dflash.dfly import DFlyHead, DFlyWeights
    from ..heads.dflash.format import load_dflash

    folder, vocab = _split(argument)
    base = load_dflash(folder, target)
    if vocab is not None:
        base = reduce_readout(base, Path(target_path), vocab)
    extra = DFlyWeights.load(weights_file(Path(folder)), base.device, base.dtype)
    return DFlyDrafter(DFlyHead(base, extra, target.config.num_layers), shape, name=f"dfly:{argument}")


register(DrafterEntry("dfly", USAGE, Capabilities(trees=TREES, couples=True), build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
