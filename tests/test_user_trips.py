"""What a new user tripped on in the CLI (issue 24, item 6), each mended and pinned here: the
drafter list in --help comes from the registry; bench's quick preset says one wall time in --help
and in its file; serve --help shows every default; --json's time split adds up and --stats shows
the same `other`; --tree/--controller without --drafter are refused; a tree-size error says a
controller the user did not give is the default. (The catalog's: tests/test_gguf_folder.py; the
training and head commands': tests/test_train_eagle3.py, tests/test_eagle3_export.py.)"""

import json
import re
from pathlib import Path

import pytest

from outrider.cli import QUICK_TIME, _parser, main
from outrider.drafters.capabilities import Capabilities, Drafts
from outrider.drafters.registry import DrafterEntry, entries, register, unregister


def help_of(capsys, monkeypatch, *argv) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no wrapping inside a usage string
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def one_line_error(capsys, *argv) -> str:
    code = main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_drafter_help_lists_the_registry(capsys, monkeypatch):
    """Every registered drafter (eagle3 and hybrid included), and one registered from outside:
    the list is read from the registry, not typed a second time."""
    toy = DrafterEntry("toy-trip", "toy-trip:N", Capabilities(trees={"chain": Drafts("chain")}), build=None)
    register(toy)
    try:
        for command in ("generate", "serve"):
            text = help_of(capsys, monkeypatch, command)
            line = next(row for row in text.splitlines() if row.lstrip().startswith("--drafter DRAFTER"))
            for entry in entries().values():
                assert entry.usage in line, (command, entry.usage, line)
            assert "eagle3:PATH_OR_NAME" in line and "hybrid:" in line and "toy-trip:N" in line
    finally:
        unregister(toy.name)


def test_quick_preset_says_one_wall_time():
    """bench --help and presets/quick.toml give the same figure for the quick preset."""
    bench = _parser()._subparsers._group_actions[0].choices["bench"]
    preset = next(a for a in bench._actions if a.dest == "preset")
    toml = (Path(__file__).parents[1] / "outrider" / "bench" / "presets" / "quick.toml").read_text()
    comment = " ".join(line.lstrip("# ") for line in toml.splitlines() if line.startswith("#"))
    pattern = r"(\d+(?:-\d+)? min(?:utes)? on 2 (?:CPU )?cores)"
    in_help, in_file = re.findall(pattern, preset.help), re.findall(pattern, comment)
    assert in_help == in_file == [QUICK_TIME], (preset.help, comment)


def test_serve_help_shows_every_default(capsys, monkeypatch):
    serve = _parser()._subparsers._group_actions[0].choices["serve"]
    options = [a for a in serve._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 17
    for action in options:
        assert "default" in action.help.lower(), action.option_strings
    text = help_of(capsys, monkeypatch, "serve")
    for shown in ("(default: 8000)", "(default: 127.0.0.1", "default: 16)", "(default: 256)", "(default: 2048,",
                  "(default: 512)", "default: chain", "default: cost"):
        assert shown in text, shown


def test_json_time_split_adds_up_and_stats_shows_the_same_other(capsys, tiny_folders):
    """total_s = prefill_s + draft_s + verify_s + other_s in --json (other does not hold the
    prefill), and --stats prints that same `other`."""
    code = main(["generate", "--model", str(tiny_folders["llama"]), "--max-new-tokens", "8", "--drafter",
                 "early-exit:1", "--json", "--stats", "w5 w6 w7 w8 w9 w10 w11 w12"])
    captured = capsys.readouterr()
    assert code == 0
    s = json.loads(captured.out)["stats"]
    assert s["prefill_s"] > 0 and s["other_s"] >= 0
    parts = s["prefill_s"] + s["draft_s"] + s["verify_s"] + s["other_s"]
    assert parts == pytest.approx(s["total_s"], rel=0, abs=1e-9), s
    shown = re.search(r"other ([0-9.]+) s", captured.err)
    assert shown and shown.group(1) == f"{s['other_s']:.2f}", captured.err


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("given, named", [(["--tree", "static:2,2"], "--tree"),
                                          (["--controller", "cost"], "--controller"),
                                          (["--tree", "chain", "--controller", "fixed:2"], "--tree and --controller")])
def test_tree_or_controller_without_a_drafter_is_refused(capsys, monkeypatch, command, given, named):
    """Refused in one line before anything loads (the model named does not exist: no load tried)."""
    import outrider.llm

    monkeypatch.setattr(outrider.llm, "LLM", None)  # nothing may be built
    argv = [command, "--model", "no-such-model", *given] + (["x"] if command == "generate" else [])
    line = one_line_error(capsys, *argv)
    assert f"{named} shape" in line and "--drafter" in line and "unknown model" not in line, line


def test_default_tree_and_controller_are_kept(tiny_folders, monkeypatch, capsys):
    """Not given: chain and fixed:4 for generate, chain and cost for serve, as before."""
    import outrider.llm
    import outrider.serve.server as server

    seen = {}

    class Probe:
        def __init__(self, model, **kw):
            seen.update(kw)
            raise SystemExit(0)

    monkeypatch.setattr(outrider.llm, "LLM", Probe)
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_folders["llama"]), "--drafter", "ngram", "x"])
    assert (seen["tree"], seen["controller"]) == ("chain", "fixed:4")
    monkeypatch.setattr(server, "serve", lambda options: seen.update(serve=options) or 0)
    assert main(["serve", "--drafter", "ngram"]) == 0
    assert (seen["serve"].tree, seen["serve"].controller) == ("chain", "cost")
    assert main(["serve"]) == 0 and seen["serve"].drafter is None


def test_tree_size_error_says_the_controller_is_the_default(capsys, tiny_folders):
    m = str(tiny_folders["llama"])
    line = one_line_error(capsys, "generate", "--model", m, "--drafter", "early-exit:1", "--tree", "static:8,8,8", "x")
    assert "the default --controller fixed:4" in line and "limit of 256" in line, line
    line = one_line_error(capsys, "generate", "--model", m, "--drafter", "early-exit:1", "--tree", "static:8,8,8",
                          "--controller", "fixed:4", "x")
    assert "with --controller fixed:4" in line and "default" not in line, line  # given: named as given
    line = one_line_error(capsys, "generate", "--model", m, "--drafter", "early-exit:1", "--controller", "fixed:12",
                          "--max-tree-nodes", "10", "x")
    assert "the default --tree chain with --controller fixed:12" in line and "limit of 10" in line, line
