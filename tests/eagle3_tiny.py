"""Tiny random EAGLE-3 heads saved in the reference layout (heads/eagle3/format.py), for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_eagle3(folder: Path, target_config: dict, *, draft_vocab: int | None = None, seed: int = 0,
                 layer_ids=None, semantics: str | None = None, own_lm_head: bool = True,
                 prefix: str = "midlayer.", drop: tuple[str, ...] = (), config_edits: dict | None = None,
                 tensor_edits=None) -> Path:
    """A random head for a target whose config.json is `target_config`: hidden size and heads as
    the target's, intermediate 96; `draft_vocab` < V gives d2t/t2d over every other token from 1.
    drop: tensor names to leave out; config_edits / tensor_edits(tensors): corruptions."""
    t = target_config
    H, V = t["hidden_size"], t["vocab_size"]
    nh, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    d, inter = H // nh, 96
    Vd = draft_vocab or V
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=0.3: torch.randn(*shape, generator=g) * scale  # noqa: E731
    norm = lambda: 1.0 + rand(H, scale=0.1)  # noqa: E731
    tensors = {
        "fc.weight": rand(H, 3 * H, scale=0.15),
        prefix + "input_layernorm.weight": norm(), prefix + "hidden_norm.weight": norm(),
        prefix + "post_attention_layernorm.weight": norm(),
        prefix + "self_attn.q_proj.weight": rand(nh * d, 2 * H, scale=0.2),
        prefix + "self_attn.k_proj.weight": rand(nkv * d, 2 * H, scale=0.2),
        prefix + "self_attn.v_proj.weight": rand(nkv * d, 2 * H),
        prefix + "self_attn.o_proj.weight": rand(H, nh * d),
        prefix + "mlp.gate_proj.weight": rand(inter, H), prefix + "mlp.up_proj.weight": rand(inter, H),
        prefix + "mlp.down_proj.weight": rand(H, inter),
        "norm.weight": norm(),
    }
    if own_lm_head:
        tensors["lm_head.weight"] = rand(Vd, H, scale=1.0)
    if Vd < V:
        used = torch.arange(1, V, 2)[:Vd] if Vd <= V // 2 else torch.cat((torch.arange(1, V, 2),
                                                                           torch.arange(0, V, 2)))[:Vd].sort().values
        tensors["d2t"] = used - torch.arange(Vd)  # int64: target = d + d2t[d]
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[used] = True
        tensors["t2d"] = t2d
    if tensor_edits is not None:
        tensor_edits(tensors)
    for name in drop:
        tensors.pop(name)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": H, "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": nkv,
        "vocab_size": V, "draft_vocab_size": Vd, "target_hidden_size": H, "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": t.get("rope_theta", 10000.0), "tie_word_embeddings": False,
    }
    eagle = {}
    if layer_ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    if semantics is not None:
        eagle["eagle_aux_layer_semantics"] = semantics
    if eagle:
        config["eagle_config"] = eagle
    config.update(config_edits or {})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def target_with_head(root: Path) -> tuple[Path, Path]:
    """A vocab-8, 4-layer Llama (so random drafts are sometimes right) and a head for it with 6
    draft tokens reading its layers 0, 1, 2 (sglang ids): (target folder, head folder)."""
    from tiny import make_tiny

    folder = make_tiny("llama", root / "t", vocab=8, layers=4)
    head = write_eagle3(root / "head", json.loads((folder / "config.json").read_text()), draft_vocab=6,
                        layer_ids=[0, 1, 2], semantics="sglang", seed=4)
    return folder, head
