"""Every stopping point reached inside a multi-token round ends the sequence exactly where plain
decoding ends it (issue 29).

A round commits several tokens at once; EOS, a stop string (one that starts inside a token
too), `max_new_tokens` and the context limit must cut it at the same token plain decoding stops
at, with the same finish reason and counts. The oracle drafter (tests/oracle.py) proposes the
target's own continuation, so every draft on the reference path is accepted and the stopping
point lands, by construction, at the first, a middle, the last draft or the bonus token of a
round: chains, static and dynamic trees, greedy and seeded sampling.
"""

from __future__ import annotations

import pytest

from enumerate_law import one_thread
from oracle import OracleDrafter
from tiny import add_tokenizer, make_tiny

from outrider.control.controllers import FixedController
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder

DEPTH = 4
PROMPT = [5, 9, 14, 5, 9]
PLACES = {"first": 0, "middle": 2, "last draft": DEPTH - 1, "bonus": DEPTH}
SHAPES = ("chain", "static:2,2,1,1", "dynamic")
SAMPLING = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=7)}


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama whose continuation of PROMPT has new tokens a few rounds in."""
    return add_tokenizer(make_tiny("llama", tmp_path_factory.mktemp("stops") / "t", vocab=96, seed=3))


@pytest.fixture(scope="module")
def model(folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    return load_decoder(folder, "cpu"), decode


def reference(target, params: SamplingParams) -> list[int]:
    """The target's own continuation of PROMPT, past every stopping point (a copy: the plain
    decoding of one target and sampling is worked out once per module, see `plain_of`)."""
    key = ("reference", id(target), params)
    if key not in _PLAIN:
        _PLAIN[key] = generate_ids(target, [Request(PROMPT, 40, params, ignore_eos=True)], set())[0].token_ids
    return list(_PLAIN[key])


_PLAIN: dict = {}  # plain decoding's results, which do not depend on the shape or place of a case


@pytest.fixture(autouse=True, scope="module")
def _plain_results_forgotten():
    yield
    _PLAIN.clear()


def plain_of(target, decode, params, kind: str, sampling: str, setting: dict):
    """run(...) without speculation for a stop kind and sampling: the same for every shape and
    place of the round, so run once per module (the completion is only read)."""
    key = ("plain", id(target), kind, sampling)
    if key not in _PLAIN:
        _PLAIN[key] = run(target, decode, params, setting)
    return _PLAIN[key]


def stop_position(ref: list[int], decode) -> int:
    """Where to put the stopping point: an output position (past a few rounds) whose token is
    new there and where the stop string below first appears (tiny random models repeat
    themselves, so not every position will do)."""
    for p in range(12, 5, -1):
        if ref[p] not in ref[:p] and stop_string(ref, p, decode) not in decode(ref[:p]):
            return p
    raise AssertionError(f"no usable stopping point in {ref}: pick another prompt")


def stop_string(ref: list[int], p: int, decode) -> str:
    """From the last character of token p - 1 to the first characters of token p: it starts inside a token."""
    before, upto = decode(ref[:p]), decode(ref[:p + 1])
    return before[-1:] + upto[len(before):][:2]


def oracle_spec(ref: list[int], shape: str, at: int, place: int) -> tuple[Speculator, OracleDrafter]:
    drafter = OracleDrafter({tuple(PROMPT): ref}, shape, vocab=96, align=(at, place))
    kind = shape.partition(":")[0]
    options = SpecOptions("oracle", shape if kind == "static" else ("dynamic:3,3" if kind == "dynamic" else "chain"),
                          f"fixed:{DEPTH}")
    return Speculator(options, drafter, FixedController(DEPTH), parse_shape(options.tree)), drafter


def stop_setting(kind: str, ref: list[int], at: int, decode) -> dict:
    """What makes the sequence stop at output position `at`: request fields, eos ids, max_len."""
    if kind == "eos":
        return {"eos": {ref[at]}}
    if kind == "length":
        return {"max_new_tokens": at + 1}
    if kind == "stop string":
        return {"stop": (stop_string(ref, at, decode),)}
    if kind == "context":  # K/V rows for the prompt and `at` outputs: the last output is a root with no row
        return {"max_len": len(PROMPT) + at}
    raise ValueError(kind)


def run(target, decode, params, setting, speculation=None):
    """The completion, and how many target forwards it took (one prefill, then one a round)."""
    request = Request(PROMPT, setting.get("max_new_tokens", 30), params, setting.get("stop", ()))
    calls, forward = [0], target.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    target.forward = counted
    try:
        done = generate_ids(target, [request], setting.get("eos", set()), speculation=speculation, decode=decode,
                            max_len=setting.get("max_len"))[0]
    finally:
        del target.forward
    return done, calls[0]


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("kind", ["eos", "length", "stop string", "context"])
def test_stop_inside_a_round_equals_plain_decoding(model, kind, place, shape, sampling):
    target, decode = model
    params = SAMPLING[sampling]
    ref = reference(target, params)
    at = stop_position(ref, decode)
    setting = stop_setting(kind, ref, at, decode)
    plain, plain_forwards = plain_of(target, decode, params, kind, sampling, setting)
    spec, oracle = oracle_spec(ref, shape, at, PLACES[place])
    fast, fast_forwards = run(target, decode, params, setting, spec)
    assert fast.token_ids == plain.token_ids
    assert fast.text == plain.text and fast.finish_reason == plain.finish_reason
    assert plain.finish_reason == {"eos": "eos", "length": "length", "stop string": "stop", "context": "context"}[kind]
    for key in ("new_tokens", "committed"):
        assert fast.stats[key] == plain.stats[key] == len(plain.token_ids), key
    # the round that reached the stopping point really held several tokens, with it at `place`
    # (the context limit caps the last round's drafts to the rows left: only its start is aligned)
    assert len(plain.token_ids) == at + (kind != "stop string")  # a stop string's token p - 1 is kept
    first = at - PLACES[place]
    aligned = [k for start, k in oracle.rounds if start == first]
    assert kind == "context" or (aligned and aligned[0] >= max(PLACES[place], 1))
    assert fast.round_stats.rounds < plain.round_stats.rounds
    for done in (plain, fast):  # one count per round that produced kept tokens, adding up to them
        by_round = done.round_stats.committed_by_round
        assert len(by_round) == done.round_stats.rounds and min(by_round) > 0
        assert sum(by_round) == len(done.token_ids)
    if kind != "context":  # every round drafted: it committed what lies between round starts (if kept)
        starts = [start for start, _ in oracle.rounds]
        kept = [b - a for a, b in zip(starts, starts[1:] + [len(fast.token_ids)])]
        assert fast.round_stats.committed_by_round == [n for n in kept if n > 0]
    # no round past the stopping point: plain decoding stops at the round that commits token `at`
    assert plain_forwards == 1 + at + 1
    if kind != "context":  # the round reaching it is the last (the context's last rounds hold no drafts)
        assert oracle.rounds[-1][0] == first and fast_forwards == 1 + len(oracle.rounds)


@pytest.fixture(scope="module")
def llm(folder):
    """One LLM for the module's API cases (each sets its own speculator, after its plain run)."""
    from outrider import LLM

    return LLM(str(folder), device="cpu")


@pytest.mark.parametrize("place", list(PLACES))
def test_streamed_text_and_stop_through_llm_generate(llm, place):
    """The Python API front end: the oracle in an LLM, a stop string reached at each place of a
    round; streamed pieces add up to the text, equal to plain decoding's."""
    llm.speculator = None  # the previous case's oracle
    prompt = " ".join(f"w{t}" for t in PROMPT)
    ids = llm.encode(prompt)
    ref = generate_ids(llm.target, [Request(ids, 40, ignore_eos=True)], set())[0].token_ids
    at = stop_position(ref, llm.decode)
    stop = stop_string(ref, at, llm.decode)
    plain = llm.generate(prompt, 30, stop=stop)
    drafter = OracleDrafter({tuple(ids): ref}, vocab=llm.target.config.vocab_size, align=(at, PLACES[place]))
    llm.speculator = Speculator(SpecOptions("oracle", "chain", f"fixed:{DEPTH}"), drafter, FixedController(DEPTH),
                                parse_shape("chain"))
    pieces = []
    fast = llm.generate(prompt, 30, stop=stop, on_text=lambda i, text: pieces.append(text))
    assert (fast.text, fast.token_ids, fast.finish_reason) == (plain.text, plain.token_ids, "stop")
    assert "".join(pieces) == fast.text and stop not in fast.text


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_eos_at_the_length_limit_is_eos(model, sampling):
    """An EOS that is also the last token max_new_tokens allows ends as "eos" (OpenAI's "stop"),
    in a round that holds more tokens after it."""
    target, decode = model
    params = SAMPLING[sampling]
    ref = reference(target, params)
    at = stop_position(ref, decode)
    setting = {"eos": {ref[at]}, "max_new_tokens": at + 1}
    plain, _ = run(target, decode, params, setting)
    fast, _ = run(target, decode, params, setting, oracle_spec(ref, "chain", at, 2)[0])
    assert plain.finish_reason == fast.finish_reason == "eos"
    assert fast.token_ids == plain.token_ids == ref[: at + 1]


def test_ignore_eos_runs_on_through_a_round(model):
    """A request that ignores EOS runs past an EOS in the middle of a round, as plain decoding does."""
    target, decode = model
    ref = reference(target, SamplingParams())
    at = stop_position(ref, decode)
    request = Request(PROMPT, at + 6, ignore_eos=True)
    plain = generate_ids(target, [request], {ref[at]})[0]
    fast = generate_ids(target, [request], {ref[at]}, speculation=oracle_spec(ref, "chain", at, 2)[0])[0]
    assert fast.token_ids == plain.token_ids == ref[: at + 6] and fast.finish_reason == "length"


def test_without_a_tokenizer_there_is_no_text(model):
    """Token-level runs (the bench): no text in events or completions, and stop strings refused."""
    from outrider.engine.loop import EngineLoop
    from outrider.errors import ConfigError

    target, _ = model
    engine = EngineLoop(target, set(), max_running=1, max_len=64)
    engine.add(Request(PROMPT, 5))
    events = [e for _ in range(8) if engine.has_work for e in engine.step()]
    assert events and all(e.text == "" for e in events) and events[-1].completion.text is None
    with pytest.raises(ConfigError, match="stop strings need the engine's tokenizer"):
        engine.add(Request(PROMPT, 5, stop=("x",)))
