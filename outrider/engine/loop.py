"""The step-able engine: requests come and go; each `step()` is one round for the whole batch.

    engine = EngineLoop(target, eos_ids, speculation, max_running=16, chunk_size=512)
    rid = engine.add(Request(prompt_ids, max_new_tokens, params))   # any time, between steps
    while engine.has_work:
        for event in engine.step():          # new tokens per request; `finished` when it ends
            ...

One step, between rounds and then one round (engine/round.py):
1. retire cancelled requests (their slot is free for this very step);
2. admit waiting requests into free slots while the limits allow (engine/scheduler.py);
3. prefill: write the K/V of up to `chunk_size` prompt tokens of the requests still prefilling,
   oldest first, in one forward; a long prompt takes several steps while the others keep
   decoding. A prompt's last token is not prefilled: it is the first round's root;
4. one round (`run_round`) for every request whose prompt is in the cache; then the stopping
   rules of engine/generate.py (EOS, max new tokens, context, the caller's stop rule) retire those
   that are done.

Each request has its own sampling settings and randomness (drawn by output position,
spec/random.py) and may turn speculation off or cap its draft nodes per round, so what a request
commits never depends on what else is in the batch: greedy output equals `LLM.generate` for the
request alone, and so does seeded sampling. The engine is single-threaded: call it from one
thread (serve/worker.py runs it in its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from .generate import Finished, OnCommit, Request, check_request, stop_after_round, with_seed
from ..models.batch import pack
from ..models.decoder import Decoder
from ..spec.random import PositionalRandom
from .round import Sequence, run_round
from ..spec.types import DraftTree
from ..spec.verifiers import choose_verifier
from .scheduler import Scheduler


@dataclass
class Event:
    """What one step did for one request: tokens committed (after stopping rules cut them) and,
    when it ended, its Finished record."""

    request_id: int
    new_tokens: list[int]
    finished: Finished | None = None


@dataclass(eq=False)
class _Entry:
    request_id: int
    request: Request
    seq: Sequence
    rows: int  # K/V rows reserved (scheduler.py)
    speculate: bool
    slot: int = -1
    prefilled: int = 0  # prompt tokens whose K/V is written
    decoding: bool = False
    cancelled: bool = False
    added_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0
    prefill_s: float = 0.0
    prompt_hidden: list = field(default_factory=list)  # prefill taps per chunk (layer -> [n, E]) for the drafter


class EngineLoop:
    def __init__(self, target: Decoder, eos_ids: set[int], speculation=None, *, max_running: int = 16,
                 max_len: int | None = None, max_kv_rows: int | None = None, chunk_size: int | None = None,
                 on_commit: OnCommit | None = None):
        """max_len: K/V rows per slot (default: the target's context); max_kv_rows: rows all
        running requests may reserve together (default: every slot full); chunk_size: prompt
        tokens prefilled per step (default: no limit); on_commit(request_id, output_ids) is
        the caller's stop rule (engine/generate.py OnCommit), called after every round."""
        context = target.config.max_position_embeddings
        self.max_len = min(max_len or context, context)
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size}")
        self.target = target
        self.eos_ids = set(eos_ids)
        self.speculation = speculation
        self.chunk_size = chunk_size
        self.on_commit = on_commit
        self.headroom = speculation.max_tree_size if speculation is not None else 1
        self.cache = target.new_cache(max_running, self.max_len)
        self.scheduler = Scheduler(max_running, max_kv_rows or max_running * self.max_len)
        if speculation is not None:  # early exit drafts over this cache; the cost controller's batch table
            speculation.prepare(self.cache, max_running)
        self._entries: dict[int, _Entry] = {}  # every request not yet finished, by id
        self._next_id = 0

    # -- requests ---------------------------------------------------------------------------------
    def check(self, request: Request) -> int:
        """The K/V rows `request` reserves; ConfigError when it can never run here. Reads only
        settings, so another thread may call it."""
        check_request(request, self.max_len)
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
        seq = Sequence(rid, -1, prompt, len(prompt), params, PositionalRandom(params.seed), verify)
        entry = _Entry(rid, request, seq, rows, speculate)
        self.scheduler.add(entry)
        self._entries[rid] = entry
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop a request at the next step (its slot is freed then); unknown or finished ids are ignored."""
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self._entries)

    def run_all(self, requests: list[Request]) -> list[Finished]:
        """Add `requests` (ids in that order), step until nothing is left, and return each one's
        Finished in the same order: the offline use of the engine (generation.generate_ids)."""
        ids = [self.add(r) for r in requests]
        finished: dict[int, Finished] = {}
        while self.has_work:
            for event in self.step():
                if event.finished is not None:
                    finished[event.request_id] = event.finished
        return [finished[i] for i in ids]

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_rows_used(self) -> int:
        """K/V rows holding committed tokens, over the running requests."""
        return sum(self.cache.lengths[e.slot] for e in self.scheduler.running)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        events: list[Event] = []
        for entry in [e for e in self._entries.values() if e.cancelled]:
            events.append(self._finish(entry, "cancelled"))
        now = time.perf_counter()
        for entry in self.scheduler.admit():
            entry.seq.slot = entry.slot
            entry.admitted_at = now
            self.cache.set_length(entry.slot, 0)
        self._prefill()
        decoding = [e for e in self.scheduler.running if e.decoding]
        if decoding:
            events.extend(self._round(decoding))
        return events

    def _prefill(self) -> None:
        """Write the next chunk of prompt K/V for the requests still prefilling, oldest first."""
        budget = self.chunk_size if self.chunk_size is not None else float("inf")
        todo, chunks = [], []
        for entry in self.scheduler.running:
            if entry.decoding or budget <= 0:
                continue
            prompt = entry.seq.tokens[: entry.seq.prompt_len - 1]  # the last prompt token is the root
            take = int(min(len(prompt) - entry.prefilled, budget))
            if take > 0:
                todo.append(entry)
                chunks.append(torch.tensor(prompt[entry.prefilled: entry.prefilled + take]))
                budget -= take
            elif take == 0:
                self._start_decoding(entry)
        if todo:
            taps = self.speculation.hidden_layers if self.speculation is not None else ()
            batch = pack([e.slot for e in todo], [e.prefilled for e in todo], chunks, logits="none",
                         hidden_layers=taps, scratch_row=self.cache.scratch_row, device=self.target.device)
            out = self.target.forward(batch, self.cache)
            for b, (entry, chunk) in enumerate(zip(todo, chunks)):
                if taps and entry.speculate:  # the drafter reads the prompt's hidden states (speculator.start)
                    entry.prompt_hidden.append({layer: h[b, : chunk.shape[0]] for layer, h in out.hidden.items()})
                entry.prefilled += int(chunk.shape[0])
                self.cache.set_length(entry.slot, entry.prefilled)
                if entry.prefilled == entry.seq.prompt_len - 1:
                    self._start_decoding(entry)

    def _start_decoding(self, entry: _Entry) -> None:
        entry.decoding = True
        if entry.speculate:
            self.speculation.start(entry.seq, entry.prompt_hidden)
            entry.prompt_hidden = []
        entry.prefill_s = time.perf_counter() - entry.admitted_at

    def _round(self, entries: list[_Entry]) -> list[Event]:
        spec = self.speculation
        drafted_at = []

        def propose(seqs: list[Sequence]) -> list[DraftTree]:
            trees = [DraftTree.root_only(seq.tokens[-1]) for seq in seqs]
            drafting = [b for b, e in enumerate(entries) if e.speculate]
            if drafting:
                free = []
                for b in drafting:
                    rows, cap = self.cache.free_rows(seqs[b].slot), entries[b].request.max_draft_tokens
                    free.append(rows if cap is None else min(rows, cap + 1))
                for b, tree in zip(drafting, spec.propose_batch([seqs[b] for b in drafting], free, len(seqs))):
                    trees[b] = tree
            drafted_at.append((time.perf_counter(), max(t.size for t in trees)))
            return trees

        taps = spec.hidden_layers if spec is not None else ()
        before = [len(e.seq.output) for e in entries]
        results, hidden = run_round(self.target, self.cache, [e.seq for e in entries], propose, taps)
        if spec is not None:  # the batch's verify cost as it is now, for the cost controller
            drafted, width = drafted_at[0]
            spec.observe_verify_time(len(entries), width, time.perf_counter() - drafted)
        reasons = []
        for entry, result in zip(entries, results):
            eos = set() if entry.request.ignore_eos else self.eos_ids
            reasons.append(stop_after_round(entry.seq, entry.request, len(result.tokens), eos, self.cache,
                                            self.on_commit))
        drafting = [b for b, e in enumerate(entries) if e.speculate]
        if drafting:
            spec.update_batch([entries[b].seq for b in drafting], [results[b] for b in drafting],
                              [hidden[b] for b in drafting])
        events = []
        for entry, reason, old in zip(entries, reasons, before):
            new = entry.seq.output[old:]
            if reason is None:
                events.append(Event(entry.request_id, new))
            else:
                done = self._finish(entry, reason)
                done.new_tokens = new
                events.append(done)
        return events

    def _finish(self, entry: _Entry, reason: str) -> Event:
        del self._entries[entry.request_id]
        if entry.slot < 0:
            self.scheduler.drop_waiting(entry)
        else:
            if entry.decoding and entry.speculate:
                self.speculation.finish(entry.seq)
            self.scheduler.release(entry)
        seq = entry.seq
        total = time.perf_counter() - (entry.admitted_at or entry.added_at)
        return Event(entry.request_id, [], Finished(seq.output, reason, seq.stats, entry.prefill_s, total))
