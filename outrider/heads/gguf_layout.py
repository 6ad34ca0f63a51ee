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

The names every kind shares are here, each kind's own in its package (heads/eagle3/gguf.py,
heads/dflash/gguf.py: its names, required keys and tensors, metadata; a kind llama.cpp loads names
its module in heads/kinds.py); ours on the left (heads/eagle3/format.py's `midlayer.` names,
z-lab's for DFlash), llama.cpp's on the right. Shapes are given as torch shapes ([rows, cols]); GGUF stores the
reversed order (ne = [cols, rows]), as llama.cpp's create_tensor calls write them.
"""

from __future__ import annotations

import torch

LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}  # every kind's layer; each kind adds its own (heads/<kind>/gguf.py)
TOP = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
       "embed_tokens.weight": "token_embd.weight", "d2t": "d2t"}


def gguf_of(kind: str):
    """The kind's GGUF module (heads/<kind>/gguf.py: ARCH, names, REQUIRED_KEYS, its tensors and
    keys); a one-line ConfigError for a kind llama.cpp does not load."""
    from ..errors import ConfigError
    from .kinds import KINDS

    if kind not in KINDS or KINDS[kind].gguf is None:
        loadable = ", ".join(k.name for k in KINDS.values() if k.gguf is not None)
        raise ConfigError(f"no GGUF layout for a {kind} head; llama.cpp loads {loadable}")
    return KINDS[kind].module(KINDS[kind].gguf)


def gguf_name(kind: str, ours: str) -> str:
    """llama.cpp's name of our tensor `ours` (ValueError for one llama.cpp has no place for)."""
    g = gguf_of(kind)
    if ours in g.NAMES_TOP:
        return g.NAMES_TOP[ours]
    found = g.layer_of(ours)
    if found is None or found[1] not in g.NAMES_LAYER:
        raise ValueError(f"no llama.cpp tensor for {ours}")
    return f"blk.{found[0]}.{g.NAMES_LAYER[found[1]]}"


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
    return gguf_of(kind).permuted_heads(ours, num_heads, num_kv_heads)


def required_tensors(kind: str, hidden: int, inputs: int, heads: int, kv_heads: int, head_dim: int,
                     inter: int, layers: int = 1) -> dict[str, tuple[int, ...]]:
    """What the loader's create_tensor calls without TENSOR_NOT_REQUIRED ask for, as torch shapes
    (rows, cols) of llama.cpp's names: `inputs` is fc's input width (3Ht for EAGLE-3, n*H for DFlash)."""
    g = gguf_of(kind)
    H, D = hidden, head_dim
    attn_in = g.attention_inputs(H)
    out = {"fc.weight": (H, inputs), "output_norm.weight": (H,)}
    if "hidden_norm.weight" in g.NAMES_TOP:  # DFlash's norm after fc
        out[g.NAMES_TOP["hidden_norm.weight"]] = (H,)
    for i in range(layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (H,), p + "attn_q.weight": (heads * D, attn_in),
                    p + "attn_k.weight": (kv_heads * D, attn_in), p + "attn_v.weight": (kv_heads * D, attn_in),
                    p + "attn_output.weight": (H, heads * D), p + "ffn_norm.weight": (H,),
                    p + "ffn_gate.weight": (inter, H), p + "ffn_up.weight": (inter, H),
                    p + "ffn_down.weight": (H, inter)})
        out.update(g.required_layer(p, H, D))
    return out
