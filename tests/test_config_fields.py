"""Never run a model wrong: every field transformers writes for a family is classified
(models/config_fields.py), a field that changes the arithmetic and is not read refuses the model in
one line (a Llama 3 config saved by transformers 5 carries its RoPE scaling as `rope_parameters`:
it ran with plain RoPE; now llama3 is implemented, and a type that is not, such as proportional, is
refused), and so does a tensor the runtime would not read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.errors import ModelError
from outrider.models.config import ModelConfig
from outrider.models.config_fields import CHECKED, INERT, READ
from outrider.weights.loader import load_decoder

CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "qwen3_5": "Qwen3_5TextConfig", "qwen3_next": "Qwen3NextConfig", "gemma3": "Gemma3TextConfig",
           "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config", "minicpm3": "MiniCPM3Config",
           "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig", "olmoe": "OlmoeConfig"}


@pytest.mark.parametrize("family", CLASSES)
def test_every_field_transformers_writes_is_classified(family):
    import transformers

    written = set(getattr(transformers, CLASSES[family])().to_dict())
    unknown = written - READ - INERT - set(CHECKED)
    assert not unknown, f"{family}: say in models/config_fields.py what {sorted(unknown)} do"


def _raw(**changes) -> dict:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    return {**raw, **changes}


# (field, a value that changes the arithmetic, a value that does not)
CASES = [
    # RoPE types models/rope.py does not implement (default, linear, llama3 and yarn run: tests/test_rope.py)
    ("rope_scaling", {"rope_type": "proportional", "factor": 8.0}, None),
    ("rope_scaling", {"type": "proportional", "factor": 2.0}, {"type": "linear", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "proportional", "factor": 8.0, "rope_theta": 5e5}, {"rope_type": "default", "rope_theta": 5e5}),
    ("rope_parameters", {"rope_type": "su", "factor": 4.0},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}),
    ("sliding_window", 64, None),
    ("layer_types", ["sliding_attention", "full_attention"], ["full_attention", "full_attention"]),
    ("partial_rotary_factor", 0.5, 1.0),
    ("final_logit_softcapping", 30.0, None),
    ("attn_logit_softcapping", 50.0, None),
    ("hidden_act", "gelu_pytorch_tanh", "silu"),
    ("mlp_bias", True, False),
    ("quantization_config", {"quant_method": "gptq"}, None),
    ("attention_bias", True, False),
]


@pytest.mark.parametrize("field, bad, good", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_field_that_changes_the_arithmetic_refuses_in_one_line(field, bad, good):
    with pytest.raises(ModelError, match="is not supported yet") as err:
        ModelConfig.from_dict(_raw(**{field: bad}))
    assert "\n" not in str(err.value)
    ModelConfig.from_dict(_raw(**{field: good}))  # the neutral value runs


def test_a_window_the_context_never_reaches_is_no_window():
    """Qwen2.5's and Qwen3's configs name a window with use_sliding_window false, or one as long as
    the context; a shorter one Qwen2 runs (tests/test_mistral_sliding.py), Qwen3 refuses."""
    qwen, qwen3 = {"architectures": ["Qwen2ForCausalLM"]}, {"architectures": ["Qwen3ForCausalLM"]}
    ModelConfig.from_dict(_raw(**qwen, sliding_window=32768, use_sliding_window=False))
    assert ModelConfig.from_dict(_raw(**qwen, sliding_window=256, use_sliding_window=True)).plain_block  # = context
    ModelConfig.from_dict(_raw(**qwen3, sliding_window=256, use_sliding_window=True))
    assert ModelConfig.from_dict(_raw(**qwen, sliding_window=128, use_sliding_window=True,
                                      max_window_layers=1)).layer_windows == (0, 128)
    with pytest.raises(ModelError, match="sliding-window attention"):
        ModelConfig.from_dict(_raw(**qwen3, sliding_window=128, use_sliding_window=True))
    ModelConfig.from_dict(_raw(**qwen, attention_bias=True))  # Qwen2's biases are on Q, K, V only: read


@pytest.fixture(scope="module")
def rope_folders(tmp_path_factory):
    """Small random Llamas saved by transformers itself (5.x writes the RoPE type under
    rope_parameters): one with llama3 scaling, one with proportional RoPE (not implemented)."""
    import transformers as tf

    folders = {}
    for kind, rope in (("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                       ("proportional", {"rope_type": "proportional", "factor": 2.0})):
        config = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                rope_parameters={**rope, "rope_theta": 500000.0})
        torch.manual_seed(0)
        folders[kind] = tmp_path_factory.mktemp(kind)
        tf.LlamaForCausalLM(config).save_pretrained(folders[kind])
    return folders


def test_a_llama3_config_saved_by_transformers_runs_with_its_scaling(rope_folders):
    """It was run with plain RoPE, silently; now with llama3's frequencies (tests/test_rope.py
    checks logits and tokens against transformers)."""
    raw = json.loads((rope_folders["llama3"] / "config.json").read_text())
    assert "rope_scaling" not in raw or not raw["rope_scaling"]  # where transformers 5 puts it: rope_parameters
    model = load_decoder(rope_folders["llama3"], "cpu", torch.float32)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert model.config.rope.rope_type == "llama3" and not torch.equal(model.inv_freq, plain)


def test_a_type_not_implemented_is_refused_by_load_and_cli_in_one_line(rope_folders):
    with pytest.raises(ModelError, match=r"RoPE scaling \(rope_parameters: rope_type 'proportional'\)") as err:
        load_decoder(rope_folders["proportional"], "cpu", torch.float32)
    assert "\n" not in str(err.value)
    run = subprocess.run([sys.executable, "-m", "outrider.cli", "generate", "--model", str(rope_folders["proportional"]),
                          "--max-new-tokens", "2", "hello"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "RoPE scaling" in lines[0], run.stderr


def test_a_tensor_the_runtime_does_not_read_refuses_the_model(tiny_folders, tmp_path):
    """An o_proj bias (a Llama with attention_bias, its config edited back to false) would be left
    out of the arithmetic: the load names it instead."""
    import shutil

    folder = tmp_path / "extra"
    shutil.copytree(tiny_folders["llama"], folder)
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"does not read \(model\.layers\.1\.self_attn\.o_proj\.bias\)") as err:
        load_decoder(folder, "cpu", torch.float32)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelError, match="o_proj.bias"):
        load_decoder(folder, "cpu", "q4")
    load_decoder(tiny_folders["llama"], "cpu", torch.float32)  # every tensor read: loads


def test_partial_rotary_inside_rope_parameters_is_seen():
    with pytest.raises(ModelError, match=r"partial rotary embeddings \(partial_rotary_factor: 0.5\)"):
        ModelConfig.from_dict(_raw(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}))


def test_a_hybrid_reads_its_own_fields_and_refuses_rope_scaling():
    raw = _raw(architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=4, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"],
               rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25})
    c = ModelConfig.from_dict(raw)
    assert c.layer_kinds == ("gated_delta",) * 3 + ("attention",) and c.rotary_dim == 4  # a quarter of 16
    with pytest.raises(ModelError, match="RoPE scaling"):
        ModelConfig.from_dict({**raw, "rope_parameters": {"rope_type": "proportional", "factor": 4.0}})
