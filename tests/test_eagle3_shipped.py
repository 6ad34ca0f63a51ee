"""The EAGLE-3 head shipped for SmolLM2-135M (outrider/heads/shipped/eagle3/smollm2-135m-instruct):
it fits the 25 MB limit, passes check-head's structural checks against the pulled target, and
drafts losslessly (greedy speculative == autoregressive, chain and dynamic tree) on real code."""

import json
from pathlib import Path

import pytest
import torch

from outrider.cli import main
from outrider.drafters.eagle3 import Eagle3Drafter
from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.heads.catalog import resolve_head
from outrider.heads.eagle3.format import load_eagle3
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.control.controllers import FixedController
from outrider.engine.speculator import SpecOptions, Speculator

pytestmark = pytest.mark.model

HEAD = Path(__file__).parents[1] / "outrider" / "heads" / "shipped" / "eagle3" / "smollm2-135m-instruct"


def test_shipped_files_are_small_safetensors_with_their_recipe():
    assert resolve_head("smollm2-135m-instruct") == HEAD
    names = sorted(p.name for p in HEAD.iterdir())
    assert names == ["config.json", "model.safetensors", "outrider_golden.json", "train_info.json"]
    assert (HEAD / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    info = json.loads((HEAD / "train_info.json").read_text())
    assert info["seed"] == 0 and info["tokens"] > 0 and "--regenerate" in info["command"]


def test_check_head_structure_passes(smollm2_path, capsys):
    assert main(["check-head", str(HEAD), "--target", str(smollm2_path), "--no-golden"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "vocab map" in out


@pytest.mark.parametrize("tree", ["chain", "dynamic:4,12"])
def test_shipped_head_is_lossless_on_code(smollm2_decoder, smollm2_tokenizer, tree):
    target = smollm2_decoder
    head = load_eagle3(HEAD, target)
    drafter = Eagle3Drafter(head, parse_shape(tree), head.config.taps(target.config.num_layers), name="eagle3:smollm2")
    spec = Speculator(SpecOptions("eagle3:smollm2-135m-instruct", tree, "fixed:4"), drafter, FixedController(4),
                      parse_shape(tree))
    prompt = smollm2_tokenizer("def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n")["input_ids"]
    with torch.inference_mode():
        ar = generate_ids(target, [Request(list(prompt), 24, SamplingParams())], set())[0]
        sp = generate_ids(target, [Request(list(prompt), 24, SamplingParams())], set(), speculation=spec)[0]
    assert sp.token_ids == ar.token_ids
    assert sum(sp.round_stats.accepted_by_position) > 0  # the trained head's drafts are accepted sometimes


def test_speculators_export_of_the_docs_loads_offline(smollm2_path, tmp_path, monkeypatch):
    """`outrider export eagle3 smollm2-135m-instruct --format speculators --out DIR` (docs/learned-drafters.md's
    example) records the pulled target's folder as the verifier: config and tokenizer load from it
    with the Hub unreachable (a Hugging Face id would not)."""
    from transformers import AutoConfig, AutoTokenizer

    from outrider.heads.eagle3.export import export_eagle3

    said = []
    out = export_eagle3(HEAD, tmp_path / "smol-speculators", "speculators",
                        "smollm2-135m-instruct", golden=False, log=said.append)
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(smollm2_path.resolve()) and verifier["architectures"] == ["LlamaForCausalLM"]
    assert any("--verifier HuggingFaceTB/SmolLM2-135M-Instruct" in line for line in said), said
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert AutoConfig.from_pretrained(verifier["name_or_path"]).model_type == "llama"
    assert AutoTokenizer.from_pretrained(verifier["name_or_path"])("def f():")["input_ids"]
