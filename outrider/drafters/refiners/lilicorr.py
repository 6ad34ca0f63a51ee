"""`--refiner lilicorr:PATH`: LiLiCorr, a lattice over the block scored with a learned pairwise correlator.

A block drafter's positions are drafted independently: position k's distribution does not know
which token position k-1 will hold, so the product of marginals favours pairs that never occur
together ("of of", half of one identifier glued to half of another). LiLiCorr builds a lattice of
each position's top-k tokens and scores a path through it by the marginals plus a learned pairwise
term between neighbours:

    score(t_1..t_d) = sum_k log q_k(t_k) + weight * sum_k C(t_{k-1}, t_k)      (t_0: the root)

C is the correlator: pointwise mutual information of adjacent tokens, log p(a, b) - log p(a) -
log p(b), estimated from the target's own regenerated text and kept for the pairs seen at least
`min_count` times (0 for the others), clipped to [-4, 4] (train/lilicorr.py fits it; a
`lilicorr.safetensors` file: `keys` [P] int64 = a * V + b sorted, `values` [P] float32, metadata
`weight`, `vocab`). A beam of the best prefixes at each depth walks the lattice; the best prefixes
of all depths are packed into the tree (a prefix scores the best path through it, so the kept set
is a tree), beside the best nodes of the tree it is given (half the budget).

Exact: it only proposes. Our reading of the issue's summary (the paper's own text was not found in
the indexes this project can search).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ...errors import ConfigError, ModelError
from ...spec.types import DraftTree
from ..block import Block
from .base import RefinerCost, build_tree, paths_of

FILE = "lilicorr.safetensors"
LATTICE = 4  # tokens per position


class Correlator:
    """C(a, b) for adjacent tokens a, b: sorted keys a * V + b with their values; 0 elsewhere."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, vocab: int, weight: float = 1.0):
        self.keys, self.values, self.vocab, self.weight = keys, values, vocab, weight

    def pair(self, prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """prev: [n] long, nxt: [m] long -> [n, m] float C(prev_i, next_j)."""
        want = (prev.unsqueeze(1) * self.vocab + nxt.unsqueeze(0)).reshape(-1)  # [n * m]
        if self.keys.numel() == 0:
            return torch.zeros(prev.numel(), nxt.numel())
        at = torch.searchsorted(self.keys, want).clamp(max=self.keys.numel() - 1)
        hit = self.keys[at] == want
        return torch.where(hit, self.values[at], torch.zeros(())).reshape(prev.numel(), nxt.numel())

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"keys": self.keys.contiguous(), "values": self.values.float().contiguous()}, folder / FILE,
                  metadata={"weight": json.dumps(self.weight), "vocab": str(self.vocab)})
        return folder / FILE

    @staticmethod
    def load(path: str | Path) -> "Correlator":
        path = Path(path)
        file = path / FILE if path.is_dir() else path
        try:
            with safe_open(file, "pt") as f:
                meta = f.metadata() or {}
                keys, values = f.get_tensor("keys"), f.get_tensor("values")
            vocab, weight = int(meta["vocab"]), float(json.loads(meta["weight"]))
        except FileNotFoundError:
            raise ModelError(f"{file} not found: fit a correlator with `outrider train lilicorr` first") from None
        except (SafetensorError, KeyError, ValueError, OSError) as err:
            raise ModelError(f"{file} is not a LiLiCorr correlator ({err}); fit it again with `outrider train lilicorr`") from None
        if keys.dtype != torch.int64 or keys.shape != values.shape or keys.dim() != 1:
            raise ModelError(f"{file}: keys [P] int64 and values [P] expected; fit it again")
        return Correlator(keys, values.float(), vocab, weight)


class LiLiCorr:
    name = "lilicorr"
    exact = True
    cost = RefinerCost(forwards=0, per_node=True)

    def __init__(self, correlator: Correlator):
        self.c = correlator

    def refine(self, block: Block, tree: DraftTree, depth: int, nodes: int, greedy: bool) -> DraftTree:
        depth = min(depth, block.size)
        if depth < 1:
            return tree
        top = block.logp[:depth].topk(min(LATTICE, block.logp.shape[-1]), dim=-1)
        values, ids = top.values, block.target_ids(top.indices)  # [depth, k]
        beam = [((), 0.0)]  # (path, score)
        scored = []
        width = max(1, nodes)
        for k in range(depth):
            prev = torch.tensor([p[-1] if p else block.root for p, _ in beam])  # [b]
            pair = self.c.pair(prev, ids[k]) * self.c.weight  # [b, k]
            base = torch.tensor([s for _, s in beam]).unsqueeze(1)  # [b, 1]
            total = base + values[k].unsqueeze(0) + pair  # [b, k]
            flat = total.reshape(-1)
            best = flat.topk(min(width, flat.numel())).indices.tolist()
            kk = ids.shape[1]
            beam = [(beam[i // kk][0] + (int(ids[k, i % kk]),), float(flat[i])) for i in best]
            scored.extend((list(p), float(torch.tensor(s).exp())) for p, s in beam)
        given = paths_of(tree)
        keep = build_tree(block.root, given, max(nodes // 2, 1), depth)
        return build_tree(block.root, paths_of(keep) + scored, nodes, depth)


def make(arg: str, head=None, folder=None) -> LiLiCorr:
    if not arg and folder is not None and (Path(folder) / FILE).is_file():
        arg = str(Path(folder) / FILE)  # the one shipped beside the block head
    if not arg:
        raise ConfigError("lilicorr needs its correlator: lilicorr:PATH (from `outrider train lilicorr`); "
                          "this block head has none beside it")
    c = Correlator.load(arg)
    if head is not None and c.vocab != head.config.vocab_size:
        raise ConfigError(f"lilicorr:{arg} was fitted for a vocabulary of {c.vocab} tokens, this target has "
                          f"{head.config.vocab_size}: fit one on this target's text")
    return LiLiCorr(c)
