"""`--refiner dartree:PATH`: DARTree, a small autoregressive correction head over the block, grown as a tree.

A block drafter drafts position k without knowing the token its tree places at k-1. DARTree adds a
small head that puts that dependence back: for a node at depth k-1 holding token t, its children
come from the block's hidden state of slot k corrected by t,

    h'_k = h_k + W2 silu(W1 cat(rms(h_k), rms(embed(t))))      [H] ; W1 [C, 2H], W2 [H, C]
    logits = lm_head(norm(h'_k))                               the block head's own norm and output head

Depth 1 takes the block's own slot-1 distribution (the block saw the root itself). The tree grows
one depth per forward of the correction head over all the frontier's nodes at once (batched by
depth), best-first as EAGLE-2 does: the `TOP` frontier nodes of highest cumulative log-probability
are expanded into their `TOP` best children each, and the `nodes` best of all are kept; beside the
best nodes of the tree it is given (half the budget). Trained by `outrider train dartree` on the
frozen block head's hidden states with teacher forcing (train/dartree.py); the weights are
`dartree.safetensors` (`w1`, `w2`, `norm_h`, `norm_e`).

Exact: it only proposes. Our reading of the issue's summary (the paper's own text was not found in
the indexes this project can search).
"""

from __future__ import annotations

import heapq
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ...errors import ConfigError, ModelError
from ...models.layers import embedding, linear, rms_norm
from ...spec.types import DraftTree
from ..block import Block
from .base import RefinerCost, build_tree, paths_of

FILE = "dartree.safetensors"
TOP = 4


class CorrectionHead:
    """The correction MLP; `head` the block head (DFlashHead) whose norm, embedding and lm_head it uses."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, norm_h: torch.Tensor, norm_e: torch.Tensor, head):
        self.w1, self.w2, self.norm_h, self.norm_e, self.head = w1, w2, norm_h, norm_e, head

    def hidden(self, h: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """h: [n, H] block hidden states, parents: [n] long parent tokens -> corrected [n, H]."""
        eps = self.head.config.rms_norm_eps
        e = embedding(parents.unsqueeze(0).to(h.device), self.head.w.embed)[0].to(h.dtype)  # [n, H]
        x = torch.cat((rms_norm(h, self.norm_h, eps), rms_norm(e, self.norm_e, eps)), dim=-1)  # [n, 2H]
        return h + linear(F.silu(linear(x, self.w1)), self.w2)

    def logits(self, h: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """-> [n, Vd] float32 draft logits."""
        w = self.head.w
        return linear(rms_norm(self.hidden(h, parents), w.norm, self.head.config.rms_norm_eps), w.lm_head).float()

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: getattr(self, k).detach().contiguous() for k in ("w1", "w2", "norm_h", "norm_e")}, folder / FILE)
        return folder / FILE

    @staticmethod
    def load(path: str | Path, head) -> "CorrectionHead":
        path = Path(path)
        file = path / FILE if path.is_dir() else path
        try:
            t = load_file(file)
        except FileNotFoundError:
            raise ModelError(f"{file} not found: train a DARTree head with `outrider train dartree` first") from None
        except (SafetensorError, OSError) as err:
            raise ModelError(f"{file} is not a DARTree head ({err}); train it again") from None
        H = head.config.hidden_size
        missing = [k for k in ("w1", "w2", "norm_h", "norm_e") if k not in t]
        if missing or t.get("w1", torch.empty(0, 0)).shape[-1] != 2 * H or t["w2"].shape[0] != H:
            raise ModelError(f"{file} does not fit this block head (hidden size {H}"
                             f"{', missing ' + ', '.join(missing) if missing else ''}): train one for it")
        dev, dt = head.device, head.dtype
        return CorrectionHead(*(t[k].to(dev, dt) for k in ("w1", "w2", "norm_h", "norm_e")), head)


class DARTree:
    name = "dartree"
    exact = True
    cost = RefinerCost(forwards=1, per_node=True)  # one small forward per depth

    def __init__(self, correction: CorrectionHead):
        self.c = correction

    def refine(self, block: Block, tree: DraftTree, depth: int, nodes: int, greedy: bool) -> DraftTree:
        depth = min(depth, block.size)
        if depth < 1:
            return tree
        cand = [(block.root, -1, 0.0)]  # (token, parent cand, cumulative log q)
        frontier = [0]
        logp = torch.log_softmax(block.logits[:1].float(), -1)  # [1, Vd]: slot 1 saw the root
        for d in range(depth):
            top = logp.topk(min(TOP, logp.shape[-1]), dim=-1)
            ids = block.target_ids(top.indices).tolist()
            children = []
            for row, cid in enumerate(frontier):
                for lp, token in zip(top.values[row].tolist(), ids[row]):
                    cand.append((token, cid, cand[cid][2] + lp))
                    children.append(len(cand) - 1)
            frontier = heapq.nlargest(TOP, children, key=lambda c: cand[c][2])
            if d + 1 == depth:
                break
            h = block.hidden[d + 2].unsqueeze(0).expand(len(frontier), -1)  # slot d+2 of the block
            parents = torch.tensor([cand[c][0] for c in frontier])
            logp = torch.log_softmax(self.c.logits(h, parents), -1)  # [f, Vd]: one forward per depth
        scored = []
        for c in range(1, len(cand)):
            path, j = [], c
            while j > 0:
                path.append(cand[j][0])
                j = cand[j][1]
            scored.append((path[::-1], math.exp(cand[c][2])))
        keep = build_tree(block.root, paths_of(tree), max(nodes // 2, 1), depth)
        return build_tree(block.root, paths_of(keep) + scored, nodes, depth)


def make(arg: str, head=None, folder=None) -> DARTree:
    if not arg and folder is not None and (Path(folder) / FILE).is_file():
        arg = str(Path(folder) / FILE)  # the one shipped beside the block head
    if not arg:
        raise ConfigError("dartree needs its correction head: dartree:PATH (from `outrider train dartree`); "
                          "this block head has none beside it")
    if head is None:
        raise ConfigError("dartree refines a block head's hidden states: use it with --drafter dflash:...")
    return DARTree(CorrectionHead.load(arg, head))
