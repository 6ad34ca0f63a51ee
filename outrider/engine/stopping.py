"""Stopping rules: where a sequence ends inside what a round committed.

A round commits 1 + accepted tokens at once; the sequence must end exactly where plain decoding
would have ended, one token at a time. So after every round, in this order:
1. EOS or a stop token: the first end-of-sequence token (unless the request ignores EOS) or
   token of the request's `stop_token_ids` among the new ones ends it, kept ("eos" / "stop");
2. `max_new_tokens`: the output is cut to it ("length"; "eos" when the EOS is the last kept);
3. the context: no K/V row left for the next round's root ("context");
4. stop strings: the text stream (engine/text_stream.py) takes the kept tokens one at a time and
   cuts at the first token whose text contains one ("stop").
Tokens cut here were never output: the stats do not count them as committed.
"""

from __future__ import annotations

from .sequence import Sequence


def stop_after_round(seq: Sequence, new: int, eos_ids: set[int], free_rows: int) -> tuple[str | None, str]:
    """Cut what this round committed (`new` tokens) at the first stopping point.

    Returns (why it stopped or None, the text that became stable this round)."""
    before = len(seq.tokens)
    reason = _stop_reason(seq, new, set() if seq.request.ignore_eos else eos_ids, free_rows)
    text = ""
    if seq.text is not None:
        out = seq.output
        text = seq.text.add(out[seq.text.fed:])
        if seq.text.stopped:
            del seq.tokens[seq.prompt_len + seq.text.kept_tokens:]
            reason = "stop"
    if len(seq.tokens) < before:
        _uncount_cut(seq.stats, len(seq.output))
        if seq.logprobs is not None:
            del seq.logprobs[len(seq.output):]
    return reason, text


def _stop_reason(seq: Sequence, new: int, eos_ids: set[int], free_rows: int) -> str | None:
    out, stops = seq.output, seq.request.stop_token_ids
    reason, keep = None, len(out)
    for i in range(len(out) - new, len(out)):
        if out[i] in eos_ids or out[i] in stops:
            reason, keep = ("eos" if out[i] in eos_ids else "stop"), i + 1
            break
    limit = seq.request.max_new_tokens
    if keep >= limit:
        reason = reason if reason and keep == limit else "length"
        keep = limit
    del seq.tokens[seq.prompt_len + keep:]
    if reason is None and free_rows < 1:
        reason = "context"
    return reason


def _uncount_cut(stats, kept: int) -> None:
    """The output was cut to `kept` tokens (a limit, EOS or a stop string, possibly reaching back
    over earlier rounds): count as committed only those, and as rounds only the rounds that
    produced at least one of them, so tau is kept tokens per round that produced them. (What
    the verifier accepted, by position, stays counted: it measures the drafts, not the output.)"""
    rounds, done = 0, 0
    for size in stats.committed_by_round:
        if done >= kept:
            break
        done, rounds = done + size, rounds + 1
    stats.committed, stats.rounds = kept, rounds
    del stats.committed_by_round[rounds:]
    if done > kept:  # the last round that produced kept tokens produced some that were cut
        stats.committed_by_round[-1] -= done - kept
