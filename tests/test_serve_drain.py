"""`outrider serve` as a process: SIGTERM drains (running requests finish, new ones get 503,
exit 0); without the serve extra it says how to install it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from outrider.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_then_exits_zero(tiny_folders):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from outrider.cli import main; sys.exit(main())", "serve",
         "--model", str(tiny_folders["llama"]), "--port", str(port), "--device", "cpu", "--threads", "1",
         "--max-running", "2", "--max-model-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"prompt": "w5 w6 w7", "max_tokens": 150, "temperature": 0, "stream": True, "ignore_eos": True}
        results: list[list[dict]] = [[], []]
        started = [threading.Event(), threading.Event()]

        def stream(i):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        results[i].append(json.loads(line[6:]))
                        started[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)
        proc.send_signal(signal.SIGTERM)
        late = None
        for _ in range(50):  # the drain begins when the signal is handled
            late = httpx.post(url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2}, timeout=10)
            if late.status_code == 503:
                break
            time.sleep(0.01)
        assert late.status_code == 503 and late.json()["error"]["type"] == "server_error"
        for t in threads:
            t.join(60)
        for chunks in results:  # both running requests finished whole
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["outrider"]["rounds"] >= 1
        assert proc.wait(30) == 0
        log = proc.stderr.read()  # the startup line records the config, the CPU and the kernels
        assert "config: " in log and "cpu: " in log and "kernels: " in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_without_the_extra_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError
    assert main(["serve", "--model", "nowhere"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'outrider[serve]'" in err
