"""llama.cpp's llama-server as a bench peer (bench/llama_server.py), against a stand-in server
(fixtures/fake_llama_server.py: its command line, /health and /completion), so no llama.cpp
build is needed: the command line each spec type starts, a completion's tokens and timings, the
fall back to --no-repack where its defaults crash, and a whole bench where one server crashes."""

import json
import stat
import sys
from pathlib import Path

import pytest

from outrider.bench import llama_server, peers
from outrider.bench import run as bench_run
from outrider.bench.methods import parse_config
from outrider.bench.peer_process import PeerFailed, PeerUnavailable
from outrider.cli import main
from outrider.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A llama-server stand-in on OUTRIDER_LLAMA_SERVER, a target and a draft folder with a GGUF,
    and the file its starts' argv go to."""
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FIXTURES / "fake_llama_server.py"}" "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    argv = tmp_path / "argv.jsonl"
    monkeypatch.setenv("OUTRIDER_LLAMA_SERVER", str(binary))
    monkeypatch.setenv("FAKE_LLAMA_SERVER_ARGV", str(argv))
    monkeypatch.delenv("FAKE_LLAMA_SERVER_MODE", raising=False)
    folders = {}
    for name in ("target", "draft"):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "original.gguf").write_bytes(b"GGUF")

    def starts() -> list[list[str]]:
        return [json.loads(line) for line in argv.read_text().splitlines()] if argv.exists() else []

    folders["starts"] = starts
    return folders


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_peer_kinds_parse_and_bad_ones_are_refused_in_one_line():
    assert llama_server.parse_kind("llama-server") == (None, None)
    assert llama_server.parse_kind("llama-server:ngram-mod") == ("ngram-mod", None)
    assert llama_server.parse_kind("llama-server:draft-simple:8") == ("draft-simple", 8)
    assert llama_server.parse_kind("llama-server:draft-dflash:7") == ("draft-dflash", 7)
    assert not llama_server.is_kind("llama.cpp") and llama_server.is_kind("llama-server:ngram-cache")
    for peer, why in [("llama-server:bogus", "spec type 'bogus' is not one"),
                      ("llama-server:ngram-mod:8", "applies to draft-simple and the learned draft-\\* types only"),
                      ("llama-server:draft-simple:0", "must be a positive integer")]:
        with pytest.raises(ConfigError, match=why):
            parse_config({"method": [{"name": "x", "peer": peer, "assistant": "d"}]}, "m.toml")
    with pytest.raises(ConfigError, match="^m.toml: method 'x': llama-server:draft-simple needs assistant"):
        parse_config({"method": [{"name": "x", "peer": "llama-server:draft-simple"}]}, "m.toml")
    assert parse_config({"method": [{"name": "x", "peer": "llama-server:ngram-cache"}]}, "m.toml").methods[0].peer \
        == "llama-server:ngram-cache"


def test_learned_draft_types_take_a_head_and_start_as_a_fixed_chain():
    """draft-eagle3 / dflash / dspark: `head` required there and refused elsewhere; the command line
    names the exported head as -md with the draft threads, and :N is a fixed chain of N (no n-min,
    no p-min cut), as ours under fixed:N; without :N its own defaults."""
    line = {"name": "x", "peer": "llama-server:draft-dflash:7", "head": "smollm2-135m-instruct"}
    method = parse_config({"method": [line]}, "m.toml").methods[0]
    assert method.head == "smollm2-135m-instruct" and "head smollm2-135m-instruct" in method.label
    for bad, why in [({"peer": "llama-server:draft-eagle3"}, "head = .* goes with llama-server:draft-eagle3"),
                     ({"peer": "llama-server:ngram-mod", "head": "h"}, "head = .* goes with llama-server:draft-eagle3"),
                     ({"peer": "transformers", "head": "h"}, "head goes with llama-server's learned"),
                     ({"drafter": "dflash:h", "head": "h"}, "head goes with a llama-server peer")]:
        with pytest.raises(ConfigError, match=f"^m.toml: method 'x': {why}"):
            parse_config({"method": [{"name": "x", **bad}]}, "m.toml")
    args = llama_server.server_args(Path("bin"), Path("t.gguf"), "llama-server:draft-dflash:7", 1, 80,
                                    Path("h.gguf"), repack=True)
    assert (flag(args, "--spec-type"), flag(args, "-md"), flag(args, "-td"), flag(args, "-tbd")) == \
        ("draft-dflash", "h.gguf", "1", "1")
    assert [flag(args, f) for f in ("--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min")] == ["7", "0", "0"]
    args = llama_server.server_args(Path("bin"), Path("t.gguf"), "llama-server:draft-eagle3", 2, 80, Path("h.gguf"),
                                    repack=False)
    assert flag(args, "-md") == "h.gguf" and flag(args, "--spec-type") == "draft-eagle3" and args[-1] == "--no-repack"
    assert "--spec-draft-n-max" not in args and "--spec-draft-p-min" not in args
    simple = llama_server.server_args(Path("bin"), Path("t.gguf"), "llama-server:draft-simple:4", 1, 80, Path("d.gguf"),
                                      repack=True)
    assert "--spec-draft-p-min" not in simple  # draft-simple keeps its own cut


def test_a_learned_peer_exports_its_head_and_deletes_it_when_closed(fake, monkeypatch):
    """The head is exported (here a stand-in writer) into the peer's own folder, started as -md,
    and the folder is gone after close; a kind this installation lacks is unavailable."""
    calls = []

    def export(kind, head, model_path, folder):
        calls.append((kind, head, model_path))
        (folder / f"{kind}.gguf").write_bytes(b"GGUF")
        return folder / f"{kind}.gguf"

    monkeypatch.setattr(llama_server, "export_head", export)
    peer = peers.make_peer("llama-server:draft-eagle3:4", fake["target"], assistant_path=None, lookup=10, threads=1,
                           head="my-head")
    run = peer.run([5, 6], 2)
    head_gguf = Path(flag(fake["starts"]()[0], "-md"))
    assert head_gguf.exists() and calls == [("eagle3", "my-head", fake["target"])]
    peer.close()
    assert not head_gguf.parent.exists() and run.output_ids == [7, 8]
    monkeypatch.undo()
    with pytest.raises(PeerUnavailable, match="no nosuch head kind with a GGUF export"):
        llama_server.export_head("nosuch", "h", fake["target"], fake["target"])
    with pytest.raises(PeerUnavailable, match="no shipped EAGLE-3 head of that name"):
        llama_server.export_head("eagle3", "no-such-head", fake["target"], fake["target"])


def test_draft_simple_starts_with_the_draft_and_threads_and_answers_with_its_timings(fake):
    peer = peers.make_peer("llama-server:draft-simple:8", fake["target"], assistant_path=fake["draft"], lookup=10,
                           threads=2)
    try:
        run = peer.run([5, 6, 7], 4)
    finally:
        peer.close()
    [args] = fake["starts"]()
    assert flag(args, "-m") == str(fake["target"] / "original.gguf")
    assert flag(args, "-md") == str(fake["draft"] / "original.gguf")
    assert (flag(args, "--spec-type"), flag(args, "--spec-draft-n-max")) == ("draft-simple", "8")
    assert [flag(args, f) for f in ("-t", "-tb", "-td", "-tbd")] == ["2"] * 4
    assert "--no-repack" not in args and peer.repack
    assert run.output_ids == [8, 9, 10, 11]
    s = run.stats
    assert (s["prefill_s"], s["predicted_per_token_ms"], s["draft_n"], s["draft_n_accepted"]) == (0.006, 5.0, 4, 2)
    assert s["new_tokens"] == 4 and s["server_s"] == pytest.approx(0.026)
    assert peer.note.startswith("llama-server -t 2 -tb 2") and "failed" not in peer.note
    assert peer.proc is None  # closed: the server was stopped


def test_plain_starts_without_speculation(fake):
    peer = peers.make_peer("llama-server", fake["target"], assistant_path=None, lookup=10, threads=1)
    run = peer.run([40], 2)
    peer.close()
    [args] = fake["starts"]()
    assert "--spec-type" not in args and "-md" not in args and flag(args, "-t") == "1"
    assert run.output_ids == [41, 42] and "draft_n" not in run.stats


def test_in_a_bench_that_samples_it_samples_our_law_seeded(fake, tmp_path, monkeypatch):
    """temperature then top-p, nothing else of its default chain (top-k 40, min-p 0.05), the
    prompt's seed in its seed field's range; greedy without sampling."""
    bodies = tmp_path / "bodies.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_BODIES", str(bodies))
    assert peers.samples("llama-server:ngram-mod") and peers.samples("transformers") and not peers.samples("llama.cpp")
    for sampling in ((0.7, 0.9), None):
        peer = peers.make_peer("llama-server:ngram-mod", fake["target"], assistant_path=None, lookup=10, threads=1,
                               sampling=sampling)
        run = peer.run([5, 6, 7], 4, *((2**40 + 3,) if sampling else ()))
        peer.close()
        assert run.output_ids == [8, 9, 10, 11]
        body = json.loads(bodies.read_text().splitlines()[-1])
        if sampling:
            assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["samplers"] == ["temperature", "top_p"]
            assert body["top_k"] == 0 and body["min_p"] == 0.0 and body["repeat_penalty"] == 1.0
            assert body["seed"] == (2**40 + 3) % 2**31
        else:
            assert body["temperature"] == 0.0 and "seed" not in body and "samplers" not in body


def test_where_repacked_weights_crash_it_runs_with_no_repack_and_says_so(fake, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "crash-unless-no-repack")
    peer = peers.make_peer("llama-server:ngram-mod", fake["target"], assistant_path=None, lookup=10, threads=1)
    run = peer.run([1, 2], 3)
    peer.close()
    first, second = fake["starts"]()
    assert "--no-repack" not in first and second[-1] == "--no-repack" and not peer.repack
    assert run.output_ids == [3, 4, 5]
    assert "--spec-type ngram-mod" in peer.note and "--no-repack" in peer.note
    assert "weight repacking on, it failed: crashed: its process was killed by SIGSEGV " \
           "(fake llama-server: segfault in ggml_compute_forward)" in peer.note


def test_a_server_that_fails_either_way_is_peer_failed_with_its_last_words(fake, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "crash-on-load")
    with pytest.raises(PeerFailed) as err:
        peers.make_peer("llama-server", fake["target"], assistant_path=None, lookup=10, threads=1)
    assert str(err.value) == "failed to load: its process exited with status 1 (fake llama-server: failed to load model)"
    assert len(fake["starts"]()) == 2  # with its defaults, then with --no-repack


def test_no_binary_or_no_gguf_is_unavailable(fake, tmp_path, monkeypatch):
    import outrider.config

    with pytest.raises(PeerUnavailable, match="no original GGUF at"):
        peers.make_peer("llama-server", tmp_path, assistant_path=None, lookup=10, threads=1)
    monkeypatch.delenv("OUTRIDER_LLAMA_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.setattr(outrider.config, "cache_dir", lambda: tmp_path / "cache")
    with pytest.raises(PeerUnavailable, match="scripts/build_llama_server.sh"):
        peers.make_peer("llama-server", fake["target"], assistant_path=None, lookup=10, threads=1)
    built = tmp_path / "cache/llama-server/0.3.36-x/build/bin/llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert llama_server.find_binary() == built
    assert fake["starts"]() == []


def test_a_bench_with_a_server_that_crashes_goes_on(fake, tiny_folders, tmp_path, capsys, monkeypatch):
    """ngram-mod's server answers its warm-up and first prompt, then segfaults: a FAILED row with
    its reason; the plain server and ours run every prompt, the plain one's timings kept."""
    monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "crash-after:2")
    real = peers.make_peer

    def make_peer(kind, model_path, **kw):  # the tiny model has no GGUF: the fake's folder stands in
        if kind == "llama-server:ngram-mod":
            monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "crash-after:2")
        else:
            monkeypatch.setenv("FAKE_LLAMA_SERVER_MODE", "ok")
        return real(kind, fake["target"], **kw)

    monkeypatch.setattr(bench_run, "make_peer", make_peer)
    methods = tmp_path / "methods.toml"
    model = tiny_folders["llama"]
    methods.write_text(f"""
models = ["{model}"]
workloads = ["jsonl:{FIXTURES / 'prompts.jsonl'}"]
max_new_tokens = 4

[[method]]
name = "ngram"
drafter = "ngram"

[[method]]
name = "server"
peer = "llama-server"

[[method]]
name = "server-ngram-mod"
peer = "llama-server:ngram-mod"
""")
    out = tmp_path / "out"
    code = main(["bench", "--methods", str(methods), "--out", str(out), "--threads", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads((out / "results.json").read_text())
    ran = {(r["method"], len(r["prompts"])) for r in results["runs"]}
    assert ran == {("autoregressive", 3), ("ngram", 3), ("server", 3)}
    server = next(r for r in results["runs"] if r["method"] == "server")
    assert all(p["stats"]["predicted_per_token_ms"] == 5.0 for p in server["prompts"])
    [failed] = results["skipped"]
    workload = results["runs"][0]["workload"]
    assert failed["method"] == "server-ngram-mod" and failed["failed"]
    assert failed["reason"].startswith("crashed: its process was killed by SIGSEGV (fake llama-server: segfault")
    assert failed["reason"].endswith(f"(on {workload} prompt prime)")  # its second prompt
    assert "FAILED: peer server-ngram-mod" in captured.out
    notes = {n["method"]: n["note"] for n in results["peer_notes"]}
    assert notes["server"].startswith("llama-server -t 1") and "--spec-type ngram-mod" in notes["server-ngram-mod"]
