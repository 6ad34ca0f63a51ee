"""The step-able engine: requests come and go; each `step()` is one round for the whole batch.

    engine = EngineLoop(target, eos_ids, speculation, decode=tokenizer_decode, max_running=16, chunk_size=512)
    rid = engine.add(Request(prompt_ids, max_new_tokens, params, stop=("\\n\\n",)))   # any time, between steps
    while engine.has_work:
        for event in engine.step():    # new tokens and stable text per request; `completion` when it ends
            ...

One step, between rounds and then one round (engine/round.py):
1. retire cancelled requests (their slot is free for this very step);
2. admit waiting requests into free slots while the limits allow (engine/scheduler.py);
3. prefill: write the K/V of up to `chunk_size` prompt tokens of the requests still prefilling,
   oldest first, in one forward; a long prompt takes several steps while the others keep
   decoding. A prompt's last token is not prefilled: it is the first round's root;
4. one round (`run_round`) for every request whose prompt is in the cache; then the stopping
   rules (engine/stopping.py: EOS, max new tokens, context, stop strings) retire those that are
   done.

Each request is one `Sequence` record (engine/sequence.py) from `add` to its Completion. It has
its own sampling settings and randomness (drawn by output position, spec/random.py) and may turn
speculation off or cap its draft nodes per round, so what a request commits never depends on
what else is in the batch: greedy output equals `LLM.generate` for the request alone, and so
does seeded sampling. The engine is single-threaded: call it from one thread (serve/worker.py
runs it in its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError
from ..models.batch import pack
from ..models.decoder import Decoder
from ..spec.random import PositionalRandom
from ..spec.types import DraftTree
from ..spec.verifiers import choose_verifier
from .request import Completion, Request, check_request
from .round import run_round
from .scheduler import Scheduler
from .sequence import Sequence, with_seed
from .stopping import stop_after_round
from .text_stream import TextStream

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped (engine/text_stream.py)


@dataclass
class Event:
    """What one step did for one request: the tokens it committed (after the stopping rules cut
    them), the text that became stable, and, when it ended, its Completion (then `text` also
    holds what was held back to the end)."""

    request_id: int
    new_tokens: list[int]
    text: str = ""
    completion: Completion | None = None


class EngineLoop:
    def __init__(self, target: Decoder, eos_ids: set[int], speculation=None, *, decode: Decode | None = None,
                 max_running: int = 16, max_len: int | None = None, max_kv_rows: int | None = None,
                 chunk_size: int | None = None):
        """decode: the tokenizer's, for each request's text and stop strings (None: token ids
        only); max_len: K/V rows per slot (default: the target's context); max_kv_rows: rows all
        running requests may reserve together (default: every slot full); chunk_size: prompt
        tokens prefilled per step (default: no limit)."""
        context = target.config.max_position_embeddings
        self.max_len = min(max_len or context, context)
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size}")
        self.target = target
        self.eos_ids = set(eos_ids)
        self.speculation = speculation
        self.decode = decode
        self.chunk_size = chunk_size
        self.headroom = speculation.max_tree_size if speculation is not None else 1
        self.cache = target.new_cache(max_running, self.max_len)
        self.scheduler = Scheduler(max_running, max_kv_rows or max_running * self.max_len)
        if speculation is not None:  # early exit drafts over this cache; the cost controller's batch table
            speculation.prepare(self.cache, max_running)
        self._seqs: dict[int, Sequence] = {}  # every request not yet finished, by id
        self._next_id = 0

    # -- requests ---------------------------------------------------------------------------------
    def check(self, request: Request) -> int:
        """The K/V rows `request` reserves; ConfigError when it can never run here. Reads only
        settings, so another thread may call it."""
        check_request(request, self.max_len)
        if request.stop and self.decode is None:
            raise ConfigError("stop strings need the engine's tokenizer: build the EngineLoop with decode=")
        rows = min(self.max_len, len(request.prompt_ids) + request.max_new_tokens + self.headroom)
        if rows > self.scheduler.max_kv_rows:
            raise ConfigError(f"the request needs {rows} K/V rows but the engine holds {self.scheduler.max_kv_rows}: "
                              "ask for fewer tokens or raise the K/V row limit")
        return rows

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. ConfigError when it can never run here."""
        rows = self.check(request)
        params = with_seed(request.params)
        speculate = (self.speculation is not None and request.speculate
                     and request.max_draft_tokens != 0)
        verify = (self.speculation.verifier_for(params) if speculate
                  else choose_verifier("chain", False, params).verifier)
        rid = self._next_id
        self._next_id += 1
        prompt = list(request.prompt_ids)
        text = TextStream(self.decode, request.stop) if self.decode is not None else None
        seq = Sequence(rid, request, prompt, len(prompt), params, PositionalRandom(params.seed), verify,
                       speculate=speculate, text=text, rows=rows)
        self.scheduler.add(seq)
        self._seqs[rid] = seq
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop a request at the next step (its slot is freed then); unknown or finished ids are ignored."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            seq.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self._seqs)

    def run_all(self, requests: list[Request]) -> list[Completion]:
        """Add `requests` (ids in that order), step until nothing is left, and return each one's
        Completion in the same order: the offline use of the engine (engine/generate.py)."""
        ids = [self.add(r) for r in requests]
        done: dict[int, Completion] = {}
        while self.has_work:
            for event in self.step():
                if event.completion is not None:
                    done[event.request_id] = event.completion
        return [done[i] for i in ids]

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_rows_used(self) -> int:
        """K/V rows holding committed tokens, over the running requests."""
        return sum(self.cache.lengths[s.slot] for s in self.scheduler.running)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        events: list[Event] = []
        for seq in [s for s in self._seqs.values() if s.cancelled]:
            events.append(self._finish(seq, "cancelled", []))
        now = time.perf_counter()
        for seq in self.scheduler.admit():
            seq.admitted_at = now
            self.cache.set_length(seq.slot, 0)
        self._prefill()
        decoding = [s for s in self.scheduler.running if s.decoding]
        if decoding:
            events.extend(self._round(decoding))
        return events

    def _prefill(self) -> None:
        """Write the next chunk of prompt K/V for the requests still prefilling, oldest first."""
        budget = self.chunk_size if self.chunk_size is not None else float("inf")
        todo, chunks = [], []
        for seq in self.scheduler.running:
            if seq.decoding or budget <= 0:
                continue
            prompt = seq.tokens[: seq.prompt_len - 1]  # the last prompt token is the root
            take = int(min(len(prompt) - seq.prefilled, budget))
            if take > 0:
                todo.append(seq)
                chunks.append(torch.tensor(prompt[seq.prefilled: seq.prefilled + take]))
                budget -= take
            elif take == 0:
                self._start_decoding(seq)
        if todo:
            taps = self.speculation.hidden_layers if self.speculation is not None else ()
            batch = pack([s.slot for s in todo], [s.prefilled for s in todo], chunks, logits="none",
                         hidden_layers=taps, scratch_row=self.cache.scratch_row, device=self.target.device)
            out = self.target.forward(batch, self.cache)
            for b, (seq, chunk) in enumerate(zip(todo, chunks)):
                if taps and seq.speculate:  # the drafter reads the prompt's hidden states (speculator.start)
                    seq.prompt_hidden.append({layer: h[b, : chunk.shape[0]] for layer, h in out.hidden.items()})
                seq.prefilled += int(chunk.shape[0])
                self.cache.set_length(seq.slot, seq.prefilled)
                if seq.prefilled == seq.prompt_len - 1:
                    self._start_decoding(seq)

    def _start_decoding(self, seq: Sequence) -> None:
        seq.decoding = True
        if seq.speculate:
            self.speculation.start(seq, seq.prompt_hidden)
            seq.prompt_hidden = []
        seq.prefill_s = time.perf_counter() - seq.admitted_at

    def _round(self, seqs: list[Sequence]) -> list[Event]:
        spec = self.speculation
        drafting = [b for b, s in enumerate(seqs) if s.speculate]
        drafted_at = []

        def propose(batch: list[Sequence]) -> list[DraftTree]:
            trees = [DraftTree.root_only(seq.tokens[-1]) for seq in batch]
            if drafting:
                free = []
                for b in drafting:
                    rows, cap = self.cache.free_rows(batch[b].slot), batch[b].request.max_draft_tokens
                    free.append(rows if cap is None else min(rows, cap + 1))
                for b, tree in zip(drafting, spec.propose_batch([batch[b] for b in drafting], free, len(batch))):
                    trees[b] = tree
            drafted_at.append((time.perf_counter(), max(t.size for t in trees)))
            return trees

        taps = spec.hidden_layers if spec is not None else ()
        before = [len(s.output) for s in seqs]
        results, hidden = run_round(self.target, self.cache, seqs, propose, taps)
        if spec is not None:  # the batch's verify cost as it is now, for the cost controller
            drafted, width = drafted_at[0]
            spec.observe_verify_time(len(seqs), width, time.perf_counter() - drafted)
        stops = [stop_after_round(seq, len(result.tokens), self.eos_ids, self.cache.free_rows(seq.slot))
                 for seq, result in zip(seqs, results)]
        if drafting:
            spec.update_batch([seqs[b] for b in drafting], [results[b] for b in drafting],
                              [hidden[b] for b in drafting])
        events = []
        for seq, (reason, text), old in zip(seqs, stops, before):
            new = seq.output[old:]
            events.append(Event(seq.seq_id, new, text) if reason is None else self._finish(seq, reason, new, text))
        return events

    def _finish(self, seq: Sequence, reason: str, new: list[int], text: str = "") -> Event:
        del self._seqs[seq.seq_id]
        if seq.slot < 0:
            self.scheduler.drop_waiting(seq)
        else:
            if seq.decoding and seq.speculate:
                self.speculation.finish(seq)
            self.scheduler.release(seq)
        completion, rest = seq.completion(reason)
        return Event(seq.seq_id, new, text + rest, completion)
