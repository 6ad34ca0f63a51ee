"""What a head computes, recorded beside its golden tau: per-slot argmaxes and logits on fixed inputs.

The golden tau (heads/golden.py) sums a head up in one number, and a damaged head can keep
it: issue 43's DFlash head with `layers.0.mlp.down_proj` zeroed kept tau 1.068 while 220 of 875
slot argmaxes changed and logits moved by up to 8.7. So the golden record also holds, for each
golden prompt, what the head computes along the target's own greedy text (prompt + the 32 tokens
the golden run generated; the inputs are fixed by the prompts and the target, never by the head):

    "computes": {"what": "...", "slots": S, "anchors": [[a, ...] per prompt],
                 "argmax": [[...] per prompt: anchors x slots, row-major, target ids],
                 "logits": [[...] per prompt: the logit of that argmax, rounded to 4 decimals],
                 "tolerance": {"atol": ..., "rtol": ..., "note": ...}}

The kinds fill it in (heads/dflash/golden.py: the block at every generated position, slots
1..B-1; heads/eagle3/golden.py: every generated position, slot 1 from the target's features,
slots 2..depth fed the text's tokens and the head's own hidden, as a chain drafts).

`compare_computes`: for every slot, the re-measured logit of the golden argmax token must be within
atol + rtol * |golden logit| of the golden one, and that token must still be the argmax: exactly
on the same machine, device and dtype; elsewhere it may lose a near tie (its logit within the same
tolerance of the new maximum). TOLERANCE comes from measured float32 noise (its note says how).
"""

from __future__ import annotations

import torch

TOP = 8  # logits kept per slot while comparing (the golden token's, if it fell behind, is among them)
DECIMALS = 4  # logits are stored rounded to this: 5e-5 at most, far below the tolerance
# Measured on the shipped SmolLM2 heads (float32 target, the 5 golden prompts, 875 DFlash and 480
# EAGLE-3 slots; Xeon @ 2.80GHz, AVX-512, 2026-12-05): the golden's arithmetic (plain F.linear,
# one thread) against the CPU's timed kernels on two threads moved no argmax and no logit by more
# than 8.6e-6 (8.1e-6 DFlash, 8.6e-6 EAGLE-3); the float32 tolerance is about 100x that. With
# AVX2 kernels forced (ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
# `check-head` on the shipped heads found every argmax and logits within 5.6e-5 of the stored ones
# (their 4-decimal rounding included).
TOLERANCE = {"float32": {"atol": 1e-3, "rtol": 1e-4}, "other": {"atol": 0.1, "rtol": 1e-2}}
TOLERANCE_NOTE = ("float32: about 100x the largest logit difference measured between plain F.linear on one "
                  "thread and the timed CPU kernels on two (8.6e-6, the shipped SmolLM2 heads); bf16/fp16: not "
                  "measured, set from bfloat16's 8-bit mantissa")


def top_of(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [A, S, V] over the target vocabulary (-inf outside a draft vocabulary) ->
    (values, ids) [A, S, TOP], largest first (ties: the lowest id first, as argmax)."""
    values, ids = logits.float().cpu().sort(dim=-1, descending=True, stable=True)
    return values[..., :TOP].contiguous(), ids[..., :TOP].contiguous()


def measured_part(what: str, slots: int, anchors: list[list[int]],
                  tops: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The measurement's "computes": per prompt its anchors and the top logits of every slot
    (tensors; `recorded` turns them into the golden's lists)."""
    return {"what": what, "slots": slots, "anchors": anchors, "values": [v for v, _ in tops],
            "ids": [i for _, i in tops]}


def recorded(part: dict, dtype: str) -> dict:
    """The golden's "computes" from a measurement's: argmax ids and their logits, as lists."""
    tolerance = TOLERANCE["float32" if dtype == "float32" else "other"]
    return {"what": part["what"], "slots": part["slots"], "anchors": part["anchors"],
            "argmax": [ids[..., 0].flatten().tolist() for ids in part["ids"]],
            "logits": [[round(float(v), DECIMALS) for v in values[..., 0].flatten()] for values in part["values"]],
            "tolerance": {**tolerance, "note": TOLERANCE_NOTE}}


def compare_computes(golden: dict, measured: dict, same_machine: bool) -> tuple[bool, str]:
    """(ok, one line): does the head compute what the golden records (module docstring)?"""
    gold, part = golden["computes"], measured["computes"]
    if part["slots"] != gold["slots"] or part["anchors"] != gold["anchors"]:
        return False, (f"the head computes {part['slots']} slot(s) at anchors {_lengths(part)} where the golden has "
                       f"{gold['slots']} at {_lengths(gold)}: its block size or the target's text changed since "
                       "export; check --target or re-export")
    atol, rtol = float(gold["tolerance"]["atol"]), float(gold["tolerance"]["rtol"])
    S, total, changed, moved, worst, first = part["slots"], 0, 0, 0, 0.0, None
    for p, (want_ids, want_logits, values, ids) in enumerate(zip(gold["argmax"], gold["logits"], part["values"],
                                                                 part["ids"])):
        values, ids = values.reshape(-1, TOP), ids.reshape(-1, TOP)  # [A * S, TOP]
        for j, (g, v_gold) in enumerate(zip(want_ids, want_logits)):
            total += 1
            allowed = atol + rtol * abs(v_gold)
            hit = (ids[j] == g).nonzero().flatten()
            v = float(values[j, hit[0]]) if hit.numel() else float(values[j, 0])  # fell behind: the new max
            move = abs(v - v_gold) if v == v else float("inf")  # NaN: infinitely far
            worst = max(worst, move)
            moved += move > allowed
            tie = hit.numel() and not same_machine and float(values[j, 0]) - v <= allowed
            if int(ids[j, 0]) != g and not tie:
                changed += 1
                if first is None:
                    first = (p, gold["anchors"][p][j // S], j % S + 1, int(ids[j, 0]), g)
    allowed = f"{atol:g} + {rtol:g}|x|"
    if changed or moved:
        where = "" if first is None else (f" (first: prompt {first[0]}, position {first[1]}, slot {first[2]}: "
                                          f"token {first[3]} where the golden has {first[4]})")
        return False, (f"{changed} of {total} slot argmaxes differ from the golden{where}, {moved} logits move past "
                       f"the tolerance (by up to {worst:.3g}; allowed {allowed}): the head's weights or config changed "
                       "since export; check --target and the weights, or re-export")
    exact = "exact argmaxes: same machine, device and dtype" if same_machine else "near ties allowed elsewhere"
    return True, f"{total} slot argmaxes equal, logits within {worst:.2g} (allowed {allowed}; {exact})"


def _lengths(part: dict) -> list[int]:
    return [len(a) for a in part["anchors"]]
