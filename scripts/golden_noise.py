"""How far a head's golden logits move when only the float arithmetic changes (issue 43, item 7).

Measures the golden of a shipped head twice on its recorded prompts and settings: as `outrider
export` does (plain F.linear, one thread) and with the CPU's timed kernels on two threads, then
prints how many slot argmaxes moved and the largest logit difference (the noise the tolerance in
heads/golden_compute.py is chosen against):

    .venv/bin/python scripts/golden_noise.py outrider/heads/shipped/dflash/smollm2-135m-instruct
    .venv/bin/python scripts/golden_noise.py outrider/heads/shipped/eagle3/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
from pathlib import Path

from outrider.catalog.resolve import resolve_model
from outrider.config import overriding
from outrider.heads.files import read_raw
from outrider.heads.kinds import kind_of
from outrider.heads.golden import read_golden, settings_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a head folder with an outrider_golden.json")
    folder = parser.parse_args().folder
    golden = read_golden(folder)
    module = kind_of(read_raw(folder)).module("golden")
    args = (folder, resolve_model(golden["target"]["name"]), settings_of(golden), golden["prompts"])
    pinned = module.measure(*args)
    module.overriding = lambda **_: overriding(linear="auto", threads=2)  # what measure pins, undone
    try:
        timed = module.measure(*args)
    finally:
        module.overriding = overriding
    a, b = pinned["computes"], timed["computes"]
    slots = moved = 0
    worst = 0.0
    for va, ia, vb, ib in zip(a["values"], a["ids"], b["values"], b["ids"]):
        same = ia[..., 0] == ib[..., 0]
        slots, moved = slots + same.numel(), moved + int((~same).sum())
        worst = max(worst, float((va[..., 0] - vb[..., 0])[same].abs().max()))
    print(f"{folder}: {moved} of {slots} slot argmaxes moved, largest logit difference {worst:.3g}; "
          f"tau {pinned['tau']:.4f} and {timed['tau']:.4f}")


if __name__ == "__main__":
    main()
