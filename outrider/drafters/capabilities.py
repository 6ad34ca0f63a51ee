"""What a drafter declares about its drafts, so that nothing else needs to know which drafter it is.

From these facts the speculator chooses the exact verifier (spec/verifiers.py), the options
refuse a `--tree` the drafter cannot build, and the target's forward taps the hidden states of
the layers the drafter reads. The built-in drafters declare:

    drafter                --tree    the verifier gets   gives_probs
    ngram                  chain     a chain             no
    suffix                 chain     a tree              no (its trees come from counts)
    draft-model, early-exit chain    a chain             yes: a sampled chain draws each draft from q
                           static    a tree              no: the top-b children of q
                           sampled   a tree              yes: b children drawn from q without replacement
                           dynamic   a tree              no: the best nodes by cumulative log q
    eagle3                 as draft-model (chain, static, sampled, dynamic)
    oilbird, ooo, toolspec chain     a tree              no (suffix trees, merged with semantic
                                                             neighbours, a sidecar's hint, a schema)
    sparsespec             as draft-model (the target drafting for itself)
    dflash                 chain     a chain             yes: each position's draft drawn from its q
                           ddtree    a tree              no: the best prefixes of the marginals
    dblast                 chain     a chain             yes: drafts by component, each row the posterior-
                                                             marginalised q(. | drafts so far)
    hybrid:[K,]DRAFTER     DRAFTER's a tree              no (suffix trees or DRAFTER's drafts, q dropped)

needs_hidden (eagle3, dflash, dblast, oilbird; sparsespec where the native layer does not run) and
needs_attention (sparsespec) ask the verify forward for hidden states or attention scores too.

How `gives_probs` depends on the shape and on sampling: it is declared per `--tree` kind, and it
states what the drafts are *when sampling* (temperature > 0): every child drawn at random from
`draft_probs` of its parent. At temperature 0 every drafter drafts deterministically and the
greedy verifiers need no q, so nothing more is declared for greedy decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..spec.types import TREE_KINDS


@dataclass(frozen=True)
class Drafts:
    """What a drafter proposes for one `--tree` kind.

    tree_kind: "chain" when every proposal is a chain (parents -1, 0, ..., k-1), else "tree";
    gives_probs: when sampling, each child is a random draw from `draft_probs` of its parent,
        and the tree carries those probabilities (a top-k child is not a draw: say False);
    without_replacement: with gives_probs on a tree, siblings are drawn without replacement.
    """

    tree_kind: str
    gives_probs: bool = False
    without_replacement: bool = False

    def __post_init__(self):
        if self.tree_kind not in TREE_KINDS:
            raise ValueError(f"tree_kind must be one of {TREE_KINDS}, got {self.tree_kind!r}")
        if self.without_replacement and not self.gives_probs:
            raise ValueError("without_replacement describes sampled siblings: it needs gives_probs=True")


@dataclass(frozen=True)
class Capabilities:
    """Everything a drafter declares.

    trees: the `--tree` kinds it can build ("chain", "static", "sampled", "dynamic"), each with the drafts
        it proposes for that kind;
    needs_hidden: the target layers whose hidden states (the output of layer i) it reads after
        each round; () for drafters that read only tokens;
    reads_target_cache: it drafts with the target's own first layers over the target's own K/V
        cache (early exit): the engine hands it that cache (`attach_target_cache`) and each
        sequence's slot (`start(..., target_slot=)`); it writes only rows past the committed
        prefix, which the verify forward overwrites.
    couples: its sampled chain can be drawn with the verifier's own token uniforms: started with
        `start(..., coupled=True)`, it draws its draft at absolute position t as
        `categorical(q_t, u_t)`, u_t the uniform of (seed, t, TOKEN) that the walk's committed
        token `categorical(p_t, u_t)` uses (spec/random.py). The engine asks for it only where the
        verifier is a walk (a seeded request: spec/verifiers.py), whose committed tokens never
        depend on the drafts, so it stays exact and accepts a draft whenever p_t and q_t put u_t
        in the same token (every time when p_t == q_t). Without it the chain draws from the
        drafter's own streams, independent of the verifier's, as rejection sampling needs.
    needs_attention: it reads the verify forward's attention scores (ForwardOutput.attention: per
        layer, K/V head and key, the weights the sequence's verified rows gave it): the engine asks
        the forward for them and hands each sequence's [layers, G, kv_len], or None where the
        forward cannot give them (not the native layer), to `observe_attention(seq_ids, scores)`
        before the round's update (SparseSpec-L).
    catches_up: its state follows from the committed tokens alone, and a proposal brings it level
        with the `tokens` it is given (drafters/base.py `catch_up`): a round in which it proposed
        nothing for a sequence (the controller backed off) is not followed by an `update` for it,
        so that such a round costs what plain decoding does; `finish` still gets every token.
    """

    trees: Mapping[str, Drafts]
    needs_hidden: tuple[int, ...] = field(default=())
    reads_target_cache: bool = False
    needs_attention: bool = False
    couples: bool = False
    catches_up: bool = False

    def __post_init__(self):
        if not self.trees:
            raise ValueError("a drafter must build at least one --tree kind (e.g. {'chain': Drafts('chain')})")
        if any(not isinstance(i, int) or i < 0 for i in self.needs_hidden):
            raise ValueError(f"needs_hidden must hold layer indices >= 0, got {self.needs_hidden!r}")

    def builds(self, shape_kind: str) -> bool:
        return shape_kind in self.trees

    def drafts(self, shape_kind: str) -> Drafts:
        """The drafts for `--tree` of this kind; ValueError when the drafter does not build it
        (options refuse that earlier, with a ConfigError: engine/speculator.py)."""
        if shape_kind not in self.trees:
            raise ValueError(f"this drafter builds only --tree {' or '.join(self.trees)}, not {shape_kind}")
        return self.trees[shape_kind]
