"""Every OpenAI parameter honoured or refused (issue 25 items 1, 2, 4, 6): checked before admission
with a 400 naming the field, the server healthy after; what is honoured equals the engine run
on the same Request; the small items (int64 seeds, 404/405/401 bodies, text/plain refused, the
API key compared in constant time, time per output token observed per token)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import torch

from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.errors import ConfigError
from outrider.llm import LLM
from outrider.sampling import SamplingParams
from outrider.serve.api import GOLDEN
from outrider.serve.server import ServeOptions, build
from test_serve_api import KEY, LiveServer, metric, words

AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 96  # the tiny models' (tests/tiny.py)


@pytest.fixture(scope="module")
def tiny(tiny_folders):
    return tiny_folders["llama"]


@pytest.fixture(scope="module")
def server(tiny):
    srv = LiveServer(tiny, drafter="ngram", controller="fixed:3", api_key=KEY, max_running=4, chunk_size=16)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def offline(tiny, server):
    torch.set_num_threads(1)
    return LLM(str(tiny), device="cpu")


def post(srv, body: dict, chat: bool = False, **kw) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(srv.url + path, json=body, headers=AUTH, timeout=60, **kw)


def alone(llm: LLM, request: Request):
    """The request run by itself on a plain (non-speculative) engine: what the server must return."""
    engine = EngineLoop(llm.target, llm.eos_ids, None, decode=llm.decode, max_len=256)
    return engine.run_all([request])[0]


def ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer(text)["input_ids"]


def assert_error(r: httpx.Response, status: int, param: str | None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert "\n" not in error["message"]
    return error


def healthy(srv) -> bool:
    return httpx.get(srv.url + "/health").json() == {"status": "ok"} and post(
        srv, {"prompt": "w5 w6", "max_tokens": 2, "temperature": 0}).status_code == 200


# -- 1. validation before admission -------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": [VOCAB], "max_tokens": 4}, "prompt"),  # the issue's reproduction: one past the vocabulary
    ({"prompt": [[5, 6], [3, -1]]}, "prompt"),
    ({"prompt": "w5", "stop_token_ids": [VOCAB + 7]}, "stop_token_ids"),
    ({"prompt": "w5", "logit_bias": {str(VOCAB): 5}}, "logit_bias"),
    ({"prompt": "w5", "logit_bias": {"w5": 5}}, "logit_bias"),
    ({"prompt": "w5", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "w5", "max_tokens": 300}, "max_tokens"),  # 1 + 300 > the 256-token context: not capped
    ({"prompt": "w5", "temperature": 2.5}, "temperature"),
    ({"prompt": "w5", "temperature": -1}, "temperature"),
    ({"prompt": "w5", "top_p": 0}, "top_p"),
    ({"prompt": "w5", "top_p": 1.5}, "top_p"),
    ({"prompt": "w5", "top_k": -2}, "top_k"),
    ({"prompt": "w5", "min_p": 2}, "min_p"),
    ({"prompt": "w5", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "w5", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "w5", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "w5", "seed": 2**63}, "seed"),
    ({"prompt": "w5", "n": 0}, "n"),
    ({"prompt": "w5", "logprobs": 21}, "logprobs"),
    ({"prompt": "", "max_tokens": 2}, "prompt"),
    ({"prompt": "w5", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
])
def test_bad_values_are_refused_before_admission_naming_the_field(server, body, param):
    assert_error(post(server, body), 400, param)


def test_bad_chat_values_name_the_field(server):
    user = [{"role": "user", "content": "w5 w6"}]
    cases = [({"messages": user, "max_completion_tokens": 400}, "max_completion_tokens"),
             ({"messages": user, "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true (vLLM)
             ({"messages": user, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages")]
    for body, param in cases:
        assert_error(post(server, body, chat=True), 400, param)
    assert healthy(server)


def test_the_server_stays_healthy_after_every_refusal(server):
    for body in ({"prompt": [VOCAB], "max_tokens": 4}, {"prompt": [10**9]}, {"prompt": "w5", "logit_bias": {"96": 1}}):
        assert post(server, body).status_code == 400
    assert healthy(server)
    assert server.state.worker.failed is None


@pytest.mark.model
def test_the_issue_reproduction_on_smollm2(smollm2_path):
    """`{"prompt": [49152], "max_tokens": 4}` killed the engine for everyone (issue 25, 1)."""
    srv = LiveServer(smollm2_path, drafter="ngram", controller="fixed:2", max_running=2, max_model_len=256)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [49152], "max_tokens": 4})
        error = assert_error(r, 400, "prompt")
        assert "49152" in error["message"] and "drafter" not in error["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and httpx.get(srv.url + "/health").json()["status"] == "ok"
    finally:
        srv.close()


# -- 2. honoured: equal to the engine run on the same Request -----------------------------------
def test_sampling_parameters_reach_the_engine(server, offline):
    body = {"prompt": words(3), "max_tokens": 10, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
            "seed": 11, "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2,
            "logit_bias": {"7": 2.5, "9": -3}, "stop_token_ids": [12], "user": "someone"}
    got = post(server, body).json()["choices"][0]
    params = SamplingParams(0.8, 20, 0.9, 11, 0.05, 1.2, 0.5, 0.3, logit_bias={7: 2.5, 9: -3})
    want = alone(offline, Request(ids(offline, words(3)), 10, params, stop_token_ids=(12,)))
    assert got["text"] == want.text


def test_greedy_logit_bias_forces_a_token(server):
    text = post(server, {"prompt": words(4), "max_tokens": 6, "temperature": 0, "logit_bias": {"7": 100}}).json()
    assert text["choices"][0]["text"] == " ".join(["w7"] * 6)
    banned = post(server, {"prompt": "w7 w7 w7", "max_tokens": 6, "temperature": 0,
                           "logit_bias": {"7": -100}}).json()["choices"][0]["text"]
    assert "w7" not in banned.split()


def test_a_stop_token_ends_the_output(server, offline):
    free = post(server, {"prompt": words(5), "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json()
    tokens = free["choices"][0]["text"].split()
    stop_id = int(tokens[3][1:])  # "w42" is id 42
    cut = post(server, {"prompt": words(5), "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                        "stop_token_ids": [stop_id]}).json()["choices"][0]
    first = tokens.index(tokens[3])
    assert cut["text"].split() == tokens[:first + 1] and cut["finish_reason"] == "stop"


def test_int64_seeds_and_n_samples(server):
    """Any int64 seed works (-1 and 2**64 - 1 are the same seed); choice i of n is the request with
    seed + i * GOLDEN alone, so the samples differ and each is reproducible."""
    base = {"prompt": words(6), "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    a = post(server, {**base, "seed": -1}).json()["choices"][0]["text"]
    assert post(server, {**base, "seed": -1}).json()["choices"][0]["text"] == a
    assert post(server, {**base, "seed": -2**63}).status_code == post(server, {**base, "seed": 2**63 - 1}).status_code == 200
    out = post(server, {**base, "seed": 5, "n": 3}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and out["usage"]["completion_tokens"] == 24
    texts = [c["text"] for c in out["choices"]]
    for i, text in enumerate(texts):
        seed = (5 + i * GOLDEN) % 2**64
        seed = seed - 2**64 if seed >= 2**63 else seed  # as a client sends it: an int64
        assert post(server, {**base, "seed": seed}).json()["choices"][0]["text"] == text
    assert len(set(texts)) > 1 and texts[0] == post(server, {**base, "seed": 5}).json()["choices"][0]["text"]


def test_several_prompts_and_n_give_prompt_major_choices(server, offline):
    out = post(server, {"prompt": [words(7), words(8)], "max_tokens": 5, "temperature": 0.7, "seed": 3, "n": 2}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == len(ids(offline, words(7))) + len(ids(offline, words(8)))
    solo = post(server, {"prompt": words(8), "max_tokens": 5, "temperature": 0.7, "seed": 3}).json()
    assert out["choices"][2]["text"] == solo["choices"][0]["text"]


def test_completion_logprobs_and_echo(server, offline):
    body = {"prompt": words(9), "max_tokens": 6, "temperature": 0, "logprobs": 3}
    choice = post(server, body).json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and len(lp["tokens"]) == 6
    assert " ".join(lp["tokens"]) == choice["text"]  # the word tokenizer joins tokens with spaces
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and top[token] == logprob and 3 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the likeliest
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    want = alone(offline, Request(ids(offline, words(9)), 6, SamplingParams(), logprobs=3))
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)

    echo = post(server, {**body, "echo": True}).json()["choices"][0]
    prompt_len = len(ids(offline, words(9)))
    assert echo["text"] == words(9) + choice["text"]
    assert echo["logprobs"]["tokens"][:prompt_len] == words(9).split()
    assert echo["logprobs"]["token_logprobs"][0] is None and echo["logprobs"]["top_logprobs"][0] is None
    assert echo["logprobs"]["token_logprobs"][prompt_len:] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    only = post(server, {"prompt": words(9), "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    assert only["choices"][0]["text"] == words(9) and only["usage"]["completion_tokens"] == 0
    assert len(only["choices"][0]["logprobs"]["tokens"]) == prompt_len


def test_chat_logprobs(server):
    body = {"messages": [{"role": "user", "content": words(10)}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    choice = post(server, body, chat=True).json()["choices"][0]
    content = choice["logprobs"]["content"]
    words_out = [c["token"] for c in content if c["token"] != "<|im_end|>"]  # EOS: in logprobs, not in the text
    assert " ".join(words_out) == choice["message"]["content"]
    assert len(content) == post(server, body, chat=True).json()["usage"]["completion_tokens"]
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"} and bytes(c["bytes"]).decode() == c["token"]
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"])
    plain = post(server, {**body, "logprobs": True, "top_logprobs": None}, chat=True).json()["choices"][0]
    assert all(c["top_logprobs"] == [] for c in plain["logprobs"]["content"])


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_and_usage_equal_the_whole_response(server, chat):
    if chat:
        body = {"messages": [{"role": "user", "content": words(11)}], "logprobs": True, "top_logprobs": 1}
    else:
        body = {"prompt": words(11), "logprobs": 1, "echo": True}
    body.update(max_tokens=7, temperature=0)
    whole = post(server, body, chat=chat).json()
    events = []
    with httpx.stream("POST", server.url + ("/v1/chat/completions" if chat else "/v1/completions"), headers=AUTH,
                      json={**body, "stream": True, "stream_options": {"include_usage": True,
                                                                        "continuous_usage_stats": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert events[-1]["usage"] == whole["usage"] and events[-1]["choices"] == []
    assert all("usage" in e for e in events)
    if chat:
        content = [c for e in events[:-1] for c in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
        assert content == whole["choices"][0]["logprobs"]["content"]
    else:
        merged = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        for e in events[:-1]:
            for k, v in (e["choices"][0]["logprobs"] or {}).items():
                merged[k] += v
        assert merged == whole["choices"][0]["logprobs"]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]


# -- 2. refused like vLLM, never ignored ------------------------------------------------------
@pytest.mark.parametrize("chat, extra, param", [
    (False, {"suffix": "x"}, "suffix"),
    (False, {"best_of": 3}, "best_of"),
    (False, {"best_of": 2, "n": 3}, "best_of"),
    (False, {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream (vLLM)
    (False, {"min_tokens": 3}, "min_tokens"),
    (False, {"messages": []}, "messages"),
    (False, {"guided_json": {}}, "guided_json"),
    (True, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto", as vLLM
    (True, {"tool_choice": "auto"}, "tool_choice"),
    (True, {"tools": [], "tool_choice": "none"}, "tools"),  # as vLLM and OpenAI
    (True, {"functions": [{"name": "f"}]}, "functions"),
    (True, {"echo": True}, "echo"),
    (True, {"store": True}, "store"),
    (True, {"audio": {"voice": "x"}}, "audio"),
    (True, {"logprobs": 2}, "logprobs"),
    (True, {"prompt": "w5"}, "prompt"),
    (True, {"frobnicate": 1}, "frobnicate"),
])
def test_unsupported_parameters_are_refused_not_ignored(server, chat, extra, param):
    base = {"messages": [{"role": "user", "content": "w5"}]} if chat else {"prompt": "w5"}
    assert_error(post(server, {**base, "max_tokens": 2, **extra}, chat=chat), 400, param)


def test_structured_outputs_where_llguidance_cannot_read_the_tokenizer_are_refused(server):
    """The tiny models' word-level tokenizer has no llguidance form: response_format and tool
    calls are a 400 naming the field, saying why (tests/test_serve_structured.py: SmolLM2)."""
    pytest.importorskip("llguidance")
    user = [{"role": "user", "content": "w5 w6"}]
    tool = {"type": "function", "function": {"name": "f"}}
    json_object = {"response_format": {"type": "json_object"}}
    for chat, body, param in ((True, {"messages": user, **json_object}, "response_format"),
                              (False, {"prompt": "w5", **json_object}, "response_format"),
                              (True, {"messages": user, "tools": [tool], "tool_choice": "required"}, "tools")):
        error = assert_error(post(server, {**body, "max_tokens": 2}, chat=chat), 400, param)
        assert error["code"] == "structured_outputs_unavailable" and "leave" in error["message"]
    assert healthy(server)


def test_neutral_values_and_no_effect_fields_are_accepted(server):
    user = [{"role": "user", "content": "w5 w6", "name": "ann"}]
    chat = {"messages": user, "max_tokens": 3, "temperature": 0, "response_format": {"type": "text"},
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none", "store": False,
            "metadata": {"a": "b"}, "user": "u", "service_tier": "auto",
            "parallel_tool_calls": True, "modalities": ["text"], "skip_special_tokens": True}
    assert post(server, chat, chat=True).status_code == 200
    completion = {"prompt": "w5 w6", "max_tokens": 3, "temperature": 0, "best_of": 1, "suffix": None, "echo": False,
                  "min_tokens": 0, "user": "u"}
    assert post(server, completion).status_code == 200


# -- 6. the smaller items -------------------------------------------------------------------------
def test_unknown_routes_and_methods_answer_the_openai_error_body(server):
    r = httpx.get(server.url + "/v1/nothing-here", headers=AUTH)
    assert_error(r, 404, None)
    r = httpx.delete(server.url + "/v1/completions", headers=AUTH)
    assert_error(r, 405, None)
    assert r.headers["allow"] == "POST"


def test_401_says_bearer_and_the_key_is_compared_in_constant_time(server, monkeypatch):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert_error(r, 401, None)
    assert r.headers["www-authenticate"] == "Bearer"
    import outrider.serve.api as api

    calls, real = [], api.hmac.compare_digest
    monkeypatch.setattr(api.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    assert calls == [(f"Bearer {KEY}".encode(), f"Bearer {KEY}".encode())]


def test_text_plain_bodies_are_refused(server):
    body = json.dumps({"prompt": "w5", "max_tokens": 2})
    for content_type in ("text/plain", None, "application/x-www-form-urlencoded"):
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert assert_error(r, 400, None)["code"] == "unsupported_media_type"
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_time_per_output_token_is_observed_per_token(server):
    name = "outrider:time_per_output_token_seconds_count"
    before, seconds = metric(server, name), metric(server, "outrider:time_per_output_token_seconds_sum")
    outs = [post(server, {"prompt": words(20 + i), "max_tokens": 9, "temperature": 0, "ignore_eos": True}).json()
            for i in range(3)]
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    assert metric(server, name) - before == tokens - 3  # every output token but each request's first
    assert metric(server, "outrider:time_per_output_token_seconds_sum") >= seconds


# -- 4. lengths and the context --------------------------------------------------------------
def test_max_model_len_above_the_context_is_an_error_at_startup(tiny):
    with pytest.raises(ConfigError, match="above the model's context of 256"):
        build(ServeOptions(model=str(tiny), device="cpu", threads=1, max_model_len=1024))
    from outrider.serve.server import max_model_len

    assert max_model_len(ServeOptions(), 256) == 256
    with pytest.raises(ConfigError, match="above the model's context of 256"):
        max_model_len(ServeOptions(max_model_len=2048), 256)  # given, not clamped
    assert max_model_len(ServeOptions(), 8192) == 2048 and max_model_len(ServeOptions(max_model_len=64), 256) == 64


def test_a_client_that_disconnects_frees_its_slot_within_a_round(tmp_path_factory):
    """Non-streaming: the handler watches for the disconnect beside its job, so the slot is freed
    at the next step, not when the request would have ended (or 0.25 s of silence)."""
    from tiny import add_tokenizer, make_tiny

    folder = add_tokenizer(make_tiny("llama", tmp_path_factory.mktemp("long") / "llama", max_positions=4096))
    srv = LiveServer(folder, max_running=2, max_model_len=4096)
    try:
        body = json.dumps({"prompt": words(50), "max_tokens": 4000, "ignore_eos": True, "speculate": False})
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(request)
            deadline = time.time() + 20
            while srv.state.worker.engine.num_running == 0:
                assert time.time() < deadline
                time.sleep(0.01)
            time.sleep(0.2)
        gone = time.time()
        while srv.state.worker.engine.num_running:
            assert time.time() - gone < 2, "the slot was not freed after the client left"
            time.sleep(0.005)
        assert metric(srv, "outrider:request_success_total", 'finished_reason="abort"') == 1
        assert metric(srv, "outrider:generation_tokens_total") < 4000
    finally:
        srv.close()


def test_docs_list_every_field():
    """docs/serving.md's table of OpenAI parameters names every field protocol.py knows."""
    from pathlib import Path

    from outrider.serve.protocol import FIELDS

    text = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    table = text[text.index("## OpenAI parameters"):text.index("## Options")]
    missing = [name for name in FIELDS if f"`{name}`" not in table]
    assert not missing, missing
