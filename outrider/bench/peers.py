"""Peers: other engines run on the same model and prompts, in the same process.

    transformers                  AutoModelForCausalLM.generate, greedy
    transformers-assisted         the same with assistant_model (a draft model)
    transformers-prompt-lookup    the same with prompt_lookup_num_tokens
    llama.cpp                     llama-cpp-python on the model's original GGUF (the `peers` extra)
    llama.cpp-prompt-lookup       the same with its prompt-lookup decoding

Each peer takes prompt ids and returns a PromptRun. A peer that cannot run here (llama.cpp not
installed, no original GGUF for a user folder) says why, and the bench reports it as skipped.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .runner import PromptRun, run_transformers


class PeerUnavailable(Exception):
    """This peer cannot run on this machine or model; the message says why."""


class TransformersPeer:
    def __init__(self, model_path: Path, kind: str, assistant_path: Path | None = None, lookup: int = 10):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        for folder in (model_path, assistant_path if kind == "transformers-assisted" else None):
            if folder is not None and not any(Path(folder).glob("*.safetensors")):
                raise PeerUnavailable(f"{folder} keeps only a GGUF (an imported model): transformers needs float "
                                      "weights (a packaged model's folder has them)")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        self.assistant = None
        if kind == "transformers-assisted":
            self.assistant = AutoModelForCausalLM.from_pretrained(str(assistant_path), dtype=torch.float32).eval()
        self.lookup = lookup if kind == "transformers-prompt-lookup" else None

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> PromptRun:
        return run_transformers(self.model, prompt_ids, max_new_tokens, assistant=self.assistant,
                                prompt_lookup=self.lookup)


class LlamaCppPeer:
    def __init__(self, gguf: Path, kind: str, threads: int, lookup: int = 10):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise PeerUnavailable("llama-cpp-python is not installed (pip install -e '.[peers]')") from None
        if not gguf.exists():
            raise PeerUnavailable(f"no original GGUF at {gguf} (only catalog models keep one)")
        draft = None
        if kind == "llama.cpp-prompt-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, verbose=False, draft_model=draft,
                         logits_all=draft is not None)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> PromptRun:
        out: list[int] = []
        start = time.perf_counter()
        self.llm.reset()
        eos = self.llm.token_eos()
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if token == eos or len(out) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return PromptRun(out, seconds, {"new_tokens": len(out), "tokens_per_s": len(out) / seconds})


def make_peer(kind: str, model_path: Path, *, assistant_path: Path | None, lookup: int, threads: int):
    if kind.startswith("transformers"):
        return TransformersPeer(model_path, kind, assistant_path, lookup)
    return LlamaCppPeer(Path(model_path) / "original.gguf", kind, threads, lookup)
