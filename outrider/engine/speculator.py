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

The speculator holds the drafter and the controller and calls them around the rounds (`prepare`
once per engine, `start` and `finish` per sequence); a round calls them itself (engine/round.py,
engine/drafting.py), through the hooks their protocols declare (drafters/base.py,
control/base.py), which the speculator checks it has when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..control import base as control_base
from ..control.controllers import Controller, parse_controller
from ..drafters.base import Drafter, missing_hooks
from ..drafters.capabilities import Drafts
from ..drafters.registry import DrafterEntry, builders_of, declared, parse_drafter
from ..errors import ConfigError
from ..models.decoder import Decoder
from ..sampling import SamplingParams
from ..spec.shapes import TreeShape, parse_shape
from ..spec.verifiers import PARAMETERIZED, VERIFIERS, choose_verifier, is_walk, verifier_entry

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
        controller = parse_controller(self.controller, profile_factory=lambda: None)
        if getattr(controller, "chains_only", False) and shape.kind != "chain":
            raise ConfigError(f"{_named('--controller', self.controller)} stops chains early and would draft every "
                              f"{_named('--tree', self.tree)} round to its full depth: use --tree chain, or "
                              f"--controller fixed:{controller.max_depth} for this tree")
        depth = controller.max_depth
        self.check_nodes(max(shape.max_drafts(depth), shape.fed_nodes(depth)), depth)
        if self.verifier is not None:
            verifier = verifier_entry(self.verifier)
            if verifier is None:
                raise ConfigError(f"--verifier {self.verifier!r}: no such verifier; known: {', '.join(VERIFIERS)}, "
                                  f"{', '.join(n + ':...' for n in PARAMETERIZED)}")
            tree_kind = entry.capabilities.drafts(shape.kind).tree_kind
            if tree_kind not in verifier.kinds:
                raise ConfigError(f"--verifier {self.verifier} verifies only a {' or a '.join(verifier.kinds)}; "
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
        self.catches_up = capabilities.catches_up  # a round that proposed nothing needs no update (round.py)
        # a sampled chain drawn with the walk's own uniforms where the walk verifies it (start)
        self.couples = capabilities.couples and self.drafts.gives_probs and self.tree_kind == "chain"
        missing = missing_hooks(drafter, capabilities)
        if missing:
            raise TypeError(f"drafter {options.kind!r} ({type(drafter).__name__}) lacks {', '.join(missing)}; "
                            "subclass drafters.base.DrafterBase for the defaults")
        missing = control_base.missing_hooks(controller)
        if missing:
            raise TypeError(f"controller {controller.name!r} ({type(controller).__name__}) lacks {', '.join(missing)}; "
                            "subclass control.base.PerSequence for the defaults")
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
                                      batch_profile_factory=batch_profile, model=target)
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

    # -- around the rounds ---------------------------------------------------------------------
    def start(self, seq, prompt_hidden: list[dict[int, torch.Tensor]] | None = None) -> None:
        """A sequence whose prompt is in the cache. prompt_hidden: the prefill forward's taps,
        chunk by chunk (layer -> [n, E]), covering every prompt token but the last; a drafter
        that declares needs_hidden gets them as `hidden` [len(prompt) - 1, layers, E] (None for
        a one-token prompt). Where the sequence's verifier is a walk and the drafter samples a
        chain it can couple, the drafter draws it with the walk's own uniforms (`coupled`)."""
        self.controller.start(seq.seq_id)
        extra = {}  # what the drafter declared it reads
        if self.couples and not seq.params.greedy and is_walk(seq.verify):
            extra["coupled"] = True
        if self.reads_target_cache:
            extra["target_slot"] = seq.slot
        if self.hidden_layers:
            chunks = [self.stacked(h) for h in prompt_hidden or ()]
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

    def stacked(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """layer -> [n, E] -> [n, len(hidden_layers), E], in the declared order."""
        missing = [layer for layer in self.hidden_layers if layer not in hidden]
        if missing:
            raise ValueError(f"the forward did not tap layer(s) {missing} that drafter {self.options.kind!r} "
                             f"declares; pass hidden_layers={self.hidden_layers}")
        return torch.stack([hidden[layer] for layer in self.hidden_layers], dim=1)

    def finish(self, seq) -> None:
        self.controller.finish(seq.seq_id)
        self.drafter.finish(seq.seq_id, list(seq.tokens))
