"""Speculation-length controllers: how deep to draft this round.

    fixed:N     always N deep
    adaptive    a moving average of the acceptance rate, with hysteresis: one deeper after
                rounds that accept most drafts, one shallower after rounds that accept few
    cost        the depth of most expected committed tokens per second of round time, all
                depths weighed (not LibraSpec's marginal rule, which goes deeper only while the
                next depth pays), using per-position acceptance estimates, the drafter's own
                confidence where it has one, live draft times, and the target's verify-cost
                profile measured on this machine; now and then one deeper, so that
                an estimate gone stale is seen again. With several
                sequences in a round it prices the whole batch's verify forward (batch_cost.py)
                and picks one depth for the round, backing off as the batch grows

A controller sees only round statistics: it never changes what is committed, so every
controller is lossless.

Another controller is a class with the `Controller` methods (control/base.py; `PerSequence` gives
the defaults of all but `start`, `budget` and `observe`) and one `register_controller(NAME, factory)`
call, after which `--controller NAME[:ARGUMENT]` builds it (docs/adding-a-method.md). The
package's own registered controllers live in the modules of `REGISTERED_BUILT_IN`, imported before
the first registration or look-up:

    libraspec[:MAX]      LibraSpec (libraspec.py): drafts up to MAX deep, then verifies a drafted
                         node only while its confidence pays for its share of the verify cost
    threshold:T[,MAX]    the plain confidence threshold beside it: verifies nodes of confidence >= T
    entropy[:MAX]        (entropy.py) a model drafter's chain stops once, by the drafts' entropies and
                         the measured step and verify times, one more draft would lower the
                         expected tokens per second (SparseSpec-L's controller)
    specla[:MAX[,T]]     SpecLA (specla.py): drops draft nodes of path confidence below T before
                         verification, then sizes the tree by expected accepted tokens against a
                         verify cost that counts the target's state bytes (specla_cost.py)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from ..spec.tree import depths
from ..spec.types import Budget, DraftTree, VerifyResult
from .base import Controller, PerSequence
from .cost import CostController


class FixedController(PerSequence):
    def __init__(self, depth: int):
        self.name = f"fixed:{depth}"
        self.max_depth = depth

    def start(self, seq_id: int) -> None:
        pass

    def budget(self, seq_id: int) -> Budget:
        return Budget(depth=self.max_depth, nodes=self.max_depth)

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        pass  # the depth is fixed


@dataclass
class _Moving:
    depth: int
    rate: float = 0.5


class AdaptiveController(PerSequence):
    """Depth follows an exponential moving average of the per-round acceptance rate."""

    def __init__(self, max_depth: int = 8, start: int = 4, alpha: float = 0.3,
                 raise_above: float = 0.75, lower_below: float = 0.35):
        self.name = "adaptive"
        self.max_depth = max_depth
        self.start_depth, self.alpha = start, alpha
        self.raise_above, self.lower_below = raise_above, lower_below
        self._seqs: dict[int, _Moving] = {}

    def start(self, seq_id: int) -> None:
        self._seqs[seq_id] = _Moving(self.start_depth)

    def finish(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def budget(self, seq_id: int) -> Budget:
        depth = self._seqs.setdefault(seq_id, _Moving(self.start_depth)).depth
        return Budget(depth=depth, nodes=depth)

    def observe(self, seq_id: int, tree: DraftTree, result: VerifyResult) -> None:
        state = self._seqs.setdefault(seq_id, _Moving(self.start_depth))
        drafted = tree.size - 1
        if drafted == 0:
            return
        depth_reached = int(depths(tree.parents).max()) if drafted else 0
        rate = result.num_accepted / max(depth_reached, 1)
        state.rate = (1 - self.alpha) * state.rate + self.alpha * rate
        if state.rate > self.raise_above and result.num_accepted == depth_reached:
            state.depth = min(self.max_depth, state.depth + 1)
        elif state.rate < self.lower_below:
            state.depth = max(1, state.depth - 1)

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        pass  # acceptance alone moves the depth


BUILT_IN = ("fixed", "adaptive", "cost")  # parsed by parse_controller itself
BUILT_IN_USAGES = ("fixed:N (0-64)", "adaptive[:MAX]", "cost[:MAX]")
REGISTERED_BUILT_IN = ("libraspec", "entropy", "specla", "batch_verify")  # modules of this package that call register_controller
_REGISTERED: dict[str, tuple[str, Callable[..., Controller], bool, bool]] = {}  # name -> (usage, factory, profiles, reads_model)
_LOADED = [False]


def _load_built_in() -> None:
    """Import the package's registering modules once, before any other registration (so their
    names come first in messages and cannot be taken)."""
    if not _LOADED[0]:
        _LOADED[0] = True
        for module in REGISTERED_BUILT_IN:
            importlib.import_module(f"{__package__}.{module}")


def register_controller(name: str, factory: Callable[..., Controller], usage: str | None = None,
                        profiles: bool = False, reads_model: bool = False) -> None:
    """Make `--controller NAME[:ARGUMENT]` build `factory(ARGUMENT)` ("" when there is no colon).

    The factory parses its argument and raises ConfigError saying what to pass (parse_controller
    prefixes "--controller 'TEXT': "); `usage` spells the name for messages, e.g. "aimd[:MAX]"
    (default: `name`). With `profiles`, the factory is called as
    `factory(ARGUMENT, profile_factory, batch_profile_factory)` (parse_controller's; either may be
    None, and the profile one may return None when options are only being checked: call them when
    first needed). With `reads_model` as well, the call has a fourth argument, the target model
    (a Decoder: its config and weights, for a controller that prices the target's state, as
    SpecLA's does), None when options are only being checked. The module that defines the
    controller calls this when it is imported.
    ValueError if another controller, built-in or registered, has the name."""
    _load_built_in()
    if not name or ":" in name or name != name.strip():
        raise ValueError(f"a controller name is a non-empty word without ':', got {name!r}")
    old = _REGISTERED.get(name)
    if name in BUILT_IN or (old is not None and old[1] is not factory):
        raise ValueError(f"a controller called {name!r} is already registered; pick another name")
    _REGISTERED[name] = (usage or name, factory, profiles or reads_model, reads_model)


def unregister_controller(name: str) -> None:
    """Remove a controller added with `register_controller` (tests and experiments)."""
    _REGISTERED.pop(name, None)


def controller_usages() -> list[str]:
    """How `--controller` spells every controller: the built-in ones, then the registered ones
    (the CLI's help and parse_controller's refusal read this one list)."""
    _load_built_in()
    return [*BUILT_IN_USAGES, *(entry[0] for entry in _REGISTERED.values())]


def parse_controller(text: str, profile_factory=None, batch_profile_factory=None, model=None) -> Controller:
    """`fixed:N`, `adaptive[:MAX]`, `cost[:MAX]` or a registered `NAME[:ARGUMENT]`;
    `profile_factory()` gives the cost profile, `batch_profile_factory(max_batch)` the batch one
    (batch_cost.py) when a batch first needs it; `model`: the target, for a controller registered
    with reads_model (None: options only checked)."""
    _load_built_in()
    kind, _, arg = text.partition(":")
    if kind in _REGISTERED:
        _, factory, profiles, reads_model = _REGISTERED[kind]
        try:
            if reads_model:
                return factory(arg, profile_factory, batch_profile_factory, model)
            return factory(arg, profile_factory, batch_profile_factory) if profiles else factory(arg)
        except ConfigError as err:
            raise ConfigError(f"--controller {text!r}: {err}") from None
    try:
        number = int(arg) if arg else None
    except ValueError:
        number = -1
    if kind == "fixed" and number is not None and 0 <= number <= 64:
        return FixedController(number)
    if kind == "adaptive" and (number is None or 1 <= number <= 64):
        return AdaptiveController(max_depth=number or 8)
    if kind == "cost" and (number is None or 1 <= number <= 64):
        if profile_factory is None:
            raise ConfigError("--controller cost needs the target's verify-cost profile")
        return CostController(profile_factory(), max_depth=number or 12, batch_profile=batch_profile_factory)
    usages = controller_usages()
    raise ConfigError(f"--controller {text!r}: use {', '.join(usages[:-1])} or {usages[-1]}")
