"""Which exact verifier fits a drafter and the sampling parameters, decided at configuration time.

Every verifier has the signature `verify(tree, target_logits [n, vocab], params, rng) -> VerifyResult`
(rng: spec/random.py). The choice depends on three facts, all known before the first round:

- `tree_kind`: "chain" (parents [-1, 0, ..., k-1]) or "tree";
- `gives_probs`: the drafter's children of node i are random draws from draft_probs[i]
  (a drafter that takes the top-k of its distribution does not qualify: say False);
- `sampling.greedy` (temperature 0), and for trees with probabilities whether the siblings were
  drawn without replacement.

    greedy                   chain -> greedy_chain          tree -> greedy_tree
    sampling, probabilities  chain -> rejection_chain       tree -> multidraft[_without_replacement]
    sampling, none           chain -> chain_walk            tree -> tree_walk
    sampling, seeded         chain -> chain_walk            tree -> tree_walk

A request with a seed (`seeded=True`) is verified by the walk whatever its drafts: the walks
(`walks=True`) commit at each position exactly `categorical(p_t, u_t)`, the token plain sampling
with that seed draws there, and accept a draft only when it equals that token. So drafting
changes the speed, never the text: the same seed gives the same text whatever the controller
decides (docs/usage.md#seeds). A drafter that samples its chain may then draw each draft with the
same uniform from its own q (coupled drafting, engine/speculator.py), which keeps acceptance up.
Unseeded requests get the verifier of most acceptance (rejection sampling, multi-draft).

A combination that cannot be verified exactly is refused with a reason, never run lossy; so is
a verifier that needs draft_probs at temperature 0, where drafters draft greedily and give none.

Lossy verifiers (`lossy=True`, named so: `resispec-lossy`, spec/verify_resispec.py) are never
chosen by default; only by name (`--verifier NAME`), and the lossless tests leave them out. A
verifier that takes an argument (`verify-skip-lossy:T,G`, spec/verify_skip.py) is in
PARAMETERIZED, not VERIFIERS: `verifier_entry(name)` builds it from its name (once per name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models.edgexpert import NAME as EDGEXPERT_NAME
from ..models.edgexpert import verifier as edgexpert_verifier
from ..sampling import SamplingParams
from .acceptmoe import NAME as ACCEPTMOE_NAME
from .acceptmoe import verifier as acceptmoe_verifier
from .s2moe_gate import NAME as GATE_NAME
from .s2moe_gate import verifier as gate_verifier
from .types import TREE_KINDS, DraftTree, VerifyResult
from .verify_chain import verify_chain, verify_chain_reference
from .verify_greedy import verify_greedy_chain, verify_greedy_reference, verify_greedy_tree
from .verify_multidraft import MultiDraftVerifier
from .verify_resispec import ResiSpecVerifier
from .verify_skip import NAME as SKIP_NAME
from .verify_skip import parse_skip
from .verify_tree import verify_chain_walk, verify_tree_walk, verify_tree_walk_reference

Verifier = Callable[[DraftTree, torch.Tensor, SamplingParams, object], VerifyResult]


@dataclass(frozen=True)
class Entry:
    verify: Verifier
    kinds: tuple[str, ...]  # tree kinds it handles
    needs_probs: bool  # needs children drawn from draft_probs
    greedy_only: bool  # exact at temperature 0 only
    without_replacement: bool | None = None  # the sibling mode it assumes on trees (None: any)
    lossy: bool = False  # not exact: chosen only by name, never by default
    walks: bool = False  # commits categorical(p_t, u_t) at each position whatever the drafts (the seeded default)


VERIFIERS: dict[str, Entry] = {
    "greedy_chain": Entry(verify_greedy_chain, ("chain",), False, True),
    "greedy_tree": Entry(verify_greedy_tree, TREE_KINDS, False, True),
    "greedy_reference": Entry(verify_greedy_reference, TREE_KINDS, False, True),
    "rejection_chain": Entry(verify_chain, ("chain",), True, False),
    "rejection_chain_reference": Entry(verify_chain_reference, ("chain",), True, False),
    "chain_walk": Entry(verify_chain_walk, ("chain",), False, False, walks=True),
    "tree_walk": Entry(verify_tree_walk, TREE_KINDS, False, False, walks=True),
    "tree_walk_reference": Entry(verify_tree_walk_reference, TREE_KINDS, False, False, walks=True),
    "multidraft": Entry(MultiDraftVerifier(without_replacement=False), TREE_KINDS, True, False, False),
    "multidraft_without_replacement": Entry(MultiDraftVerifier(without_replacement=True), TREE_KINDS, True, False, True),
    # lossy (docs/methods.md#resispec): siblings drawn without replacement, as `--tree sampled:...` draws them
    "resispec-lossy": Entry(ResiSpecVerifier(without_replacement=True), ("tree",), True, False, True, lossy=True),
}


# verifiers named NAME:ARGUMENT -> a factory of the Entry (all lossy: named `-lossy`, never a default)
PARAMETERIZED: dict[str, Callable[[str], Entry]] = {
    # LOSSY (docs/methods.md#verifier-skipping): a confident prefix committed unverified; greedy chains only
    SKIP_NAME: lambda argument: Entry(parse_skip(argument), ("chain",), False, True, lossy=True),
    # LOSSY MoE routing of the verify forward (docs/methods.md#acceptmoe, #edgexpert); greedy walks
    ACCEPTMOE_NAME: lambda argument: Entry(acceptmoe_verifier(argument), TREE_KINDS, False, True, lossy=True),
    EDGEXPERT_NAME: lambda argument: Entry(edgexpert_verifier(argument), TREE_KINDS, False, True, lossy=True),
    GATE_NAME: lambda argument: Entry(gate_verifier(argument), TREE_KINDS, False, True, lossy=True),
}
_BUILT: dict[str, Entry] = {}


def verifier_entry(name: str) -> Entry | None:
    """The registry entry of the verifier called `name` (`NAME` or, for PARAMETERIZED ones,
    `NAME[:ARGUMENT]`), or None when there is none; ConfigError for a bad argument."""
    if name in VERIFIERS:
        return VERIFIERS[name]
    base, _, argument = name.partition(":")
    if base not in PARAMETERIZED:
        return None
    if name not in _BUILT:
        _BUILT[name] = PARAMETERIZED[base](argument)
    return _BUILT[name]


def lossless_names() -> tuple[str, ...]:
    """The exact verifiers (the lossless tests run these)."""
    return tuple(name for name, entry in VERIFIERS.items() if not entry.lossy)


def is_walk(verify: Verifier) -> bool:
    """Whether `verify` is a walk: it commits categorical(p_t, u_t) with the TOKEN uniform at each
    position, whatever the drafts, so a drafter may draw its chain with those same uniforms."""
    return any(entry.walks and entry.verify is verify for entry in VERIFIERS.values())


@dataclass(frozen=True)
class VerifierChoice:
    """The chosen verifier and its name, or `verifier is None` and `reason` says why."""

    name: str
    verifier: Verifier | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.verifier is not None


def choose_verifier(
    tree_kind: str,
    gives_probs: bool,
    sampling: SamplingParams,
    *,
    without_replacement: bool = False,
    name: str | None = None,
    seeded: bool = False,
) -> VerifierChoice:
    """The best exact verifier for this combination, or the one called `name` if it fits.
    seeded: the request gave a seed, so its text must be plain sampling's (the walk; `name` wins)."""
    if tree_kind not in TREE_KINDS:
        return VerifierChoice("", None, f"tree_kind must be one of {TREE_KINDS}, got {tree_kind!r}")
    if name is None:
        name = _default(tree_kind, gives_probs, sampling, without_replacement, seeded)
    entry = verifier_entry(name)
    if entry is None:
        return VerifierChoice(name, None, f"no verifier called {name!r}; known: {', '.join(VERIFIERS)}, "
                                          f"{', '.join(n + ':...' for n in PARAMETERIZED)}")
    refusal = _refusal(name, entry, tree_kind, gives_probs, sampling, without_replacement)
    if refusal:
        return VerifierChoice(name, None, refusal)
    exact = "LOSSY (not exact)" if entry.lossy else "exact"
    return VerifierChoice(name, entry.verify, f"{name}: {exact} for a {tree_kind}{_facts(gives_probs, sampling)}")


def _default(tree_kind: str, gives_probs: bool, sampling: SamplingParams, without_replacement: bool,
             seeded: bool) -> str:
    if sampling.greedy:
        return f"greedy_{tree_kind}"
    if seeded or not gives_probs:
        return f"{tree_kind}_walk"
    if tree_kind == "chain":
        return "rejection_chain"
    return "multidraft_without_replacement" if without_replacement else "multidraft"


def _refusal(
    name: str, entry: Entry, tree_kind: str, gives_probs: bool, sampling: SamplingParams, without_replacement: bool
) -> str | None:
    if tree_kind not in entry.kinds:
        return f"{name} verifies only a {' or a '.join(entry.kinds)}, not a {tree_kind}"
    if entry.greedy_only and not sampling.greedy:
        return f"{name} is exact only at temperature 0 (got {sampling.temperature}); use a sampling verifier"
    if entry.needs_probs and not gives_probs:
        return f"{name} needs drafts drawn from draft_probs; this drafter gives none (use tree_walk)"
    if entry.needs_probs and sampling.greedy:
        return (f"{name} needs drafts drawn from draft_probs, which drafters draw only when sampling; at "
                f"temperature 0 use greedy_{tree_kind} (the default)")
    assumes = entry.without_replacement
    if tree_kind == "tree" and assumes is not None and assumes != without_replacement:
        return f"{name} assumes siblings drawn {_mode(assumes)}, but this drafter draws them {_mode(without_replacement)}"
    return None


def _mode(without_replacement: bool) -> str:
    return "without replacement" if without_replacement else "with replacement"


def _facts(gives_probs: bool, sampling: SamplingParams) -> str:
    probs = "drafts drawn from draft_probs" if gives_probs else "drafts without probabilities"
    mode = "greedy" if sampling.greedy else f"temperature {sampling.temperature}"
    return f" of {probs}, {mode}"
