"""Text out of token ids: an incremental detokenizer with stop strings, one per request.

`TextStream` is fed a sequence's output token ids as they are committed (any number per call)
and returns only **stable** text: characters that no later token can change. Two kinds of tail
are held back until they resolve:
- an incomplete UTF-8 character (a byte-level token can end mid-character; the tokenizer's decode
  shows it as a trailing U+FFFD), and
- a tail that could still be the start of a stop string (`"fib"` while `"fibonacci(n - 1)"` is a
  stop string).

Stop strings are found in the text, wherever the tokens split it: one may begin inside a token
and span tokens committed in different rounds. Tokens are processed one at a time, so where a
sequence stops does not depend on how its tokens were grouped into rounds (speculative or not).
The sequence stops after the first token whose stable text contains a stop string; `text` then
ends exactly before the earliest occurrence, and `kept_tokens` is the number of output tokens the
kept text came from: the fewest tokens whose text covers it. So when the stop string starts inside
a token, that token is kept (its text runs past the cut) and the stop string's later tokens go.

Work is linear in the output length: each token decodes only a small window of recent ids,
`ids[prefix_offset:]`, and compares it with the decode of `ids[prefix_offset:read_offset]`, the
window's already-decoded part, which gives the decoder its context (a leading space, a joiner).
This assumes what the tokenizers of our families do: the text of `ids[:n]` without its trailing
U+FFFDs only grows with n (`reference_text` asserts it).
Worked example (byte-level BPE, "日" is 3 bytes split over two tokens, no stop strings):

    ids          decode(ids[prefix_offset:])   prefix_text   stable new text  offsets after
    [A]  "Hi"    "Hi"                          ""            "Hi"             prefix 0, read 1
    [B]  "日"[:2] "Hi\\ufffd"                    "Hi"          ""  (held)       prefix 0, read 1
    [C]  "日"[2:] "Hi日"                         "Hi"          "日"             prefix 1, read 3

`reference_text` is the slow, obviously correct definition (decode every prefix, search the
whole text); tests check the stream against it on random token sequences of a real tokenizer.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import ConfigError

REPLACEMENT = "\ufffd"  # what a tokenizer's decode shows for bytes that are not (yet) UTF-8

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped


class TextStream:
    """The text of one sequence's output, fed token ids as they come.

        stream = TextStream(decode, stops=["\\n\\n"])
        shown = stream.add(new_ids)      # after every round: newly stable text ("" if none)
        if stream.stopped:               # a stop string was found: keep stream.kept_tokens ids
            ...
        shown += stream.finish()         # at the end: the held-back rest; now shown == stream.text

    `decode(ids)` must skip special tokens and apply no clean-up of spaces (which would make
    the text of a window depend on what lies outside it). Empty stop strings are ignored.
    """

    def __init__(self, decode: Decode, stops: Sequence[str] = ()):
        self._decode = decode
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: already-emitted ids kept as the decoder's context
        self._read_offset = 0  # ids before this are clean: their text ends on a whole character
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._pending = ""  # stable text of ids[read_offset:] (the window's tail minus its U+FFFDs)
        self._unstable = ""  # the window's trailing U+FFFDs, shown only by finish()
        self._pieces: list[str] = []  # the stable text, in pieces
        self._ends = [0]  # _ends[n]: length of the stable text of the first n ids
        self._recent = ""  # the last characters of the stable text, where a stop string may start
        self._unsent = ""  # stable text not yet returned (held back or just grown)
        self._cut: int | None = None  # where the text ends, once a stop string is found
        self.kept_tokens: int | None = None  # set by a stop string, or by finish()
        self._fed = 0
        self._finished = False

    @property
    def stopped(self) -> bool:
        """A stop string was found; ids added afterwards are ignored."""
        return self._cut is not None

    @property
    def fed(self) -> int:
        """How many ids have been added (those after a stop included)."""
        return self._fed

    def add(self, new_ids: Sequence[int]) -> str:
        """Take the next output ids; return the text that became stable and safe to show."""
        if self._finished:
            raise RuntimeError("TextStream.add after finish()")
        self._fed += len(new_ids)
        for token in new_ids:
            if self.stopped:
                break
            self._step(int(token))
        return self._release()

    def finish(self) -> str:
        """End of generation: return what is left to show (held-back text, an incomplete
        character's U+FFFD); `text` is final afterwards."""
        if not self._finished:
            self._finished = True
            if not self.stopped:
                self.kept_tokens = len(self._ids)
                rest, self._unsent = self._unsent + self._unstable, ""
                return rest
        return ""

    @property
    def text(self) -> str:
        """The output text: cut before the first stop string; after finish(), the whole text."""
        stable = "".join(self._pieces)
        if self.stopped:
            return stable[: self._cut]
        return stable + (self._unstable if self._finished else "")

    # -- one token ------------------------------------------------------------------------------
    def _step(self, token: int) -> None:
        self._ids.append(token)
        window = self._decode(self._ids[self._prefix_offset:])
        tail = window[len(self._prefix_text):]
        stable_tail = tail.rstrip(REPLACEMENT)
        grown = stable_tail[len(self._pending):]
        if tail and not tail.endswith(REPLACEMENT):  # ends on a whole character: clean
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self._pending, self._unstable = "", ""
        else:
            self._pending, self._unstable = stable_tail, tail[len(stable_tail):]
        before = self._ends[-1]
        self._ends.append(before + len(grown))
        self._grow(before, grown)

    def _grow(self, before: int, grown: str) -> None:
        """The stable text grew from `before` characters by `grown`: look for stop strings."""
        if not grown:
            return
        self._pieces.append(grown)
        self._unsent += grown
        if not self._stops:
            return
        # No stop string lies wholly in the old text, so one ends in `grown` and starts at most
        # longest - 1 characters before it: _recent holds exactly those characters.
        start = before - len(self._recent)
        self._recent += grown
        hits = [at for at in (self._recent.find(s) for s in self._stops) if at >= 0]
        if hits:
            self._cut = start + min(hits)
            self.kept_tokens = bisect_left(self._ends, self._cut)  # fewest ids covering the cut
        else:
            self._recent = self._recent[-(self._longest - 1):] if self._longest > 1 else ""

    def _release(self) -> str:
        """Hand out the unsent stable text, minus a tail that could begin a stop string."""
        if self.stopped:
            keep = self._cut - (self._ends[-1] - len(self._unsent))  # unsent characters before the cut
            out, self._unsent = self._unsent[:max(keep, 0)], ""
            return out
        hold = _stop_prefix_len(self._unsent, self._stops)
        out = self._unsent[: len(self._unsent) - hold]
        self._unsent = self._unsent[len(out):]
        return out


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


@dataclass
class ReferenceText:
    visible: str  # what may be shown after these ids
    text: str  # the output text if generation ended after these ids
    kept_tokens: int
    stopped: bool


def reference_text(decode: Decode, ids: Sequence[int], stops: Sequence[str] = ()) -> ReferenceText:
    """The definition TextStream implements, slowly: decode every prefix of `ids` whole."""
    stops = [s for s in stops if s]
    ids = list(ids)
    stable = [""]  # stable[n]: text of the first n ids, without its trailing U+FFFDs
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n]).rstrip(REPLACEMENT)
        assert text.startswith(stable[-1]), "stable text must only grow"
        stable.append(text)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            cut = min(hits)
            kept = next(m for m in range(n + 1) if len(stable[m]) >= cut)
            return ReferenceText(text[:cut], text[:cut], kept, True)
    text = stable[-1]
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return ReferenceText(text[: len(text) - hold], decode(ids), len(ids), False)


def check_text(value: str, what: str) -> None:
    """Refuse a str that is not valid Unicode text, e.g. bytes that were not UTF-8 on the
    command line (Python hands them in as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        char = ord(value[err.start])
        found = (f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF
                 else f"lone surrogate U+{char:04X}")
        raise ConfigError(f"{what} is not valid UTF-8 text ({found} at character {err.start}): "
                          "pass UTF-8 text") from None
