"""Mixture-of-experts GGUFs (llama.cpp architectures `qwen3moe`, `olmoe`, and `llama` with experts:
Mixtral) read in place under Hugging Face's names.

What llama.cpp's converter (convert_hf_to_gguf.py; conversion/qwen.py Qwen3MoeModel over
Qwen2MoeModel, conversion/olmo.py OlmoeModel, conversion/llama.py LlamaModel for Mixtral; read in
llama-cpp-python 0.3.36's vendored copy) writes, and how it is read back here:

- each layer's experts stacked into 3-D `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`
  [experts, out, in] (Mixtral's w1 / w3 / w2), read as one [out, in] tensor an expert
  (`mlp.experts.{j}.gate_proj` ...; a quantized expert is whole rows of blocks, kept as they are);
  the router `ffn_gate_inp` as `mlp.gate.weight` (F32 in the file); everything else by the dense
  names (gguf_convert.hf_tensor_name), Mixtral's Q/K rows unpermuted as Llama's are;
- the metadata: `expert_count`, `expert_used_count`, `expert_feed_forward_length` (Qwen3-MoE's
  moe_intermediate_size; OLMoE's and Mixtral's experts are of `feed_forward_length`);
- renormalisation is not in the file: llama.cpp's graphs fix it per architecture
  (src/models/qwen3moe.cpp and llama.cpp's Mixtral path renormalise the chosen experts' weights,
  olmoe.cpp does not: build_moe_ffn's norm_w), so norm_topk_prob is true for qwen3moe and Mixtral,
  false for olmoe, as llama.cpp runs them;
- a layer without `ffn_gate_inp` is dense (Qwen3-MoE's mlp_only_layers; the converter writes its
  ffn_gate / ffn_up / ffn_down); a Mixtral GGUF carries no sliding window (llama.cpp's llama graph
  has none), so none is read.
"""

from __future__ import annotations

import re

from ..errors import ModelError
from .gguf_hybrid import EXPERTS

ARCHS = {"qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"), "olmoe": ("olmoe", "OlmoeForCausalLM")}
MIXTRAL = ("mixtral", "MixtralForCausalLM")  # a `llama` GGUF with experts
RENORMALISED = {"qwen3moe": True, "olmoe": False, "llama": True}  # llama.cpp's graphs' norm_w
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def is_moe(meta: dict) -> bool:
    """A GGUF of one of the MoE architectures read here."""
    arch = meta.get("general.architecture")
    return arch in ARCHS or (arch == "llama" and int(meta.get("llama.expert_count") or 0) > 0)


def model(meta: dict) -> tuple[str, str]:
    """(model_type, architecture class) of an MoE GGUF."""
    arch = meta["general.architecture"]
    return ARCHS[arch] if arch in ARCHS else MIXTRAL


def tensors(index, name_of) -> dict:
    """An MoE GGUF's tensors (gguf_index.IndexedTensor) under the names the loader asks for: the
    stacked experts one [out, in] tensor an expert, the rest by `name_of` (hf_tensor_name)."""
    out = {}
    for name, t in index.tensors.items():
        match = _BLOCK.fullmatch(name)
        if match and match.group(2) in EXPERTS:
            out.update(one_an_expert(t, int(match.group(1)), EXPERTS[match.group(2)]))
        else:
            out[name_of(name)] = t
    return out


def one_an_expert(t, layer: int, proj: str) -> dict:
    """A stacked expert tensor t [experts, out, in] (gguf_index.IndexedTensor) as one [out, in]
    tensor an expert, `model.layers.{layer}.mlp.experts.{j}.{proj}.weight` (proj: gate_proj, ...)."""
    from .gguf_index import IndexedTensor

    if len(t.shape) != 3:
        raise ModelError(f"GGUF tensor '{t.name}' is {list(t.shape)}, not [experts, out, in]")
    p = f"model.layers.{layer}.mlp.experts."
    # data: [experts, out, in] floats or [experts, out, row bytes]
    return {f"{p}{j}.{proj}.weight": IndexedTensor(t.name, t.type, t.shape[1:], t.data[j])
            for j in range(t.shape[0])}


def config_fields(meta: dict, tensors: dict) -> dict:
    """The MoE fields of config.json from an MoE GGUF's metadata and tensor names."""
    arch = meta["general.architecture"]
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    scale = key("expert_weights_scale")
    if scale not in (None, 0, 1):
        raise ModelError(f"GGUF expert_weights_scale {scale} is not supported (the routed experts' weights as chosen)")
    layers = int(key("block_count"))
    experts, used = int(key("expert_count")), int(key("expert_used_count"))
    fields = {"num_experts_per_tok": used, "norm_topk_prob": RENORMALISED[arch]}
    if arch == "qwen3moe":
        fields.update(num_experts=experts, moe_intermediate_size=int(key("expert_feed_forward_length")),
                      decoder_sparse_step=1, use_sliding_window=False, sliding_window=None,
                      mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
    elif arch == "olmoe":
        fields.update(num_experts=experts, clip_qkv=None)
    else:  # Mixtral: every layer sparse, always renormalised (its config has no norm_topk_prob)
        fields.pop("norm_topk_prob")
        fields.update(num_local_experts=experts, sliding_window=None)
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if dense and arch != "qwen3moe":
        raise ModelError(f"GGUF layer {dense[0]} has no router (ffn_gate_inp): every {arch} layer is a mixture of experts")
    return fields
