"""`--drafter ooo:SIDECAR[,tokens=N]`: OoO-Spec, a sidecar model's hint of the coming tool call.

OoO-Spec (issue 26, item 2; out-of-order tool-call speculation): when a request arrives, a small
sidecar model predicts the whole answer (for a tool call: the function and every argument) from
the same prompt, in the background, while the target starts decoding at once. When the hint is
ready it becomes one more draft source beside the suffix drafter's pool; the target verifies
every draft as always, so the output is the target's whatever the hint says.

Here:

- SIDECAR is a catalog name or a model folder whose tokenizer maps text to the target's token ids
  (checked from the two tokenizer.json files before anything loads, as for `draft-model:NAME`;
  the target's own folder fits, a sidecar "prompted with itself"). So the hint needs no
  re-tokenisation: its ids are the target's.
- `start(seq_id, prompt)` queues the prompt for one background worker thread (a daemon), which
  prefills it on the sidecar and decodes greedily up to N tokens (`tokens=N`, default 64),
  stopping early at the sidecar's end-of-sequence ids. The hint is published once, when complete
  (one attribute set last); the engine thread only reads it and never waits for it.
- Until the hint is ready the drafter is the plain suffix drafter (suffix.py). After, each round
  the hint is matched like a tiny suffix pool: the longest suffix of the committed tokens (at most
  the suffix drafter's max_match) that occurs in `prompt tail + hint`, ending inside the hint
  (the tail lets the first round match before any output), gives the hint's next tokens up to the
  round's depth, each scored 1.0. They are merged with the suffix speculation into one tree of at
  most the round's node budget, best score first, ties to the suffix tree (oilbird.py `merge`).
  Among equally long matches the first one at or after the last match used wins.
- Requests queue for the one worker in arrival order; a finished request's hint is dropped (its
  decoding stops at the next token).
- Threads: the sidecar's forwards run in the worker thread, in the same process, and share the
  process's torch intra-op thread count (`--threads`); nothing is set per thread. On a 2-core CPU
  with `--threads 1` the sidecar and the target each run on one core; with more threads they
  compete for the same cores.

`stats()` reports the hints started, ready and late (the request ended first), each ready hint's latency (seconds from `start` to
publication), the draft nodes that came from the hint alone, the accepted tokens beyond what the
suffix tree alone held, and the requests where the hint gave at least one such token.
"""

from __future__ import annotations

import atexit
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError, OutriderError
from ..models.batch import pack
from ..sampling import SamplingParams
from ..spec.types import Budget, DraftTree, VerifyResult
from .merge import accepted_beyond, merge, paths
from .registry import DrafterEntry, register
from .suffix import SuffixDrafter, spec_tree
from .window import parse_options

USAGE = "ooo:SIDECAR[,tokens=N]"
TOKENS = 64  # the hint's length at most
HINT_SCORE = 1.0  # a hint node's score in the merged tree (suffix scores are count shares <= 1)


@dataclass(frozen=True)
class OooArgument:
    sidecar: str  # catalog name or folder
    tokens: int = TOKENS

    def __str__(self) -> str:
        return self.sidecar if self.tokens == TOKENS else f"{self.sidecar},tokens={self.tokens}"


def parse_argument(text: str) -> OooArgument:
    if not text:
        raise ConfigError(f"{USAGE} needs a sidecar model (a catalog name or folder) after the colon")
    if Path(text).exists():
        return OooArgument(text)
    name, options = parse_options(text, ("tokens",))
    if not name:
        raise ConfigError(f"{USAGE}: give a sidecar model name or folder before the options")
    tokens = options.get("tokens", str(TOKENS))
    if not tokens.isdigit() or not 1 <= int(tokens) <= 4096:
        raise ConfigError(f"tokens={tokens!r}: give the hint's length, a whole number from 1 to 4096 ({USAGE})")
    return OooArgument(name, int(tokens))


@dataclass
class Hint:
    """One request's hint. `tokens` is None until the worker publishes the finished hint."""

    prompt: list[int]
    started: float
    tokens: list[int] | None = None
    latency: float | None = None  # seconds from start to publication
    cancelled: bool = False
    context: int = 0  # prompt tokens before the hint in `seq` (the tail matched before any output)
    seq: list[int] = field(default_factory=list)  # prompt tail + hint, built on the engine thread
    cursor: int = 0  # where the last match used ended in `seq`
    gained: int = 0  # accepted tokens beyond the suffix tree's
    hint_paths: set = field(default_factory=set)  # this round's proposals, for stats
    suffix_paths: set = field(default_factory=set)


@dataclass
class Stats:
    hints: int = 0
    ready: int = 0
    latencies: list[float] = field(default_factory=list)
    hint_drafted: int = 0  # draft nodes from the hint alone
    hint_accepted: int = 0  # accepted tokens beyond what the suffix tree alone held
    requests_helped: int = 0  # finished requests with hint_accepted > 0
    late: int = 0  # requests that finished before their hint was ready (it is then dropped)


class OooDrafter(SuffixDrafter):
    """The suffix drafter, plus each request's hint from a sidecar model running in the background."""

    name = "ooo"
    capabilities = SuffixDrafter.capabilities

    def __init__(self, sidecar, max_tokens: int = TOKENS, stop_ids: tuple[int, ...] = (),
                 vocab_limit: int | None = None, delay=None, wait: bool = False, **suffix):
        """sidecar: a Decoder of its own (never the target's object: it runs in another thread);
        stop_ids: its end-of-sequence ids; vocab_limit: the target's vocabulary (a hint is cut at
        the first id at or past it). For tests: delay(hint) runs in the worker before the hint is
        published; wait=True makes `start` wait for the hint (ready before the first round)."""
        super().__init__(**suffix)
        if max_tokens < 1:
            raise ConfigError(f"ooo: the hint's length must be >= 1, got {max_tokens}")
        self.sidecar = sidecar
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_ids)
        self.vocab_limit = vocab_limit
        self.delay = delay
        self.wait = wait
        self.counts = Stats()
        self._hints: dict[int, Hint] = {}
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self.error: BaseException | None = None  # the worker's last failure (a request then has no hint)

    # -- the sidecar, in the worker thread -------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            if self._worker is None:  # at exit, end it before the interpreter does (close)
                atexit.register(self.close)
            self._worker = threading.Thread(target=self._work, name="ooo-sidecar", daemon=True)
            self._worker.start()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every hint and end the worker thread, waiting for the sidecar forward it is in.
        Registered at exit: a process that ended while the worker was inside a native forward was
        aborted there ("terminate called without an active exception", seen from scripts/ooo_hints.py)."""
        for hint in self._hints.values():
            hint.cancelled = True
        worker = self._worker
        if worker is not None and worker.is_alive():
            self._queue.put(None)  # the worker's end, after the cancelled hints before it
            worker.join(timeout)

    def _work(self) -> None:
        while True:
            hint = self._queue.get()
            if hint is None:
                self._queue.task_done()
                return
            try:
                if not hint.cancelled:
                    tokens = self.predict(hint)
                    if self.delay is not None:
                        self.delay(hint)
                    hint.latency = time.perf_counter() - hint.started
                    hint.tokens = tokens  # published last: the engine thread reads only this
            except BaseException as err:  # noqa: BLE001 - a failed hint leaves the plain suffix drafter
                self.error = err
            finally:
                self._queue.task_done()

    def predict(self, hint: Hint) -> list[int]:
        """Greedy decoding of the sidecar on the prompt: up to max_tokens ids, [] if it cannot."""
        model = self.sidecar
        prompt = hint.prompt
        room = model.config.max_position_embeddings - len(prompt)
        n = min(self.max_tokens, room)
        if n < 1 or not prompt:
            return []
        cache = model.new_cache(1, len(prompt) + n)
        with torch.inference_mode():
            batch = pack([0], [0], [torch.tensor(prompt)], logits="last", scratch_row=cache.scratch_row,
                         device=model.device)
            logits = model.forward(batch, cache).logits
            cache.set_length(0, len(prompt))
            out: list[int] = []
            while True:
                token = int(logits[0, -1].argmax())
                if token in self.stop_ids or (self.vocab_limit is not None and token >= self.vocab_limit):
                    break
                out.append(token)
                if len(out) >= n or hint.cancelled:
                    break
                length = cache.lengths[0]
                batch = pack([0], [length], [torch.tensor([token])], logits="last", scratch_row=cache.scratch_row,
                             device=model.device)
                logits = model.forward(batch, cache).logits
                cache.set_length(0, length + 1)
        return out

    # -- protocol -----------------------------------------------------------------------------
    def start(self, seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> None:
        super().start(seq_id, prompt, params)
        old = self._hints.pop(seq_id, None)
        if old is not None:
            old.cancelled = True
        hint = self._hints[seq_id] = Hint(list(prompt), time.perf_counter())
        self.counts.hints += 1
        self._ensure_worker()
        self._queue.put(hint)
        if self.wait:
            self._queue.join()

    def scored_proposal(self, seq_id: int, tokens: list[int], budget: Budget) -> tuple[DraftTree, float]:
        hint = self._hints.get(seq_id)
        if hint is None or hint.tokens is None or not hint.tokens:
            return super().scored_proposal(seq_id, tokens, budget)
        state = self._synced_state(seq_id, tokens)
        suffix = self.speculation(state, budget)
        cont = self.continuation(hint, tokens, budget.depth)
        from_hint = [(tuple(cont[:d]), HINT_SCORE) for d in range(1, len(cont) + 1)]
        min_prob = max(self.min_prob, budget.min_confidence)
        spec, new = merge(suffix, from_hint, budget.nodes, min_prob)
        self.counts.hint_drafted += new
        hint.suffix_paths = paths(suffix.tokens, suffix.parents)
        hint.hint_paths = {p for p, _ in from_hint}
        return spec_tree(tokens[-1], spec), spec.score

    def update(self, seq_id: int, result: VerifyResult, hidden: torch.Tensor | None = None) -> None:
        hint = self._hints.get(seq_id)
        if hint is not None and (hint.hint_paths or hint.suffix_paths):
            committed = tuple(result.tokens[: result.num_accepted])
            gained = accepted_beyond(committed, hint.suffix_paths, hint.hint_paths)
            hint.gained += gained
            self.counts.hint_accepted += gained
            hint.hint_paths, hint.suffix_paths = set(), set()
        super().update(seq_id, result, hidden)

    def finish(self, seq_id: int, tokens: list[int]) -> None:
        hint = self._hints.pop(seq_id, None)
        if hint is not None:
            hint.cancelled = True
            if hint.tokens is not None:
                self.counts.ready += 1
                self.counts.latencies.append(hint.latency)
            else:
                self.counts.late += 1
            self.counts.requests_helped += hint.gained > 0
        super().finish(seq_id, tokens)

    # -- matching the hint ------------------------------------------------------------------------
    def continuation(self, hint: Hint, tokens: list[int], depth: int) -> list[int]:
        """The hint's tokens after the longest suffix of `tokens` found in prompt tail + hint."""
        if not hint.seq:
            tail = hint.prompt[-self.max_match:]
            hint.context, hint.seq = len(tail), tail + hint.tokens
        seq, first = hint.seq, hint.context
        best_len, best_end = 0, -1
        limit = min(self.max_match, len(tokens))
        for end in range(max(first, 1), len(seq)):  # seq[end] is the first token proposed
            m = 0
            while m < limit and m < end and seq[end - 1 - m] == tokens[-1 - m]:
                m += 1
            if m > best_len or (m == best_len and m and best_end < hint.cursor <= end):
                best_len, best_end = m, end
        if best_len == 0 or depth < 1:
            return []
        hint.cursor = best_end
        return seq[best_end: best_end + depth]

    def stats(self) -> dict:
        c = self.counts
        ready = [h.latency for h in self._hints.values() if h.tokens is not None]
        latencies = c.latencies + ready
        return {
            "hints": c.hints, "hints_ready": c.ready + len(ready), "hints_late": c.late,
            "hint_latency_s": latencies, "hint_latency_mean_s": sum(latencies) / len(latencies) if latencies else None,
            "hint_drafted": c.hint_drafted, "hint_accepted": c.hint_accepted, "requests_helped": c.requests_helped,
            "worker_error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
        }


# -- registration ---------------------------------------------------------------------------------
def models_needed(arg: OooArgument) -> tuple[str, ...]:
    return (arg.sidecar,)


def check_fits(arg: OooArgument, target_config, target_path: Path) -> str | None:
    from ..catalog.resolve import resolve_model
    from .draft_model import tokenizer_mismatch

    try:
        path = resolve_model(arg.sidecar)
    except OutriderError as err:
        return f"the sidecar: {err}"
    if Path(path).resolve() == Path(target_path).resolve():
        return None  # the target prompted as its own sidecar
    reason = tokenizer_mismatch(target_path, path)
    return None if reason is None else f"the sidecar: {reason} (the hint's ids must be the target's)"


def stop_ids_of(folder: Path) -> tuple[int, ...]:
    """The end-of-sequence ids in the folder's config.json and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return tuple(sorted(i for i in ids if isinstance(i, int)))


def build(arg: OooArgument, shape, target, target_path: Path) -> OooDrafter:
    from ..catalog.resolve import resolve_model
    from ..kernels import native
    from ..weights.loader import auto_dtype, load_decoder

    path = resolve_model(arg.sidecar)
    own = auto_dtype(path, target.device)  # as draft-model: its numerics change only the hint
    if own and native.i8_available():
        own += "-i8"
    # its own object, even for the target's folder
    sidecar = load_decoder(path, target.device, own or target.dtype, kv_dtype=target.kv_dtype)
    drafter = OooDrafter(sidecar, arg.tokens, stop_ids_of(path), vocab_limit=target.config.vocab_size)
    drafter.name = f"ooo:{arg}"
    return drafter


register(DrafterEntry("ooo", USAGE, OooDrafter.capabilities, build=build, parse_argument=parse_argument,
                      models_needed=models_needed, check_fits=check_fits))
