"""A stop string at the very start of the output: the sequence ends with no output at all, in
plain decoding and inside a speculative round alike, and its counts go to zero (no round
produced a kept token). The stopping rules' recount must then leave nothing to adjust."""

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

PROMPT = [5, 9, 14, 5, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = add_tokenizer(make_tiny("llama", tmp_path_factory.mktemp("stops") / "t", vocab=96, seed=3))
    tok = AutoTokenizer.from_pretrained(str(folder))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    return load_decoder(folder, "cpu"), decode


def test_stop_string_at_the_start_leaves_no_output(model):
    target, decode = model
    with one_thread():
        ref = generate_ids(target, [Request(PROMPT, 12, ignore_eos=True)], set())[0].token_ids
        stop = decode(ref)[:1]  # the output's first character: it ends the text before it starts
        assert stop
        drafter = OracleDrafter({tuple(PROMPT): ref}, vocab=96)
        spec = Speculator(SpecOptions("oracle", "chain", "fixed:4"), drafter, FixedController(4), parse_shape("chain"))
        for speculation in (None, spec):
            done = generate_ids(target, [Request(PROMPT, 12, SamplingParams(), (stop,))], set(),
                                speculation=speculation, decode=decode)[0]
            assert (done.token_ids, done.text, done.finish_reason) == ([], "", "stop")
            assert done.stats["committed"] == done.round_stats.rounds == 0 and done.round_stats.committed_by_round == []
