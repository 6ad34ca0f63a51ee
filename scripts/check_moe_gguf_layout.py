"""Check tests/moe_gguf.py (our writer of a Qwen3-MoE, OLMoE or Mixtral GGUF in llama.cpp's
converter's layout) and tests/deepseek_gguf.py (DeepSeek-V2 / V3 as `deepseek2`) against the real
converter, and Outrider's load of the converter's own output against the safetensors it came from.

    .venv/bin/python scripts/check_moe_gguf_layout.py --llama-cpp DIR [--tokenizer DIR] [--families A,B]

DIR: llama.cpp's source tree with convert_hf_to_gguf.py and gguf-py (llama-cpp-python 0.3.36's
sdist vendors one, vendor/llama.cpp). The converter refuses a tokenizer it does not know, so each
tiny model takes a real BPE tokenizer's files (--tokenizer, default: the pulled SmolLM2's) and its
vocab_size (49,152). Every model is all-MoE (llama.cpp's qwen3moe graph has no dense layer).
DeepSeek-V2 / V3 (a dense first layer, then MoE layers with shared experts; V2 group-limited with one
q_proj, V3 with a q LoRA, noaux_tc groups and a random correction bias) get `scoring_func` in their
config.json as DeepSeek's own configs write it (transformers' config classes write none, and the
converter writes the gating function only from it); the converter splits kv_b_proj into attn_k_b /
attn_v_b, which tests/deepseek_gguf.py's split form must equal.
Mixtral goes through the converter's LlamaModel, which imports sentencepiece before it looks for a
tokenizer.model; where sentencepiece is not installed a stand-in module that only lets that import
pass is put on the converter's path (it then finds no tokenizer.model and takes the BPE one).

For each family at --outtype f32 and q8_0 it checks: every tensor's name, type, shape and bytes
equal between the converter's file and ours; the model's metadata (`<arch>.*`) equal; and the
converter's file imported into Outrider gives the safetensors load's logits (f32: bit for bit;
q8_0: its blocks against its values dequantized, within float rounding). Prints one line a check;
exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

SIZES = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
DEEPSEEK = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4,  # as DeepSeek's configs have it (the converter splits kv_b_proj by it)
                kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False, n_routed_experts=8, num_experts_per_tok=3,
                moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2)
SCORING = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}  # as DeepSeek's own config.json files name it
FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3")


def build(family: str, folder: Path, tokenizer: Path) -> None:
    import transformers as tf

    models = {
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **SIZES, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True)),
        "olmoe": lambda: tf.OlmoeForCausalLM(tf.OlmoeConfig(
            **SIZES, intermediate_size=32, num_experts=6, num_experts_per_tok=3)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
            **SIZES, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2)),
        "deepseek_v2": lambda: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
            **DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
        "deepseek_v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **DEEPSEEK, q_lora_rank=32, norm_topk_prob=True, routed_scaling_factor=2.5)),
    }
    torch.manual_seed(9)
    model = models[family]().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    if family in SCORING:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "scoring_func": SCORING[family]}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)


def convert(llama_cpp: Path, folder: Path, out: Path, outtype: str, work: Path) -> None:
    import importlib.util
    import subprocess

    paths = [str(llama_cpp / "gguf-py")]
    if importlib.util.find_spec("sentencepiece") is None:
        (work / "shim").mkdir(exist_ok=True)
        (work / "shim" / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
        paths.append(str(work / "shim"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out),
           "--outtype", outtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the converter failed:\n{done.stderr[-3000:]}")


def main() -> int:
    from check_qwen35_gguf_layout import compare, gguf_names, logits

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=Path.home() / ".cache/outrider/models/smollm2-135m-instruct")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"some of {', '.join(FAMILIES)}")
    args = parser.parse_args()
    families = args.families.split(",")
    if not set(families) <= set(FAMILIES):
        parser.error(f"--families: {args.families!r}: choose among {', '.join(FAMILIES)}")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="moe-gguf-"))
    os.environ["OUTRIDER_CACHE_DIR"] = str(work / "cache")
    from outrider.catalog.imported import import_gguf
    from outrider.weights.loader import load_decoder
    from deepseek_gguf import write_deepseek_gguf
    from moe_gguf import write_moe_gguf

    tokens = torch.tensor([3, 9, 4, 11, 7, 8, 20, 5, 3, 9, 60, 61, 62, 63, 12, 30, 31, 2, 9, 4])
    failed = False
    for family in families:
        folder = work / family
        build(family, folder, args.tokenizer)
        want = logits(load_decoder(folder, "cpu", torch.float32), tokens)
        for outtype, qtype in (("f32", "F32"), ("q8_0", "Q8_0")):
            case, stem = f"{family} {outtype}", f"{family}-{outtype}"
            theirs, ours = work / f"converter-{stem}.gguf", work / f"ours-{stem}.gguf"
            convert(args.llama_cpp, folder, theirs, outtype, work)
            if family in SCORING:
                write_deepseek_gguf(folder, ours, qtype, split_kv_b=True, tokenizer=False)
            else:
                write_moe_gguf(folder, ours, qtype, tokenizer=False)
            problems = compare(theirs, ours)
            failed |= bool(problems)
            count = len(gguf_names(theirs))
            print(f"{case}: layout " + (f"equal ({count} tensors' names, types, shapes, bytes; the model's metadata)"
                                        if not problems else "DIFFERS: " + "; ".join(problems)))
            imported = import_gguf(theirs, name=f"converter-{stem}", log=lambda line: None)
            got = logits(load_decoder(imported, "cpu", torch.float32), tokens)
            if outtype == "f32":
                same = torch.equal(got, want)
                failed |= not same
                print(f"{case}: converter's file in Outrider vs the safetensors load: "
                      f"{'bit-equal logits' if same else 'DIFFER by %g' % (got - want).abs().max()}")
            else:
                blocks = logits(load_decoder(imported, "cpu", "gguf"), tokens)
                diff = float((blocks - got).abs().max())
                failed |= diff > 1e-4 * float(got.abs().max())
                print(f"{case}: --dtype gguf (its blocks) vs float32 (its values dequantized): max |diff| {diff:.2e}; "
                      f"vs the unquantized safetensors: {float((got - want).abs().max()):.3f} (Q8_0's own error)")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
