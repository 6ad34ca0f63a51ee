"""`outrider serve --pipeline-stages 2` on Ray (outrider/cluster/pipeline_ray.py), on a tiny model.

One Ray instance and one server for the module (its 2 stages are actors that load the model):
with a draft model, mask rewind and 2 micro-batches its greedy text over HTTP equals one
process's; its target then decodes without a drafter, giving one process's tokens; last, a stage
killed makes the next generate fail with one line naming the stage. The stage logic itself is
tested in-process (tests/test_pipeline.py)."""

from __future__ import annotations

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("uvicorn")

from test_serve_api import LiveServer  # noqa: E402
from tiny import add_tokenizer, make_tiny  # noqa: E402

from outrider.cluster.pipeline import StageDied  # noqa: E402
from outrider.llm import LLM  # noqa: E402

PROMPTS = ["hello world", "abc def ghi", "zz"]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # projections of multiples of 32 inputs: at q4 the native layer runs every stage
    return add_tokenizer(make_tiny("llama", tmp_path_factory.mktemp("piperay") / "t", layers=5,
                                   intermediate_size=128))


@pytest.fixture(scope="module")
def served(ray_local, target):
    srv = LiveServer(target, drafter=f"draft-model:{target}", controller="fixed:4", dtype="q4", pipeline_stages=2,
                     pipeline_rewind="mask", pipeline_micro_batches=2)
    yield srv
    if srv.thread.is_alive():
        srv.close()
    srv.state.llm.target.close()


def test_serve_with_two_stages_gives_one_process_text(served, target):
    # the target drafting for itself: rounds of several tokens
    one = LLM(str(target), drafter=f"draft-model:{target}", device="cpu", threads=1, dtype="q4")
    expected = [c.text for c in one.generate(PROMPTS, 24)]
    assert len(served.state.llm.target.stages.where()) == 2
    for prompt, text in zip(PROMPTS, expected):
        body = {"model": served.name, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        reply = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == text
    assert served.state.llm.target.traversals < 3 * 24  # each verify pass committed several tokens


def test_plain_decoding_on_the_stages_then_a_stage_dies(served, target):
    served.close()  # the engine thread stops; its LLM's target (the stages) stays
    llm = served.state.llm
    llm.speculator = None  # autoregressive through the same stages, 3 sequences in 2 micro-batches
    one = LLM(str(target), device="cpu", threads=1, dtype="q4")
    assert [c.token_ids for c in llm.generate(PROMPTS, 16)] == [c.token_ids for c in one.generate(PROMPTS, 16)]
    ray.kill(llm.target.stages.handles[1])
    with pytest.raises(StageDied) as err:
        llm.generate(PROMPTS, 4)
    message = str(err.value)
    assert "\n" not in message and message.startswith("pipeline stage 1 (layers 3-4) died")
