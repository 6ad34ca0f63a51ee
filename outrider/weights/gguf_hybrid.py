"""A gated-delta hybrid's GGUF (llama.cpp architectures `qwen35`, Qwen3.5's text model, and
`qwen3next`, Qwen3-Next) read under Hugging Face's names, with what llama.cpp's converter changed
undone exactly.

What the converter (llama.cpp's convert_hf_to_gguf.py, conversion/qwen.py: Qwen3_5TextModel over
_LinearAttentionVReorderBase over Qwen3NextModel; read in llama-cpp-python 0.3.36's vendored copy)
writes for a Qwen3.5 checkpoint, and how it is read back here:

- names: `linear_attn.in_proj_qkv / _z / _a / _b` -> `blk.N.attn_qkv / attn_gate / ssm_alpha /
  ssm_beta`, `conv1d` -> `ssm_conv1d`, `dt_bias` -> `ssm_dt.bias`, `A_log` -> `ssm_a`,
  `linear_attn.norm` -> `ssm_norm`, `out_proj` -> `ssm_out`, `post_attention_layernorm` ->
  `post_attention_norm`; attention and MLP as Qwen3's (`attn_q` keeps q_proj's rows as they are:
  each head's queries then its gate). `hf_name` maps them back.
- `ssm_a` holds -exp(A_log), the decay the runtime multiplies by (DeltaWeights.a_neg): read as is,
  under the name `linear_attn.a_neg` (not a Hugging Face name; the loader takes it instead of
  computing -exp(A_log)), so nothing is recomputed.
- RMS norms that scale by (1 + w) (input, post-attention, final, q_norm, k_norm; not the gated
  `linear_attn.norm`) are stored with the 1 added: the GGUF source says so (quant_load's
  `norms_folded`) and the loader takes them as stored rather than add 1 again
  (loader.norms_folded; exact: no subtract-then-add round trip).
- `ssm_conv1d` is the depthwise kernel squeezed to [channels, K]; read back as [channels, 1, K].
- value heads, where there are more of them than key heads (HV = r HK), are reordered from grouped
  by key head, [k0v0 .. k0v(r-1), k1v0 ..], to tiled, [k0v0, k1v0, .., k0v1, k1v1, ..]: the V
  rows of attn_qkv, the rows of attn_gate, ssm_alpha, ssm_beta, ssm_a, ssm_dt, the V channels of
  ssm_conv1d, and the columns of ssm_out. `VHeadOrder` gives the index that puts each back: rows
  are gathered (a quantized row is whole blocks, so blocks are gathered too); ssm_out's columns
  are gathered in float, and a quantized ssm_out multiplies its input gathered into the file's
  order instead (`InputOrder`), since a block may span two heads.
- multi-token-prediction blocks (`nextn_predict_layers` > 0, the converter's default where the
  checkpoint has `mtp.*` tensors): blocks past the model's layers, a draft head the model's own
  output never reads. They are named `mtp.<gguf name>` (`tensors`) and not read, as a
  safetensors checkpoint's `mtp.*` tensors are not (loader.check_all_read); the config's
  num_hidden_layers and layer_types are the model's own.

Qwen3-Next (Qwen3NextModel, which Qwen3.5's classes extend) is written the same way, less the
value-head reorder, plus: its `in_proj_qkvz` (rows grouped per key head) split into `attn_qkv`
(all q, all k, all v: Qwen3.5's in_proj_qkv) and `attn_gate` (z: in_proj_z); its `in_proj_ba`
kept grouped as `ssm_ba`, read here as in_proj_b and in_proj_a rows; the experts stacked into 3-D
`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps` [experts, out, in], read as one tensor an
expert (`experts.{j}.gate_proj` ...: a quantized expert is whole rows of blocks); the router
`ffn_gate_inp`, the shared expert `ffn_*_shexp` and its gate `ffn_gate_inp_shexp`. The file does
not say `norm_topk_prob`: llama.cpp's qwen3next graph always renormalises the chosen experts'
weights (src/models/qwen3next.cpp, build_moe_ffn's norm_w), so it is true; layers without a router
are dense (`mlp_only_layers`; the converter writes none).

Qwen3.5's interleaved multimodal RoPE sections (`rope.dimension_sections`) give every rotary
frequency the same position for text, which is plain partial RoPE (`rope.dimension_count` of
`attention.key_length`), what the runtime runs.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from ..errors import ModelError

ARCH, NEXT = "qwen35", "qwen3next"
MODELS = {ARCH: ("qwen3_5_text", "Qwen3_5ForCausalLM"), NEXT: ("qwen3_next", "Qwen3NextForCausalLM")}  # model_type, class
MODEL = MODELS[ARCH]

# gguf name within a block -> Hugging Face name within `model.layers.N.`
LAYER_TENSORS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.a_neg",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # Qwen3-Next's router, shared expert and its gate
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
BA = "ssm_ba.weight"  # Qwen3-Next's in_proj_ba, grouped per key head
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
A_NEG = "linear_attn.a_neg"  # -exp(A_log) as the GGUF stores it


def hf_name(gguf_name: str) -> str | None:
    """`blk.0.ssm_a` -> `model.layers.0.linear_attn.a_neg`; None for a name not of this layout."""
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}"
    return None


def _key(meta: dict, name: str, default=None):
    return meta.get(f"{meta['general.architecture']}.{name}", default)


def model_layers(meta: dict) -> int:
    """The model's own layers: the blocks less the multi-token-prediction ones after them."""
    blocks, mtp = int(_key(meta, "block_count")), int(_key(meta, "nextn_predict_layers", 0) or 0)
    if not 0 <= mtp < blocks:
        raise ModelError(f"GGUF metadata: nextn_predict_layers {mtp} of {blocks} blocks; the file is damaged")
    return blocks - mtp


def tensors(index, name_of) -> dict:
    """A hybrid GGUF's tensors (gguf_index.IndexedTensor) under the names the loader asks for:
    `name_of` (gguf_convert.hf_tensor_name) for most; blocks past the model's layers as
    `mtp.<gguf name>` (a draft head beside the model: not read); Qwen3-Next's ssm_ba as the rows
    of in_proj_b and in_proj_a, and its 3-D experts as one [out, in] tensor an expert."""
    from .gguf_index import IndexedTensor

    layers = model_layers(index.meta)
    out = {}
    for name, t in index.tensors.items():
        match = _BLOCK.fullmatch(name)
        if match and int(match.group(1)) >= layers:
            out[f"mtp.{name}"] = t
        elif match and match.group(2) == BA:
            p = f"model.layers.{match.group(1)}.linear_attn."
            b, a = _ba_rows(index.meta)
            out[p + "in_proj_b.weight"] = IndexedTensor(name, t.type, (len(b), *t.shape[1:]), t.data[b])
            out[p + "in_proj_a.weight"] = IndexedTensor(name, t.type, (len(a), *t.shape[1:]), t.data[a])
        elif match and match.group(2) in EXPERTS:
            p = f"model.layers.{match.group(1)}.mlp.experts."
            for j in range(t.shape[0]):  # data: [experts, out, in] floats or [experts, out, row bytes]
                out[f"{p}{j}.{EXPERTS[match.group(2)]}.weight"] = IndexedTensor(name, t.type, t.shape[1:], t.data[j])
        else:
            out[name_of(name)] = t
    return out


def _ba_rows(meta: dict) -> tuple[np.ndarray, np.ndarray]:
    """ssm_ba's rows [HK, (b of r value heads, a of r)] -> the b rows and the a rows, value head h r + j."""
    k_heads, v_heads = int(_key(meta, "ssm.group_count")), int(_key(meta, "ssm.time_step_rank"))
    r = v_heads // k_heads
    rows = np.arange(2 * v_heads).reshape(k_heads, 2, r)
    return rows[:, 0].reshape(-1), rows[:, 1].reshape(-1)


def config_fields(meta: dict, head_dim: int, tensors=()) -> dict:
    """The hybrid's own config.json fields from a `qwen35` / `qwen3next` GGUF's metadata (arrays
    included) and its tensor names."""
    key = lambda name, default=None: _key(meta, name, default)  # noqa: E731
    layers = model_layers(meta)
    recurrent = key("attention.recurrent_layers")
    if recurrent is not None:
        recurrent = [bool(r) for r in recurrent][:layers]
    else:
        interval = int(key("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    v_heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    rotary = int(key("rope.dimension_count", head_dim))
    fields = {
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "full_attention_interval": int(key("full_attention_interval", 4)),
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": inner // v_heads,
        "attention_bias": False,
        "partial_rotary_factor": rotary / head_dim,
    }
    if meta["general.architecture"] == NEXT:
        scale = key("expert_weights_scale")
        if scale not in (None, 0, 1):
            raise ModelError(f"GGUF expert_weights_scale {scale} is not supported (the routed experts' weights as chosen)")
        fields.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                      moe_intermediate_size=int(key("expert_feed_forward_length")),
                      shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")),
                      norm_topk_prob=True, decoder_sparse_step=1,  # llama.cpp's graph renormalises (module doc)
                      mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
    return fields


class VHeadOrder:
    """Where the converter moved each value head (module docstring), and the indices that undo it."""

    def __init__(self, meta: dict):
        key = lambda name: int(_key(meta, name))  # noqa: E731
        self.k_heads, self.v_heads = key("ssm.group_count"), key("ssm.time_step_rank")
        self.k_dim, self.v_dim = key("ssm.state_size"), key("ssm.inner_size") // self.v_heads

    def undo(self, head_dim: int) -> np.ndarray:
        """long [v_heads * head_dim]: file position of each Hugging Face position (hf = file[undo])."""
        r = self.v_heads // self.k_heads
        moved = np.arange(self.v_heads * head_dim).reshape(self.k_heads, r, head_dim).swapaxes(0, 1).reshape(-1)
        return np.argsort(moved)  # moved[i]: the Hugging Face position the file keeps at i

    def rows(self, name: str, n: int) -> np.ndarray | None:
        """long [n]: the rows of `name` (a Hugging Face name) in Hugging Face order, as file rows."""
        if self.k_heads == self.v_heads or "linear_attn." not in name:
            return None
        qk = 2 * self.k_heads * self.k_dim  # q and k channels of in_proj_qkv and conv1d: not moved
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            return np.concatenate((np.arange(qk), qk + self.undo(self.v_dim)))
        if name.endswith("in_proj_z.weight"):
            return self.undo(self.v_dim)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias", A_NEG)):
            return self.undo(1)
        return None

    def columns(self, name: str) -> np.ndarray | None:
        """long [HV dv]: out_proj's columns in Hugging Face order, as file columns; None elsewhere."""
        if self.k_heads == self.v_heads or not name.endswith("linear_attn.out_proj.weight"):
            return None
        return self.undo(self.v_dim)


def undo_float(order: VHeadOrder, name: str, values: np.ndarray) -> np.ndarray:
    """A tensor's float values (file layout, Hugging Face name) in Hugging Face layout."""
    rows = order.rows(name, values.shape[0])
    if rows is not None:
        values = values[rows]
    columns = order.columns(name)
    if columns is not None:
        values = values[:, columns]
    if name.endswith("conv1d.weight") and values.ndim == 2:
        values = values[:, None, :]  # [C, K] -> [C, 1, K], Hugging Face's Conv1d weight
    return values


class InputOrder:
    """A projection whose input columns the file keeps in another order: y = W_file x[columns]
    (x: [..., in] in Hugging Face order), equal to W_hf x up to the summation order."""

    def __init__(self, weight, columns: np.ndarray):
        self.weight = weight
        self.columns = torch.from_numpy(np.ascontiguousarray(columns))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from ..models.layers import linear

        return linear(x.index_select(-1, self.columns.to(x.device)), self.weight, bias)
