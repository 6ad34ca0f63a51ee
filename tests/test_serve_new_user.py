"""What a new user hit on `outrider serve` (issue 38 item 6), each on a tiny model: an oversized
body is a quick 413 (by its Content-Length before it is read, or while a chunked one is read);
tokenizing a prompt holds up neither /health nor the requests beside it; a --tree sampled:...
server refuses a greedy request naming temperature, and `serve --help` lists sampled; serve takes
--verifier; a port in use is one line before anything loads; an empty stop string is ignored as
the CLI and LLM.generate ignore it; a request without `model` is answered, as the docs say."""

from __future__ import annotations

import copy
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from outrider.cli import main
from outrider.serve.state import Encoders
from test_serve_api import LiveServer, words


@pytest.fixture(scope="module")
def tiny(tiny_folders):
    return tiny_folders["llama"]


@pytest.fixture(scope="module")
def server(tiny):
    srv = LiveServer(tiny, drafter="ngram", controller="fixed:3", max_running=4, max_body_mb=1)
    yield srv
    srv.close()


def post(srv, body: dict, chat: bool = False, timeout: float = 60) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(srv.url + path, json=body, timeout=timeout)


def error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert "\n" not in err["message"]
    return err


# -- the body's size ---------------------------------------------------------------------------------
def test_a_huge_body_is_refused_by_its_length_before_it_is_read(server):
    """20 MB announced, 100 bytes sent: the 413 comes at once (the server did not wait for the rest)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        start = time.time()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 20000000\r\n\r\n" + b'{"prompt": "' + b"w5 " * 30)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    assert time.time() - start < 5
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b'"code":"request_too_large"' in body and b"--max-body-mb" in body


def test_a_huge_body_sent_whole_gets_a_quick_413(server):
    start = time.time()
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"w5 " * 7_000_000 + b'"}',
                   headers={"Content-Type": "application/json"}, timeout=60)
    err = error(r, 413, None)
    assert err["code"] == "request_too_large" and "1 MiB" in err["message"], err
    assert time.time() - start < 10


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    sent = []

    def chunks():
        yield b'{"prompt": "'
        for _ in range(200):  # 200 x 64 KiB, 12.5 MiB, if it were all read
            sent.append(1)
            yield b"w5 " * 21845
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert "content-length" not in r.request.headers  # chunked
    assert error(r, 413, None)["code"] == "request_too_large"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_body_under_the_limit_is_served(server):
    r = post(server, {"prompt": "w5 " * 60_000, "max_tokens": 2})  # 180 kB: read, tokenized, too long
    assert error(r, 400, "prompt")["message"].startswith("the prompt has 60000 tokens")


# -- tokenizing beside the others ------------------------------------------------------------------
class Held:
    """A tokenizer whose encoding of a long text waits until released (as a megabyte prompt takes
    seconds); copies (Encoders) share the events."""

    def __init__(self, tok, started: threading.Event, release: threading.Event):
        self.tok, self.started, self.release = tok, started, release

    def __getattr__(self, name):  # chat_template, apply_chat_template: the tokenizer's
        return getattr(self.tok, name)

    def __call__(self, text, **kw):
        if len(text) > 500:
            self.started.set()
            self.release.wait(60)
        return self.tok(text, **kw)

    def __deepcopy__(self, memo):
        return Held(copy.deepcopy(self.tok, memo), self.started, self.release)


def test_health_and_other_requests_answer_while_a_long_prompt_is_tokenized(server, monkeypatch):
    state = server.state
    started, release = threading.Event(), threading.Event()
    monkeypatch.setattr(state, "encoders", Encoders(Held(state.llm.tokenizer, started, release),
                                                    state.tokenizer_lock))
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, server, {"prompt": words(5, 200), "max_tokens": 2})
        try:
            assert started.wait(30)
            t0 = time.time()
            assert httpx.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
            beside = post(server, {"prompt": words(6), "max_tokens": 6, "temperature": 0}, timeout=20)
            assert beside.status_code == 200 and beside.json()["choices"][0]["text"]  # decoded meanwhile
            chat = post(server, {"messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 3,
                                 "temperature": 0}, chat=True, timeout=20)  # tokenized with another copy
            assert chat.status_code == 200 and not slow.done() and time.time() - t0 < 20
        finally:
            release.set()
        assert slow.result().status_code == 200


# -- a sampled tree, --verifier, the port ------------------------------------------------------------
def test_a_sampled_tree_server_refuses_greedy_naming_temperature(tiny_folders, capsys):
    srv = LiveServer(tiny_folders["llama"], drafter=f"draft-model:{tiny_folders['llama-draft']}",
                     tree="sampled:2,2", controller="fixed:2", max_running=2)
    try:
        err = error(post(srv, {"prompt": words(1), "max_tokens": 4, "temperature": 0}), 400, "temperature")
        assert "temperature above 0" in err["message"] and "speculate: false" in err["message"]
        assert "--tree static" not in err["message"]  # not the CLI's advice
        for body in ({"temperature": 0.8, "seed": 1}, {"temperature": 0, "speculate": False}):
            assert post(srv, {"prompt": words(1), "max_tokens": 4, **body}).status_code == 200
    finally:
        srv.close()
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "sampled:2,2,1" in help_text and "--verifier" in help_text and "--max-body-mb" in help_text


def test_serve_takes_a_verifier(tiny, capsys):
    srv = LiveServer(tiny, drafter="ngram", controller="fixed:2", verifier="greedy_chain", max_running=2)
    try:
        assert srv.state.worker.engine.speculation.options.verifier == "greedy_chain"
        assert post(srv, {"prompt": words(2), "max_tokens": 4, "temperature": 0}).status_code == 200
        err = error(post(srv, {"prompt": words(2), "max_tokens": 4, "temperature": 0.7}), 400, "temperature")
        assert "greedy_chain" in err["message"], err
    finally:
        srv.close()
    assert main(["serve", "--model", str(tiny), "--drafter", "ngram", "--verifier", "nope"]) == 2
    assert "no such verifier" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny), "--verifier", "greedy_chain"]) == 2  # no drafter
    assert "--drafter" in capsys.readouterr().err


def test_a_port_in_use_is_one_line_before_anything_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.time()
        assert main(["serve", "--model", "nowhere-not-loaded", "--port", str(port)]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: port {port} is in use: pass --port N\n" and out.out == ""
    assert time.time() - start < 10


# -- stop strings, the model field -----------------------------------------------------------------
def test_an_empty_stop_string_is_ignored(server):
    base = {"prompt": words(3), "max_tokens": 12, "temperature": 0}
    plain = post(server, base).json()["choices"][0]["text"]
    assert post(server, {**base, "stop": ""}).json()["choices"][0]["text"] == plain
    stop = plain.split()[3]
    cut = post(server, {**base, "stop": [stop]}).json()["choices"][0]
    both = post(server, {**base, "stop": ["", stop]}).json()["choices"][0]
    assert both == cut and cut["finish_reason"] == "stop" and stop not in cut["text"]


def test_a_request_without_model_is_answered_and_the_docs_say_so(server):
    r = post(server, {"prompt": words(4), "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == server.name
    error(post(server, {"prompt": words(4), "max_tokens": 2, "model": "gpt-4o"}), 404, "model")
    docs = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    (row,) = [line for line in docs.splitlines() if line.startswith("| `model` |")]
    assert "optional" in row and "404" in row
    assert "413" in docs and "--max-body-mb" in docs
