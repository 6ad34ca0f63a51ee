"""Peers: other engines run on the same model and prompts, each in a child process of its own.

    transformers                  AutoModelForCausalLM.generate, greedy (sampling, seeded, in a bench
                                  that samples: bench/sampling.py; llama-server too; the others stay greedy)
    transformers-assisted         the same with assistant_model (a draft model)
    transformers-prompt-lookup    the same with prompt_lookup_num_tokens
    llama.cpp                     llama-cpp-python on the model's original GGUF (the `peers` extra)
    llama.cpp-prompt-lookup       the same with its prompt-lookup decoding
    llama-server[:SPEC_TYPE]      llama.cpp's server binary over HTTP, plain or speculative
                                  (llama_server.py: a subprocess already, so not in a child of ours)

Each peer takes prompt ids and returns a PromptRun. A peer that cannot run here (llama.cpp not
installed, no original GGUF for a user folder) says why, and the bench reports it as skipped; one
that crashes, exits, raises or hangs (peer_process.py) is one failed row with its reason, and the
rest of the bench goes on.

llama.cpp on a CPU with AMX tiles: llama-cpp-python 0.3.36, built from source with its defaults,
segfaulted in its first completion on SmolLM2's GGUF on an Intel Xeon (Sapphire Rapids): the
weights repacked into its "extra buffer types" (the AMX / repacked CPU buffers) crash, and with
them off it runs. So on such a CPU the peer loads with `use_extra_bufts` off (llama.cpp's
`--no-repack`), and the report says so. Llama() has no argument for it (0.3.36 swallows unknown
keyword arguments silently), so the field is cleared in the model parameters it starts from.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import time
from pathlib import Path

import torch

from . import llama_server
from .peer_process import PeerFailed, PeerProcess, PeerUnavailable  # noqa: F401 (run.py's imports)
from .runner import PromptRun, run_transformers


class TransformersPeer:
    def __init__(self, model_path: Path, kind: str, assistant_path: Path | None = None, lookup: int = 10,
                 sampling: tuple[float, float] | None = None):
        """sampling: (temperature, top_p) to sample with (a bench that samples), each run seeded."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        _check_transformers(model_path, kind, assistant_path)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        self.assistant = None
        if kind == "transformers-assisted":
            self.assistant = AutoModelForCausalLM.from_pretrained(str(assistant_path), dtype=torch.float32).eval()
        self.lookup = lookup if kind == "transformers-prompt-lookup" else None
        self.sampling = sampling

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> PromptRun:
        sampling = None if self.sampling is None else (*self.sampling, seed)
        return run_transformers(self.model, prompt_ids, max_new_tokens, assistant=self.assistant,
                                prompt_lookup=self.lookup, sampling=sampling)


class LlamaCppPeer:
    def __init__(self, gguf: Path, kind: str, threads: int, lookup: int = 10, amx: bool | None = None):
        _check_llama_cpp(gguf)
        from llama_cpp import Llama

        draft = None
        if kind == "llama.cpp-prompt-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.extra_buffer_types = not (amx_tiles() if amx is None else amx)
        with _extra_buffer_types(Llama, self.extra_buffer_types) as extra:
            self.llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, verbose=False, draft_model=draft,
                             logits_all=draft is not None, **extra)
        self.note = None if self.extra_buffer_types else (
            "loaded with llama.cpp's extra buffer types off (use_extra_bufts = false, as --no-repack): this CPU "
            "has AMX tiles, where llama-cpp-python 0.3.36's repacked / AMX weight buffers crashed in the first "
            "completion")

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


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (where llama.cpp's extra buffer types crashed)."""
    from ..config import cpu_flags

    return "amx_tile" in cpu_flags()


@contextlib.contextmanager
def _extra_buffer_types(llama_class, on: bool):
    """Yields the keyword arguments for Llama(); with `on` false, llama.cpp's extra buffer types
    are off for the models loaded inside: by Llama's own argument where it has one, else in the
    default model parameters Llama() starts from (llama_cpp.llama_model_default_params)."""
    if on:
        yield {}
        return
    if "use_extra_bufts" in inspect.signature(llama_class.__init__).parameters:
        yield {"use_extra_bufts": False}
        return
    import llama_cpp.llama_cpp as native

    original = native.llama_model_default_params

    def without_extra_buffers():
        params = original()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    native.llama_model_default_params = without_extra_buffers
    try:
        yield {}
    finally:
        native.llama_model_default_params = original


def _check_transformers(model_path: Path, kind: str, assistant_path: Path | None) -> None:
    for folder in (model_path, assistant_path if kind == "transformers-assisted" else None):
        if folder is not None and not any(Path(folder).glob("*.safetensors")):
            raise PeerUnavailable(f"{folder} keeps only a GGUF (an imported model): transformers needs float "
                                  "weights (a packaged model's folder has them)")


def _check_llama_cpp(gguf: Path) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailable("llama-cpp-python is not installed (pip install -e '.[peers]')")
    if not Path(gguf).exists():
        raise PeerUnavailable(f"no original GGUF at {gguf} (only catalog models keep one)")


SAMPLES = ("transformers", "transformers-assisted", "transformers-prompt-lookup")  # the peers that sample when asked


def samples(kind: str) -> bool:
    """Whether a peer kind samples in a bench that samples (the rest stay greedy): transformers'
    and llama-server's (bench/llama_server.py)."""
    return kind in SAMPLES or llama_server.is_kind(kind)


def open_peer(kind: str, model_path: Path, assistant_path: Path | None, lookup: int, threads: int,
              sampling: tuple[float, float] | None = None):
    """The peer itself, in this process (the child's side of make_peer)."""
    if kind.startswith("transformers"):
        return TransformersPeer(Path(model_path), kind, assistant_path, lookup, sampling)
    return LlamaCppPeer(Path(model_path) / "original.gguf", kind, threads, lookup)


def make_peer(kind: str, model_path: Path, *, assistant_path: Path | None, lookup: int, threads: int,
              sampling: tuple[float, float] | None = None, head: str | None = None) -> PeerProcess:
    """The peer in a child process. What can be seen from here to stop it (not installed, no
    weights for it) raises PeerUnavailable before a process starts; a crash while it loads raises
    PeerFailed. sampling: (temperature, top_p) for a peer that samples (`samples`; the others stay greedy).
    head: llama-server's learned draft-* types' head (llama_server.py)."""
    if llama_server.is_kind(kind):  # a process of its own already: no child of ours around it
        return llama_server.make_llama_server(kind, Path(model_path), assistant_path, threads, sampling, head=head)
    if kind.startswith("transformers"):
        _check_transformers(Path(model_path), kind, assistant_path)
    else:
        _check_llama_cpp(Path(model_path) / "original.gguf")
    extra = {"sampling": sampling} if sampling is not None and kind in SAMPLES else {}
    return PeerProcess(open_peer, {"kind": kind, "model_path": Path(model_path), "assistant_path": assistant_path,
                                   "lookup": lookup, "threads": threads, **extra}, threads)
