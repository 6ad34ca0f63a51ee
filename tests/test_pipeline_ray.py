"""`outrider serve --pipeline-stages 2` on Ray (outrider/cluster/pipeline_ray.py), on a tiny model.

One Ray instance for the module. The server's greedy text with a draft model equals one
process's; through `split_llm`, without a drafter and with mask rewind and micro-batches, the
tokens equal one process's too; then a stage killed makes the next generate fail with one line
naming the stage. The stage logic itself is tested in-process (tests/test_pipeline.py)."""

from __future__ import annotations

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("uvicorn")

from test_serve_api import LiveServer  # noqa: E402
from tiny import add_tokenizer, make_tiny  # noqa: E402

from outrider.cluster.pipeline import StageDied  # noqa: E402
from outrider.cluster.pipeline_llm import split_llm  # noqa: E402
from outrider.llm import LLM  # noqa: E402

PROMPTS = ["hello world", "abc def ghi", "zz"]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # projections of multiples of 32 inputs: at q4 the native layer runs every stage
    return add_tokenizer(make_tiny("llama", tmp_path_factory.mktemp("piperay") / "t", layers=5,
                                   intermediate_size=128))


def test_serve_with_two_stages_gives_one_process_text(ray_local, target):
    drafter = f"draft-model:{target}"  # the target drafting for itself: rounds of several tokens
    one = LLM(str(target), drafter=drafter, device="cpu", threads=1, dtype="q4")
    expected = [c.text for c in one.generate(PROMPTS, 24)]
    srv = LiveServer(target, drafter=drafter, controller="fixed:4", dtype="q4", pipeline_stages=2)
    try:
        assert len(srv.state.llm.target.stages.where()) == 2
        for prompt, text in zip(PROMPTS, expected):
            body = {"model": srv.name, "prompt": prompt, "max_tokens": 24, "temperature": 0}
            reply = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
            assert reply["choices"][0]["text"] == text
        assert srv.state.llm.target.traversals < 3 * 24  # each verify pass committed several tokens
    finally:
        srv.close()
        srv.state.llm.target.close()


def test_plain_decoding_with_mask_rewind_and_micro_batches_then_a_stage_dies(ray_local, target):
    one = LLM(str(target), device="cpu", threads=1, dtype="q4")
    expected = [c.token_ids for c in one.generate(PROMPTS, 16)]
    llm = LLM(str(target), device="cpu", threads=1, dtype="q4")
    split_llm(llm, 2, transport="ray", rewind="mask", micro_batches=2, dtype="q4", threads=1)
    try:
        assert [c.token_ids for c in llm.generate(PROMPTS, 16)] == expected
        ray.kill(llm.target.stages.handles[1])
        with pytest.raises(StageDied) as err:
            llm.generate(PROMPTS, 4)
        message = str(err.value)
        assert "\n" not in message and message.startswith("pipeline stage 1 (layers 3-4) died")
    finally:
        llm.target.close()
