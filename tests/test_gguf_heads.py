"""EAGLE-3 and DFlash heads exported as the GGUF llama.cpp loads (issue 43 item 6; heads/gguf_export.py),
checked without llama-server on tiny heads: the tensor names, shapes, dtypes and metadata keys are
the ones llama.cpp's loader asks for (listed here from vendor/llama.cpp/src/models/eagle3.cpp and
dflash.cpp's load_arch_hparams / load_arch_tensors and llama-model.cpp's load_hparams), reading the
file back gives the head's weights bit for bit (fp32 and bf16), EAGLE-3's q/k permutation turns
Hugging Face's rotate-half RoPE into llama.cpp's interleaved one, and bad output paths are refused.
scripts/llamacpp_head_check.py runs the real thing."""

import json

import gguf
import numpy as np
import pytest
import torch
from eagle3_tiny import write_eagle3
from enumerate_law import one_thread
from tiny import add_tokenizer, make_tiny

from outrider.cli import main
from outrider.errors import ConfigError
from outrider.heads.dflash.format import read_tensors as read_dflash
from outrider.heads.eagle3.format import read_tensors as read_eagle3
from outrider.heads.gguf_export import export_gguf, ours_from_gguf, read_gguf
from outrider.heads.gguf_layout import rope_permute
from outrider.heads.dflash.trainable import DFlashTrainable
from outrider.train.outputs import write_head
from outrider.weights.loader import load_decoder

# What the loaders read without a default (llama-model.cpp load_hparams l.1321-1327, then
# eagle3.cpp / dflash.cpp load_arch_hparams), and the keys our export writes beside them.
EAGLE3_KEYS = ["eagle3.context_length", "eagle3.embedding_length", "eagle3.block_count",
               "eagle3.attention.layer_norm_rms_epsilon", "eagle3.target_layers", "eagle3.target_hidden_size",
               "eagle3.norm_before_residual", "eagle3.norm_before_fc", "eagle3.attention.head_count",
               "eagle3.attention.head_count_kv", "eagle3.feed_forward_length", "eagle3.rope.freq_base"]
DFLASH_KEYS = ["dflash.context_length", "dflash.embedding_length", "dflash.block_count",
               "dflash.attention.layer_norm_rms_epsilon", "dflash.target_layers", "dflash.block_size",
               "dflash.attention.head_count", "dflash.attention.head_count_kv", "dflash.feed_forward_length",
               "dflash.rope.freq_base", "tokenizer.ggml.mask_token_id"]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def tokenizer_gguf(path, vocab):
    """A GGUF holding only a target's tokenizer keys (what the export copies into the draft)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"w{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ggufheads")
    target = add_tokenizer(make_tiny("llama", root / "t", vocab=8, layers=4), vocab=8)
    tok = tokenizer_gguf(root / "tok.gguf", 8)
    cfg = json.loads((target / "config.json").read_text())
    e3 = write_eagle3(root / "e3", cfg, draft_vocab=6, layer_ids=[0, 1, 2], semantics="sglang", seed=4)
    decoder = load_decoder(target, "cpu")
    head = DFlashTrainable.for_target(decoder, torch.tensor([0, 2, 3, 5, 6, 7]), seed=2, layers=2, block_size=4,
                                      mask_token_id=7, layer_ids=(0, 2))
    df = root / "df"
    write_head(df, head)
    out = {"e3": export_gguf("eagle3", e3, root / "e3.gguf", target, target_gguf=tok),
           "e3bf16": export_gguf("eagle3", e3, root / "e3b.gguf", target, dtype="bf16", target_gguf=tok),
           "df": export_gguf("dflash", df, root / "df.gguf", target, target_gguf=tok)}
    return root, target, tok, e3, df, out


def layout(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name) for t in r.tensors}


def test_eagle3_gguf_has_what_the_loader_asks_for(setup):
    root, target, tok, e3, df, out = setup
    r, tensors = layout(out["e3"])
    H, nh, nkv, d, inter, V, Vd = 64, 4, 2, 16, 96, 8, 6
    # eagle3.cpp load_arch_tensors: {ne0, ne1} as create_tensor lists them (GGUF order)
    want = {"fc.weight": ((3 * H, H), "F32"), "output_norm.weight": ((H,), "F32"),
            "output.weight": ((H, Vd), "F32"), "d2t": ((Vd,), "I64"),
            "blk.0.attn_norm.weight": ((H,), "F32"), "blk.0.attn_norm_2.weight": ((H,), "F32"),
            "blk.0.attn_q.weight": ((2 * H, nh * d), "F32"), "blk.0.attn_k.weight": ((2 * H, nkv * d), "F32"),
            "blk.0.attn_v.weight": ((2 * H, nkv * d), "F32"), "blk.0.attn_output.weight": ((nh * d, H), "F32"),
            "blk.0.ffn_norm.weight": ((H,), "F32"), "blk.0.ffn_gate.weight": ((H, inter), "F32"),
            "blk.0.ffn_up.weight": ((H, inter), "F32"), "blk.0.ffn_down.weight": ((inter, H), "F32")}
    assert tensors == want
    meta, _ = read_gguf(out["e3"])
    assert meta["general.architecture"] == "eagle3"
    assert [k for k in EAGLE3_KEYS if k not in meta] == []
    assert meta["eagle3.target_layers"] == [1, 2, 3]  # sglang ids 0, 1, 2 = the inputs of layers 1, 2, 3
    assert meta["eagle3.target_hidden_size"] == H and meta["eagle3.block_count"] == 1
    assert meta["eagle3.norm_before_residual"] is False
    assert meta["tokenizer.ggml.tokens"][:3] == ["w0", "w1", "w2"]  # the target's tokenizer, copied
    d2t = read_gguf(out["e3"])[1]["d2t"]
    assert d2t.tolist() == (read_eagle3(e3)["d2t"] + torch.arange(Vd)).tolist()
    _, bf = layout(out["e3bf16"])
    assert bf["blk.0.attn_q.weight"][1] == "BF16" and bf["blk.0.attn_norm.weight"][1] == "F32"


def test_dflash_gguf_has_what_the_loader_asks_for(setup):
    root, target, tok, e3, df, out = setup
    c = json.loads((df / "config.json").read_text())
    H, nh, nkv, d, inter = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], \
        c["intermediate_size"]
    r, tensors = layout(out["df"])
    # dflash.cpp load_arch_tensors: fc {n*H, H}, enc.output_norm, output_norm, output + d2t (reduced vocab)
    want = {"fc.weight": ((2 * H, H), "F32"), "enc.output_norm.weight": ((H,), "F32"),
            "output_norm.weight": ((H,), "F32"), "output.weight": ((H, 6), "F32"), "d2t": ((6,), "I64")}
    for i in range(2):
        p = f"blk.{i}."
        want.update({p + "attn_norm.weight": ((H,), "F32"), p + "attn_q.weight": ((H, nh * d), "F32"),
                     p + "attn_k.weight": ((H, nkv * d), "F32"), p + "attn_v.weight": ((H, nkv * d), "F32"),
                     p + "attn_output.weight": ((nh * d, H), "F32"), p + "attn_q_norm.weight": ((d,), "F32"),
                     p + "attn_k_norm.weight": ((d,), "F32"), p + "ffn_norm.weight": ((H,), "F32"),
                     p + "ffn_gate.weight": ((H, inter), "F32"), p + "ffn_up.weight": ((H, inter), "F32"),
                     p + "ffn_down.weight": ((inter, H), "F32")})
    assert tensors == want
    meta, stored = read_gguf(out["df"])
    assert meta["general.architecture"] == "dflash"
    assert [k for k in DFLASH_KEYS if k not in meta] == []
    assert meta["dflash.target_layers"] == [1, 3]  # DFlash ids 0, 2 (outputs) = the inputs of layers 1, 3
    assert meta["dflash.block_size"] == 4 and meta["tokenizer.ggml.mask_token_id"] == 7
    assert meta["dflash.block_count"] == 2
    assert stored["d2t"].tolist() == [0, 2, 3, 5, 6, 7]
    # NEOX RoPE: q/k as Hugging Face stores them
    assert torch.equal(stored["blk.0.attn_q.weight"], read_dflash(df)["layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("which,kind,dtype", [("e3", "eagle3", None), ("e3bf16", "eagle3", torch.bfloat16),
                                              ("df", "dflash", None)])
def test_reading_back_gives_the_weights_bit_for_bit(setup, which, kind, dtype):
    root, target, tok, e3, df, out = setup
    ours = read_eagle3(e3) if kind == "eagle3" else read_dflash(df)
    ours.pop("t2d")
    if dtype is not None:
        ours = {n: t if n == "d2t" else t.to(dtype) for n, t in ours.items()}
    from outrider.heads.gguf_export import head_tensors
    from outrider.models.config import ModelConfig

    config, _ = head_tensors(kind, e3 if kind == "eagle3" else df, ModelConfig.load(target))
    back = ours_from_gguf(kind, out[which], config, {n: t.dtype for n, t in ours.items()})
    assert back.keys() == ours.keys()
    for name, t in ours.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def rope_hf(x, pos, theta=10000.0):
    """Hugging Face's rotate-half RoPE on rows [T, heads, d]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None, None].double() * inv  # [T, 1, d/2]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
    return x * cos + rot * sin


def rope_interleaved(x, pos, theta=10000.0):
    """llama.cpp's RoPE NORM (ggml_rope_ext mode 0): pairs (2i, 2i+1) rotate by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None, None].double() * inv
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = a * ang.sin() + b * ang.cos()
    return out


def test_eagle3_q_permutation_turns_rotate_half_into_interleaved_rope():
    g = torch.Generator().manual_seed(0)
    heads, d, cols, T = 3, 8, 5, 4
    w = torch.randn(heads * d, cols, generator=g, dtype=torch.float64)
    x = torch.randn(T, cols, generator=g, dtype=torch.float64)
    pos = torch.arange(T) + 3
    hf = rope_hf((x @ w.T).view(T, heads, d), pos)
    cpp = rope_interleaved((x @ rope_permute(w, heads).T).view(T, heads, d), pos)
    # llama.cpp's row 2i is Hugging Face's row i and its row 2i+1 Hugging Face's i + d/2, rotated alike
    order = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), -1).reshape(-1)
    assert torch.allclose(cpp, hf[..., order])
    assert not torch.allclose(rope_interleaved((x @ w.T).view(T, heads, d), pos), hf[..., order])  # unpermuted: wrong


def test_bad_output_and_missing_tokenizer_are_refused(setup, tmp_path):
    root, target, tok, e3, df, out = setup
    with pytest.raises(ConfigError, match="already exists"):
        export_gguf("eagle3", e3, out["e3"], target, target_gguf=tok)
    with pytest.raises(ConfigError, match=".gguf file"):
        export_gguf("eagle3", e3, tmp_path / "x.bin", target, target_gguf=tok)
    with pytest.raises(ConfigError, match="--target-gguf"):
        export_gguf("eagle3", e3, tmp_path / "x.gguf", target)  # the tiny target keeps no original.gguf
    assert not (tmp_path / "x.gguf").exists()


def test_cli_exports_gguf(setup, tmp_path, capsys):
    root, target, tok, e3, df, out = setup
    dest = tmp_path / "cli.gguf"
    assert main(["export", "dflash", str(df), "--format", "gguf", "--out", str(dest), "--target", str(target),
                 "--target-gguf", str(tok)]) == 0
    assert "draft-dflash" in capsys.readouterr().out
    assert np.array_equal(read_gguf(dest)[1]["fc.weight"].numpy(), read_gguf(out["df"])[1]["fc.weight"].numpy())
