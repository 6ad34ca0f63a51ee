"""A speculation configuration: drafter + tree shape + controller + verifier, checked up front.

`SpecOptions` parses the user's strings (`--drafter`, `--tree`, `--controller`) without loading
anything, so a bad string or an unsupported combination is refused at once with its reason.
`Speculator.build` then loads what the drafter needs and checks that it fits the target (same
tokenizer, layer count) before the first token is generated.

    drafters    ngram | suffix | draft-model:NAME | early-exit:K
    trees       chain | static:B1,B2,... | dynamic:K,N     (the shape of a model drafter's tree)
    controllers fixed:N | adaptive[:MAX] | cost[:MAX]
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..control.controllers import Controller, parse_controller
from ..drafters.base import Budget, Drafter
from ..errors import ConfigError
from ..models.decoder import Decoder
from ..sampling import SamplingParams
from .shapes import TreeShape, parse_shape
from .types import DraftTree, VerifyResult
from .verifiers import choose_verifier

DRAFTER_KINDS = ("ngram", "suffix", "draft-model", "early-exit")
MAX_TREE_NODES = 256  # draft nodes per sequence per round, unless the user raises it


@dataclass(frozen=True)
class SpecOptions:
    drafter: str  # e.g. "ngram", "draft-model:qwen2.5-coder-0.5b-instruct", "early-exit:8"
    tree: str = "chain"
    controller: str = "fixed:4"
    max_tree_nodes: int = MAX_TREE_NODES  # refuse shapes whose rounds could draft or feed more

    @property
    def kind(self) -> str:
        return self.drafter.partition(":")[0]

    @property
    def argument(self) -> str:
        return self.drafter.partition(":")[2]

    @property
    def shape(self) -> TreeShape:
        return parse_shape(self.tree)

    def check(self) -> "SpecOptions":
        """Refuse a bad string or combination before anything is loaded."""
        if self.kind not in DRAFTER_KINDS:
            raise ConfigError(f"--drafter {self.drafter!r}: unknown drafter; use ngram, suffix, "
                              "draft-model:NAME or early-exit:K")
        shape = self.shape
        if self.kind in ("ngram", "suffix") and not shape.is_chain:
            raise ConfigError(f"--tree {self.tree} applies to model drafters; the {self.kind} drafter "
                              "builds its own drafts from its index (leave --tree at chain)")
        if self.kind == "draft-model" and not self.argument:
            raise ConfigError("--drafter draft-model:NAME needs a model name or folder after the colon")
        if self.kind == "early-exit":
            try:
                if int(self.argument) < 1:
                    raise ValueError
            except ValueError:
                raise ConfigError(f"--drafter {self.drafter!r}: early-exit:K needs a layer count K >= 1") from None
        if not (isinstance(self.max_tree_nodes, int) and self.max_tree_nodes >= 1):
            raise ConfigError(f"max_tree_nodes must be a positive integer, got {self.max_tree_nodes!r}")
        depth = parse_controller(self.controller, profile_factory=lambda: None).max_depth
        self.check_nodes(max(shape.max_drafts(depth), shape.fed_nodes(depth)), depth)
        return self

    def check_nodes(self, nodes: int, depth: int) -> None:
        """Refuse a configuration whose rounds may hold more than `max_tree_nodes` draft nodes."""
        if nodes > self.max_tree_nodes:
            raise ConfigError(
                f"--tree {self.tree} with --controller {self.controller} (depth up to {depth}) makes up to "
                f"{nodes} draft nodes per round, over the limit of {self.max_tree_nodes}; use a smaller "
                f"tree or a lower depth, or raise the limit with --max-tree-nodes")

    def label(self) -> str:
        return f"{self.drafter} {self.tree} {self.controller}"


class Speculator:
    """Drives one drafter and one controller for the generation loop (see generation.py)."""

    def __init__(self, options: SpecOptions, drafter: Drafter, controller: Controller, shape: TreeShape):
        self.options = options
        self.drafter = drafter
        self.controller = controller
        self.shape = shape
        self.hidden_layers: tuple[int, ...] = ()
        self._trees: dict[int, DraftTree] = {}
        self.tree_kind = "chain" if (shape.is_chain and options.kind != "suffix") else "tree"
        options.check_nodes(self.max_tree_size - 1, controller.max_depth)

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def build(options: SpecOptions, target: Decoder, target_path: Path, log=None) -> "Speculator":
        options.check()
        shape = options.shape
        drafter = _make_drafter(options, shape, target, target_path)

        def profile():
            from ..control.profile import load_or_measure
            from ..models.catalog import cache_dir

            return load_or_measure(target_path, target, cache_dir() / "profiles", log)

        controller = parse_controller(options.controller, profile_factory=profile)
        return Speculator(options, drafter, controller, shape)

    def verifier_for(self, params: SamplingParams):
        choice = choose_verifier(self.tree_kind, self.drafter.gives_probs, params)
        if not choice.ok:
            raise ConfigError(f"{self.options.label()}: {choice.reason}")
        return choice.verifier

    @property
    def max_tree_size(self) -> int:
        return 1 + self.nodes_for(self.controller.max_depth)

    def nodes_for(self, depth: int) -> int:
        return self.drafter.max_nodes(depth)

    # -- the loop's hooks ---------------------------------------------------------------------
    def start(self, seq) -> None:
        self.controller.start(seq.seq_id)
        self.drafter.start(seq.seq_id, list(seq.tokens), seq.params)

    def propose(self, seq, free_rows: int) -> DraftTree:
        budget = self.controller.budget(seq.seq_id)
        nodes = min(self.nodes_for(budget.depth), free_rows - 1)
        if budget.depth < 1 or nodes < 1:
            tree = DraftTree.root_only(seq.tokens[-1])
        else:
            budget = Budget(depth=budget.depth, nodes=nodes, min_confidence=budget.min_confidence)
            start = time.perf_counter()
            tree = self.drafter.propose(seq.seq_id, seq.tokens, budget)
            if hasattr(self.controller, "draft_step_s"):
                step = (time.perf_counter() - start) / max(budget.depth, 1)
                self.controller.draft_step_s = 0.8 * self.controller.draft_step_s + 0.2 * step
        self._trees[seq.seq_id] = tree
        return tree

    def update(self, seq, result: VerifyResult, hidden: dict[int, torch.Tensor]) -> None:
        tree = self._trees.pop(seq.seq_id)
        self.controller.observe(seq.seq_id, tree, result)
        self.drafter.update(seq.seq_id, result, None)

    def finish(self, seq) -> None:
        self.drafter.finish(seq.seq_id, list(seq.tokens))


def _make_drafter(options: SpecOptions, shape: TreeShape, target: Decoder, target_path: Path) -> Drafter:
    from ..drafters.model import ModelDrafter

    if options.kind == "ngram":
        from ..drafters.ngram import NgramDrafter

        return NgramDrafter()
    if options.kind == "suffix":
        from ..drafters.suffix import SuffixDrafter

        return SuffixDrafter()
    if options.kind == "early-exit":
        k = int(options.argument)
        if k >= target.config.num_layers:
            raise ConfigError(f"--drafter early-exit:{k}: the target has {target.config.num_layers} layers; "
                              f"pick K below that (about a quarter is a good start)")
        return ModelDrafter(target, shape, num_layers=k, name=options.drafter)
    # draft-model:NAME
    from ..models.catalog import resolve_model
    from ..models.loader import load_decoder

    draft_path = resolve_model(options.argument)
    reason = tokenizer_mismatch(target_path, draft_path)
    if reason:
        raise ConfigError(f"--drafter {options.drafter} cannot serve this target: {reason}")
    draft = load_decoder(draft_path, target.device, target.dtype)
    return ModelDrafter(draft, shape, name=options.drafter, target_vocab=target.config.vocab_size)


def tokenizer_mismatch(target_path: Path, draft_path: Path) -> str | None:
    """A reason the two folders' tokenizers differ, or None when they map text to the same ids."""
    def vocab(folder: Path):
        path = Path(folder) / "tokenizer.json"
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        added = sorted((t["id"], t["content"]) for t in raw.get("added_tokens", []))
        return raw.get("model", {}).get("type"), raw.get("model", {}).get("vocab"), added

    a, b = vocab(target_path), vocab(draft_path)
    if a is None or b is None:
        return "a tokenizer.json is missing, so the vocabularies cannot be compared"
    if a != b:
        size_a, size_b = len(a[1] or {}), len(b[1] or {})
        return f"its tokenizer differs from the target's ({size_b} vs {size_a} tokens); use a model of the same family"
    return None
