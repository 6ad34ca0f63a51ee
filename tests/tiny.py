"""Tiny random models of each family, saved as Hugging Face folders (transformers is the reference)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# A folder where each tiny model is built once and then copied from (scripts/mutate.py sets it: a
# mutant's tests run in a fresh process, and building the models there cost seconds a mutant).
CACHE = os.environ.get("OUTRIDER_TEST_TINY_CACHE")
RNG = "torch-rng-state.safetensors"

FAMILIES = ("llama", "qwen2", "qwen3")  # the attention families every runtime test covers
HYBRIDS = ("qwen3_5", "qwen3_next")  # families with gated-delta layers (tests/test_hybrid.py, test_qwen3_next.py)


def make_tiny(family: str, folder: Path, vocab: int = 96, seed: int = 0, layers: int = 3, tied: bool = False,
              max_positions: int = 256, **overrides) -> Path:
    """Save a tiny random `family` model to `folder`; returns the folder. overrides: config fields
    set after the family's (e.g. mlp_only_layers=[] for a Qwen3-Next whose every MLP is sparse)."""
    key = f"{family}-v{vocab}-s{seed}-l{layers}-{'tied' if tied else 'untied'}-p{max_positions}"
    key += "".join(f"-{k}{v}".replace(" ", "") for k, v in sorted(overrides.items()))
    if CACHE and (Path(CACHE) / key).is_dir():
        shutil.copytree(Path(CACHE) / key, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns(RNG))
        torch.set_rng_state(load_file(Path(CACHE) / key / RNG)["state"])  # as building it leaves torch's generator
        return Path(folder)
    import transformers as tf

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )
    if family == "llama":
        config = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        config = tf.Qwen2Config(**common, rope_theta=1e6)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=16, rope_theta=1e6)
        cls = tf.Qwen3ForCausalLM
    elif family == "qwen3_5":  # a gated-delta hybrid: three gated-delta layers, then attention (models/qwen3_5.py)
        config = tf.Qwen3_5TextConfig(**common, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                      linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.25})
        cls = tf.Qwen3_5ForCausalLM
    elif family == "qwen3_next":  # the Qwen3.5 layout with MoE MLPs (layer 1 dense; models/qwen3_next.py)
        config = tf.Qwen3NextConfig(**common, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[1],
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 0.25})
        cls = tf.Qwen3NextForCausalLM
    else:
        raise ValueError(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # larger weights than the init, so logits are far from uniform
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    if CACHE:  # built whole under a name of its own, then renamed: a reader never sees half of it
        part = Path(CACHE) / f"{key}.{os.getpid()}.part"
        shutil.copytree(folder, part, dirs_exist_ok=True)
        save_file({"state": torch.get_rng_state()}, part / RNG)
        try:
            part.rename(Path(CACHE) / key)
        except OSError:  # another process got there first
            shutil.rmtree(part, ignore_errors=True)
    return Path(folder)


def reference(folder: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_tokenizer(folder: Path, vocab: int = 96) -> Path:
    """A word-level tokenizer over `vocab` ids: <unk>, <|im_start|>, <|im_end|>, then w3, w4, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return Path(folder)


def logits_in_steps(model, tokens: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """tokens[:cuts[-1]]'s logits [cuts[-1], vocab] from one slot's forwards over tokens[cuts[i]:cuts[i + 1]]
    (cuts [0, n]: a whole prefill; more cuts: a chunked one, or decode steps), each part's rows
    committed before the next, as the engine commits them."""
    from outrider.models.batch import pack

    cache = model.new_cache(1, cuts[-1] + 8)
    rows = []
    for start, stop in zip(cuts, cuts[1:]):
        out = model.forward(pack([0], [start], [tokens[start:stop]], scratch_row=cache.scratch_row), cache)
        rows.append(out.logits[0])
        cache.set_length(0, stop)
    return torch.cat(rows)


def saved_references(tmp_path_factory, names, save, tokens: torch.Tensor) -> dict:
    """For each name: (its folder, transformers' model `save(name, folder)` wrote there, that model's
    logits over tokens [T, vocab], our float32 decoder loaded from the folder)."""
    from outrider.weights.loader import load_decoder

    out = {}
    for name in names:
        folder = tmp_path_factory.mktemp(name)
        reference = save(name, folder)
        with torch.no_grad():
            want = reference(tokens[None]).logits[0]  # [T, vocab]
        out[name] = folder, reference, want, load_decoder(folder, "cpu", torch.float32)
    return out
