"""`--drafter draft-model:NAME`: an independent, smaller model of the target's family drafts.

NAME is a catalog name or a model folder. The draft model must map text to the same token ids
as the target (same tokenizer), which is checked from the two tokenizer.json files before any
weights load. It drafts with `ModelDrafter` (model.py) and declares what that class declares.

`draft-model:NAME@DTYPE` loads the draft model in a `--dtype` of its own (default: the
target's). The drafter's precision only changes which tokens it proposes, never what is
committed (the target verifies every one), so a fast lossy kernel is fair game here:
`@q4-bf16-lossy` drafts with torch's int4 kernel while the output stays exactly the target's.
For the same reason the draft model's prompt prefill runs its many rows through the bfloat16
GEMM wherever the CPU has AMX (quant_linear.filling(bf16=True)), with no opt-in: on the Qwen
pair the 0.5B's prefill of 3 HumanEval prompts went from ~2.8 s to ~0.9 s beyond the target's.

`draft-model:NAME[@DTYPE],vocab=N` keeps only N + a few rows of the draft model's output head:
token ids 0..N-1 (a byte-pair tokenizer's ids follow its merge order, so the low ids are its
common tokens, as FR-Spec found) and the tokenizer's added tokens (end of turn, end of text).
It then proposes no other token; the target still verifies each and adds its own bonus, so the
output is unchanged. On the Qwen pair (151,936 tokens, 896 wide) the 0.5B `@q4_0` step reads 77
MB less of its 278 per draft token.

`draft-model:NAME[@DTYPE][,vocab=N],window=W[,sink=S]` (Windowed-MTP, window.py): the draft
model attends to the first S positions and the last W only, and keeps only those rows of K/V;
the options come in any order after the name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError
from ..weights.loader import DTYPE_NAMES
from .model import ModelDrafter
from .registry import DrafterEntry, register
from .window import Window, parse_options, window_misfit, window_of

USAGE = "draft-model:NAME[@DTYPE][,vocab=N][,window=W[,sink=S]]"


@dataclass(frozen=True)
class DraftModel:
    name: str  # catalog name or folder
    dtype: str | None = None  # its own --dtype (None: the target's)
    vocab: int | None = None  # the head's first token ids kept (None: all)
    window: Window | None = None  # attend to a sink and the last W positions only (None: all)

    def __str__(self) -> str:
        text = self.name if self.dtype is None else f"{self.name}@{self.dtype}"
        text = text if self.vocab is None else f"{text},vocab={self.vocab}"
        return text if self.window is None else f"{text},{self.window}"


def parse_argument(text: str) -> DraftModel:
    if not text:
        raise ConfigError("draft-model:NAME needs a model name or folder after the colon")
    if not Path(text).exists():
        text, options = parse_options(text, ("vocab", "window", "sink"))
        window = window_of(options, "draft-model:NAME")
        vocab = options.get("vocab")
        if vocab is not None and (not vocab.isdigit() or int(vocab) < 1):
            raise ConfigError(f"vocab={vocab!r}: give a positive number of token ids, as in "
                              "draft-model:NAME,vocab=65536")
        if options:
            return replace(parse_argument(text), vocab=None if vocab is None else int(vocab), window=window)
    name, at, dtype = text.rpartition("@")
    if not at or Path(text).exists():
        return DraftModel(text)
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype '{dtype}' after '@': use one of {', '.join(DTYPE_NAMES)}")
    if not name:
        raise ConfigError("give a model name or folder before the '@' (draft-model:NAME@DTYPE)")
    return DraftModel(name, dtype)


def models_needed(arg: DraftModel) -> tuple[str, ...]:
    return (arg.name,)


def check_fits(arg: DraftModel, target_config, target_path: Path) -> str | None:
    from ..catalog.resolve import resolve_model

    return window_misfit(arg.window, target_config) or tokenizer_mismatch(target_path, resolve_model(arg.name))


def build(arg: DraftModel, shape, target, target_path: Path) -> ModelDrafter:
    from ..catalog.resolve import resolve_model
    from ..models.config import ModelConfig
    from ..weights.loader import auto_dtype, load_decoder, parse_dtype

    path = resolve_model(arg.name)
    # no @DTYPE: the drafter's own GGUF quantization where our kernel runs it, with int8
    # activations where they run (its numerics change only its proposals; measured:
    # docs/benchmarks/2026-12-01-amd-epyc-zen5-avx512.md, Draft model: the Qwen pair with int8
    # activations), else the target's float dtype
    from ..kernels import native

    own = auto_dtype(path, target.device)
    if own and native.i8_available():
        own += "-i8"
    dtype = parse_dtype(arg.dtype) if arg.dtype else own or target.dtype
    vocab = min(target.config.vocab_size, ModelConfig.load(path).vocab_size)
    ids = draft_vocab_ids(path, arg.vocab, vocab) if arg.vocab and arg.vocab < vocab else None
    # a drafter's prompt in bfloat16 where the CPU has AMX, and the target's K/V cache type
    # (--kv-dtype): both change only its proposals
    draft = load_decoder(path, target.device, dtype, head_ids=ids, kv_dtype=target.kv_dtype, drafter=True)
    return ModelDrafter(draft, shape, name=f"draft-model:{arg}", target_vocab=target.config.vocab_size,
                        window=arg.window)


def draft_vocab_ids(folder: Path, n: int, limit: int) -> torch.Tensor:
    """Token ids 0..n-1 and the tokenizer's added tokens, all below `limit`: long [m], sorted."""
    path = Path(folder) / "tokenizer.json"
    added = [t["id"] for t in json.loads(path.read_text()).get("added_tokens", [])] if path.exists() else []
    ids = sorted(set(range(min(n, limit))) | {i for i in added if 0 <= i < limit})
    return torch.tensor(ids, dtype=torch.long)


def tokenizer_mismatch(target_path: Path, draft_path: Path) -> str | None:
    """A reason the two folders' tokenizers differ, or None when they map text to the same ids."""
    files = [Path(folder) / "tokenizer.json" for folder in (target_path, draft_path)]
    if all(f.exists() for f in files) and files[0].read_bytes() == files[1].read_bytes():
        return None  # one file twice (a family's models share it): no need to parse 7 MB of JSON twice

    def vocab(folder: Path):
        path = Path(folder) / "tokenizer.json"
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        added = sorted((t["id"], t["content"]) for t in raw.get("added_tokens", []))
        return raw.get("model", {}).get("type"), raw.get("model", {}).get("vocab"), added

    a, b = vocab(target_path), vocab(draft_path)
    if a is None or b is None:
        return "a tokenizer.json is missing, so the vocabularies cannot be compared"
    if a != b:
        size_a, size_b = len(a[1] or {}), len(b[1] or {})
        return f"its tokenizer differs from the target's ({size_b} vs {size_a} tokens); use a model of the same family"
    return None


register(DrafterEntry("draft-model", USAGE, ModelDrafter.capabilities, build=build, parse_argument=parse_argument,
                      models_needed=models_needed, check_fits=check_fits, windowed=True))
