"""The public Python API: `LLM(model).generate(prompts, ...)`.

The engine owns the tokenizer and the chat template; the runtime below it sees token ids only.

    from outrider import LLM
    llm = LLM("smollm2-135m-instruct")
    print(llm.generate("def fib(n):", max_new_tokens=64).text)
"""

from __future__ import annotations

import numbers

from . import config as runtime
from .config import RuntimeConfig
from .engine.generate import offline_engine
from .engine.prefix_cache import PrefixCache
from .engine.request import Completion, Request
from .engine.speculator import MAX_TREE_NODES, SpecOptions, Speculator
from .engine.text_stream import check_text
from .engine.threads import cpu_share_for
from .kernels import dispatch
from .errors import ConfigError
from .sampling import SamplingParams
from .weights.loader import auto_dtype, load_decoder, parse_dtype, parse_kv_dtype, resolve_device
from .weights.tokenizer import eos_ids_of, load_tokenizer

__all__ = ["LLM", "Completion"]


class LLM:
    def __init__(self, model: str | None = None, *, drafter: str | None = None, tree: str = "chain",
                 controller: str = "fixed:4", device: str | None = None, dtype: str | None = None,
                 threads: int | None = None, max_tree_nodes: int = MAX_TREE_NODES, kv_dtype: str | None = None,
                 config: RuntimeConfig | dict | None = None, verifier: str | None = None,
                 prefix_cache_mb: int = 256, kv_memory: int | str | None = None):
        """`drafter`: None (autoregressive), "ngram", "suffix", "draft-model:NAME", "early-exit:K",
        "eagle3:PATH_OR_NAME" or "hybrid:[K,]DRAFTER"; `tree`: chain, static:B1,B2,...,
        sampled:B1,B2,... (siblings drawn from q; temperature > 0 only) or dynamic:K,N;
        `controller`: fixed:N, adaptive[:MAX], cost[:MAX] or a registered one (libraspec[:MAX],
        threshold:T[,MAX], entropy[:MAX]); `verifier`: a verifier by name, for every request
        (None: the best exact one per request, the walk for a seeded one, so that its text is
        plain sampling's: docs/usage.md#seeds; "resispec-lossy" is lossy, docs/methods.md);
        `kv_dtype`: the K/V cache's values, "float32" or "float16" (None: the compute dtype); `config`: the runtime
        config (outrider/config.py; a dict changes the current one), put in force for the
        process; `threads` is its `threads`; `prefix_cache_mb`: memory of the exact prefix cache kept
        across `generate` calls (prompts that share a prefix with an earlier call's prompt or output
        prefill only the rest; engine/prefix_cache.py; 0: off; off by itself where it would not be
        exact, `prefix_cache_note` says why); `kv_memory`: paged K/V in a pool of that many MiB (512)
        or pages ("2000p"; engine/paging.py), the prompts of a `generate` call running as its pages
        allow (None: a slot each). Bad strings are refused before loading."""
        from .catalog.packages import DEFAULT_MODEL
        from .catalog.resolve import resolve_model

        if verifier is not None and not drafter:
            raise ConfigError("verifier needs a drafter: autoregressive decoding verifies nothing")
        options = SpecOptions(drafter, tree, controller, max_tree_nodes, verifier).check() if drafter else None
        torch_dtype = parse_dtype(dtype)
        cache_dtype = parse_kv_dtype(kv_dtype)
        torch_device = resolve_device(device)  # an unknown or absent device is refused here, not mid-load
        if threads is not None:
            _check_threads(threads)
        if isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, numbers.Integral) or prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb must be an integer >= 0 (0: off), got {prefix_cache_mb!r}")
        if kv_memory is not None:
            from .engine.paging import parse_kv_memory

            parse_kv_memory(kv_memory)
        if config is not None or threads is not None:
            runtime.use(config, **({"threads": threads} if threads is not None else {}))
        self.config = runtime.current()
        self.name = model or DEFAULT_MODEL
        self.path = resolve_model(self.name)
        if self.name.lower().endswith(".gguf"):  # a GGUF file: named as it was imported (a server's model id)
            self.name = self.path.name
        if dtype is None:  # the model's own GGUF quantization where our kernel runs it (loader.auto_dtype)
            torch_dtype = auto_dtype(self.path, torch_device)
        self.target = load_decoder(self.path, torch_device, torch_dtype, kv_dtype=cache_dtype)
        self.tokenizer = load_tokenizer(self.path)
        self.eos_ids = eos_ids_of(self.path, self.tokenizer)
        self.speculator = Speculator.build(options, self.target, self.path) if options else None
        # the thread count follows the free cores unless the config fixes it (engine/threads.py)
        self.cpu_share = cpu_share_for(self.config.threads, dispatch.plan().follow_free_cores)
        self._grammars = None
        self.prefix_cache = PrefixCache(budget_bytes=prefix_cache_mb << 20) if prefix_cache_mb else None
        self.prefix_cache_note: str | None = None  # why the cache is off, after the first generate
        self.kv_pages = None  # paged K/V: the pool's pages (engine/paging.py)
        if kv_memory is not None:
            from .engine.paging import pages_of

            self.kv_pages = pages_of(kv_memory, self.target, 16)

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

    def encode_images(self, prompt: str, images: list, chat: bool = False) -> tuple[list[int], tuple]:
        """A prompt with images: its token ids (each image's tokens expanded) and the image rows
        that replace them (Request.prompt_embeds); models/image_prompt.py."""
        from .models.image_pixels import read_image
        from .models.image_prompt import expand_text, image_text, prompt_embeds

        tower = self.target.vision
        if tower is None:
            raise ConfigError(f"model '{self.name}' is a text model ({self.target.config.architecture}): it takes no "
                              "images; give one to a vision-language model (docs/models.md)")
        check_text(prompt, "the prompt")
        pixels = [read_image(image, tower.config, self.path) for image in images]
        text = expand_text(image_text(prompt, len(images), chat, self.tokenizer), pixels, tower.config, self.tokenizer)
        ids = self.tokenizer(text, add_special_tokens=not chat)["input_ids"]
        return ids, prompt_embeds(tower, ids, pixels)

    def grammars(self):
        """The grammar compiler for this model's tokenizer (built on first use: about a second)."""
        if self._grammars is None:
            from .spec.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.target.config.vocab_size, self.eos_ids)
        return self._grammars

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped, spaces left as the tokens have them."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: str | list[str], max_new_tokens: int = 128, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: str | list[str] | None = None,
                 chat: bool = False, on_text=None, response_format: dict | None = None,
                 grammar_drafting: bool = True, images=None) -> Completion | list[Completion]:
        """Generate for one prompt (returns a Completion) or a list (returns a list).

        stop: a stop string or a list of them (empty ones are ignored). The text ends exactly
        before the earliest one; `token_ids` keep the token in which it starts (see Completion).
        on_text(index, new_text), for streaming, receives only stable new text of prompt `index`
        (never an incomplete character nor a tail that may start a stop string; what is held
        back comes at the end): its pieces add up to that Completion's `text`.
        response_format: OpenAI's ({"type": "json_object"} or {"type": "json_schema",
        "json_schema": {"schema": {...}}}): the output follows the grammar, speculative or not
        (spec/grammar.py; needs the `structured` extra); grammar_drafting: drafts pruned at
        forbidden tokens and forced tokens drafted for free (off: the grammar only masks p).
        images: a vision-language model's (models/idefics3.py): for one prompt, an image or a list of
        them; for a list of prompts, one such entry a prompt (None: none). An image is a file path
        (PNG / JPEG through Pillow, or a .npy / .safetensors pixel tensor) or a pixel tensor [3, S, S]
        (models/image_prompt.py); the prompt's `<image>` markers say where they go (else before its
        text, or where the chat template puts them).
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
        params = SamplingParams(temperature, top_k, top_p, seed)
        grammar = self.grammars().compile(response_format) if response_format is not None else None
        encoded = [self.encode_images(p, i, chat) if i else (self.encode(p, chat), None)
                   for p, i in zip(batch, _check_images(images, single, len(batch)))]
        requests = [Request(ids, max_new_tokens, params, tuple(stops), grammar=grammar,
                            grammar_drafting=grammar_drafting, prompt_embeds=embeds) for ids, embeds in encoded]
        engine = offline_engine(self.target, requests, self.eos_ids, self.speculator, self.decode,
                                prefix_cache=self.prefix_cache, kv_pages=self.kv_pages)
        self.prefix_cache_note = engine.prefix_cache_note
        ids = {engine.add(r): i for i, r in enumerate(requests)}  # request id -> prompt index
        out: list[Completion | None] = [None] * len(batch)
        with self.cpu_share:
            while engine.has_work:
                for event in engine.step():
                    if event.text and on_text is not None:
                        on_text(ids[event.request_id], event.text)
                    if event.completion is not None:
                        out[ids[event.request_id]] = event.completion
                self.cpu_share.tick()
        return out[0] if single else out


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


def _check_images(images, single: bool, count: int) -> list[list]:
    """generate's `images` as one list of images a prompt (empty: none)."""
    def one(entry) -> list:
        if entry is None:
            return []
        return list(entry) if isinstance(entry, (list, tuple)) else [entry]

    if images is None:
        return [[] for _ in range(count)]
    if single:
        return [one(images)]
    if not isinstance(images, (list, tuple)) or len(images) != count:
        raise ConfigError(f"images: give one entry a prompt ({count} prompts), each an image, a list of them or None")
    return [one(entry) for entry in images]


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
