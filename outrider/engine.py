"""The public Python API: `LLM(model).generate(prompts, ...)`.

The engine owns the tokenizer and the chat template; the runtime below it sees token ids only.

    from outrider import LLM
    llm = LLM("smollm2-135m-instruct")
    print(llm.generate("def fib(n):", max_new_tokens=64).text)
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
import torch

from .errors import ConfigError, ModelError
from .generation import Finished, Request, generate_ids
from .models.loader import load_decoder, resolve_device
from .sampling import SamplingParams
from .spec.setup import MAX_TREE_NODES, SpecOptions, Speculator
from .stats import summarize


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


class LLM:
    def __init__(self, model: str | None = None, *, drafter: str | None = None, tree: str = "chain",
                 controller: str = "fixed:4", device: str | None = None, dtype: str | None = None,
                 threads: int | None = None, max_tree_nodes: int = MAX_TREE_NODES):
        """`drafter`: None (autoregressive), "ngram", "suffix", "draft-model:NAME" or
        "early-exit:K"; `tree`: chain, static:B1,B2,... or dynamic:K,N; `controller`:
        fixed:N, adaptive[:MAX] or cost[:MAX]. Bad strings are refused before loading."""
        from .models.catalog import DEFAULT_MODEL, resolve_model

        options = SpecOptions(drafter, tree, controller, max_tree_nodes).check() if drafter else None
        torch_dtype = _parse_dtype(dtype)
        torch_device = resolve_device(device)  # an unknown or absent device is refused here, not mid-load
        if threads is not None:
            torch.set_num_threads(_check_threads(threads))
        self.name = model or DEFAULT_MODEL
        self.path = resolve_model(self.name)
        self.target = load_decoder(self.path, torch_device, torch_dtype)
        self.tokenizer = _load_tokenizer(self.path)
        self.eos_ids = eos_ids_of(self.path, self.tokenizer)
        self.speculator = Speculator.build(options, self.target, self.path) if options else None

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(f"model '{self.name}' has no chat template; run without --chat")
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: str | list[str], max_new_tokens: int = 128, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
                 chat: bool = False, on_text=None) -> Completion | list[Completion]:
        """Generate for one prompt (returns a Completion) or a list (returns a list).

        on_text(index, text_so_far) is called after every round, for streaming.
        """
        single = isinstance(prompts, str)
        batch = [prompts] if single else list(prompts)
        # one seed for every prompt: a prompt's text depends on (prompt, seed), not on its place
        # in the batch (randomness is drawn by output position, spec/random.py)
        params = [SamplingParams(temperature, top_k, top_p, seed) for _ in batch]
        requests = [Request(self.encode(p, chat), max_new_tokens, sp) for p, sp in zip(batch, params)]
        stops = [s for s in (stop or []) if s]

        def on_commit(index: int, output: list[int]) -> int | None:
            text = self.decode(output)
            cut = _stop_cut(text, stops)
            if on_text is not None:
                on_text(index, text if cut is None else text[:cut])
            if cut is None:
                return None
            return _tokens_before(self, output, text[:cut])

        finished = generate_ids(self.target, requests, self.eos_ids, speculation=self.speculator,
                                on_commit=on_commit)
        out = [self._completion(f, stops) for f in finished]
        return out[0] if single else out

    def _completion(self, f: Finished, stops: list[str]) -> Completion:
        text = self.decode(f.output_ids)
        cut = _stop_cut(text, stops)
        if cut is not None:
            text = text[:cut]
        stats = summarize(f)
        return Completion(text, f.output_ids, f.finish_reason, stats)


def _stop_cut(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def _tokens_before(llm: LLM, output: list[int], kept_text: str) -> int:
    """The fewest output tokens whose text covers `kept_text` (the stop string's own tokens go)."""
    for n in range(len(output) + 1):
        if len(llm.decode(output[:n])) >= len(kept_text):
            return n
    return len(output)


def _check_threads(threads) -> int:
    """CPU threads for torch: an integer >= 1."""
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be an integer >= 1 (or None for torch's default), got {threads!r}")
    if threads < 1:
        raise ConfigError(f"threads must be a positive integer, got {threads}")
    return int(threads)


def _parse_dtype(name: str | None) -> torch.dtype | None:
    table = {None: None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ConfigError(f"unknown dtype '{name}': use float32, bfloat16 or float16")
    return table[name]


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"{path}: cannot load the tokenizer ({first}); re-pull the model") from None


def eos_ids_of(path: Path, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
