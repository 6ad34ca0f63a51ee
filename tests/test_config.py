"""The runtime config (outrider/config.py): one typed object, from the environment, the API and
the CLI; bad values are one-line errors; what is in force is recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outrider import config
from outrider.cli import main
from outrider.config import RuntimeConfig, from_env
from outrider.errors import ConfigError


def test_defaults_and_environment():
    base = from_env({})
    assert base == RuntimeConfig() and base.linear == "auto" and base.native and not base.lossy_bf16_prefill
    env = from_env({"OUTRIDER_LINEAR": "chunked", "OUTRIDER_NATIVE_LAYER": "0", "OUTRIDER_CACHE": "/tmp/c",
                    "OUTRIDER_TILE_PREFILL": "0", "OUTRIDER_PREFILL_GEMM": "1", "OUTRIDER_THREADS": "3"})
    assert (env.linear, env.native_layer, env.cache_dir, env.amx_prefill, env.gemm_prefill, env.threads) == (
        "chunked", False, Path("/tmp/c"), False, "on", 3)
    # the new name wins over an older one
    assert from_env({"OUTRIDER_AMX_PREFILL": "1", "OUTRIDER_TILE_PREFILL": "0"}).amx_prefill is True


@pytest.mark.parametrize("changes, message", [
    ({"linear": "fastest"}, "config linear must be one of"),
    ({"gemm_prefill": "maybe"}, "config gemm_prefill must be one of"),
    ({"native": "perhaps"}, "config native is on or off"),
    ({"threads": "0"}, "config threads must be a positive integer"),
    ({"threads": "two"}, "config threads must be a positive integer"),
    ({"nosuch": "1"}, "unknown config key 'nosuch'"),
])
def test_bad_values_are_one_line(changes, message):
    with pytest.raises(ConfigError, match=message) as err:
        RuntimeConfig().replace(**changes)
    assert "\n" not in str(err.value)


def test_overriding_puts_the_old_config_back():
    before = config.current()
    with config.overriding(linear="mm_t") as inside:
        assert config.current() is inside and inside.linear == "mm_t"
    assert config.current() is before


def test_cli_config_lists_keys_and_records(capsys):
    assert main(["config", "--json", "--config", "linear=chunked"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["config"]["linear"] == "chunked" and "isa" in record["cpu"] and "native" in record
    config.use(linear="auto")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    for f in ("threads", "native_layer", "OUTRIDER_CACHE", "lossy_bf16_prefill", "instruction sets"):
        assert f in out


@pytest.mark.parametrize("item, message", [("linear", "--config takes KEY=VALUE"),
                                           ("colour=blue", "unknown config key 'colour'")])
def test_cli_bad_config_is_one_line_before_loading(capsys, item, message):
    assert main(["generate", "--model", "no-such-model", "--config", item, "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_api_takes_a_config(tiny_folders):
    from outrider import LLM

    before = config.current()
    try:
        llm = LLM(str(tiny_folders["llama"]), device="cpu", config={"linear": "linear", "threads": 1})
        assert llm.config.linear == "linear" and config.current().threads == 1
        assert llm.generate("w1 w2", max_new_tokens=3).token_ids
    finally:
        config.use(before)
