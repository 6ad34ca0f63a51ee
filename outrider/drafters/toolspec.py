"""`--drafter toolspec[:retrieval=off]`: ToolSpec, schema-aware and retrieval-augmented drafting of tool calls.

ToolSpec (Xia et al. 2026, arXiv 2604.13519): a tool call's structure is fixed by the tool schemas
in the prompt, so a finite-state machine can fill the schema's tokens (the function name, the
argument keys, the punctuation) deterministically and leave only the variable fields (the
argument values) to speculation, which retrieval supplies (the prompt, earlier calls). Training-
free; it only proposes, so the output is the target's.

Here:

- `start(seq_id, prompt)` decodes the prompt with the target's tokenizer and parses the function
  schemas in it (toolspec_schema.py: BFCL's `{"name", "description", "parameters"}` objects, one a
  line in our `toolcall` workload, or `{"type": "function", "function": ...}`). A prompt without
  schemas leaves the plain suffix drafter (suffix.py), node for node.
- As tokens commit, their text is fed to the call's state machine (toolspec_fsm.py), which says
  what the skeleton writes next from where the output is: the call's head (`{"name": "f",
  "arguments": {"first_key": ` and how its value begins), after a value the next key in the
  schema's order or the closing braces and the end of the turn, an enum's or a boolean's value.
  Each alternative's text is tokenised with the target's tokenizer *in context* (after the text of
  the last committed tokens, so a token that a BPE merge would join across the boundary is not
  proposed split), cut to the round's depth, and the alternatives form a small trie whose nodes
  are scored by the shares of the alternatives through them (ranked keys, the end of a call).
- Retrieval is the suffix drafter's: the request's own tree over prompt + output (argument values
  copied from the question) and the global tree of earlier outputs (earlier calls). Its speculation
  and the schema trie are merged into one tree of at most the round's node budget (`2 * depth`),
  best score first, ties to the suffix tree (oilbird.py `merge`), as OoO-Spec merges its hint.
  `retrieval=off` drops the suffix tree (the schema alone: an ablation).

`stats()` reports the requests with schemas, the tools parsed, the draft nodes that came from the
schema alone, and the accepted tokens beyond what the suffix tree alone held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..sampling import SamplingParams
from ..spec.types import Budget, DraftTree, VerifyResult
from .merge import accepted_beyond, merge, paths
from .registry import DrafterEntry, register
from .suffix import Speculation, SuffixDrafter, spec_tree
from .toolspec_fsm import CallState
from .toolspec_schema import Tool, parse_tools
from .window import parse_options

USAGE = "toolspec[:retrieval=off]"
TAIL = 4  # committed tokens whose text goes before a continuation when it is tokenised


def parse_argument(text: str) -> bool:
    """"" or `retrieval=on|off` -> whether the suffix drafter's retrieval is merged in."""
    if not text:
        return True
    rest, options = parse_options("," + text, ("retrieval",))
    if rest:
        raise ConfigError(f"{text!r}: the only option is retrieval=on|off ({USAGE})")
    value = options["retrieval"]
    if value not in ("on", "off"):
        raise ConfigError(f"retrieval={value!r}: give on or off ({USAGE})")
    return value == "on"


class Codec:
    """Text to the target's token ids and back, through a Hugging Face fast tokenizer's backend
    (no clean-up of spaces: the decoded text is the bytes the tokens stand for)."""

    def __init__(self, tokenizer):
        self.backend = tokenizer.backend_tokenizer

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


@dataclass
class Call:
    """One request's schemas and where its output is in a call."""

    tools: list[Tool]
    state: CallState
    fed: int  # committed tokens whose text the state has read
    prompt_len: int
    gained: int = 0  # accepted tokens beyond the suffix tree's
    schema_paths: set = field(default_factory=set)  # this round's proposals, for stats
    suffix_paths: set = field(default_factory=set)


@dataclass
class Stats:
    requests: int = 0  # requests started
    with_tools: int = 0  # requests whose prompt had schemas
    tools: int = 0  # schemas parsed, over those requests
    schema_drafted: int = 0  # draft nodes from the schema alone
    schema_accepted: int = 0  # accepted tokens beyond what the suffix tree alone held
    requests_helped: int = 0  # finished requests with schema_accepted > 0


class ToolSpecDrafter(SuffixDrafter):
    """The suffix drafter (retrieval), plus each request's tool-call skeleton from its schemas."""

    name = "toolspec"
    capabilities = SuffixDrafter.capabilities

    def __init__(self, codec, end_ids: tuple[int, ...] = (), vocab_limit: int | None = None,
                 retrieval: bool = True, **suffix):
        """codec: the target's tokenizer (`encode(text)`, `decode(ids)`); end_ids: the end-of-turn
        id proposed after a call's last brace (the first one); vocab_limit: the target's vocabulary
        (a path stops at an id at or past it); retrieval: merge the suffix drafter's speculation."""
        super().__init__(**suffix)
        self.codec = codec
        self.end_ids = tuple(end_ids)
        self.vocab_limit = vocab_limit
        self.retrieval = retrieval
        self.counts = Stats()
        self._calls: dict[int, Call] = {}

    # -- protocol -----------------------------------------------------------------------------
    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> None:
        super().start(seq_id, prompt, params)
        self._calls.pop(seq_id, None)
        self.counts.requests += 1
        tools = parse_tools(self.codec.decode(prompt))
        if tools:
            self._calls[seq_id] = Call(tools, CallState(tools), len(prompt), len(prompt))
            self.counts.with_tools += 1
            self.counts.tools += len(tools)

    def scored_proposal(self, seq_id: int, tokens: list[int], budget: Budget) -> tuple[DraftTree, float]:
        call = self._calls.get(seq_id)
        if call is None:
            return super().scored_proposal(seq_id, tokens, budget)
        state = self._synced_state(seq_id, tokens)
        self._read(call, tokens)
        suffix = self.speculation(state, budget) if self.retrieval else Speculation()
        from_schema = self.schema_paths(call, tokens, budget.depth)
        min_prob = max(self.min_prob, budget.min_confidence)
        spec, new = merge(suffix, from_schema, budget.nodes, min_prob)
        self.counts.schema_drafted += new
        call.suffix_paths = paths(suffix.tokens, suffix.parents)
        call.schema_paths = {p for p, _ in from_schema}
        return spec_tree(tokens[-1], spec), spec.score

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        call = self._calls.get(seq_id)
        if call is not None and (call.schema_paths or call.suffix_paths):
            committed = tuple(result.tokens[: result.num_accepted])
            gained = accepted_beyond(committed, call.suffix_paths, call.schema_paths)
            call.gained += gained
            self.counts.schema_accepted += gained
            call.schema_paths, call.suffix_paths = set(), set()
        super().update(seq_id, result, hidden)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        call = self._calls.pop(seq_id, None)
        if call is not None:
            self.counts.requests_helped += call.gained > 0
        super().finish(seq_id, tokens)

    # -- the schema's proposals ---------------------------------------------------------------
    def _read(self, call: Call, tokens: list[int]) -> None:
        """Feed the state machine the text of the tokens committed since it last read."""
        if len(tokens) < call.fed:  # another prefix (never from the engine): read the output again
            call.state, call.fed = CallState(call.tools), min(call.prompt_len, len(tokens))
        if len(tokens) == call.fed:
            return
        new = tokens[call.fed:]
        if call.fed > call.prompt_len:  # decoded after the token before, so a leading space stays
            before = self.codec.decode(tokens[call.fed - 1: call.fed])
            both = self.codec.decode(tokens[call.fed - 1:])
            text = both[len(before):] if both.startswith(before) else self.codec.decode(new)
        else:
            text = self.codec.decode(new)
        call.state.feed(text)
        call.fed = len(tokens)

    def schema_paths(self, call: Call, tokens: list[int], depth: int) -> list[tuple[tuple[int, ...], float]]:
        """Every prefix of the skeleton's alternatives, as token paths, each with the summed share
        of the alternatives through it (at most 1)."""
        score: dict[tuple[int, ...], float] = {}
        for alt in call.state.continuations():
            ids = self.in_context(tokens, alt.text) if alt.text else []
            if alt.end and self.end_ids:
                ids = ids + [self.end_ids[0]]
            if self.vocab_limit is not None:
                ids = ids[: next((i for i, t in enumerate(ids) if t >= self.vocab_limit), len(ids))]
            for d in range(1, min(depth, len(ids)) + 1):
                path = tuple(ids[:d])
                score[path] = min(1.0, score.get(path, 0.0) + alt.share)
        return list(score.items())

    def in_context(self, tokens: list[int], text: str) -> list[int]:
        """`text`'s tokens as they would follow the committed tokens: the last TAIL tokens' text and
        `text` tokenised together, the part after the committed text kept (`text` alone when a
        token would straddle the boundary)."""
        tail = tokens[-TAIL:]
        before = self.codec.decode(tail)
        ids = self.codec.encode(before + text)
        for k in range(1, min(len(ids), len(tail) + 2) + 1):
            if self.codec.decode(ids[:k]) == before:
                return ids[k:]
        return self.codec.encode(text)

    def stats(self) -> dict:
        c = self.counts
        return {"requests": c.requests, "requests_with_tools": c.with_tools, "tools_parsed": c.tools,
                "schema_drafted": c.schema_drafted, "schema_accepted": c.schema_accepted,
                "requests_helped": c.requests_helped}


# -- registration ---------------------------------------------------------------------------------
def build(retrieval: bool, shape, target, target_path: Path) -> ToolSpecDrafter:
    from ..weights.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(target_path)
    end = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    drafter = ToolSpecDrafter(Codec(tokenizer), end, vocab_limit=target.config.vocab_size, retrieval=retrieval)
    drafter.name = "toolspec" if retrieval else "toolspec:retrieval=off"
    return drafter


register(DrafterEntry("toolspec", USAGE, ToolSpecDrafter.capabilities, build=build, parse_argument=parse_argument))
