"""One speculative round for every decoding sequence, top to bottom in `run_round`:

    trees    = propose(spec, cache, seqs)             # the controller's budgets, one drafter call, its trim
    trees    = constrain(seqs, trees, ...)            # grammars: forced chains, pruning, allowed tokens
    problems = invalid(trees, ...)                    # a bad tree is left out of the forward
    forward  = Forward.run(target, cache, ...)        # one target forward: logits at the real rows
    results  = verify(seqs, trees, forward)           # each sequence's verifier; greedy: one host read
    commit(cache, seqs, trees, results, forward)      # the slot state keeps the accepted path; tokens
    stops    = stop_after_round(seq, ...)             # EOS, stop ids, length, context, stop strings
    observe(spec, ...)                                # the controller sees the round, the drafter follows

Invariant between rounds: `cache.lengths[slot] == len(seq.tokens) - 1` (the root, the last
committed token, is not in the cache yet: this round's forward writes it).

Faults stay with their sequence: a drafter that raises as it proposes or follows, an invalid
tree, non-finite logits, a verifier that raises or a grammar that refuses a committed token fail
that sequence alone (`RoundEnd.failed`), and the others commit as if it had not been there (each
row's result never depends on the other rows: kernels/native.py). An exception in the target's
forward is not a sequence's: it propagates.

Steps: engine/drafting.py (propose, observe), engine/constrain.py, engine/verify.py (invalid,
Forward, verify), engine/commit.py, engine/stopping.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..models.decoder import Decoder
from ..models.kv_cache import KVCache
from .commit import commit
from .constrain import constrain
from .drafting import observe, propose
from .sequence import Sequence
from .speculator import Speculator
from .stopping import stop_after_round
from .verify import Forward, invalid, verify


@dataclass
class RoundEnd:
    """How the round left each sequence (batch index b): failed[b], why it fails (finish_reason
    "error"); stops[b], for a sequence that committed, (its finish reason or None, its newly
    stable text) from the stopping rules."""

    failed: dict[int, str]
    stops: dict[int, tuple[str | None, str]]


def run_round(target: Decoder, cache: KVCache, spec: Speculator | None, seqs: list[Sequence],
              eos_ids: set[int]) -> RoundEnd:
    """One round for `seqs`, each with its prompt in the cache (spec None: no drafter, each tree
    the root alone). The proposal's time and the verification's are shared out evenly among the
    sequences whose trees went on to verification (their `stats.draft_s`, `stats.verify_s`)."""
    start = time.perf_counter()
    vocab = target.config.vocab_size
    trees, failed = propose(spec, cache, seqs)  # the root alone where a sequence does not draft
    trees, broke = constrain(seqs, trees, failed, cache, spec.max_tree_size if spec else 1, vocab)
    failed |= broke
    drafted = time.perf_counter()
    live = [b for b in range(len(seqs)) if b not in failed]  # may be none: every proposal failed
    failed |= invalid(trees, live, vocab)
    taps, scores = (spec.hidden_layers, spec.attention) if spec else ((), False)
    forward = Forward.run(target, cache, seqs, trees, [b for b in live if b not in failed], taps, scores)
    results, broke = verify(seqs, trees, forward)  # batch index -> VerifyResult
    failed |= broke
    failed |= commit(cache, seqs, trees, results, forward)  # a grammar may refuse what was committed
    verified = time.perf_counter()
    _share(seqs, live, drafted - start, verified - drafted)
    if spec is not None and live:  # the batch's verify cost as it is now, for the cost controller
        spec.controller.observe_verify_time(len(live), max(trees[b].size for b in live), time.perf_counter() - drafted)
    stops = {b: stop_after_round(seqs[b], len(r.tokens), eos_ids, cache.free_rows(seqs[b].slot))
             for b, r in results.items()}
    drafting = [b for b in results if seqs[b].speculate]
    if drafting:  # the drafter follows the round's result, whatever a stop cut from the output
        # a drafter that catches up from the tokens is not followed where it proposed nothing
        # (the controller backed off): such a round costs what plain decoding does
        follow = [not spec.catches_up or trees[b].size > 1 for b in drafting]
        broke = observe(spec, [seqs[b] for b in drafting], [trees[b] for b in drafting],
                        [results[b] for b in drafting],
                        [forward.hidden(b, [0, *results[b].accepted_nodes]) for b in drafting],
                        [forward.attention(b) for b in drafting], follow)
        failed |= {drafting[i]: why for i, why in broke.items()}
    return RoundEnd(failed, stops)


def _share(seqs: list[Sequence], among: list[int], draft_s: float, verify_s: float) -> None:
    """The round's proposal and verification times, split evenly among seqs[b] for b in `among`."""
    share = 1.0 / max(len(among), 1)
    for b in among:
        seqs[b].stats.draft_s += draft_s * share
        seqs[b].stats.verify_s += verify_s * share
