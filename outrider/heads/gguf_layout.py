"""The GGUF layout llama.cpp loads for an EAGLE-3 or a DFlash draft (`--spec-type draft-eagle3 | draft-dflash`).

Read from the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist (paths under vendor/llama.cpp/):

    src/llama-arch.cpp        arch names "eagle3" (l.145), "dflash" (l.146); keys %s.target_layers,
                              %s.target_hidden_size, %s.norm_before_residual, %s.norm_before_fc (l.369-372),
                              %s.block_size (l.374), tokenizer.ggml.mask_token_id (l.402); tensor names
                              fc (l.703), d2t (l.704), enc.output_norm (l.491), blk.%d.attn_norm_2 (l.479)
    src/models/eagle3.cpp     load_arch_hparams: target_layers (exactly 3), target_hidden_size,
                              norm_before_residual / norm_before_fc (optional, default false);
                              load_arch_tensors: fc {3Ht, H}, output_norm, output {H, Vd} (optional:
                              else the target's), d2t {Vd} I64 (optional), token_embd (optional), one
                              layer: attn_norm, attn_norm_2 (hidden_norm), attn_q/k/v {2H, .},
                              attn_output, ffn_norm, ffn_gate/up/down. RoPE type NORM
                              (src/llama-model.cpp l.3087), so q/k rows are stored permuted the way
                              conversion/llama.py's LlamaModel.permute does for Hugging Face weights.
    src/models/dflash.cpp     load_arch_hparams: target_layers (required), block_size (read by
                              common/speculative.cpp l.984, default 16); load_arch_tensors: fc
                              {n*H, H}, enc.output_norm (the hidden_norm after fc), output_norm,
                              output {H, Vd} and d2t optional, per layer attn_norm, attn_q/k/v,
                              attn_output, attn_q_norm, attn_k_norm {d}, ffn_norm, ffn_gate/up/down.
                              RoPE type NEOX (l.3185): weights as Hugging Face stores them.
    common/speculative.cpp    the target's layer *inputs* are tapped (llama_get_embeddings_layer_inp:
                              Hugging Face hidden_states[id], l.543 / l.1058): our taps as they are
                              (eagle3: vllm ids; DFlash: its ids + 1, as conversion/qwen.py writes);
                              DFlash's mask token is the draft vocabulary's mask id (l.997), so the
                              draft carries the target's tokenizer (as the converters copy it).
    conversion/llama.py       d2t is written as absolute target ids (d + d2t[d]), I64; t2d is dropped.

Names here are ours on the left (heads/eagle3/format.py's `midlayer.` names, z-lab's for DFlash),
llama.cpp's on the right. Shapes are given as torch shapes ([rows, cols]); GGUF stores the
reversed order (ne = [cols, rows]), as llama.cpp's create_tensor calls write them.
"""

from __future__ import annotations

import torch

ARCH = {"eagle3": "eagle3", "dflash": "dflash"}
LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}
EAGLE3_LAYER = {**LAYER, "hidden_norm.weight": "attn_norm_2.weight"}
DFLASH_LAYER = {**LAYER, "self_attn.q_norm.weight": "attn_q_norm.weight",
                "self_attn.k_norm.weight": "attn_k_norm.weight"}
TOP = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
       "embed_tokens.weight": "token_embd.weight", "d2t": "d2t"}
DFLASH_TOP = {**TOP, "hidden_norm.weight": "enc.output_norm.weight"}

# The metadata keys each loader reads without a default (llama-model.cpp's llama_model_base::load_hparams
# l.1321-1327, then the arch's load_arch_hparams), without the `ARCH.` prefix.
REQUIRED_KEYS = {"eagle3": ("context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                            "target_layers", "target_hidden_size"),
                 "dflash": ("context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                            "target_layers")}


def gguf_name(kind: str, ours: str) -> str:
    """llama.cpp's name of our tensor `ours` (ValueError for one llama.cpp has no place for)."""
    layer = EAGLE3_LAYER if kind == "eagle3" else DFLASH_LAYER
    top = TOP if kind == "eagle3" else DFLASH_TOP
    if ours in top:
        return top[ours]
    if kind == "eagle3" and ours.startswith("midlayer."):
        rest, index = ours[len("midlayer."):], 0
    elif kind == "dflash" and ours.startswith("layers."):
        index_text, _, rest = ours[len("layers."):].partition(".")
        index = int(index_text)
    else:
        raise ValueError(f"no llama.cpp tensor for {ours}")
    if rest not in layer:
        raise ValueError(f"no llama.cpp tensor for {ours}")
    return f"blk.{index}.{layer[rest]}"


def rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows [heads*d, C] from rotate-half (Hugging Face) order to llama.cpp's interleaved
    (RoPE NORM) order: within each head, row i of the first half goes to 2i, of the second to 2i+1."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `rope_permute`."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(kind: str, ours: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads a tensor's rows are RoPE-permuted by on its way to llama.cpp (EAGLE-3's q/k
    only: its graph ropes in NORM mode; DFlash's ropes NEOX, as Hugging Face), else None."""
    if kind != "eagle3":
        return None
    if ours.endswith("self_attn.q_proj.weight"):
        return num_heads
    if ours.endswith("self_attn.k_proj.weight"):
        return num_kv_heads
    return None


def required_tensors(kind: str, hidden: int, inputs: int, heads: int, kv_heads: int, head_dim: int,
                     inter: int, layers: int = 1) -> dict[str, tuple[int, ...]]:
    """What the loader's create_tensor calls without TENSOR_NOT_REQUIRED ask for, as torch shapes
    (rows, cols) of llama.cpp's names: `inputs` is fc's input width (3Ht for EAGLE-3, n*H for DFlash)."""
    H, D = hidden, head_dim
    attn_in = 2 * H if kind == "eagle3" else H
    out = {"fc.weight": (H, inputs), "output_norm.weight": (H,)}
    if kind == "dflash":
        out["enc.output_norm.weight"] = (H,)
    for i in range(layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (H,), p + "attn_q.weight": (heads * D, attn_in),
                    p + "attn_k.weight": (kv_heads * D, attn_in), p + "attn_v.weight": (kv_heads * D, attn_in),
                    p + "attn_output.weight": (H, heads * D), p + "ffn_norm.weight": (H,),
                    p + "ffn_gate.weight": (inter, H), p + "ffn_up.weight": (inter, H),
                    p + "ffn_down.weight": (H, inter)})
        if kind == "eagle3":
            out[p + "attn_norm_2.weight"] = (H,)
        else:
            out.update({p + "attn_q_norm.weight": (D,), p + "attn_k_norm.weight": (D,)})
    return out
