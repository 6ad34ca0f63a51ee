"""`generate`'s options as a new user meets them (issue 38): every controller in its help, a
verifier that cannot run refused before anything loads, every --config value checked, the
documented cache variable read, and the documented `LLM(...)` signature the real one."""

import inspect
import json
import re
from pathlib import Path

import pytest
from test_cli_errors import one_line_error

from outrider import LLM, config
from outrider.cli import main
from outrider.control.controllers import controller_usages, register_controller, unregister_controller
from outrider.errors import ConfigError

USAGE_MD = Path(__file__).parent.parent / "docs" / "usage.md"


def help_of(capsys, option: str, following: str) -> str:
    """`generate --help`'s text for `option` (up to the `following` option), on one line."""
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    return text.split(f" {option} ", 1)[1].split(f" {following} ", 1)[0]


def test_generate_help_lists_every_controller_from_the_registry(capsys):
    register_controller("zigzag-trip", lambda arg: None, usage="zigzag-trip[:MAX]")
    try:
        line = help_of(capsys, "--controller CONTROLLER", "--verifier VERIFIER")
    finally:
        unregister_controller("zigzag-trip")
    for usage in ("fixed:N", "adaptive[:MAX]", "cost[:MAX]", "libraspec[:MAX]", "threshold:T[,MAX]", "entropy[:MAX]",
                  "zigzag-trip[:MAX]"):
        assert usage in line, (usage, line)
    assert "zigzag-trip" not in " ".join(controller_usages())  # gone from the one list once unregistered


@pytest.mark.parametrize("drafter", ["eagle3:smollm2-135m-instruct", "draft-model:smollm2-135m-instruct",
                                     "early-exit:1"])
@pytest.mark.parametrize("verifier", ["rejection_chain", "rejection_chain_reference", "multidraft",
                                      "multidraft_without_replacement"])
def test_a_verifier_that_needs_q_is_refused_greedy_before_loading(capsys, drafter, verifier):
    """Greedy drafts carry no draft_probs: such a verifier used to fail every request silently
    (`"text": ""`, finish_reason "error", exit 0). A model that does not exist shows that the
    refusal comes before anything loads."""
    one_line_error(capsys, "generate", "--model", "no-such-model", "hi", "--drafter", drafter, "--verifier", verifier,
                   expect=f"{verifier} needs drafts drawn from draft_probs, which drafters draw only when sampling; "
                          "at temperature 0 use greedy_chain (the default)")


def test_the_api_refuses_it_at_generate(tiny_folders):
    llm = LLM(str(tiny_folders["llama"]), drafter="early-exit:1", verifier="rejection_chain")
    with pytest.raises(ConfigError, match="at temperature 0 use greedy_chain"):
        llm.generate("w5 w6 w7", max_new_tokens=4)
    assert len(llm.generate("w5 w6 w7", max_new_tokens=4, temperature=0.8, seed=1).token_ids) == 4


def test_a_config_value_is_checked_even_where_threads_overrides_it(capsys):
    one_line_error(capsys, "generate", "--model", "no-such-model", "--config", "threads=abc", "--threads", "1", "hi",
                   expect="config threads must be a positive integer, got 'abc'")
    one_line_error(capsys, "generate", "--model", "no-such-model", "--config", "threads=0", "--threads", "1", "hi",
                   expect="config threads must be a positive integer, got 0")
    # a valid one is taken and --threads wins; the unknown model is what fails then
    one_line_error(capsys, "generate", "--model", "no-such-model", "--config", "threads=2", "--threads", "1", "hi",
                   expect="no-such-model")
    assert config.current().threads == 1


def test_the_documented_cache_variable_is_read(monkeypatch, tmp_path):
    assert config.env_name("cache_dir") == "OUTRIDER_CACHE_DIR"
    assert config.from_env({"OUTRIDER_CACHE_DIR": str(tmp_path / "new")}).cache_dir == tmp_path / "new"
    assert config.from_env({"OUTRIDER_CACHE": str(tmp_path / "old")}).cache_dir == tmp_path / "old"
    both = {"OUTRIDER_CACHE_DIR": str(tmp_path / "new"), "OUTRIDER_CACHE": str(tmp_path / "old")}
    assert config.from_env(both).cache_dir == tmp_path / "new"
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "env"))
    assert config.from_env().cache_dir == tmp_path / "env"
    assert "`OUTRIDER_CACHE_DIR` (or `OUTRIDER_CACHE`)" in USAGE_MD.read_text()


def test_usage_md_documents_the_llm_signature():
    """docs/usage.md's `LLM(...)` line names every parameter with its default, verifier included."""
    text = " ".join(USAGE_MD.read_text().split())
    documented = re.search(r"`LLM\((model=None, \*, .*?)\)`", text).group(1)
    names = []
    for parameter in inspect.signature(LLM.__init__).parameters.values():
        if parameter.name == "self":
            continue
        default = json.dumps(parameter.default) if isinstance(parameter.default, str) else parameter.default
        names.append(f"{parameter.name}={default}")
    assert documented == ", ".join(names[:1] + ["*"] + names[1:])
    assert "`verifier`" in text.split("`LLM(")[1].split("## Seeds")[0]  # and says what it does


def test_serve_help_lists_every_controller_too(capsys):
    """serve --help's controllers come from the registry, as generate --help's do (in this process:
    the help is built from the registry when the parser is, which a registered one shows)."""
    register_controller("zigzag", lambda arg: None, usage="zigzag[:MAX]")
    try:
        with pytest.raises(SystemExit) as done:
            main(["serve", "--help"])
    finally:
        unregister_controller("zigzag")
    assert done.value.code == 0
    flat = " ".join(capsys.readouterr().out.split())
    for usage in ("fixed:N", "cost[:MAX]", "libraspec[:MAX]", "threshold:T[,MAX]", "entropy[:MAX]", "zigzag[:MAX]"):
        assert usage in flat, usage
