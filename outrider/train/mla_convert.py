"""Convert a grouped-query attention model (Qwen2, Llama: RoPE on halves, Q/K/V biases or none) to
latent attention the MHA2MLA way (Ji et al. 2025), written as `Mha2MlaForCausalLM`
(models/mha2mla.py: DeepSeek-V2's tensor names, a rotated key per source K/V head, no latent norm).

    tensors, raw = convert(tensors, raw, rank, pairs, keep="high")

Per layer, per K/V head g of head_dim D (RoPE pairs (i, i + D/2) at frequency theta^(-2i/D)):

- partial RoPE: `pairs` of the D/2 frequencies keep their rotation ("high": the fastest, 0 ..
  pairs - 1; "uniform": every (D/2 / pairs)-th), so dr = 2 pairs dimensions a head, laid out in
  halves order; they form a geometric series again, so the runtime's RoPE at base
  theta ** (stride dr / D) turns them exactly (stride 1 for high, D / dr for uniform). Queries' and
  keys' matching dimensions move to q_pe and to kv_a_proj_with_mqa's rotated rows (with k's bias);
- the other dn = D - dr key dimensions of every K/V head and all of V are compressed together: the
  joint SVD of [W_k,nope (G dn rows); W_v (G D rows)] = U S V^T cut to `rank` r gives the latent
  c = S_r^1/2 V_r^T x (kv_a_proj_with_mqa's first r rows) and kv_b_proj = U_r S_r^1/2, its rows
  per query head h (K/V head g = h // (H / G)): g's dn key rows, then g's D value rows;
- biases: q's stays q_proj's; k's rotated share goes to kv_a_proj_with_mqa; the rest of k's only
  adds q . b to every score of a query (the softmax drops it); v's passes attention unchanged
  (the weights sum to 1), so o_proj gains the bias W_o b_v.

At full rank (r = G (dn + D)) the converted model computes the source's attention exactly, up to
float rounding (tests/test_mla_convert.py); below it the SVD's error is what FunctionalMLA's
reconstruction (train/mla_reconstruct.py) then trains away.
"""

from __future__ import annotations

import torch

ARCHITECTURE = "Mha2MlaForCausalLM"
KEEPS = ("high", "uniform")


def kept_pairs(half: int, pairs: int, keep: str) -> tuple[list[int], int]:
    """(the kept frequency indices of a head's `half` = D/2, their stride)."""
    if keep not in KEEPS:
        raise ValueError(f"keep must be one of {', '.join(KEEPS)}, not {keep!r}")
    if not 0 < pairs <= half or (keep == "uniform" and half % pairs):
        raise ValueError(f"cannot keep {pairs} of {half} RoPE frequencies ({keep})")
    stride = 1 if keep == "high" else half // pairs
    return [stride * j for j in range(pairs)], stride


def head_dims(D: int, pairs: int, keep: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(a head's nope dimensions [D - 2 pairs], its rotated ones in halves order [2 pairs], stride)."""
    kept, stride = kept_pairs(D // 2, pairs, keep)
    rope = kept + [i + D // 2 for i in kept]
    nope = [i for i in range(D) if i not in set(rope)]
    return torch.tensor(nope, dtype=torch.long), torch.tensor(rope, dtype=torch.long), stride


def convert_layer(w: dict, H: int, G: int, D: int, rank: int, pairs: int, keep: str, balance: bool = False) -> dict:
    """One attention layer's q/k/v/o (and biases) under "q_proj.weight"... names -> the MLA
    layer's tensors under DeepSeek-V2's names (module notes). balance: TransMLA's K/V balancing
    (W_k,nope divided by alpha = ||W_k,nope|| / ||W_v|| before the joint SVD, its rows of kv_b_proj
    times alpha after: the same keys, but the SVD no longer spends its rank on K's larger norm)."""
    nope, rope, _ = head_dims(D, pairs, keep)
    dn = D - 2 * pairs
    E = w["q_proj.weight"].shape[1]
    wq = w["q_proj.weight"].double().view(H, D, E)
    wk = w["k_proj.weight"].double().view(G, D, E)
    wv = w["v_proj.weight"].double().view(G, D, E)
    k_nope = wk[:, nope].reshape(G * dn, E)
    alpha = float(k_nope.norm() / wv.norm()) if balance and dn else 1.0
    joint = torch.cat((k_nope / alpha, wv.reshape(G * D, E)))  # [G (dn + D), E]
    U, S, Vt = torch.linalg.svd(joint, full_matrices=False)
    r = min(rank, S.shape[0])
    root = S[:r].sqrt()
    down = root[:, None] * Vt[:r]  # [r, E]
    up = U[:, :r] * root[None, :]  # [G (dn + D), r]
    up_k, up_v = up[: G * dn].view(G, dn, r) * alpha, up[G * dn:].view(G, D, r)
    group = torch.arange(H) // (H // G)  # each query head's K/V head
    kv_b = torch.cat((up_k[group], up_v[group]), dim=1).reshape(H * (dn + D), r)  # per head: keys, values
    out = {
        "q_proj.weight": torch.cat((wq[:, nope], wq[:, rope]), dim=1).reshape(H * D, E),
        "kv_a_proj_with_mqa.weight": torch.cat((down, wk[:, rope].reshape(G * 2 * pairs, E))),
        "kv_b_proj.weight": kv_b,
        "o_proj.weight": w["o_proj.weight"].double(),
    }
    if "q_proj.bias" in w:
        bq = w["q_proj.bias"].double().view(H, D)
        out["q_proj.bias"] = torch.cat((bq[:, nope], bq[:, rope]), dim=1).reshape(-1)
    if "k_proj.bias" in w:
        bk = w["k_proj.bias"].double().view(G, D)
        out["kv_a_proj_with_mqa.bias"] = torch.cat((torch.zeros(r, dtype=bk.dtype), bk[:, rope].reshape(-1)))
    if "v_proj.bias" in w:
        bv = w["v_proj.bias"].double().view(G, D)[group].reshape(-1)  # [H D]: each head's value bias
        out["o_proj.bias"] = out["o_proj.weight"] @ bv
    return {k: v.float().contiguous() for k, v in out.items()}


def mla_config(raw: dict, rank: int, pairs: int, keep: str) -> dict:
    """The converted model's config.json: the source's with DeepSeek-V2's MLA fields."""
    H = int(raw["num_attention_heads"])
    G = int(raw.get("num_key_value_heads") or H)
    D = int(raw.get("head_dim") or int(raw["hidden_size"]) // H)
    _, _, stride = head_dims(D, pairs, keep)
    params = dict(raw.get("rope_parameters") or {})
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    if params and params.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE type {params['rope_type']!r}: the conversion keeps default RoPE's frequencies only")
    dn, dr = D - 2 * pairs, 2 * pairs
    new_theta = theta ** (stride * dr / D)  # the kept frequencies, a geometric series over dr dimensions
    out = {k: v for k, v in raw.items() if k not in ("num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
                                                      "attention_bias", "use_sliding_window", "sliding_window",
                                                      "max_window_layers", "layer_types")}
    out.update(architectures=[ARCHITECTURE], model_type="mha2mla", kv_lora_rank=min(rank, G * (dn + D)),
               q_lora_rank=None, qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=D, qk_rope_heads=G,
               kv_latent_norm=False, rope_parameters={"rope_type": "default", "rope_theta": new_theta},
               mha2mla={"source_rope_theta": theta, "keep": keep, "pairs": pairs, "rank": rank})
    return out


def convert(tensors: dict, raw: dict, rank: int, pairs: int, keep: str = "high",
            balance: bool = False) -> tuple[dict, dict]:
    """A source model's tensors (Hugging Face names) and config.json -> the converted model's."""
    H = int(raw["num_attention_heads"])
    G = int(raw.get("num_key_value_heads") or H)
    D = int(raw.get("head_dim") or int(raw["hidden_size"]) // H)
    out = {k: v for k, v in tensors.items() if ".self_attn." not in k}
    for layer in range(int(raw["num_hidden_layers"])):
        prefix = f"model.layers.{layer}.self_attn."
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        for name, value in convert_layer(own, H, G, D, rank, pairs, keep, balance).items():
            out[prefix + name] = value
    raw = mla_config(raw, rank, pairs, keep)
    raw["mha2mla"]["balance"] = balance
    return out, raw
