"""Fit LiLiCorr's pairwise correlator (drafters/refiners/lilicorr.py) from a target's own text.

The correlator is the pointwise mutual information of adjacent tokens, estimated by counting over
token-id sequences (the target's regenerated responses, `OUT/regenerated.jsonl` of a training
run, whose lines hold `ids`), kept for pairs seen at least `min_count` times and clipped.
The weight of the pairwise term is chosen on a held-out tenth of the sequences: the one of
{0.25, 0.5, 1.0} under which the adjacent-pair score best ranks the true next token among the
most frequent candidates (top-1 rate), so "learned" means fitted to data, by counts and one
held-out choice.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch

from ..drafters.refiners.lilicorr import Correlator

CLIP = 4.0


def read_ids(path: str | Path) -> list[list[int]]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            ids = item.get("ids") or item.get("response_ids") or []
            if len(ids) > 1:
                out.append([int(t) for t in ids])
    return out


def fit(sequences: list[list[int]], vocab: int, min_count: int = 3, weight: float | None = None) -> Correlator:
    held = sequences[:: 10]
    train = [s for i, s in enumerate(sequences) if i % 10]
    uni, bi = Counter(), Counter()
    for s in train:
        uni.update(s)
        bi.update(zip(s[:-1], s[1:]))
    n_uni, n_bi = sum(uni.values()), max(sum(bi.values()), 1)
    keys, values = [], []
    for (a, b), c in bi.items():
        if c >= min_count:
            pmi = math.log(c / n_bi) - math.log(uni[a] / n_uni) - math.log(uni[b] / n_uni)
            keys.append(a * vocab + b)
            values.append(max(-CLIP, min(CLIP, pmi)))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    c = Correlator(torch.tensor([keys[i] for i in order], dtype=torch.long),
                   torch.tensor([values[i] for i in order], dtype=torch.float32), vocab, 1.0)
    c.weight = weight if weight is not None else _choose_weight(c, held, uni)
    return c


def _choose_weight(c: Correlator, held: list[list[int]], uni: Counter) -> float:
    """The weight under which log unigram + weight * C ranks the true next token first most often
    among the 32 most frequent tokens plus the true one (held-out pairs)."""
    common = torch.tensor([t for t, _ in uni.most_common(32)])
    total = sum(uni.values())
    logp = {t: math.log(n / total) for t, n in uni.items()}
    best, best_w = -1.0, 1.0
    pairs = [(a, b) for s in held for a, b in zip(s[:-1], s[1:])][:4000]
    for w in (0.25, 0.5, 1.0):
        hits = 0
        for a, b in pairs:
            cand = torch.cat((common, torch.tensor([b]))).unique()
            base = torch.tensor([logp.get(int(t), -20.0) for t in cand])
            score = base + w * c.pair(torch.tensor([a]), cand)[0]
            hits += int(cand[score.argmax()]) == b
        rate = hits / max(len(pairs), 1)
        if rate > best:
            best, best_w = rate, w
    return best_w


def add_arguments(p) -> None:
    p.add_argument("--responses", required=True, help="a regenerated.jsonl of the target (lines with `ids`): "
                   "OUT/regenerated.jsonl of a `train eagle3|dflash --regenerate` run")
    p.add_argument("--vocab", type=int, required=True, help="the target's vocabulary size")
    p.add_argument("--out", required=True, help="output folder (lilicorr.safetensors); a DFlash head's folder ships "
                   "it beside the head, where `--refiner lilicorr` finds it")
    p.add_argument("--min-count", type=int, default=3, help="pairs seen fewer times score 0 (default 3)")


def run(args) -> int:
    seqs = read_ids(args.responses)
    c = fit(seqs, args.vocab, args.min_count)
    path = c.save(args.out)
    print(f"{path}: {c.keys.numel()} pairs from {len(seqs)} sequences, weight {c.weight}")
    return 0


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="outrider train lilicorr", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
