"""`--drafter eagle3:PATH_OR_NAME`: an EAGLE-3 head (heads/eagle3.py) drafts from the target's own features.

PATH is a head folder (config.json + model.safetensors, heads/eagle3_format.py), in the EAGLE or
the speculators layout; NAME a head shipped for that target (heads/catalog.py). The head reads
three target layers; the drafter declares them as `needs_hidden` (in our tap convention, converted
from the head's), so the target's verify forward of each round returns them at no extra pass and
the speculator hands over each sequence's rows of the accepted path; the prompt's come from the
prefill forward.

The head's K/V follows the committed prefix. Head row p holds (feature of position p, token p+1):
with n committed tokens, rows 0..n-2 are the committed ones, built only from target features.
Between rounds the features of the newly committed positions wait in `pending` and are written
at the next proposal (one forward, causal), whose last row gives the first draft's distribution:

    start(prompt x_0..x_{n-1}, features f_0..f_{n-2})      pending = f_0..f_{n-2}, rows = 0
    propose: write rows 0..n-2 (tokens x_1..x_{n-1})        rows = n-1; row n-2 predicts x_n
             drafts: node i of the tree (depth d) is head row n-2+i at position n-2+d, fed the
             output hidden of its parent's row and its own token; written past the committed rows
    update(accepted path a nodes, features f_{n-1}..f_{n-1+a})  pending = those a+1 rows

Draft rows are never kept: the committed length is the rollback. Drafting by `--tree`:
chain (greedy: argmax; sampling: each draft drawn from q, the head's warped distribution over the
target vocabulary, kept for rejection sampling), static:B1,.. (top-b children) and dynamic:K,N
(EAGLE-2: expand the K best nodes by cumulative log-probability per depth, keep the N best),
the trees verified by the greedy or tree-walk verifier.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..heads.catalog import resolve_head
from ..heads.eagle3 import Eagle3Head
from ..heads.eagle3_format import load_eagle3, misfit, read_config
from ..kv import KVCache
from ..models.batch import pack
from ..sampling import SamplingParams, warp_probs
from ..spec.random import PositionalRandom
from ..spec.shapes import TreeShape
from ..spec.types import DraftTree, VerifyResult
from .base import Budget, ancestors_kept
from .capabilities import Capabilities, Drafts
from .registry import DrafterEntry, register

TREES = {
    "chain": Drafts("chain", gives_probs=True),  # sampled: each draft drawn from q, q kept
    "static": Drafts("tree"),  # top-b children: not draws
    "dynamic": Drafts("tree"),  # best nodes by cumulative log q: not draws
}


@dataclass
class _State:
    cache: KVCache
    params: SamplingParams
    rng: PositionalRandom  # the request's drafting streams
    pending: torch.Tensor  # [m, H] fused features of committed positions not yet written
    rows: int = 0  # committed head rows in the cache
    last_hidden: torch.Tensor | None = None  # [H] output hidden of row rows-1
    last_logits: torch.Tensor | None = None  # [Vd] its logits


class Eagle3Drafter:
    """Drafts with an EAGLE-3 head; `capabilities.needs_hidden` are this head's target layers."""

    def __init__(self, head: Eagle3Head, shape: TreeShape, taps: tuple[int, ...], name: str = "eagle3"):
        self.head = head
        self.shape = shape
        self.name = name
        self.capabilities = Capabilities(trees=TREES, needs_hidden=tuple(taps))
        self.vocab = head.config.vocab_size
        self._states: dict[int, _State] = {}

    # -- protocol -----------------------------------------------------------------------------
    def max_nodes(self, depth: int) -> int:
        return self.shape.max_drafts(depth)

    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None,
              hidden: torch.Tensor | None = None) -> None:
        """hidden: [len(prompt) - 1, 3, Ht] the prompt's features at the declared layers (the
        last prompt token is the first root: its features come with the first round); None
        for a one-token prompt."""
        params = params or SamplingParams()
        rows = 0 if hidden is None else hidden.shape[0]
        if rows != len(prompt) - 1:
            got = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"eagle3 start needs the prompt's features [{len(prompt) - 1}, 3, Ht], got {got}")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**63 - 1, ()))
        cache = self.head.new_cache(1, max(256, 2 * len(prompt)))
        pending = self.head.fuse(hidden) if rows else self.head.w.fc.new_zeros(0, self.head.config.hidden_size)
        self._states[seq_id] = _State(cache, params, PositionalRandom(seed).drafting(), pending)

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        """hidden: [1 + num_accepted, 3, Ht] the target's features of the root and accepted nodes."""
        if hidden is None or hidden.shape[0] != 1 + result.num_accepted:
            got = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"eagle3 update needs the accepted path's features [{1 + result.num_accepted}, 3, Ht], "
                             f"got {got}")
        st = self._states[seq_id]
        st.pending = torch.cat((st.pending, self.head.fuse(hidden)))

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        self._states.pop(seq_id, None)

    def propose(self, seq_id: int, tokens: list[int], budget: Budget) -> DraftTree:
        st = self._states[seq_id]
        depth = self.shape.max_depth(budget.depth)
        st.cache.ensure_capacity(len(tokens) + self.shape.fed_nodes(depth) + 1)
        self._catch_up(st, tokens)
        if st.rows == 0 or depth < 1 or budget.nodes < 1:  # a one-token prompt: no feature yet
            return DraftTree.root_only(tokens[-1])
        if self.shape.is_chain:
            return self._chain(st, tokens, min(depth, budget.nodes))
        return self._tree(st, tokens[-1], depth, budget.nodes)

    # -- the head's forward -------------------------------------------------------------------
    def _catch_up(self, st: _State, tokens: list[int]) -> None:
        """Write the committed rows whose features arrived: row p gets token p + 1."""
        m = st.pending.shape[0]
        if st.rows + m != len(tokens) - 1:
            raise ValueError(f"eagle3 drafter out of step: {st.rows} rows + {m} pending features for "
                             f"{len(tokens)} committed tokens (expected {len(tokens) - 1} rows)")
        if m == 0:
            return
        batch = pack([0], [st.rows], [torch.tensor(tokens[st.rows + 1:])], scratch_row=st.cache.scratch_row,
                     device=self.head.device)
        logits, hidden = self.head.forward(batch, st.cache, st.pending.unsqueeze(0))
        st.rows += m
        st.cache.set_length(0, st.rows)
        st.pending = st.pending[:0]
        st.last_hidden, st.last_logits = hidden[0, -1], logits[0, -1]

    def _feed(self, st: _State, tokens: list[int], parents: list[int], first: int,
              inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft nodes first.. of the tree `parents` (node 0: the last committed row), fed
        `inputs` [n, H] (their parents' output hidden). Returns (logits [n, Vd], hidden [n, H])."""
        batch = pack([0], [st.rows - 1], [torch.tensor(tokens)], [torch.tensor(parents)],
                     scratch_row=st.cache.scratch_row, device=self.head.device, first_nodes=[first])
        logits, hidden = self.head.forward(batch, st.cache, inputs.unsqueeze(0))
        return logits[0], hidden[0]

    # -- drafting -----------------------------------------------------------------------------
    def _chain(self, st: _State, tokens: list[int], k: int) -> DraftTree:
        sampling = not st.params.greedy
        rng = st.rng.at(len(tokens))  # offset d - 1: the token at depth d
        logits, hidden = st.last_logits, st.last_hidden
        drafts, qs = [], []
        for d in range(1, k + 1):
            full = self.head.target_logits(logits)  # [V]
            if sampling:
                q = warp_probs(full, st.params)
                token = rng.categorical(q, offset=d - 1)
                qs.append(q)
            else:
                token = int(full.argmax())
            drafts.append(token)
            if d < k:
                out_logits, out_hidden = self._feed(st, [token], list(range(-1, d)), d, hidden.unsqueeze(0))
                logits, hidden = out_logits[0], out_hidden[0]
        probs = None
        if sampling:
            probs = torch.zeros(k + 1, self.vocab)
            probs[:k] = torch.stack(qs).cpu()
        return DraftTree.chain(tokens[-1], drafts, probs)

    def _tree(self, st: _State, root: int, depth: int, max_nodes: int) -> DraftTree:
        """Static (top-b of every node) or dynamic (EAGLE-2) trees, grown one depth per forward.

        cand[i] = (target token, parent cand id, cumulative log q); cand 0 is the root. Expanded
        candidates are fed to the head as a tree of their own (`fed`, node 0 the root's row)."""
        dynamic = self.shape.kind == "dynamic"
        if dynamic:
            max_nodes = min(max_nodes, self.shape.max_nodes)
        cand: list[tuple[int, int, float]] = [(root, -1, 0.0)]
        fed_of = {0: 0}  # cand id -> node in the fed tree
        fed_tokens, fed_parents = [root], [-1]
        frontier = [0]
        logits, hidden = st.last_logits.unsqueeze(0), st.last_hidden.unsqueeze(0)  # [f, Vd], [f, H]
        for d in range(depth):
            width = self.shape.top_k if dynamic else self.shape.branching[d]
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = logp.topk(min(width, logp.shape[-1]), dim=-1)
            ids = self.head.target_ids(top.indices).tolist()
            children = []
            for row, cid in enumerate(frontier):
                for lp, token in zip(top.values[row].tolist(), ids[row]):
                    if not dynamic and len(cand) - 1 >= max_nodes:
                        break
                    cand.append((token, cid, cand[cid][2] + lp))
                    children.append(len(cand) - 1)
            expand = heapq.nlargest(self.shape.top_k, children, key=lambda c: cand[c][2]) if dynamic else children
            if d == depth - 1 or not expand:
                break
            first = len(fed_tokens)
            for cid in expand:
                fed_of[cid] = len(fed_tokens)
                fed_tokens.append(cand[cid][0])
                fed_parents.append(fed_of[cand[cid][1]])
            rows = {cid: i for i, cid in enumerate(frontier)}
            inputs = hidden[[rows[cand[cid][1]] for cid in expand]]  # [e, H]: each parent's output
            logits, hidden = self._feed(st, fed_tokens[first:], fed_parents, first, inputs)
            frontier = expand
        chosen = range(1, len(cand))
        if dynamic:
            best = set(heapq.nlargest(max_nodes, chosen, key=lambda c: cand[c][2]))
            chosen = [c for c in chosen if c in best and ancestors_kept(cand, c, best)]
        index, tokens, parents = {0: 0}, [root], [-1]
        for c in chosen:  # cand ids grow with depth: parents come first
            index[c] = len(tokens)
            tokens.append(cand[c][0])
            parents.append(index[cand[c][1]])
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


# -- registration ---------------------------------------------------------------------------------
def parse_argument(text: str) -> str:
    """A head folder, or a shipped head by its target's catalog name (heads/catalog.py)."""
    if not text:
        raise ConfigError("eagle3:PATH needs the folder of an EAGLE-3 head (config.json + model.safetensors) "
                          "or the name of a shipped head")
    return str(resolve_head(text))


def check_fits(path: str, target_config, target_path: Path) -> str | None:
    return misfit(read_config(path), target_config, has_embed=True, has_lm_head=True)  # tensors: at load


def build(path: str, shape: TreeShape, target, target_path: Path) -> Eagle3Drafter:
    head = load_eagle3(path, target)
    return Eagle3Drafter(head, shape, head.config.taps(target.config.num_layers), name=f"eagle3:{path}")


register(DrafterEntry("eagle3", "eagle3:PATH_OR_NAME", Capabilities(trees=TREES), build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
