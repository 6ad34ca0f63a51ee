"""Record a head folder's outrider_golden.json again, with the settings, prompts and target it holds.

Issue 43 gave the golden a record of what the head computes (format 2: per-slot argmaxes and
logits, heads/golden_compute.py); the shipped heads' goldens were re-recorded with this script
(one thread, plain F.linear, as `outrider export` measures), and it prints whether the tau and
the target's outputs are the ones recorded before:

    .venv/bin/python scripts/rerecord_golden.py outrider/heads/shipped/dflash/smollm2-135m-instruct
    .venv/bin/python scripts/rerecord_golden.py outrider/heads/shipped/eagle3/smollm2-135m-instruct
    .venv/bin/python scripts/rerecord_golden.py outrider/heads/shipped/eagle3/smollm2-135m-gdn
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from outrider.catalog.resolve import resolve_model
from outrider.heads.files import read_raw
from outrider.heads.kinds import kind_of
from outrider.heads.golden import read_golden, record, settings_of, write_golden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a head folder with an outrider_golden.json")
    folder = parser.parse_args().folder
    old = read_golden(folder)
    if old is None:
        raise SystemExit(f"{folder} has no outrider_golden.json: export the head to record one")
    head_kind = kind_of(read_raw(folder))
    kind, measure = head_kind.name, head_kind.part("measure")
    start = time.time()
    measured = measure(folder, resolve_model(old["target"]["name"]), settings_of(old), old["prompts"])
    new = record(measured, old["target"]["name"], Path(old["target"]["path"]), old["target"]["architectures"])
    outputs = [r["output_ids"] for r in new["results"]] == [r["output_ids"] for r in old["results"]]
    settings = new["settings"] == old["settings"]
    print(f"{folder}: {kind}, {time.time() - start:.0f} s; tau {old['tau']:.4f} -> {new['tau']:.4f} (rounds "
          f"{old['rounds']} -> {new['rounds']}, committed {old['committed']} -> {new['committed']}); the target's "
          f"outputs {'as' if outputs else 'NOT as'} recorded; settings {'as' if settings else 'NOT as'} recorded")
    write_golden(folder, new)
    print(f"wrote {folder / 'outrider_golden.json'} ({(folder / 'outrider_golden.json').stat().st_size} bytes)")


if __name__ == "__main__":
    main()
