"""`outrider models check`: one line saying a model runs (with what it is) or what of it does not,
the exit status saying which, and no weight read (names and shapes only)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.cli import main


def check(capsys, path) -> tuple[int, str]:
    code = main(["models", "check", str(path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return code, out[0]


def test_a_model_that_runs_is_described(capsys, tiny_folders, monkeypatch):
    from outrider.weights import loader

    monkeypatch.setattr(loader._Tensors, "get", lambda *a: pytest.fail("check read a weight"))
    code, line = check(capsys, tiny_folders["qwen3"])
    assert code == 0 and line.startswith("supported: ") and "Qwen3ForCausalLM, 3 layers (attention)" in line


def edited(folder, tmp_path, **changes):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, **changes}))
    return out


@pytest.mark.parametrize("changes, says", [
    ({"architectures": ["GPTNeoXForCausalLM"]}, "architecture 'GPTNeoXForCausalLM' is not supported"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "RoPE scaling (rope_scaling: rope_type 'proportional')"),
    ({"sliding_window": 16, "use_sliding_window": True}, "sliding-window attention"),  # Qwen3's (Qwen2 reads it)
])
def test_what_does_not_run_is_named(capsys, tiny_folders, tmp_path, changes, says):
    family = "qwen3" if "sliding_window" in changes else "qwen2"
    code, line = check(capsys, edited(tiny_folders[family], tmp_path, **changes))
    assert code == 1 and line.startswith("unsupported: ") and says in line, line


def test_a_tensor_nobody_reads_is_named(capsys, tiny_folders, tmp_path):
    folder = edited(tiny_folders["llama"], tmp_path)
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["model.layers.0.post_feedforward_layernorm.weight"] = torch.ones(64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    code, line = check(capsys, folder)
    assert code == 1 and "model.layers.0.post_feedforward_layernorm.weight" in line
