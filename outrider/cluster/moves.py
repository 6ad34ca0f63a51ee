"""Moving a request to another replica while it runs: cancel it there, continue it here.

    router.move(request_id, replica)      # any thread; MoveError (one line) when it cannot move
    policy.moves(running, replicas, now)  # TailSieve's: asked after each request of a group ends

A move of a request waiting for a slot only changes the queue it waits in. A running request's
job is cancelled on its replica; the replica answers each unfinished choice with a "cancelled"
Completion holding every token it committed, and each such choice continues on the target as a
new engine request: the prompt followed by those tokens, and the tokens left of `max_tokens`. It
continues, it does not restart: the target prefills the committed tokens (one forward) and
decodes the next one. Choices that ended on the old replica while it was being cancelled keep
their Completion.

What the client sees stays one stream. The old replica's text is forwarded up to the cancel (what
its text stream held back, a tail that could begin a stop string or half a character, is not);
on the target, the router makes the text itself, from the token ids the replica sends with each
update (`ids=True`, replica.py), with a `TextStream` fed the whole output so far: a replica would
decode the continuation without the text before it (a leading space, a character split across
the cut, a stop string spanning it). The first characters sent from the target are exactly those
the client has not had. The final Completion is the whole output: token ids, text, logprobs, the
prompt's logprobs, round counters and times summed over the replicas; `finish_reason` the
target's, or "stop" when the router's text found a stop string first.

Randomness: every draw of the engine is a function of the request's seed and the absolute
position of the token it decides (spec/random.py), and the continuation keeps the request's
`sampling.seed` and its positions (its prompt is the original prompt + the committed tokens). A
request with a seed therefore draws, after the move, exactly what it would have drawn unmoved:
greedy and seeded output equal the unmoved run's token for token (drafters without probabilities,
or none; a sampled draft-model or early-exit chain was already seed-and-drafter reproducible, and
a move changes its drafter's state, so there it is the same law, another draw). Without a seed
the replica drew one; the target draws another: the same distribution, a different draw from
the one the first replica would have made.

Not movable (MoveError): a request under a grammar (response_format, tool calls: the grammar's
state after the output so far lives in the replica) and one with a presence or frequency penalty
(they count the output's tokens, which the target would read as prompt). The repetition penalty
covers prompt and output alike, so it moves.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from itertools import zip_longest

from ..engine.request import Completion
from ..engine.stats import summarize
from ..engine.text_stream import TextStream
from ..serve.worker import Update
from ..spec.types import RoundStats
from .policy import Decision


class MoveError(ValueError):
    """A move the router cannot make; the message is one line."""


def unmovable(job) -> str | None:
    """Why a job cannot move, or None."""
    for r in job.requests:
        if r.grammar is not None:
            return "it follows a grammar (response_format or a tool call), whose state stays in its replica"
        if r.params.presence_penalty or r.params.frequency_penalty:
            return ("its presence or frequency penalty counts output tokens, which the next replica would read "
                    "as prompt")
    return None


@dataclass
class Choice:
    """One choice of a moved job."""

    prior: Completion | None = None  # what it committed on the replicas it left, merged
    stream: TextStream | None = None  # its text from its first output token (continuing legs)
    carry: str = ""  # text made from the output, not yet sent
    ids: list = field(default_factory=list)  # this leg's committed token ids so far
    lps: list = field(default_factory=list)  # this leg's logprobs so far (streams)
    sent: int = 0  # this leg's tokens forwarded in updates
    flush: Update | None = None  # a zero-token update held while its leg is cancelled (the held-back text)
    stop_at: int | None = None  # this leg's tokens kept, when the router's text found a stop string
                                # (0 when the stop string's start cuts into the tokens before this leg)
    ended: bool = False


class Move:
    """A job's state from its first move on: which choices the current leg runs, what each has
    committed before it, and each one's text (see the module's docstring)."""

    def __init__(self, job, decode, ended=()):
        """ended: the choices that had already ended when the first move was asked for."""
        self.job, self.decode = job, decode
        self.target = None  # the Decision of a move asked for, until the leg it leaves has ended
        self.choices = [Choice(ended=i in ended) for i in range(len(job.requests))]
        self.leg = list(range(len(job.requests)))  # the job's choice index of each request of this leg
        self.continuing = False  # this leg continues earlier output: its text is made here
        self.count = 0  # moves made
        self.cancel_leg = False  # every choice of the leg has ended here: the replica may stop it

    # the current leg's items -> the client's -------------------------------------------------------
    def translate(self, kind: str, item) -> list:
        if kind == "error":
            return [(kind, item)]
        index = item.index if kind == "update" else item[0]
        i = self.leg[index]
        c = self.choices[i]
        if c.ended:
            return []
        if kind == "ids":
            if c.stop_at is not None:  # the router's text stopped it and the replica went on: end it
                return self._end(i, None)
            self._feed(c, item[1])
            return []
        if kind == "update":
            if not self.continuing:
                if self.target is not None and item.tokens == 0:  # the cancel's flush, perhaps
                    c.flush = item
                    return []
                return [("update", dataclasses.replace(item, index=i))]
            return self._update(i, c, item)
        completion = item[1]
        if completion.finish_reason == "cancelled" and self.target is not None:
            if self.continuing:
                self._feed(c, completion.token_ids[len(c.ids):])
                if c.stop_at is not None:  # its stop string lay in what it committed: it is done
                    return self._end(i, completion)
            c.prior = self._merge(i, completion.token_ids, completion.logprobs, "cancelled", completion)
            c.flush = None
            return []  # it continues on the target
        return self._end(i, completion)

    def _feed(self, c: Choice, ids: list) -> None:
        c.ids += ids
        if self.continuing and ids and c.stop_at is None:
            c.carry += c.stream.add(ids)
            if c.stream.stopped:
                c.stop_at = max(c.stream.kept_tokens - len(c.prior.token_ids), 0)

    def _update(self, i: int, c: Choice, u: Update) -> list:
        """A continuing leg's update: its token count and logprobs (cut at the router's stop), the
        router's text."""
        limit = len(c.ids) if c.stop_at is None else min(c.stop_at, len(c.ids))
        kept = max(0, min(u.tokens, limit - c.sent))
        lps = None if u.logprobs is None else list(u.logprobs[:kept])
        c.lps += lps or []
        c.sent += kept
        text, c.carry = c.carry, ""
        out = [("update", Update(i, kept, text, lps))] if kept or text or lps else []
        if c.stop_at is not None and c.sent >= c.stop_at and c.stop_at < len(c.ids):
            out += self._end(i, None)  # the replica's own text saw no stop here: it would go on
        return out

    def _end(self, i: int, completion: Completion | None) -> list:
        """Choice i is done: the rest of its text and its whole Completion."""
        c = self.choices[i]
        c.ended = True
        self.cancel_leg = all(self.choices[k].ended for k in self.leg)
        if not self.continuing:  # it ended on its first replica, as it came
            held = [("update", dataclasses.replace(c.flush, index=i))] if c.flush is not None else []
            return held + [("done", (i, completion))]
        if completion is not None:
            self._feed(c, completion.token_ids[len(c.ids):])
        keep = len(c.ids) if c.stop_at is None else c.stop_at
        rest = c.carry + c.stream.finish()
        c.carry = ""
        reason = "stop" if c.stream.stopped else completion.finish_reason
        lps = completion.logprobs if completion is not None else c.lps
        total = c.stream.kept_tokens if c.stream.stopped else None  # may cut into earlier legs' tokens
        merged = self._merge(i, c.ids[:keep], None if lps is None else lps[:keep], reason, completion, total)
        merged.text = c.stream.text
        out = [("update", Update(i, max(keep - c.sent, 0), rest, None))] if rest or keep > c.sent else []
        return out + [("done", (i, merged))]

    def _merge(self, i: int, ids: list, lps, reason: str, leg: Completion | None,
               total: int | None = None) -> Completion:
        """The choice's Completion so far: what it committed before this leg, then `ids`; the first
        `total` tokens of that when a stop string cut it."""
        prior = self.choices[i].prior
        if prior is None:
            return dataclasses.replace(leg, token_ids=list(ids), finish_reason=reason,
                                       logprobs=None if lps is None else list(lps))
        stats = _added(prior.round_stats, leg.round_stats if leg is not None else RoundStats())
        seconds = [sum(c.stats.get(k, 0.0) for c in (prior, leg) if c is not None) for k in ("prefill_s", "total_s")]
        out_ids = (prior.token_ids + list(ids))[:total]
        logprobs = None if prior.logprobs is None or lps is None else (prior.logprobs + list(lps))[:total]
        prompt_lps = prior.prompt_logprobs
        if prompt_lps is None and leg is not None and leg.prompt_logprobs is not None:  # asked for on this leg
            prompt_lps = leg.prompt_logprobs[: len(self.job.requests[i].prompt_ids)]
        return Completion(prior.text, out_ids, reason, summarize(stats, len(out_ids), *seconds), stats, logprobs,
                          prompt_lps, leg.error if leg is not None else None)

    # the next leg --------------------------------------------------------------------------------
    def next_leg(self, sent: dict) -> tuple[list, list]:
        """The target's requests: for each open choice its prompt and committed tokens, and the
        tokens left; and the items of choices that turn out to have nothing left. sent: the
        characters each choice's client has had (text the old replica held back is sent next)."""
        requests, leg, local = [], [], []
        for i, c in enumerate(self.choices):
            if c.ended:
                continue
            r = self.job.requests[i]
            if c.prior is None:  # it never reached its replica
                c.prior = Completion("", [], "cancelled", logprobs=None if r.logprobs is None else [])
            if c.stream is None:  # its first move: the text so far, less what the client has
                c.stream = TextStream(self.decode, r.stop)
                c.carry = c.stream.add(c.prior.token_ids)[sent.get(i, 0):]
            c.ids, c.lps, c.sent, c.flush = [], [], 0, None
            c.stop_at = 0 if c.stream.stopped else None
            left = r.max_new_tokens - len(c.prior.token_ids)
            if left < 1 or c.stream.stopped:
                local.append(i)
                continue
            leg.append(i)
            requests.append(dataclasses.replace(
                r, prompt_ids=list(r.prompt_ids) + list(c.prior.token_ids), max_new_tokens=left, prefill_from=None,
                prompt_logprobs=r.prompt_logprobs if c.prior.prompt_logprobs is None else None))
        self.leg, self.continuing, self.target = leg, True, None
        self.count += 1
        items = []
        for i in local:  # nothing left to run
            asked = self.job.requests[i].logprobs is not None
            items += self._end(i, Completion("", [], "length", logprobs=[] if asked else None))
        self.cancel_leg = False
        return requests, items


def _added(a: RoundStats, b: RoundStats) -> RoundStats:
    def add(x, y):
        return [p + q for p, q in zip_longest(x, y, fillvalue=0)]

    return RoundStats(a.rounds + b.rounds, a.committed + b.committed, a.drafted + b.drafted,
                      add(a.accepted_by_position, b.accepted_by_position),
                      add(a.proposed_by_position, b.proposed_by_position),
                      add(a.accepted_length_hist, b.accepted_length_hist),
                      a.committed_by_round + b.committed_by_round, a.draft_s + b.draft_s, a.verify_s + b.verify_s)


class Moves:
    """The router's side of moves (mixed into `Router`): `move`, TailSieve's `moves`, the next leg."""

    def requests(self) -> list[tuple[str, int | None, str | None]]:
        """The jobs in flight: (RequestInfo.id, replica or None before routing, rollout group)."""
        with self._cv:
            return [(f.info.id, f.replica, f.info.group) for f in self._flights.values()]

    def move(self, request_id: str, replica: int, speculate: bool | None = None, reason: str = "move") -> None:
        """Move a request in flight to `replica` (from any thread): it continues there from the
        tokens it has committed. MoveError (one line) when it cannot."""
        with self._cv:
            flight = self._movable(request_id, replica)
            flight.asked = decision = Decision(replica, speculate, flight.info.arrived, reason)
        flight.job.loop.call_soon_threadsafe(self._begin_move, flight, decision)

    def _movable(self, request_id: str, replica):
        """Under the lock: the flight of `request_id` if it may move to `replica`, else MoveError."""
        if self.decode is None:
            raise MoveError("this router has no tokenizer to continue a moved request's text with")
        n = len(self.views)
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < n:
            raise MoveError(f"replica {replica!r} does not exist: this cluster has replicas 0 to {n - 1}")
        if not self.views[replica].alive:
            raise MoveError(f"replica {replica} is dead: a request cannot move there")
        flight = next((f for f in self._flights.values() if f.info.id == request_id), None)
        if flight is None or flight.cancelled:
            raise MoveError(f"no request {request_id!r} is in flight (it has ended, or never came)")
        if flight.replica is None:
            raise MoveError(f"request {request_id} has not been routed yet: move it once it has a replica")
        moving = flight.asked or (flight.move.target if flight.move is not None else None)
        if moving is not None:
            raise MoveError(f"request {request_id} is moving already, to replica {moving.replica}")
        if flight.replica == replica:
            raise MoveError(f"request {request_id} is on replica {replica} already")
        why = unmovable(flight.job)
        if why is not None:
            raise MoveError(f"request {request_id} cannot move: {why}")
        return flight

    def _begin_move(self, flight, decision: Decision) -> None:
        """(The event loop's thread.) Leave the queue it waits in, or cancel the run it is in; `_fly`
        continues it on the target once that run has ended."""
        with self._cv:
            flight.asked = None
        if flight.cancelled or id(flight.job) not in self._flights or \
                (flight.move is not None and flight.move.target is not None):
            return
        if flight.move is None:
            flight.move = Move(flight.job, self.decode, flight.finished)
        flight.move.target = decision
        if flight.turn is not None and not flight.turn.done():  # waiting for a slot: not there any more
            self._release(flight)
            self._wake(flight, "moved")
        elif flight.running:
            try:
                self.replicas[flight.replica].cancel.remote(flight.run_key)
            except Exception:  # it died: its death answers the flight
                pass

    def _tail_moves(self, group: str | None) -> None:
        """After a request of `group` ended: the moves the policy wants among the rest of the group."""
        moves = getattr(self.policy, "moves", None)
        if moves is None or group is None:
            return
        with self._cv:
            running = [(f.info, f.replica, f.produced) for f in self._flights.values()
                       if f.info.group == group and f.replica is not None and not f.cancelled
                       and f.asked is None and (f.move is None or f.move.target is None)
                       and unmovable(f.job) is None]
            wanted = moves(running, self.views, self._now()) if running else []
        for request_id, decision in wanted:
            try:
                with self._cv:
                    flight = self._movable(request_id, decision.replica)
            except MoveError as err:
                self.log(f"outrider serve: policy {self.policy.name} moves no request: {err}", file=sys.stderr)
                continue
            self._begin_move(flight, decision)

    def _next_leg(self, flight):
        """The move asked for, its leg just ended: the target's Decision, or None when no choice is
        left to run (each ended on the old replica, its items forwarded here)."""
        move = flight.move
        target = move.target
        if flight.legs == 0:  # it never ran: it only changes queue
            flight.move = None
            return target
        requests, items = move.next_leg(flight.sent)
        for kind, item in items:
            self._forward(flight, kind, item)
        flight.leg_requests = requests
        return target if requests else None
