"""The packaged SmolLM2 (its own q4, the C kernels) through the serving engine as `outrider serve`
runs it (chunked prefill, requests arriving while others decode, n-gram speculation) against
`LLM.generate` (the whole prompt in one prefill): the same token ids, on every variant of the C
kernels this machine executes (issue 30 item 6; kernel_variants.py). (Speculative == autoregressive
on each variant: test_native_layer.py; on SmolLM2: test_quant_smollm2.py and others, default variant.)
"""

import pytest

from kernel_variants import ALL, variant  # noqa: F401  (variant: the fixture)

pytestmark = pytest.mark.model

PROMPTS = ["Here is a list of the days of the week, one a line:\nMonday\nTuesday\nWednesday\n",
           "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return"]
NEW = 12


@pytest.fixture(scope="module")
def llm():
    from outrider.llm import LLM

    return LLM("smollm2-135m-instruct", drafter="ngram", controller="fixed:4", device="cpu")


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_chunked_prefill_in_the_engine_equals_generate(llm, variant):
    from outrider.engine.loop import EngineLoop
    from outrider.engine.request import Request
    from outrider.kernels import native

    assert llm.target.quantization == "q4" and native.variant() == variant
    want = [c.token_ids for c in llm.generate(PROMPTS, max_new_tokens=NEW)]
    requests = [Request(llm.encode(p), NEW) for p in PROMPTS]
    assert min(len(r.prompt_ids) for r in requests) > 16  # several chunks each
    engine = EngineLoop(llm.target, llm.eos_ids, llm.speculator, max_running=2, chunk_size=8)
    ids, done, step = [], {}, 0
    while engine.has_work or step < len(requests):
        if step < len(requests):  # one arrives a step, while the earlier ones prefill and decode
            ids.append(engine.add(requests[step]))
        for event in engine.step():
            if event.completion is not None:
                done[event.request_id] = event.completion
        step += 1
    served = [done[i] for i in ids]
    assert [c.token_ids for c in served] == want
    assert all(len(t) == NEW for t in want)
    assert sum(c.round_stats.committed for c in served) > sum(c.round_stats.rounds for c in served)  # drafts accepted
