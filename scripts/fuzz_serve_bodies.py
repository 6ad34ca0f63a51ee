"""The requests scripts/fuzz_serve.py sends and how their answers are judged: hypothesis
strategies of request bodies (valid sampling parameters, or exactly one bad field), each with what
it expects back (a 200, a 400 naming the field, or either for a prompt that meets an injected
fault), and the check of each answer against the response models (serve/schema.py) and that
expectation.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import httpx


def fault_ids(vocab: int) -> tuple[int, int]:
    """(drafter fault, NaN fault): a prompt holding one of these token ids meets that fault."""
    return vocab - 2, vocab - 1


FAULTS = ("drafter", "nan")


# -- responses checked against the models ---------------------------------------------------------
@dataclass
class Outcome:
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    requests: int = 0
    faulted: int = 0  # 500s or error events on prompts that met an injected fault
    faulted_500: int = 0  # of which 500s

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)


def check_answer(r: httpx.Response, body: dict, chat: bool, events: list | None, expect: tuple, outcome: Outcome):
    """expect: ("ok",) or ("bad", param) or ("either",) (a prompt that meets an injected fault)."""
    from pydantic import ValidationError

    from outrider.serve.schema import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk,
                                       CompletionResponse, ErrorResponse)

    outcome.statuses[r.status_code] += 1
    show = json.dumps(body)[:300]
    try:
        if r.status_code != 200:
            error = ErrorResponse.model_validate_json(r.content).error
            if expect[0] == "bad" and (r.status_code != 400 or error.param != expect[1]):
                outcome.fail(f"expected a 400 naming {expect[1]}, got {r.status_code} {error}: {show}")
            elif expect[0] == "ok":
                outcome.fail(f"expected a 200, got {r.status_code} {error.message}: {show}")
            elif r.status_code >= 500:
                outcome.faulted += 1
                outcome.faulted_500 += 1
            return
        if expect[0] == "bad":
            outcome.fail(f"expected a 400 naming {expect[1]}, got 200: {show}")
            return
        if events is None:
            model = ChatCompletionResponse if chat else CompletionResponse
            answer = model.model_validate_json(r.content)
            choices = len(answer.choices)
            tokens = answer.usage.completion_tokens
        else:
            chunk_model = ChatCompletionChunk if chat else CompletionChunk
            if events[-1] != "[DONE]":
                outcome.fail(f"a stream did not end with [DONE]: {show}")
                return
            errors, indexes, tokens = 0, set(), None
            for data in events[:-1]:
                payload = json.loads(data)
                if "error" in payload:
                    ErrorResponse.model_validate(payload)
                    errors += 1
                    continue
                chunk = chunk_model.model_validate(payload)
                indexes |= {c.index for c in chunk.choices}
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            if errors:
                if expect[0] == "either":
                    outcome.faulted += 1
                else:
                    outcome.fail(f"a stream carried an error event: {events[-2][:200]}: {show}")
                return
            choices = len(indexes)
        n = body.get("n") or 1
        prompts = body["prompt"] if isinstance(body.get("prompt"), list) and body["prompt"] and \
            not isinstance(body["prompt"][0], int) else [None]
        if choices != n * len(prompts):
            outcome.fail(f"{choices} choices for n={n} and {len(prompts)} prompt(s): {show}")
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        if tokens is not None and limit is not None and tokens > limit * choices:
            outcome.fail(f"{tokens} output tokens for max_tokens {limit}: {show}")
    except (ValidationError, ValueError, KeyError) as err:
        outcome.fail(f"an answer that does not fit the schema ({str(err)[:300]}): {show}")


# -- hypothesis: sampling parameters ------------------------------------------------------------
def strategies(vocab: int, max_len: int, faults=()):
    """(valid, invalid): strategies of (chat, body, expect, raw body or None)."""
    from hypothesis import strategies as st

    word = st.integers(3, min(vocab, 96) - 3).map(lambda i: f"w{i}")  # never a fault id (tiny models' words)
    text = st.lists(word, min_size=1, max_size=8).map(" ".join)
    ids = st.lists(st.integers(0, vocab - 3), min_size=1, max_size=8)
    prompt = st.one_of(text, ids, st.lists(text, min_size=1, max_size=2), st.lists(ids, min_size=1, max_size=2))
    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_infinity=False)  # noqa: E731
    opt = lambda s: st.one_of(st.none(), s)  # noqa: E731

    @st.composite
    def valid(draw):
        chat = draw(st.booleans())
        temperature = draw(opt(st.one_of(st.just(0.0), floats(0.05, 2.0))))
        body = {
            "max_tokens": draw(st.integers(1, 4)), "temperature": temperature, "top_p": draw(opt(floats(0.01, 1.0))),
            "top_k": draw(opt(st.integers(-1, 200))), "min_p": draw(opt(floats(0.0, 1.0))),
            "presence_penalty": draw(opt(floats(-2, 2))), "frequency_penalty": draw(opt(floats(-2, 2))),
            "repetition_penalty": draw(opt(floats(0.05, 3.0))),
            "logit_bias": draw(opt(st.dictionaries(st.integers(0, vocab - 1).map(str), floats(-100, 100), max_size=4))),
            "seed": draw(opt(st.integers(-2**63, 2**63 - 1))),
            "stop": draw(opt(st.one_of(word, st.lists(st.text(min_size=1, max_size=4), max_size=3)))),
            "stop_token_ids": draw(opt(st.lists(st.integers(0, vocab - 1), max_size=3))),
            "ignore_eos": draw(opt(st.booleans())), "speculate": draw(opt(st.booleans())),
            "max_draft_tokens": draw(opt(st.integers(0, 6))), "user": draw(opt(st.text(max_size=5))),
        }
        if temperature != 0.0 and draw(st.booleans()):
            body["n"] = draw(st.integers(1, 3))
        body["stream"] = draw(st.booleans())
        if body["stream"] and draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans()),
                                      "continuous_usage_stats": draw(st.booleans())}
        if chat:
            body["messages"] = [{"role": draw(st.sampled_from(["user", "system", "assistant"])), "content": m}
                                for m in draw(st.lists(text, min_size=1, max_size=2))]
            body["messages"][-1]["role"] = "user"
            if draw(st.booleans()):
                body["logprobs"] = True
                body["top_logprobs"] = draw(opt(st.integers(0, 20)))
        else:
            body["prompt"] = draw(prompt)
            body["logprobs"] = draw(opt(st.integers(0, 20)))
            body["echo"] = draw(opt(st.booleans()))
            if body["echo"] and not body["stream"] and draw(st.booleans()):
                body["max_tokens"] = 0
        expect = ("ok",)
        if faults and not chat and draw(st.integers(0, 9)) == 0:  # hypothesis draws 0 more often than 1 in 10
            ids_of = dict(zip(FAULTS, fault_ids(vocab)))
            body["prompt"] = [ids_of[draw(st.sampled_from(sorted(faults)))]] + draw(ids)
            expect = ("either",)
        return chat, body, expect, None

    bad_values = {
        "temperature": st.one_of(floats(2.01, 1e6), floats(-1e6, -0.01), st.text(max_size=3), st.booleans()),
        "top_p": st.one_of(floats(-5, 0), floats(1.01, 10)), "top_k": st.integers(-10**6, -2),
        "min_p": st.one_of(floats(1.01, 9), floats(-9, -0.01)),
        "presence_penalty": st.one_of(floats(2.01, 1e9), floats(-1e9, -2.01)),
        "frequency_penalty": st.one_of(floats(2.01, 1e9), floats(-1e9, -2.01)),
        "repetition_penalty": floats(-9, 0), "seed": st.one_of(st.integers(2**63, 2**70), st.integers(-2**70, -2**63 - 1)),
        "logit_bias": st.one_of(st.integers(vocab, vocab + 10**6).map(lambda t: {str(t): 1}),
                                st.text(min_size=1, max_size=3).filter(lambda k: not k.isdigit()).map(lambda k: {k: 1}),
                                floats(100.5, 1e6).map(lambda b: {"3": b})),
        "n": st.one_of(st.integers(-5, 0), st.integers(129, 10**4)),
        "stop_token_ids": st.integers(vocab, vocab + 1000).map(lambda t: [t]),
        "max_tokens": st.one_of(st.integers(max_len, max_len * 4), st.integers(-100, -1)),
        "stop": st.just(["", "w5"]), "frobnicate": st.integers(),
    }

    @st.composite
    def invalid(draw):
        chat, body, _, _ = draw(valid())
        if draw(st.integers(0, 9)) == 0:  # a body that is not JSON at all, or NaN
            raw = draw(st.sampled_from(['{"prompt": "w5", "temperature": NaN}', "{", '["w5"]', '"w5"', "null"]))
            return chat, body, ("bad", None), raw
        name = draw(st.sampled_from(sorted(bad_values) + (["logprobs"] if not chat else ["top_logprobs"])))
        if name == "logprobs":
            value = draw(st.one_of(st.integers(21, 10**4), st.integers(-100, -1)))
        elif name == "top_logprobs":
            body["logprobs"] = True
            value = draw(st.integers(21, 10**4))
        else:
            value = draw(bad_values[name])
        if name == "max_tokens" and chat:
            body.pop("max_completion_tokens", None)
        if name == "n" and (body.get("temperature") == 0.0):
            body["temperature"] = 1.0
        body[name] = value
        if chat and name == "prompt":
            return chat, body, ("bad", "prompt"), None
        return chat, body, ("bad", name), None

    return valid, invalid


def draw_items(count: int, vocab: int, max_len: int, seed: int, faults=()) -> list[tuple]:
    """`count` items (about one in four invalid), drawn by hypothesis with a fixed seed."""
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st

    valid, invalid = strategies(vocab, max_len, faults)
    items: list[tuple] = []

    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(valid(), valid(), valid(), invalid()))
    def collect(item):
        items.append(item)

    from hypothesis import seed as fixed_seed

    fixed_seed(seed)(collect)()
    return items[:count]
