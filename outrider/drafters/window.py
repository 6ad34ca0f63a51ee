"""Windowed-MTP: a sink plus a sliding window over the drafter's own attention (issue 26, item 4).

`draft-model:NAME,window=W[,sink=S]` and `eagle3:PATH_OR_NAME,window=W[,sink=S]`: a query of the
drafter at position p attends only to keys at positions < S (the sink) and at positions
p - W + 1 .. p (itself and the W - 1 before it), among the keys it would see anyway (the committed
prefix, its tree ancestors). The rule depends on the two positions alone, so the drafter's K/V
and proposals do not depend on how its forwards are cut (a prompt's prefill in chunks, a
catch-up of several tokens, one depth of a tree per forward). The target is untouched: it still
verifies every draft, so the output is the target's (exact); only the proposals change.

The unread K/V is reclaimed: once a slot's committed rows hold `slack` rows that no future query
can see (positions S .. n - W, n the committed length), the last W - 1 rows are copied down to
rows S.., and the slot's `shift` grows by the rows dropped. Cache row r then holds position r
(r < S) or r + shift (r >= S); rotary positions stay the true ones (`pack(shifts=...)`), the K
rows were rotated at their true positions when written, and attention does not care where a key
sits. So a slot holds at most S + W - 1 + slack committed rows plus one forward's new rows,
whatever the context's length, and its attention reads that many rows: the draft's attention
and memory stop growing with the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

KEYS = ("window", "sink")


@dataclass(frozen=True)
class Window:
    window: int  # W: the positions p - W + 1 .. p a query at p sees (itself included)
    sink: int = 0  # S: positions 0 .. S - 1, seen by every query

    def __post_init__(self):
        if self.window < 1 or self.sink < 0:
            raise ValueError(f"a window needs window >= 1 and sink >= 0, got {self.window}, {self.sink}")

    @property
    def slack(self) -> int:
        """Dead rows a slot holds before they are reclaimed (one copy of W - 1 rows per `slack`
        committed tokens, so the copy costs about (W - 1) / slack rows a token)."""
        return max(16, self.window // 4)

    @property
    def chunk(self) -> int:
        """Rows per forward of a long prompt's prefill: the cache never holds more than
        S + W + slack + chunk rows of a slot."""
        return max(64, self.window)

    def mask_args(self) -> tuple[int, int]:
        return self.sink, self.window

    def __str__(self) -> str:
        return f"window={self.window}" + (f",sink={self.sink}" if self.sink else "")


def parse_options(text: str, allowed: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """'NAME,key=value,...' -> (NAME, {key: value}): the trailing ',key=value' parts whose key is
    one of `allowed` are taken off from the right (a folder whose name holds a comma keeps it)."""
    options: dict[str, str] = {}
    while True:
        head, comma, tail = text.rpartition(",")
        key, eq, value = tail.partition("=")
        if not comma or not eq or key not in allowed:
            return text, options
        if key in options:
            raise ConfigError(f"{key}= is given twice")
        options[key] = value
        text = head


def window_of(options: dict[str, str], usage: str) -> Window | None:
    """The Window the `window=` / `sink=` options ask for, or None; a one-line ConfigError for a
    value that is not a whole number (negative included), a window of 0, or a sink without a window."""
    if "window" not in options and "sink" not in options:
        return None
    values = {}
    for key in KEYS:
        if key in options:
            text = options[key]
            if not text.isdigit():
                raise ConfigError(f"{key}={text!r}: give a whole number of tokens >= {1 if key == 'window' else 0}, "
                                  f"as in {usage},window=256,sink=4")
            values[key] = int(text)
    if "window" not in values:
        raise ConfigError(f"sink={values['sink']} needs a window: {usage},window=W,sink={values['sink']}")
    if values["window"] < 1:
        raise ConfigError(f"window=0: the window holds the query itself, so give window >= 1, "
                          f"as in {usage},window=256,sink=4")
    return Window(values["window"], values.get("sink", 0))


def window_misfit(window: Window | None, target_config) -> str | None:
    """Why the window cannot restrict this target's context, or None."""
    if window is None:
        return None
    context = int(target_config.max_position_embeddings)
    if window.window + window.sink > context:
        return (f"window={window.window} plus sink={window.sink} is more than the target's context of "
                f"{context} tokens, so it would never restrict anything; give a smaller window")
    return None


def dead_rows(window: Window, committed: int) -> int:
    """Rows past the sink that no query at a position >= `committed` reads any more
    (with the slot's shift 0: cache rows = positions)."""
    return max(0, committed - window.window + 1 - window.sink)


def reclaim(window: Window, cache, slot: int, committed_rows: int, shift: int) -> tuple[int, int]:
    """Copy down a slot's live rows once `slack` of them are dead: (committed rows, shift) after.

    committed_rows: the slot's committed rows in `cache` (its length); shift: positions - rows."""
    dead = dead_rows(window, committed_rows + shift) - shift
    if dead < window.slack:
        return committed_rows, shift
    keep = committed_rows - window.sink - dead  # the W - 1 live rows past the sink
    cache.compact(slot, list(range(window.sink + dead, committed_rows)), window.sink)
    cache.set_length(slot, window.sink + keep)
    return window.sink + keep, shift + dead
