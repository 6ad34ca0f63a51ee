"""A bad EAGLE-3 head is refused before generation starts, with one line that names the problem:
a head for another target (hidden size, vocabulary), missing tensors, shapes that disagree with
its config, a vocab map that does not invert, layer ids out of the target's range."""

import json

import pytest
import torch
from eagle3_tiny import write_eagle3
from tiny import make_tiny

from outrider.errors import OutriderError
from outrider.weights.loader import load_decoder
from outrider.engine.speculator import SpecOptions, Speculator


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_tiny("llama", tmp_path_factory.mktemp("e3err") / "t", vocab=40, layers=4)
    return folder, load_decoder(folder, "cpu"), json.loads((folder / "config.json").read_text())


def refusal(setup, tmp_path, **kw) -> str:
    folder, target, cfg = setup
    head = write_eagle3(tmp_path / "head", cfg, **kw)
    with pytest.raises(OutriderError) as err:
        Speculator.build(SpecOptions(f"eagle3:{head}", "chain", "fixed:3"), target, folder)
    message = str(err.value)
    assert "\n" not in message
    return message


def flip_t2d(tensors):
    tensors["t2d"][0] = True  # one target token marked that d2t does not map


def duplicate_d2t(tensors):
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id


def float_d2t(tensors):
    tensors["d2t"] = tensors["d2t"].float()


@pytest.mark.parametrize("kw, expected", [
    (dict(config_edits={"target_hidden_size": 128}), "hidden states of size 128, this target's are 64"),
    (dict(config_edits={"vocab_size": 50}), "vocabulary has 50 tokens, the target's 40"),
    (dict(draft_vocab=16, drop=("midlayer.self_attn.k_proj.weight",)), "lacks tensor(s) midlayer.self_attn.k_proj.weight"),
    (dict(draft_vocab=16, drop=("d2t",)), "lacks tensor(s) d2t"),
    (dict(draft_vocab=16, tensor_edits=flip_t2d), "d2t and t2d do not invert each other"),
    (dict(draft_vocab=16, tensor_edits=duplicate_d2t), "two draft ids to one target id"),
    (dict(draft_vocab=16, tensor_edits=float_d2t), "d2t must hold integers"),
    (dict(layer_ids=[1, 2, 4]), "are target layers [1, 2, 4] but the target has 4 layers"),
    (dict(layer_ids=[0, 1, 3], semantics="sglang"), "are target layers [1, 2, 4] but the target has 4 layers"),
    (dict(layer_ids=[0, 1]), "must be three integers"),
    (dict(semantics="hf"), "eagle_aux_layer_semantics 'hf' is unknown"),
    (dict(config_edits={"intermediate_size": 80}), "tensor midlayer.mlp.gate_proj.weight has shape [96, 64] but its config.json says [80, 64]"),
    (dict(config_edits={"architectures": ["LlamaForCausalLM"]}), "name no EAGLE-3 head"),
    (dict(own_lm_head=False, draft_vocab=16), "has no lm_head.weight and cannot share the target's"),
])
def test_bad_heads_are_refused_in_one_line(setup, tmp_path, kw, expected):
    assert expected in refusal(setup, tmp_path, **kw)


def test_missing_folder_and_argument(setup, tmp_path):
    folder, target, _ = setup
    with pytest.raises(OutriderError, match="config.json not found"):
        Speculator.build(SpecOptions(f"eagle3:{tmp_path / 'nothing'}"), target, folder)
    with pytest.raises(OutriderError, match="eagle3:PATH needs the folder"):
        SpecOptions("eagle3").check()


def test_a_good_head_loads(setup, tmp_path):
    """The control: the same helper without a corruption builds."""
    folder, target, cfg = setup
    head = write_eagle3(tmp_path / "head", cfg, draft_vocab=16, layer_ids=[0, 1, 3])
    spec = Speculator.build(SpecOptions(f"eagle3:{head}", "dynamic:2,4", "fixed:3"), target, folder)
    assert spec.hidden_layers == (0, 1, 3) and spec.drafter.head.w.draft_to_target.dtype == torch.long
