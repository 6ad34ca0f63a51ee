"""Per-request figures, in the units the field reports them.

    tau (mean_accepted_length)  tokens committed per round, bonus included (vLLM, SGLang)
    acceptance_by_position[d]   of the rounds that drafted a token at depth d + 1, the share
                                that accepted it
    accepted_length_hist[a]     rounds that accepted exactly a drafts
    total_s = prefill_s + draft_s + verify_s + other_s   where the time went (verify includes
                                the target forward; other: stopping rules, text, scheduling)
"""

from __future__ import annotations

from ..spec.types import RoundStats


def summarize(s: RoundStats, new_tokens: int, prefill_s: float, total_s: float) -> dict:
    other = max(total_s - prefill_s - s.draft_s - s.verify_s, 0.0)
    return {
        "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / max(total_s, 1e-9),
        "total_s": total_s,
        "prefill_s": prefill_s,
        "rounds": s.rounds,
        "mean_accepted_length": s.committed / max(s.rounds, 1),
        "committed": s.committed,
        "drafted": s.drafted,
        "acceptance_by_position": [a / max(p, 1) for a, p in zip(s.accepted_by_position, s.proposed_by_position)],
        "accepted_by_position": list(s.accepted_by_position),
        "proposed_by_position": list(s.proposed_by_position),
        "accepted_length_hist": list(s.accepted_length_hist),
        "draft_s": s.draft_s,
        "verify_s": s.verify_s,
        "other_s": other,
    }


def format_stats(stats: dict) -> str:
    """A few lines for a terminal."""
    acc = " ".join(f"{a:.2f}" for a in stats["acceptance_by_position"]) or "-"
    return (
        f"{stats['new_tokens']} tokens in {stats['total_s']:.2f} s ({stats['tokens_per_s']:.1f} tok/s), "
        f"{stats['rounds']} rounds, tau {stats['mean_accepted_length']:.2f}\n"
        f"acceptance by position: {acc}\n"
        f"accepted lengths: {stats['accepted_length_hist']}\n"
        f"time: prefill {stats['prefill_s']:.2f} s, draft {stats['draft_s']:.2f} s, "
        f"verify {stats['verify_s']:.2f} s, other {stats['other_s']:.2f} s"
    )
