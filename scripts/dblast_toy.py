"""DBLast's mechanism on a multi-modal toy language, exactly (card 2.15's CPU reproduction).

    python scripts/dblast_toy.py [--modes 3] [--vocab 6] [--block 4] [--peak 0.8]
        [--temperatures 0.3,0.5,0.7,1.0,1.3]

The toy target writes each block in one of M modes: q(x_1..x_K) = sum_z pi(z) prod_k c_{z,k}(x_k),
mode z putting `peak` on its own token at position k ((2z + k) mod V) and the rest evenly; sampled
at temperature T its autoregressive conditionals are p_T(x_k | x_<k) ∝ p_1(x_k | x_<k)^(1/T).
Two block drafters, both warped by T as the engine warps them:

    independent   each position's marginal of the target (the best a block of independent
                  positions can do at T = 1), verified with it
    dblast        the mixture of the true modes (each component warped by T), drafted by
                  component, verified with the posterior-marginalised q (drafters/dblast_chain.py)

Printed: the exact expected accepted drafts of a block, E = sum_x min(p, q)(x) (1 + E after x) over
every prefix (a draft is accepted with probability min(p, q) / q when drawn from q), and the gap.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from outrider.drafters.dblast_chain import posterior_rows_reference


def toy(modes: int, vocab: int, block: int, peak: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(pi [M], components [M, K, V] float64)."""
    comp = torch.full((modes, block, vocab), (1 - peak) / (vocab - 1), dtype=torch.float64)
    for z, k in itertools.product(range(modes), range(block)):
        comp[z, k, (2 * z + k) % vocab] = peak
    pi = torch.linspace(1.0, 2.0, modes, dtype=torch.float64)
    return pi / pi.sum(), comp


def warp(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    w = probs.pow(1.0 / temperature)
    return w / w.sum(-1, keepdim=True)


def expected_accepted(p_row, q_row, prefix: list[int], block: int) -> float:
    """p_row(prefix) / q_row(prefix) -> [V] rows given the drafted prefix; exact recursion."""
    if len(prefix) == block:
        return 0.0
    p, q = p_row(prefix), q_row(prefix)
    both = torch.minimum(p, q)
    return sum(float(both[x]) * (1.0 + expected_accepted(p_row, q_row, prefix + [x], block))
               for x in range(p.shape[0]) if both[x] > 0)


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--modes", type=int, default=3)
    a.add_argument("--vocab", type=int, default=6)
    a.add_argument("--block", type=int, default=4)
    a.add_argument("--peak", type=float, default=0.8)
    a.add_argument("--temperatures", default="0.3,0.5,0.7,1.0,1.3")
    args = a.parse_args(argv)
    pi, comp = toy(args.modes, args.vocab, args.block, args.peak)
    K = args.block
    marginal = torch.einsum("m,mkv->kv", pi, comp)  # [K, V]
    print(f"toy: {args.modes} modes, vocab {args.vocab}, block {K}, peak {args.peak}; expected accepted drafts of a block")
    print("T      independent  dblast   gap")
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        def p_row(prefix):  # the target's conditional at T
            return warp(posterior_rows_reference(comp, pi, prefix + [0])[len(prefix)], temperature)

        warped = warp(comp, temperature)

        def dblast_row(prefix):
            return posterior_rows_reference(warped, pi, prefix + [0])[len(prefix)]

        independent = expected_accepted(p_row, lambda prefix: warp(marginal[len(prefix)], temperature), [], K)
        dblast = expected_accepted(p_row, dblast_row, [], K)
        print(f"{temperature:<6} {independent:11.3f}  {dblast:7.3f}  {dblast - independent:+.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
