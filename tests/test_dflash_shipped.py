"""The DFlash head shipped for SmolLM2-135M (outrider/heads/shipped/dflash/smollm2-135m-instruct):
it and its trained refiners (DARTree's correction head, LiLiCorr's correlator, xPress's head) fit the 25 MB limit
with their recipes, passes check-head's structural checks against the pulled
target, shows in `models list`, and drafts losslessly (greedy speculative == autoregressive)."""

import json
from pathlib import Path

import pytest

from outrider import LLM
from outrider.cli import main
from outrider.heads.catalog import drafters_for, resolve_head

pytestmark = pytest.mark.model

HEAD = Path(__file__).parents[1] / "outrider" / "heads" / "shipped" / "dflash" / "smollm2-135m-instruct"


def test_shipped_files_are_small_safetensors_with_their_recipe():
    assert resolve_head("smollm2-135m-instruct", "dflash") == HEAD
    assert "dflash:smollm2-135m-instruct" in drafters_for("smollm2-135m-instruct")
    names = sorted(p.name for p in HEAD.iterdir())
    assert names == ["config.json", "dartree.safetensors", "lilicorr.safetensors", "model.safetensors",
                     "outrider_golden.json", "refiners.json", "train_info.json", "xpress.safetensors"]
    assert all(p.stat().st_size <= 25 * 1024 * 1024 for p in HEAD.iterdir())
    refiners = json.loads((HEAD / "refiners.json").read_text())  # the trained refiners' recipes
    assert set(refiners) == {"dartree", "lilicorr", "xpress"}
    assert all("command" in r and "seed" in r for r in refiners.values())
    info = json.loads((HEAD / "train_info.json").read_text())
    assert info["seed"] == 0 and info["tokens"] > 0 and "--regenerate" in info["command"] and "reproduce" in info


def test_check_head_structure_passes(smollm2_path, capsys):
    assert main(["check-head", "dflash:smollm2-135m-instruct", "--target", str(smollm2_path), "--no-golden"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "mask token" in out and "z-lab's DFlash, vLLM and SGLang" in out


def test_shipped_head_is_lossless_on_code(smollm2_path):
    prompt = "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n"
    ar = LLM(str(smollm2_path), dtype="float32").generate(prompt, 24)
    sp = LLM(str(smollm2_path), dtype="float32", drafter="dflash:smollm2-135m-instruct", controller="fixed:7")
    out = sp.generate(prompt, 24)
    assert out.token_ids == ar.token_ids and out.stats["rounds"] > 0


def test_shipped_xpress_is_lossless_on_code(smollm2_path):
    """xPress's shipped head (Jacobi passes over the block) proposes; greedy output equals plain."""
    prompt = "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    ar = LLM(str(smollm2_path), dtype="float32").generate(prompt, 24)
    sp = LLM(str(smollm2_path), dtype="float32", drafter="dflash:smollm2-135m-instruct,refine=xpress:2",
             tree="ddtree:7", controller="fixed:7")
    out = sp.generate(prompt, 24)
    assert out.token_ids == ar.token_ids and out.stats["rounds"] > 0
