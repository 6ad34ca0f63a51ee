"""`outrider bench` never loses a run: --out is checked before anything loads, each finished
prompt is saved at once, Ctrl-C says how to resume, and --resume finishes the run with the same
outputs and figures as an uninterrupted one."""

import json
from pathlib import Path

import pytest

from outrider.bench import peers
from outrider.bench import run as bench_run
from outrider.bench.store import PROGRESS, RunStore, check_out, difference
from outrider.cli import main
from outrider.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"


def methods_file(tmp_path: Path, model: Path, max_new_tokens: int = 16) -> Path:
    path = tmp_path / f"methods-{max_new_tokens}.toml"
    path.write_text(f"""
models = ["{model}"]
workloads = ["jsonl:{FIXTURES / 'prompts.jsonl'}"]
max_new_tokens = {max_new_tokens}

[[method]]
name = "ngram"
drafter = "ngram"

[[method]]
name = "suffix"
drafter = "suffix"
controller = "fixed:4"

[[method]]
name = "transformers"
peer = "transformers"
""")
    return path


def bench(methods: Path, out: Path, *extra: str) -> int:
    return main(["bench", "--methods", str(methods), "--out", str(out), "--threads", "1", "--no-progress", *extra])


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if the bench gets as far as planning or loading a model."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the bench went on to plan or load a model")

    monkeypatch.setattr(bench_run, "plan", forbidden)
    monkeypatch.setattr(bench_run, "load_decoder", forbidden)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# -- --out is checked before anything runs -----------------------------------------------------

def test_out_an_existing_file_is_refused_before_anything_loads(tmp_path, capsys, nothing_loads):
    out = tmp_path / "results.txt"
    out.write_text("keep me")
    assert bench(methods_file(tmp_path, tmp_path / "no-model"), out) == 2
    line = one_error_line(capsys)
    assert f"--out {out} is a file" in line and "pick a folder" in line
    assert out.read_text() == "keep me"


@pytest.mark.parametrize("setup,resume,expect", [
    ("finished", False, "already holds a finished run"),
    ("finished", True, "already holds a finished run"),
    ("unfinished", False, "pass --resume to finish it, or pick another --out"),
    ("others", False, "already holds other files"),
    ("empty", True, "no unfinished run to resume"),
    ("under-a-file", False, "cannot write there"),
])
def test_out_folders_that_cannot_take_the_run_are_refused(tmp_path, capsys, nothing_loads, setup, resume, expect):
    out = tmp_path / "out"
    out.mkdir()
    if setup == "finished":
        (out / "run.json").write_text("{}")
        (out / "results.json").write_text("{}")
    elif setup == "unfinished":
        (out / "run.json").write_text("{}")
    elif setup == "others":
        (out / "notes.txt").write_text("mine")
    elif setup == "under-a-file":
        (tmp_path / "a-file").write_text("")
        out = tmp_path / "a-file" / "out"
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert bench(methods_file(tmp_path, tmp_path / "no-model"), out, *(["--resume"] if resume else [])) == 2
    assert expect in one_error_line(capsys)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before


def test_resume_needs_out(tmp_path, capsys, nothing_loads):
    assert main(["bench", "--methods", str(methods_file(tmp_path, tmp_path / "m")), "--resume"]) == 2
    assert "--resume needs --out" in one_error_line(capsys)


def test_check_out_takes_a_new_or_empty_folder(tmp_path):
    check_out(tmp_path / "new" / "deeper", resume=False)
    assert (tmp_path / "new" / "deeper").is_dir() and not any((tmp_path / "new" / "deeper").iterdir())
    check_out(tmp_path / "new" / "deeper", resume=False)  # still empty: still fine


# -- the saved prompts --------------------------------------------------------------------------

def test_a_broken_last_line_is_dropped_on_resume(tmp_path):
    store = RunStore.open(tmp_path, {"a": 1})
    store.add_prompt("m", "w", "p1", {"autoregressive": {"output_ids": [1, 2], "seconds": 0.1, "stats": {}}})
    store.add_prompt("m", "w", "p2", {"autoregressive": {"output_ids": [3], "seconds": 0.1, "stats": {}}})
    intact = (tmp_path / PROGRESS).read_bytes()
    with open(tmp_path / PROGRESS, "ab") as f:
        f.write(b'{"kind": "prompt", "model": "m", "wor')  # killed mid-write
    again = RunStore.open(tmp_path, {"a": 1}, resume=True)
    assert again.done("m", "w", "p1")["runs"]["autoregressive"]["output_ids"] == [1, 2]
    assert again.done("m", "w", "p2") is not None and len(again.prompts) == 2
    assert again.sessions == 2
    text = (tmp_path / PROGRESS).read_bytes()
    assert text.startswith(intact) and text.count(b"\n") == intact.count(b"\n") + 1  # cut, then a session line
    with pytest.raises(ConfigError, match=r"other settings \(a: 1 then, 2 now\)"):
        RunStore.open(tmp_path, {"a": 2}, resume=True)


def test_difference_names_the_first_setting_that_changed():
    assert difference({"a": [1, {"b": "x"}]}, {"a": [1, {"b": "x"}]}) is None
    assert difference({"a": [1, {"b": "x"}]}, {"a": [1, {"b": "y"}]}) == 'a[1].b: "x" then, "y" now'
    assert difference({"a": [1, 2]}, {"a": [1]}) == "a: 2 items then, 1 items now"
    assert difference({"a": 1}, {"a": 1, "c": 3}) == "c: null then, 3 now"


# -- interrupt, then resume ---------------------------------------------------------------------

def fixed_figures(results: dict) -> list:
    """Each run's per-prompt outputs and round counts: everything but the clock."""
    keep = ("rounds", "committed", "accepted_by_position", "proposed_by_position", "accepted_length_hist")
    return [(r["model"], r["workload"], r["method"], r["summary"]["lossless"],
             [(p["id"], p["output_ids"], p["first_difference"], {k: p["stats"].get(k) for k in keep})
              for p in r["prompts"]])
            for r in results["runs"]]


class InProcessPeer:
    """A peer built in this process (peers.open_peer, the child's side of make_peer), closed as the
    bench closes a PeerProcess. Resuming is not about the process boundary, and a spawned child
    imports torch and transformers afresh (seconds each, three times here); test_bench_peers.py
    and test_bench.py's whole run start real child processes."""

    def __init__(self, kind, model_path, *, assistant_path, lookup, threads):
        self.peer = peers.open_peer(kind, model_path, assistant_path, lookup, threads)
        self.note = getattr(self.peer, "note", None)

    def run(self, prompt_ids, max_new_tokens):
        return self.peer.run(prompt_ids, max_new_tokens)

    def close(self):
        pass


def test_interrupt_then_resume_gives_the_run_an_uninterrupted_one_gives(tiny_folders, tmp_path, capsys,
                                                                          monkeypatch):
    methods = methods_file(tmp_path, tiny_folders["llama"])
    monkeypatch.setattr(bench_run, "make_peer", InProcessPeer)
    assert bench(methods, tmp_path / "full") == 0
    full = json.loads((tmp_path / "full" / "results.json").read_text())
    capsys.readouterr()

    real = bench_run.run_ours
    calls = []

    def interrupted(*args, **kwargs):  # warm-up, then 3 of ours per prompt: stop inside the 2nd prompt
        calls.append(1)
        if len(calls) == 1 + 3 + 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_run, "run_ours", interrupted)
    out = tmp_path / "part"
    assert bench(methods, out) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (f"interrupted: 1 of 3 prompts are saved in {out}; "
                                        "to finish, run the same command with --resume")
    lines = [json.loads(x) for x in (out / PROGRESS).read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["session", "prompt"] and lines[1]["prompt"] == "greet"
    assert not (out / "results.json").exists()

    # a peer that ran before must run again; a changed setting is refused, before any model loads
    def unavailable(*args, **kwargs):
        raise bench_run.PeerUnavailable("not here")

    monkeypatch.setattr(bench_run, "make_peer", unavailable)
    assert bench(methods, out, "--resume") == 2
    assert "peer transformers ran on" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(bench_run, "load_decoder", lambda *a, **k: pytest.fail("loaded a model"))
    changed = methods_file(tmp_path, tiny_folders["llama"], max_new_tokens=12)
    assert bench(changed, out, "--resume") == 2
    assert one_error_line(capsys) == (f"error: --methods {changed} sets max_new_tokens = 12, which differs from the "
                                      "run's 16; drop --methods to resume the run as it was started, or pick another "
                                      "--out")
    for flags, named in ((["--max-new-tokens", "12"], "--max-new-tokens 12 differs from the run's 16; drop it"),
                         (["--prompts", "1"], "--prompts 1 differs from the run, which left it unset; drop it"),
                         (["--threads", "2"], "--threads 2 differs from the run's 1; drop it")):
        assert main(["bench", "--out", str(out), "--resume", *flags]) == 2
        assert named in one_error_line(capsys)
    monkeypatch.undo()

    calls.clear()

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_run, "run_ours", counted)
    monkeypatch.setattr(bench_run, "make_peer", InProcessPeer)
    # the run's own settings are read back: no methods file, no flags (README: --out DIR --resume)
    assert main(["bench", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert len(calls) == 1 + 3 * 2  # warm-up, then only the two prompts left
    resumed = json.loads((out / "results.json").read_text())
    assert fixed_figures(resumed) == fixed_figures(full)
    assert resumed["audit"] == full["audit"] and resumed["audit"]["ok"]
    assert (resumed["sessions"], full["sessions"]) == (3, 1)  # the failed peer resume opened one too
    assert (out / "report.html").exists()


def test_resume_reads_the_runs_settings_and_names_the_flags_that_differ(tmp_path):
    """A run started with `--preset quick --prompts 1 --max-new-tokens 32` resumes from its
    run.json alone; what the command gives must agree, and a difference is named as written."""
    from dataclasses import replace

    from outrider.bench.methods import load_preset, with_overrides
    from outrider.bench.settings import config_for
    from outrider.cli import _parser

    ran = with_overrides(load_preset("quick"), {"prompts": 1, "max_new_tokens": 32})
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"threads": 2, "settings": {"preset": "quick", "source": ran.source,
                                                                         "config": ran.raw}}))

    def config(*flags):
        return config_for(_parser().parse_args(["bench", "--out", str(out), "--resume", *flags]), out)

    resumed = config()
    assert (resumed.preset, resumed.prompts, resumed.max_new_tokens) == ("quick", 1, 32)
    assert [replace(m, line=0) for m in ran.methods] == list(resumed.methods) and resumed.workloads == ran.workloads
    assert config("--max-new-tokens", "32", "--preset", "quick", "--prompts", "1").max_new_tokens == 32
    for flags, message in (
            (["--max-new-tokens", "64"], "--max-new-tokens 64 differs from the run's 32; drop it to resume the run "
                                         "as it was started, or pick another --out"),
            (["--workload", "toolcall"], "--workload toolcall differs from the run's humaneval toolcall code-edit"),
            (["--preset", "quick"], "--preset quick sets prompts = 3, which differs from the run's 1; drop --preset"),
            (["--preset", "eagle3"], "--preset eagle3 has other methods than the run in --out")):
        with pytest.raises(ConfigError) as err:
            config(*flags)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
