"""Oilbird's argument and its lexical bases (oilbird.py): the exact-match pool drafter whose pool
it keys a second time (`base=`), each giving a speculation tree scored so that its paths and the
semantic neighbours' can be ranked together (merge.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..spec.types import Budget
from .ngram import NgramDrafter
from .suffix import Speculation, SuffixDrafter

K, SIM, MB = 4, 0.7, 16.0  # defaults: neighbours, cosine floor, pool bound in megabytes
BASES = ("suffix", "ngram", "suffix:local")  # the lexical drafters it keys a second time
BASE = "suffix"


@dataclass(frozen=True)
class OilbirdArgument:
    k: int = K
    sim: float = SIM
    mb: float = MB
    base: str = BASE

    def __str__(self) -> str:
        return f"{self.k},{self.sim:g},{self.mb:g}" + ("" if self.base == BASE else f",base={self.base}")


def parse_argument(text: str) -> OilbirdArgument:
    """`[K[,SIM[,MB]]][,base=BASE]`: neighbours (1 to 64), cosine floor (0 < SIM <= 1), pool bound
    in MB (> 0), the lexical base (one of BASES)."""
    if not text:
        return OilbirdArgument()
    parts = text.split(",")
    usage = ("oilbird:K[,SIM[,MB]][,base=BASE] takes K neighbours (1 to 64), a cosine floor SIM in (0, 1], "
             f"a pool bound MB > 0 and a base among {', '.join(BASES)}")
    base = BASE
    if parts[-1].startswith("base="):
        base = parts.pop()[len("base="):]
        if base not in BASES:
            raise ConfigError(f"oilbird's base={base} is not a lexical base; use one of {', '.join(BASES)}")
    if len(parts) > 3 or any("=" in part for part in parts):
        raise ConfigError(usage)
    if not parts:
        return OilbirdArgument(base=base)
    try:
        k = int(parts[0])
        sim = float(parts[1]) if len(parts) > 1 else SIM
        mb = float(parts[2]) if len(parts) > 2 else MB
    except ValueError:
        raise ConfigError(usage) from None
    if not (1 <= k <= 64 and 0.0 < sim <= 1.0 and mb > 0 and mb == mb and mb != float("inf")):
        raise ConfigError(usage)
    return OilbirdArgument(k, sim, mb, base)


class SuffixBase:
    """The suffix drafter (suffix.py, with or without its global tree): its speculation tree, count shares."""

    def __init__(self, drafter: SuffixDrafter):
        self.drafter = drafter
        self.min_prob = drafter.min_prob
        self.global_pool = drafter.global_max_tokens > 0 and drafter.global_max_sequences > 0

    def speculation(self, seq_id: int, tokens: list[int], budget: Budget) -> Speculation:
        tree = self.drafter.propose(seq_id, tokens, budget)
        if tree.size == 1:
            return Speculation()
        return Speculation(tree.tokens[1:].tolist(), tree.parents[1:].tolist(), tree.confidence[1:].tolist())


class NgramBase:
    """Prompt lookup (ngram.py): its chain, every node scored n / max_ngram for the n-gram it followed."""

    global_pool = False
    min_prob = 0.1  # the semantic paths' floor, as suffix's

    def __init__(self, drafter: NgramDrafter):
        self.drafter = drafter

    def speculation(self, seq_id: int, tokens: list[int], budget: Budget) -> Speculation:
        n, drafts = self.drafter.match(seq_id, tokens, min(budget.depth, budget.nodes))
        score = n / self.drafter.max_ngram
        return Speculation(drafts, list(range(len(drafts))), [score] * len(drafts))


def make_base(name: str) -> SuffixBase | NgramBase:
    if name == "suffix":
        return SuffixBase(SuffixDrafter())
    if name == "suffix:local":
        return SuffixBase(SuffixDrafter(global_max_tokens=0))
    if name == "ngram":
        return NgramBase(NgramDrafter())
    raise ConfigError(f"oilbird's base={name} is not a lexical base; use one of {', '.join(BASES)}")
