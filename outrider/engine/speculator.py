"""A speculation configuration: drafter + tree shape + controller + verifier, checked up front.

`SpecOptions` parses the user's strings (`--drafter`, `--tree`, `--controller`, `--verifier`)
without loading anything, so a bad string or an unsupported combination is refused at once with
its reason; `check_sampling(params)` refuses what depends on the sampling parameters too (k
sampled siblings when greedy, a named verifier that does not fit), before loading where the
parameters are known up front (the CLI) and at each request otherwise.
`Speculator.build` then asks the drafter's registry entry (drafters/registry.py) whether it fits
the target (tokenizer, layer count), builds it, and chooses the verifier from the capabilities
the drafter declares (drafters/capabilities.py); nothing here knows a drafter by its name.

    drafters    the registered ones: ngram | suffix | draft-model:NAME | early-exit:K | ...
    trees       chain | static:B1,B2,... | sampled:B1,B2,... | dynamic:K,N   (a model drafter's tree)
    controllers fixed:N | adaptive[:MAX] | cost[:MAX] | the registered ones (libraspec[:MAX], ...)
    verifiers   None: the best exact one (spec/verifiers.choose_verifier) | a registered name

A request with a seed gets the walk (unless a verifier is named): its text is plain sampling's
with that seed whatever the controller drafts; a drafter that declares `couples` then draws its
sampled chain with the walk's own uniforms (`start`; drafters/capabilities.py).

A controller with a `trim` method gets every proposal before it is verified and returns the trees
to verify, each a subtree of the drafter's (control/libraspec.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..control.controllers import Controller, parse_controller
from ..drafters.base import Budget, Drafter, propose_batch, update_batch
from ..drafters.capabilities import Drafts
from ..drafters.registry import DrafterEntry, builders_of, declared, parse_drafter
from ..errors import ConfigError
from ..models.decoder import Decoder
from ..sampling import SamplingParams
from ..spec.shapes import TreeShape, parse_shape
from ..spec.types import DraftTree, VerifyResult
from ..spec.verifiers import VERIFIERS, choose_verifier, is_walk

MAX_TREE_NODES = 256  # draft nodes per sequence per round, unless the user raises it


class Default(str):
    """A `tree` or `controller` the user did not give: its default value, marked so that a message
    about it says "the default --controller fixed:4" rather than name an option never passed."""


def _named(flag: str, value: str) -> str:
    return f"the default {flag} {value}" if isinstance(value, Default) else f"{flag} {value}"


@dataclass(frozen=True)
class SpecOptions:
    drafter: str  # e.g. "ngram", "draft-model:qwen2.5-coder-0.5b-instruct", "early-exit:8"
    tree: str = Default("chain")
    controller: str = Default("fixed:4")
    max_tree_nodes: int = MAX_TREE_NODES  # refuse shapes whose rounds could draft or feed more
    verifier: str | None = None  # a verifier by name (spec/verifiers.py); None: the best exact one

    @property
    def kind(self) -> str:
        """The drafter's registered name (before the colon)."""
        return self.drafter.partition(":")[0]

    @property
    def argument(self) -> str:
        """The drafter's argument as written (after the colon)."""
        return self.drafter.partition(":")[2]

    @property
    def shape(self) -> TreeShape:
        return parse_shape(self.tree)

    def entry(self) -> tuple[DrafterEntry, object]:
        """The drafter's registry entry and its parsed argument; ConfigError when unknown or bad."""
        return parse_drafter(self.drafter)

    def check(self) -> "SpecOptions":
        """Refuse a bad string or combination before anything is loaded."""
        entry, _ = self.entry()
        shape = self.shape
        if not entry.capabilities.builds(shape.kind):
            builds = " or ".join(entry.capabilities.trees)
            others = ", ".join(builders_of(shape.kind))
            raise ConfigError(f"--tree {self.tree} applies to model drafters ({others}); the {entry.name} "
                              f"drafter takes only --tree {builds}")
        if not (isinstance(self.max_tree_nodes, int) and self.max_tree_nodes >= 1):
            raise ConfigError(f"max_tree_nodes must be a positive integer, got {self.max_tree_nodes!r}")
        depth = parse_controller(self.controller, profile_factory=lambda: None).max_depth
        self.check_nodes(max(shape.max_drafts(depth), shape.fed_nodes(depth)), depth)
        if self.verifier is not None:
            if self.verifier not in VERIFIERS:
                raise ConfigError(f"--verifier {self.verifier!r}: no such verifier; known: {', '.join(VERIFIERS)}")
            tree_kind = entry.capabilities.drafts(shape.kind).tree_kind
            if tree_kind not in VERIFIERS[self.verifier].kinds:
                raise ConfigError(f"--verifier {self.verifier} verifies only a {' or a '.join(VERIFIERS[self.verifier].kinds)}; "
                                  f"{_named('--tree', self.tree)} of the {entry.name} drafter gives a {tree_kind}")
        return self

    def check_sampling(self, params: SamplingParams, drafts: Drafts | None = None) -> None:
        """Refuse, with a one-line ConfigError, what these sampling parameters make impossible:
        k sampled siblings when greedy (there is nothing to sample), or a `--verifier` that does
        not fit the drafts (`drafts`: what the built drafter declares; default: its registry entry)."""
        shape = self.shape
        if shape.kind == "sampled" and params.greedy:
            static = "static:" + ",".join(map(str, shape.branching))
            raise ConfigError(f"--tree {self.tree} draws siblings from q, which needs temperature > 0; "
                              f"greedy decoding drafts the same widths with --tree {static}")
        if self.verifier is not None:
            self.verifier_choice(params, drafts)

    def verifier_choice(self, params: SamplingParams, drafts: Drafts | None = None, seeded: bool = False):
        """The verifier for these parameters: the named one, or the best exact one (the walk for a
        request that gave a seed: `seeded`); ConfigError if none fits."""
        drafts = drafts or self.entry()[0].capabilities.drafts(self.shape.kind)
        choice = choose_verifier(drafts.tree_kind, drafts.gives_probs, params,
                                 without_replacement=drafts.without_replacement, name=self.verifier, seeded=seeded)
        if not choice.ok:
            raise ConfigError(f"{self.label()}: {choice.reason}")
        return choice

    def models_needed(self) -> tuple[str, ...]:
        """Models (catalog names or folders) the drafter loads, to pull before checking fits."""
        entry, argument = self.entry()
        return tuple(entry.models_needed(argument))

    def misfit(self, target_config, target_path: Path) -> str | None:
        """Why the drafter cannot serve this target (layers, tokenizer), or None."""
        entry, argument = self.entry()
        return entry.check_fits(argument, target_config, Path(target_path))

    def check_nodes(self, nodes: int, depth: int) -> None:
        """Refuse a configuration whose rounds may hold more than `max_tree_nodes` draft nodes."""
        if nodes > self.max_tree_nodes:
            raise ConfigError(
                f"{_named('--tree', self.tree)} with {_named('--controller', self.controller)} (depth up to "
                f"{depth}) makes up to {nodes} draft nodes per round, over the limit of {self.max_tree_nodes}; use a "
                f"smaller tree or a lower depth, or raise the limit with --max-tree-nodes")

    def label(self) -> str:
        verifier = f" --verifier {self.verifier}" if self.verifier is not None else ""
        return f"{self.drafter} {self.tree} {self.controller}{verifier}"


class Speculator:
    """Drives one drafter and one controller for the generation loop (see engine/generate.py).

    What the drafts are (chain or tree, drawn from q or not, siblings with or without
    replacement) and which hidden states the drafter reads come from the capabilities declared
    for `options.kind` (drafters/registry.py `declared`), for the tree kind of `shape`."""

    def __init__(self, options: SpecOptions, drafter: Drafter, controller: Controller, shape: TreeShape):
        self.options = options
        self.drafter = drafter
        self.controller = controller
        self.shape = shape
        capabilities = declared(options.kind, drafter)
        self.drafts: Drafts = capabilities.drafts(shape.kind)
        self.tree_kind = self.drafts.tree_kind
        self.hidden_layers: tuple[int, ...] = capabilities.needs_hidden  # tapped in prefill and verify
        self.reads_target_cache = capabilities.reads_target_cache  # early exit: drafts over the target's K/V
        self.attention = capabilities.needs_attention  # the verify forward's attention scores (sparsespec)
        # a sampled chain drawn with the walk's own uniforms where the walk verifies it (start)
        self.couples = capabilities.couples and self.drafts.gives_probs and self.tree_kind == "chain"
        # sequences not yet proposed for: a head drafter writes a prompt's rows at its first
        # proposal (eagle3.py, dflash.py), a one-off the controller's draft times leave out
        self._fresh: set[int] = set()
        options.check_nodes(self.max_tree_size - 1, controller.max_depth)

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def build(options: SpecOptions, target: Decoder, target_path: Path, log=None) -> "Speculator":
        options.check()
        entry, argument = options.entry()
        shape = options.shape
        reason = entry.check_fits(argument, target.config, Path(target_path))
        if reason:
            raise ConfigError(f"--drafter {options.drafter} does not fit this target: {reason}")
        drafter = entry.build(argument, shape, target, Path(target_path))

        def profile():
            from ..control.profile import load_or_measure
            from ..config import cache_dir

            return load_or_measure(target_path, target, cache_dir() / "profiles", log)

        def batch_profile(max_batch: int):
            from ..control.batch_cost import load_or_measure_batch
            from ..config import cache_dir

            return load_or_measure_batch(target_path, target, cache_dir() / "profiles", max_batch, log)

        controller = parse_controller(options.controller, profile_factory=profile,
                                      batch_profile_factory=batch_profile)
        return Speculator(options, drafter, controller, shape)

    def verifier_for(self, params: SamplingParams, seeded: bool = False):
        """The verifier of a request sampled with `params`; `seeded`: it gave a seed of its own,
        so it gets the walk unless a verifier is named (the same seed, the same text)."""
        self.options.check_sampling(params, self.drafts)
        return self.options.verifier_choice(params, self.drafts, seeded).verifier

    @property
    def max_tree_size(self) -> int:
        return 1 + self.nodes_for(self.controller.max_depth)

    def nodes_for(self, depth: int) -> int:
        return self.drafter.max_nodes(depth)

    # -- the loop's hooks ---------------------------------------------------------------------
    def start(self, seq, prompt_hidden: list[dict[int, torch.Tensor]] | None = None) -> None:
        """A sequence whose prompt is in the cache. prompt_hidden: the prefill forward's taps,
        chunk by chunk (layer -> [n, E]), covering every prompt token but the last; a drafter
        that declares needs_hidden gets them as `hidden` [len(prompt) - 1, layers, E] (None for
        a one-token prompt). Where the sequence's verifier is a walk and the drafter samples a
        chain it can couple, the drafter draws it with the walk's own uniforms (`coupled`)."""
        self.controller.start(seq.seq_id)
        self._fresh.add(seq.seq_id)
        extra = {}  # what the drafter declared it reads
        if self.couples and not seq.params.greedy and is_walk(seq.verify):
            extra["coupled"] = True
        if self.reads_target_cache:
            extra["target_slot"] = seq.slot
        if self.hidden_layers:
            chunks = [self._stack(h) for h in prompt_hidden or ()]
            extra["hidden"] = torch.cat(chunks) if chunks else None  # None: a one-token prompt
        self.drafter.start(seq.seq_id, list(seq.tokens), seq.params, **extra)

    def prepare(self, cache, max_batch: int) -> None:
        """An engine with the target's K/V `cache` and up to `max_batch` sequences a round is
        about to run: a drafter that reads the target's cache gets it, and the controller
        measures what it needs for such batches now rather than in the middle of serving."""
        if self.reads_target_cache:
            self.drafter.attach_target_cache(cache)
        if max_batch > 1:
            self.controller.prepare(max_batch)

    def propose_batch(self, seqs, free_rows: list[int], batch_size: int | None = None
                      ) -> tuple[list[DraftTree], dict[int, Exception]]:
        """A tree per sequence, the drafter called once for all that draft this round (a model
        drafter: one forward per draft depth for the batch). free_rows[b]: K/V rows sequence b
        may still write (the root's included); batch_size: sequences in this round's verify
        forward, drafting or not (default len(seqs)); a sequence whose budget is 0 gets the root
        alone. When the drafter raises, each sequence is asked alone, so the failures returned
        (index -> exception; those get the root alone) are the sequences whose proposal raises."""
        trees: list[DraftTree | None] = [None] * len(seqs)
        todo: list[tuple[int, Budget]] = []
        budgets = self.controller.budgets([seq.seq_id for seq in seqs], batch_size or len(seqs), self.nodes_for)
        for i, (seq, free, budget) in enumerate(zip(seqs, free_rows, budgets)):
            nodes = min(self.nodes_for(budget.depth), free - 1)
            if budget.depth < 1 or nodes < 1:
                trees[i] = DraftTree.root_only(seq.tokens[-1])
            else:
                todo.append((i, replace(budget, nodes=nodes)))
        failed: dict[int, Exception] = {}
        if todo:
            start = time.perf_counter()
            try:
                drafted = propose_batch(self.drafter, [seqs[i].seq_id for i, _ in todo],
                                        [seqs[i].tokens for i, _ in todo], [b for _, b in todo])
            except Exception:
                drafted = []
                for i, budget in todo:
                    try:
                        drafted += propose_batch(self.drafter, [seqs[i].seq_id], [seqs[i].tokens], [budget])
                    except Exception as err:  # noqa: PERF203  (a fault of this sequence's drafter state)
                        failed[i] = err
                        drafted.append(DraftTree.root_only(seqs[i].tokens[-1]))
            # one sequence's share of the proposal (the controller weighs it against one
            # sequence's verify cost), and its depth; not where a sequence had its first (its
            # prompt's rows written: 20 ms where a round's drafts take 1-3, SmolLM2's head)
            depth = max(b.depth for _, b in todo)
            first = [seqs[i].seq_id for i, _ in todo if seqs[i].seq_id in self._fresh]
            if not first:
                self.controller.observe_draft_time((time.perf_counter() - start) / len(todo), depth)
            self._fresh.difference_update(first)
            trim = getattr(self.controller, "trim", None)  # a controller may keep fewer drafts to verify
            if trim is not None:
                drafted = trim([seqs[i].seq_id for i, _ in todo], drafted, batch_size or len(seqs))
            for (i, _), tree in zip(todo, drafted):
                trees[i] = tree
        return trees, failed

    def observe_verify_time(self, batch_size: int, width: int, seconds: float) -> None:
        """The round's verify (forward and verifiers) over `batch_size` sequences padded to `width`."""
        self.controller.observe_verify_time(batch_size, width, seconds)

    def update_batch(self, seqs, trees: list[DraftTree], results: list[VerifyResult],
                     hidden: list[dict[int, torch.Tensor]], attention: list | None = None) -> dict[int, Exception]:
        """trees[b]: the tree verified for sequence b (the drafter's, or what a grammar made of it:
        engine/loop.py), results[b] its result; hidden[b]: the taps on the accepted path (layer ->
        [1 + num_accepted, E], engine/round.py), given to the drafter stacked in its declared
        order, or None; attention[b]: the verify forward's scores, for a drafter that declares
        needs_attention (observe_attention, before its update). Returns
        the sequences whose drafter state is broken (index -> exception): for a drafter that
        follows one sequence at a time, those whose update raised; for one with a batched
        `update_batch` that raised, every sequence of the call (what it did is unknown)."""
        for seq, tree, result in zip(seqs, trees, results):
            self.controller.observe(seq.seq_id, tree, result)
        stacked = [self._stack(h) if self.hidden_layers else None for h in hidden]
        ids = [seq.seq_id for seq in seqs]
        if self.attention:
            try:
                self.drafter.observe_attention(ids, attention if attention is not None else [None] * len(ids))
            except Exception as err:
                return {i: err for i in range(len(seqs))}
        if getattr(self.drafter, "update_batch", None) is not None:
            try:
                update_batch(self.drafter, ids, results, stacked)
            except Exception as err:
                return {i: err for i in range(len(seqs))}
            return {}
        failed = {}
        for i, (seq_id, result, h) in enumerate(zip(ids, results, stacked)):
            try:
                self.drafter.update(seq_id, result, h)
            except Exception as err:  # noqa: PERF203
                failed[i] = err
        return failed

    def _stack(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """layer -> [n, E] -> [n, len(hidden_layers), E], in the declared order."""
        missing = [layer for layer in self.hidden_layers if layer not in hidden]
        if missing:
            raise ValueError(f"the forward did not tap layer(s) {missing} that drafter {self.options.kind!r} "
                             f"declares; pass hidden_layers={self.hidden_layers}")
        return torch.stack([hidden[layer] for layer in self.hidden_layers], dim=1)

    def finish(self, seq) -> None:
        self._fresh.discard(seq.seq_id)
        self.controller.finish(seq.seq_id)
        self.drafter.finish(seq.seq_id, list(seq.tokens))
