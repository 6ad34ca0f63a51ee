"""`--refiner xpress[:P]` / `refine=xpress[:P]`: xPress, a parallel causal refiner, Jacobi passes over the block.

A block drafter drafts each slot without the token drafted before it. xPress (card 2.19; the head
in xpress_head.py) adds a logit bias that depends on the previous token through a causal
low-rank mixer, and resolves the dependence by Jacobi iteration instead of a token-by-token loop:

    t      = argmax of the block's own logits                 slots 1..d (d: the round's depth)
    pass   : prev = [token before the root, root, t_1 .. t_{d-1}]
             t    = argmax refined(hidden, prev)              every slot at once (one readout of d rows)
    repeat P passes (stop early once t no longer changes: a fixed point stays fixed)

The proposal is the chain t_1..t_d, a deterministic point mass: verified by the tree walk (greedy
or sampled), exact whatever it proposes. Because slot k reads prev_0..prev_k only, after p passes
slots 1..p hold what a sequential token-by-token decode with the same head gives, and d passes
reach that decode's fixed point (tests/test_xpress.py). P = 0 is the block's own argmax chain.

Spec: `xpress` (the head's `xpress.safetensors` beside the block head, DEFAULT_PASSES passes),
`xpress:P`, `xpress:PATH` or `xpress:PATH:P`. Needs `--tree ddtree:N` like every refiner; the
chain is min(depth, N) long. Trained by `outrider train xpress` (train/xpress.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import ConfigError
from ...spec.types import DraftTree
from ..block import Block
from .base import RefinerCost
from .xpress_head import FILE, XPressHead, XPressWeights, reference_logits

DEFAULT_PASSES = 2
MAX_PASSES = 16


def previous_tokens(block: Block, mask_token: int) -> tuple[int, int]:
    """(the token before the root, the root): slot 0's and slot 1's prev; MASK when the prompt was
    one token."""
    before = block.committed[-2] if len(block.committed) >= 2 else mask_token
    return before, block.root


def jacobi(head: XPressHead, block: Block, depth: int, passes: int, mask_token: int) -> tuple[list[int], int]:
    """The fast path: the refined chain (target ids, `depth` long) and the passes run. Causality
    saves work without changing the result: only slots 1..depth are read out, and a pass reads out
    only the slots after the previous pass's first change (slot k reads the tokens of slots < k, so
    the slots up to that change would come out the same); no change at all is a fixed point (stop)."""
    depth = min(depth, block.size)
    tokens = block.target_ids(block.logits[:depth].argmax(-1))  # [d]
    if passes < 1 or depth < 1:
        return tokens.tolist(), 0
    before, root = previous_tokens(block, mask_token)
    hn, c = head.features(block.hidden.unsqueeze(0))  # [1, B, H], [1, B, r]: the global mean over the whole block
    head_prev = torch.tensor([before, root])
    ran, first = 0, 1  # slots first..d are read out this pass
    for _ in range(passes):
        prev = torch.cat((head_prev, tokens[:-1])).unsqueeze(0)  # [1, d+1]
        tail = block.target_ids(head.logits_from(hn, c, prev, first)[0].argmax(-1))  # [d - first + 1]
        new = torch.cat((tokens[: first - 1], tail))  # [d]
        ran += 1
        changed = (new != tokens).nonzero()
        tokens = new
        if changed.numel() == 0:
            break
        first = int(changed[0, 0]) + 2  # token i is slot i+1's: slots up to i+1 read the same tokens next pass
        if first > depth:
            break  # the change was at the last slot: the next pass would change nothing
    return tokens.tolist(), ran


def reference_jacobi(weights: XPressWeights, head, block: Block, depth: int, passes: int, mask_token: int) -> list[int]:
    """The slow path: every pass over the whole block with reference_logits, no early stop."""
    depth = min(depth, block.size)
    tokens = block.target_ids(block.logits.argmax(-1)).tolist()  # [K]
    before, root = previous_tokens(block, mask_token)
    for _ in range(passes):
        logits = reference_logits(weights, head, block.hidden, [before, root, *tokens[:-1]])
        tokens = block.target_ids(logits.argmax(-1)).tolist()
    return tokens[:depth]


def sequential(weights: XPressWeights, head, block: Block, depth: int, mask_token: int) -> list[int]:
    """Token by token: slot k's token from refined logits given the tokens already chosen at
    slots < k (the decode Jacobi iteration converges to)."""
    depth = min(depth, block.size)
    before, root = previous_tokens(block, mask_token)
    chosen: list[int] = []
    K = block.size
    for k in range(depth):
        prev = [before, root, *chosen] + [root] * (K - 1 - len(chosen))  # slots past k are never read by slot k+1
        logits = reference_logits(weights, head, block.hidden, prev)
        chosen.append(int(block.target_ids(logits[k].argmax(-1).view(1))[0]))
    return chosen


class XPress:
    name = "xpress"
    exact = True

    def __init__(self, head: XPressHead, passes: int = DEFAULT_PASSES):
        self.head, self.passes = head, passes
        self.cost = RefinerCost(forwards=passes, per_node=False)  # one readout of the block's rows a pass
        self.mask_token = head.head.config.mask_token_id
        self.last_passes = 0  # passes the last refine ran (early stop at a fixed point)

    def refine(self, block: Block, tree: DraftTree, depth: int, nodes: int, greedy: bool) -> DraftTree:
        d = min(depth, nodes, block.size)
        if d < 1:
            return DraftTree.root_only(block.root)
        with torch.inference_mode():
            chain, self.last_passes = jacobi(self.head, block, d, self.passes, self.mask_token)
        return DraftTree(torch.tensor([block.root, *chain]), torch.arange(-1, d))


def parse(arg: str) -> tuple[str, int]:
    """`` | `P` | `PATH` | `PATH:P` -> (path or '', passes)."""
    path, passes = arg, DEFAULT_PASSES
    head, _, tail = arg.rpartition(":")
    if tail.strip().lstrip("-").isdigit():
        path, passes = head, int(tail)
    if not 0 <= passes <= MAX_PASSES:
        raise ConfigError(f"xpress:{arg}: the number of Jacobi passes must be 0..{MAX_PASSES}, got {passes}")
    return path, passes


def make(arg: str, head=None, folder=None) -> XPress:
    path, passes = parse(arg)
    if not path and folder is not None and (Path(folder) / FILE).is_file():
        path = str(Path(folder) / FILE)  # the one shipped beside the block head
    if not path:
        raise ConfigError("xpress needs its head: xpress:PATH[:P] (from `outrider train xpress`); "
                          "this block head has none beside it")
    if head is None:
        raise ConfigError("xpress refines a block head's hidden states: use it with --drafter dflash:...")
    weights = XPressWeights.load(path)
    weights = XPressWeights(**{k: v.to(head.device, head.dtype) for k, v in weights.tensors().items()})
    x = XPressHead(weights, head)
    bad = x.fits()
    if bad:
        raise ConfigError(f"xpress:{path} does not fit this block head ({bad}): train one for it")
    return XPress(x, passes)
