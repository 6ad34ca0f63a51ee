"""A Matryoshka suite's nested sub-models: each slice a prefix of the largest model's layers, attention
heads and FFN neurons (one weight set; MatFormer / the Matryoshka LM suite, docs/methods.md#matryoshka).

A suite is a plain Llama-shaped model folder (its config.json is the largest slice's) whose
config.json also holds

    "matryoshka": {"slices": [{"layers": 2, "heads": 2, "ffn": 128}, ..., the largest last]}

Slice s = (L_s, h_s, f_s) runs layers 0..L_s-1 of the largest; in each, the query, key and value
heads 0..h_s-1 (multi-head attention: one K/V head per query head, so a head prefix is also a K/V
prefix) and FFN neurons 0..f_s-1; the embedding, final norm and (tied) head are the largest's.
So slice s is the largest model with its tensors cut to prefixes:

    q/k/v_proj [h_s D, E]    rows 0..h_s D-1        o_proj    [E, h_s D]   columns 0..h_s D-1
    gate/up_proj [f_s, E]    rows 0..f_s-1          down_proj [E, f_s]     columns 0..f_s-1

`slice_decoder` builds that slice as a `Decoder` from the largest's (the drafter,
drafters/matryoshka.py); train/matryoshka_model.py trains the slices jointly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ModelError
from .decoder import Decoder


@dataclass(frozen=True)
class Slice:
    layers: int  # L_s: the first layers of the largest
    heads: int  # h_s: query heads per layer (= K/V heads)
    ffn: int  # f_s: FFN neurons per layer

    def to_json(self) -> dict:
        return {"layers": self.layers, "heads": self.heads, "ffn": self.ffn}

    def __str__(self) -> str:
        return f"{self.layers}L/{self.heads}H/{self.ffn}F"


def parse_slices(raw: dict, where: str = "config.json") -> list[Slice]:
    """config.json's matryoshka slices, smallest first; [] when it holds none. A slice that is not a
    prefix of the next (more of anything), or whose largest is not the model itself, is refused."""
    spec = raw.get("matryoshka")
    if spec is None:
        return []
    try:
        slices = [Slice(int(s["layers"]), int(s["heads"]), int(s["ffn"])) for s in spec["slices"]]
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{where}: matryoshka.slices must be a list of {{layers, heads, ffn}} integers") from None
    if not slices:
        raise ModelError(f"{where}: matryoshka.slices is empty")
    for a, b in zip(slices, slices[1:]):
        if a.layers > b.layers or a.heads > b.heads or a.ffn > b.ffn:
            raise ModelError(f"{where}: matryoshka slice {a} is not nested in the next one, {b}")
    last = slices[-1]
    heads = raw.get("num_attention_heads")
    if (last.layers, last.heads, last.ffn) != (raw.get("num_hidden_layers"), heads, raw.get("intermediate_size")):
        raise ModelError(f"{where}: the largest matryoshka slice {last} is not the model's own size")
    if raw.get("num_key_value_heads", heads) != heads:
        raise ModelError(f"{where}: a matryoshka suite slices heads, so it needs one K/V head per query head")
    if min(min(s.layers, s.heads, s.ffn) for s in slices) < 1:
        raise ModelError(f"{where}: every matryoshka slice needs at least one layer, head and FFN neuron")
    return slices


def slices_of(folder: str | Path) -> list[Slice]:
    """The slices of the suite in `folder` ([] for a model that is not one)."""
    path = Path(folder) / "config.json"
    return parse_slices(json.loads(path.read_text()), str(path))


def slice_decoder(target: Decoder, s: Slice) -> Decoder:
    """Slice `s` of the suite `target` as a Decoder of its own: its layers' tensors are prefixes of
    the target's (q/k/v rows, o columns, gate/up rows, down columns), made contiguous once for the
    matrix-product paths; the embedding, final norm and head are the target's own tensors."""
    c = target.config
    if target.quantization is not None:
        raise ModelError("a matryoshka slice cuts float weights; run the suite with --dtype float32 or bfloat16")
    if c.num_kv_heads != c.num_heads or c.delta is not None or c.mla is not None or c.moe is not None:
        raise ModelError(f"{c.architecture}: a matryoshka slice needs a plain attention model with one K/V head "
                         "per query head")
    if s.layers > c.num_layers or s.heads > c.num_heads or s.ffn > c.intermediate_size:
        raise ModelError(f"matryoshka slice {s} is larger than the model ({c.num_layers} layers, "
                         f"{c.num_heads} heads, {c.intermediate_size} FFN neurons)")
    D, H, I, h, f = c.head_dim, c.num_heads, c.intermediate_size, s.heads, s.ffn
    layers = []
    for w in target.layers[: s.layers]:
        # qkv [(H + 2H) D, E]: query rows, then key rows, then value rows; each cut to its first h heads
        qkv = torch.cat((w.qkv[: h * D], w.qkv[H * D: H * D + h * D], w.qkv[2 * H * D: 2 * H * D + h * D]))
        bias = None if w.qkv_bias is None else torch.cat(
            (w.qkv_bias[: h * D], w.qkv_bias[H * D: H * D + h * D], w.qkv_bias[2 * H * D: 2 * H * D + h * D]))
        gate_up = torch.cat((w.gate_up[:f], w.gate_up[I: I + f]))  # [2f, E]: gate rows, then up rows
        layers.append(replace(w, qkv=qkv.contiguous(), qkv_bias=bias, o=w.o[:, : h * D].contiguous(),
                              gate_up=gate_up.contiguous(), down=w.down[:, :f].contiguous()))
    config = replace(c, num_layers=s.layers, num_heads=h, num_kv_heads=h, intermediate_size=f,
                     layer_kinds=c.layer_kinds[: s.layers], mlp_kinds=c.mlp_kinds[: s.layers])
    return Decoder(config, target.embed, layers, target.norm, target.lm_head, None,
                   kv_dtype=target.kv_dtype, drafter=True)
