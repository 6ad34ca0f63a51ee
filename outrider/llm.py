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
from .engine.generate import Finished, Request, generate_ids
from .weights.loader import auto_dtype, load_decoder, parse_dtype, parse_kv_dtype, resolve_device
from .sampling import SamplingParams
from .engine.speculator import MAX_TREE_NODES, SpecOptions, Speculator
from .engine.stats import summarize
from .engine.text_stream import TextStream, check_text
from .engine.threads import cpu_share_for


@dataclass
class Completion:
    """One prompt's output. `text` ends exactly before the earliest stop string found;
    `token_ids` are the output tokens that text came from, so when a stop string starts inside a
    token, that token is kept and its text runs past `text` (finish_reason "stop")."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


class LLM:
    def __init__(self, model: str | None = None, *, drafter: str | None = None, tree: str = "chain",
                 controller: str = "fixed:4", device: str | None = None, dtype: str | None = None,
                 threads: int | None = None, max_tree_nodes: int = MAX_TREE_NODES, kv_dtype: str | None = None):
        """`drafter`: None (autoregressive), "ngram", "suffix", "draft-model:NAME" or
        "early-exit:K"; `tree`: chain, static:B1,B2,... or dynamic:K,N; `controller`:
        fixed:N, adaptive[:MAX] or cost[:MAX]; `kv_dtype`: the K/V cache's values, "float32" or
        "float16" (None: the compute dtype). Bad strings are refused before loading."""
        from .catalog.packages import DEFAULT_MODEL, resolve_model

        options = SpecOptions(drafter, tree, controller, max_tree_nodes).check() if drafter else None
        torch_dtype = parse_dtype(dtype)
        cache_dtype = parse_kv_dtype(kv_dtype)
        torch_device = resolve_device(device)  # an unknown or absent device is refused here, not mid-load
        if threads is not None:
            torch.set_num_threads(_check_threads(threads))
        self.name = model or DEFAULT_MODEL
        self.path = resolve_model(self.name)
        if self.name.lower().endswith(".gguf"):  # a GGUF file: named as it was imported (a server's model id)
            self.name = self.path.name
        if dtype is None:  # the model's own GGUF quantization where our kernel runs it (loader.auto_dtype)
            torch_dtype = auto_dtype(self.path, torch_device)
        self.target = load_decoder(self.path, torch_device, torch_dtype)
        self.target.kv_dtype = cache_dtype
        self.tokenizer = _load_tokenizer(self.path)
        self.eos_ids = eos_ids_of(self.path, self.tokenizer)
        self.speculator = Speculator.build(options, self.target, self.path) if options else None
        self.cpu_share = cpu_share_for(threads)  # thread count follows the free cores (engine/threads.py)

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        check_text(prompt, "the prompt")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(f"model '{self.name}' has no chat template; run without --chat")
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped, spaces left as the tokens have them."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: str | list[str], max_new_tokens: int = 128, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: str | list[str] | None = None,
                 chat: bool = False, on_text=None) -> Completion | list[Completion]:
        """Generate for one prompt (returns a Completion) or a list (returns a list).

        stop: a stop string or a list of them (empty ones are ignored). The text ends exactly
        before the earliest one; `token_ids` keep the token in which it starts (see Completion).
        on_text(index, new_text), for streaming, receives only stable new text of prompt `index`
        (never an incomplete character nor a tail that may start a stop string; what is held
        back comes at the end): its pieces add up to that Completion's `text`.
        """
        single, batch = _check_prompts(prompts)
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        stops = _check_stops(stop)
        if not isinstance(chat, bool):
            raise TypeError(f"chat must be True or False, got {chat!r}")
        if on_text is not None and not callable(on_text):
            raise TypeError(f"on_text must be a function on_text(index, new_text) or None, got {on_text!r}")
        # one seed for every prompt: a prompt's text depends on (prompt, seed), not on its place
        # in the batch (randomness is drawn by output position, spec/random.py)
        params = [SamplingParams(temperature, top_k, top_p, seed) for _ in batch]
        requests = [Request(self.encode(p, chat), max_new_tokens, sp) for p, sp in zip(batch, params)]
        streams = [TextStream(self.decode, stops) for _ in batch]

        def on_commit(index: int, output: list[int]) -> int | None:
            self.cpu_share.tick()
            stream = streams[index]
            if len(output) < stream.fed:
                raise RuntimeError(f"on_commit got {len(output)} output tokens after {stream.fed}: "
                                   "a sequence's output must only grow")
            _show(on_text, index, stream.add(output[stream.fed:]))
            return stream.kept_tokens if stream.stopped else None

        with self.cpu_share:
            finished = generate_ids(self.target, requests, self.eos_ids, speculation=self.speculator,
                                    on_commit=on_commit)
        out = [self._completion(i, f, streams[i], on_text) for i, f in enumerate(finished)]
        return out[0] if single else out

    def _completion(self, index: int, f: Finished, stream: TextStream, on_text) -> Completion:
        """Finish the text of `f` (showing its held-back rest) and wrap it up."""
        ids, reason = f.output_ids, f.finish_reason
        rest = stream.add(ids[stream.fed:]) if len(ids) > stream.fed else ""
        _show(on_text, index, rest + stream.finish())
        if stream.stopped:
            ids, reason = ids[:stream.kept_tokens], "stop"
        return Completion(stream.text, ids, reason, summarize(f))


def _show(on_text, index: int, new_text: str) -> None:
    if new_text and on_text is not None:
        on_text(index, new_text)


def _check_prompts(prompts) -> tuple[bool, list[str]]:
    """(single, batch): a str is one prompt; a list or tuple of str is a batch."""
    if isinstance(prompts, str):
        return True, [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str or a list of str, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("generate() needs at least one prompt: pass a str or a non-empty list of str")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompts[{i}] must be a str, got {type(p).__name__}")
        check_text(p, f"prompt {i}")
    return False, list(prompts)


def _check_max_new_tokens(max_new_tokens) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int >= 1, got {type(max_new_tokens).__name__} "
                        f"{max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return int(max_new_tokens)


def _check_stops(stop) -> list[str]:
    """Stop strings as a list: None, one str, or a list or tuple of str."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a str, got {type(s).__name__}")
        check_text(s, f"stop string {i}")
    return [s for s in stops if s]


def _check_threads(threads) -> int:
    """CPU threads for torch: an integer >= 1."""
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be an integer >= 1 (or None for torch's default), got {threads!r}")
    if threads < 1:
        raise ConfigError(f"threads must be a positive integer, got {threads}")
    return int(threads)




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
