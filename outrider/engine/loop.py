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
   decoding. A prompt's last token is not prefilled: it is the first round's root. With a
   prefix cache (engine/prefix_cache.py), a request first copies the K/V of its prompt's
   longest cached prefix of whole blocks into its slot and prefills only the rest; its blocks
   are kept after its prefill and when it ends (its output's rows too: a chat's next turn;
   engine/prompt_reuse.py);
   with a paged cache (`kv_pages`), a request is admitted when the pages of its prompt are free,
   and before the round each decoding request takes the pages its round may write, preempting
   the last admitted when the pool runs short (engine/paging.py);
4. one round (engine/round.py `run_round`: propose, constrain, verify, commit, stop, observe)
   for every request whose prompt is in the cache; the requests that the stopping rules
   (engine/stopping.py: EOS, max new tokens, context, stop strings) or a fault ended retire.

Each request is one `Sequence` record (engine/sequence.py) from `add` to its Completion. It has
its own sampling settings and randomness (drawn by output position, spec/random.py) and may turn
speculation off or cap its draft nodes per round, so what a request commits never depends on
what else is in the batch: greedy output equals `LLM.generate` for the request alone, and so
does seeded sampling. The engine is single-threaded: call it from one thread (serve/worker.py
runs it in its own).

Faults stay with their request: a drafter that raises while proposing, starting or following a
sequence, an invalid draft tree, non-finite logits or a verifier that raises end that request
alone with finish_reason "error" (its Completion says why); the others go on, their outputs
unchanged. An exception that escapes `step()` (the target's forward, the scheduler) is not a
request's: the engine cannot go on, and the caller should stop (the server exits non-zero).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ConfigError
from ..kernels.dispatch import PrefillPath
from ..models.batch import pack, with_embeds
from ..models.decoder import Decoder
from ..models.expert_select import selected_by, selection_of
from ..spec.processing import PathProcessor
from ..spec.random import PositionalRandom
from ..spec.verifiers import choose_verifier
from . import prompt_reuse
from .commit import token_logprobs
from .drafting import why as failure
from .request import Completion, Request, TokenLogprob, check_request
from .paging import fill_rows, make_room, take_pages
from .prefix_cache import PrefixCache, exact_prefill
from .round import run_round
from .scheduler import Scheduler
from .sequence import Sequence, with_seed
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
    logprobs: list[TokenLogprob] = field(default_factory=list)  # for new_tokens, when the request asked


class EngineLoop:
    def __init__(self, target: Decoder, eos_ids: set[int], speculation=None, *, decode: Decode | None = None,
                 max_running: int = 16, max_len: int | None = None, max_kv_rows: int | None = None,
                 chunk_size: int | None = None, prefix_cache: PrefixCache | None = None,
                 kv_pages: int | None = None, page_size: int = 16):
        """decode: the tokenizer's, for each request's text and stop strings (None: token ids
        only); max_len: K/V rows per slot (default: the target's context); max_kv_rows: rows all
        running requests may reserve together (default: every slot full); chunk_size: prompt
        tokens prefilled per step (default: no limit); prefix_cache: prompts' K/V kept and
        reused across requests (engine/prefix_cache.py; it may be shared by engines of one
        model), used only where it is exact: else `prefix_cache_note` says why it is off;
        kv_pages: the K/V in a pool of that many pages of `page_size` rows (models/paged_cache.py),
        admission and preemption by pages (engine/paging.py); None: a slot of max_len rows each."""
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
        self.paged = kv_pages is not None
        self.preemptions = 0  # requests preempted for pages (engine/paging.py)
        if self.paged and speculation is not None and speculation.reads_target_cache:
            raise ConfigError(f"the {speculation.options.kind} drafter reads the target's slot cache: "
                              "run it without paged K/V (--kv-memory)")
        self.cache = target.new_cache(max_running, self.max_len, pages=kv_pages, page_size=page_size)
        take = (lambda seq, slot: take_pages(self.cache, seq, slot, self.headroom, self.prefix_cache, self.speculation
                                             and self.speculation.hidden_layers)) if self.paged else None
        self.scheduler = Scheduler(max_running, max_kv_rows or max_running * self.max_len, take)
        if speculation is not None:  # early exit drafts over this cache; the cost controller's batch table
            speculation.prepare(self.cache, max_running)
        self.prefix_cache_note = exact_prefill(target, self.cache) if prefix_cache is not None else None
        self.prefix_cache = prefix_cache if self.prefix_cache_note is None else None
        if self.prefix_cache is not None and speculation is not None and speculation.hidden_layers:
            self.prefix_cache_note = (f"the {speculation.options.kind} drafter reads the prompt's hidden states, "
                                      "which the prefix cache does not keep: its requests prefill whole (speculate: "
                                      "false ones use the cache)")
        self._seqs: dict[int, Sequence] = {}  # every request not yet finished, by id
        self._next_id = 0

    # -- requests ---------------------------------------------------------------------------------
    def check(self, request: Request) -> int:
        """The K/V rows `request` reserves; ConfigError when it can never run here. Reads only
        settings, so another thread may call it."""
        check_request(request, self.max_len, vocab=self.target.config.vocab_size)
        if request.stop and self.decode is None:
            raise ConfigError("stop strings need the engine's tokenizer: build the EngineLoop with decode=")
        # a draft tree's rows only for a request that drafts: a plain one (speculate=False, as
        # BALANCE asks for under a K/V limit) reserves its tokens and one row
        headroom = self.headroom if self._drafts(request) else 1
        rows = min(self.max_len, len(request.prompt_ids) + request.max_new_tokens + headroom)
        if rows > self.scheduler.max_kv_rows:
            raise ConfigError(f"the request needs {rows} K/V rows but the engine holds {self.scheduler.max_kv_rows}: "
                              "ask for fewer tokens or raise the K/V row limit")
        if self.paged and self.cache.pages_for(rows) > self.cache.num_pages:
            raise ConfigError(f"the request needs {self.cache.pages_for(rows)} K/V pages but the pool holds "
                              f"{self.cache.num_pages}: ask for fewer tokens or raise --kv-memory")
        return rows

    def _drafts(self, request: Request) -> bool:
        """Whether `request` is speculated: the engine has a drafter and the request allows it."""
        return self.speculation is not None and request.speculate and request.max_draft_tokens != 0

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. ConfigError when it can never run here."""
        rows = self.check(request)
        params = with_seed(request.params)
        speculate = self._drafts(request)
        verify = self._verifier(request, params, speculate)
        rid = self._next_id
        self._next_id += 1
        prompt = list(request.prompt_ids)
        text = TextStream(self.decode, request.stop) if self.decode is not None else None
        processor = (PathProcessor(params, prompt, self.target.config.vocab_size, self.target.device)
                     if params.processes_logits else None)
        seq = Sequence(rid, request, prompt, len(prompt), params, PositionalRandom(params.seed), verify,
                       speculate=speculate, text=text, rows=rows, processor=processor,
                       grammar=request.grammar.state() if request.grammar is not None else None,
                       logprobs=[] if request.logprobs is not None else None,
                       prompt_logprobs=[None] if request.prompt_logprobs is not None else None)
        self.scheduler.add(seq)
        self._seqs[rid] = seq
        return rid

    def _verifier(self, request: Request, params, speculate: bool):
        """The request's verifier. A sampled request that gave its own seed gets the walk (unless
        a verifier is named): it commits the tokens plain sampling draws with that seed, so its
        text never depends on what the controller drafts (docs/usage.md#seeds); an unseeded one
        the verifier of most acceptance."""
        if not speculate:
            return choose_verifier("chain", False, params).verifier
        if request.params.seed is not None and not params.greedy:
            return self.speculation.verifier_for(params, seeded=True)
        return self.speculation.verifier_for(params)

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

    @property
    def kv_rows_reserved(self) -> int:
        """K/V rows the running requests hold: reserved rows, or the rows of the pages they hold."""
        return self.cache.pages_used * self.cache.page_size if self.paged else self.scheduler.rows_reserved

    @property
    def kv_rows_total(self) -> int:
        """K/V rows allocated: slots x rows a slot, or the pool's pages x rows a page."""
        return self.cache.num_pages * self.cache.page_size if self.paged else self.scheduler.num_slots * self.max_len

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        events: list[Event] = []
        for seq in [s for s in self._seqs.values() if s.cancelled]:
            events.append(self._finish(seq, "cancelled", []))
        now = time.perf_counter()
        for seq in self.scheduler.admit():
            seq.admitted_at = seq.admitted_at or now
            if not self.paged:  # a paged slot was emptied and took its pages as it was admitted
                self.cache.set_length(seq.slot, 0)
        events += self._prefill()
        decoding = [s for s in self.scheduler.running if s.decoding]
        if decoding and self.paged:
            for seq in make_room(self.cache, self.scheduler.running, decoding, self.headroom):
                self._preempt(seq)
            decoding = [s for s in decoding if s.slot >= 0]
        if decoding:
            events.extend(self._round(decoding))
        return events

    def _prefill(self) -> list[Event]:
        """Write the next chunk of prompt K/V for the requests still prefilling, oldest first (a
        request that asked for its prompt's logprobs in a forward of its own, with logits); a
        request whose `prefill_from` holds the same prompt in the cache copies its rows instead.
        Returns the events of requests that failed as they started."""
        budget = self.chunk_size if self.chunk_size is not None else float("inf")
        plain, logged, events = [], [], []
        taps = self.speculation.hidden_layers if self.speculation is not None else ()
        for seq in list(self.scheduler.running):  # a copy: a request failing as it starts leaves it
            if seq.decoding or budget <= 0:
                continue
            source = self._seqs.get(seq.request.prefill_from) if seq.request.prefill_from is not None else None
            if seq.prefilled == 0 and not seq.resume_at and prompt_reuse.copy_from(self.cache, source, seq, taps):
                events += self._start_decoding(seq)
                continue
            if seq.prefilled == 0 and not seq.looked_up:
                prompt_reuse.restore(self.prefix_cache, self.cache, seq, taps)
            prompt = seq.tokens[: fill_rows(seq)]  # the last prompt token is the root
            take = int(min(len(prompt) - seq.prefilled, budget))
            if take > 0:
                chunk = torch.tensor(prompt[seq.prefilled: seq.prefilled + take])
                log = seq.request.prompt_logprobs is not None and not seq.resume_at  # not again after a preemption
                (logged if log else plain).append((seq, chunk))
                budget -= take
            elif take == 0:
                events += self._start_decoding(seq)
        groups = [plain] + [[job] for job in logged]
        for group in (g for g in groups if g):
            events += self._prefill_forward(group, taps, logits=group is not plain)
        return events

    def _prefill_forward(self, jobs: list[tuple[Sequence, torch.Tensor]], taps, logits: bool) -> list[Event]:
        batch = pack([s.slot for s, _ in jobs], [s.prefilled for s, _ in jobs], [c for _, c in jobs],
                     logits="real" if logits else "none", hidden_layers=taps, scratch_row=self.cache.scratch_row,
                     device=self.target.device)
        if any(s.request.prompt_embeds is not None for s, _ in jobs):  # a VLM's image rows (models/image_prompt.py)
            batch = with_embeds(batch, [(s.prefilled, int(c.shape[0]), s.request.prompt_embeds) for s, c in jobs])
        if self.prefix_cache is not None and not logits:
            exact = self._exact_fill(batch)
            if not exact and len(jobs) > 1:  # several prompts past the native workspace: in halves
                half = len(jobs) // 2
                return self._prefill_forward(jobs[:half], taps, logits) + self._prefill_forward(jobs[half:], taps,
                                                                                             logits)
            if not exact:  # its rows are not a whole prefill's bits: not kept
                jobs[0][0].cacheable = False
        selection = selection_of([s.verify for s, _ in jobs])  # a LOSSY expert selection's prefill, named only
        if selection is None:
            out = self.target.forward(batch, self.cache)
        else:
            for seq, _ in jobs:  # its K/V is not a plain prefill's: never kept by the prefix cache
                seq.cacheable = seq.cacheable and getattr(seq.verify, "selection", None) is not selection
            out = selection.prefill_forward(self.target, batch, self.cache, [int(c.shape[0]) for _, c in jobs],
                                            selected_by([s.verify for s, _ in jobs], selection))
        events = []
        for b, (seq, chunk) in enumerate(jobs):
            n = int(chunk.shape[0])
            if taps and seq.speculate:  # the drafter reads the prompt's hidden states (speculator.start)
                seq.prompt_hidden.append({layer: h[b, :n] for layer, h in out.hidden.items()})
            if logits:  # row j predicts prompt token prefilled + j + 1 (the first token has none)
                nxt = seq.tokens[seq.prefilled + 1: seq.prefilled + n + 1]
                seq.prompt_logprobs += token_logprobs(out.logits[:n], nxt, seq.request.prompt_logprobs)
            seq.prefilled += n
            self.cache.set_length(seq.slot, seq.prefilled)
            if seq.prefilled == fill_rows(seq):
                prompt_reuse.store(self.prefix_cache, self.cache, seq, seq.prefilled)
                events += self._start_decoding(seq)
        return events

    def _exact_fill(self, batch) -> bool:
        """Whether a prefill forward writes the bits a whole prefill would: the native layer's
        path, or one sequence that starts its slot (filled in parts of the native layer when past
        its workspace: models/decoder.py)."""
        if self.target.prefill_path(batch) is PrefillPath.NATIVE:
            return True
        return len(batch.slot_ids) == 1 and batch.attn_mask is None and not batch.hidden_layers

    def _start_decoding(self, seq: Sequence) -> list[Event]:
        seq.decoding = True
        seq.prefill_s = time.perf_counter() - seq.admitted_at
        if seq.speculate:
            try:
                self.speculation.start(seq, seq.prompt_hidden)
            except Exception as err:  # the drafter's fault: this request fails, the others go on
                return [self._fail(seq, "the drafter failed to start", err)]
            seq.prompt_hidden = []
        return []

    def _round(self, seqs: list[Sequence]) -> list[Event]:
        """One round (engine/round.py) for the decoding requests, as events: each one's new tokens
        and text, and a Completion for those that stopped or failed."""
        before = [len(s.output) for s in seqs]
        end = run_round(self.target, self.cache, self.speculation, seqs, self.eos_ids)
        events = []
        for b, seq in enumerate(seqs):
            new = seq.output[before[b]:]
            logprobs = seq.logprobs[before[b]:] if seq.logprobs is not None else []
            if b in end.failed:
                events.append(self._fail(seq, end.failed[b]))
                continue
            reason, text = end.stops[b]
            event = Event(seq.seq_id, new, text, logprobs=logprobs)
            if reason is not None:
                event = self._finish(seq, reason, new, text, logprobs=logprobs)
            events.append(event)
        return events

    def _preempt(self, seq: Sequence) -> None:
        """Give `seq`'s pages up (make_room has) and queue it again, first: when admitted again its
        prompt and output so far are prefilled as one prompt and it goes on (engine/paging.py)."""
        if seq.decoding and seq.speculate:
            try:
                self.speculation.finish(seq)
            except Exception:  # it starts again from its committed tokens
                pass
        self.scheduler.preempt(seq)
        seq.decoding, seq.prefilled, seq.prompt_hidden = False, 0, []
        seq.resume_at, seq.looked_up = len(seq.tokens), True
        seq.preemptions += 1
        self.preemptions += 1

    def _fail(self, seq: Sequence, why: str, err: Exception | None = None) -> Event:
        """End `seq` alone with finish_reason "error"."""
        return self._finish(seq, "error", [], error=failure(why, err) if err is not None else why)

    def _finish(self, seq: Sequence, reason: str, new: list[int], text: str = "", *, logprobs=(),
                error: str | None = None) -> Event:
        del self._seqs[seq.seq_id]
        if seq.slot < 0:
            self.scheduler.drop_waiting(seq)
        else:
            if seq.decoding and reason != "error":  # its prompt's and output's rows, for a next turn
                rows = min(self.cache.lengths[seq.slot], len(seq.tokens))
                prompt_reuse.store(self.prefix_cache, self.cache, seq, rows)
            if seq.decoding and seq.speculate:
                try:
                    self.speculation.finish(seq)
                except Exception as err:
                    error = error or failure("the drafter failed to finish", err)
            self.cache.set_length(seq.slot, 0)  # a paged slot's pages go back
            self.scheduler.release(seq)
        completion, rest = seq.completion(reason, error)
        return Event(seq.seq_id, new, text + rest, completion, list(logprobs))

