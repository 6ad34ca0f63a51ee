"""Train DARTree's correction head (drafters/refiners/dartree.py) on a frozen DFlash head.

Per sequence (token ids: a target's regenerated responses, `regenerated.jsonl`): one target
forward gives the head's taps at every position; the block head's context is written once; blocks
are drafted at random anchors a (each sees positions < a only: `DFlashHead.block` masks the rows
past a slot's context); for slot k >= 2 the correction head gets the block's hidden state of slot
k and the true token at a + k - 1 (teacher forcing) and is trained with cross-entropy on the true
token at a + k, over the draft vocabulary. The block head, the target's embedding and output head
stay frozen. Per-depth accuracy (corrected vs the block's own) is printed as it trains.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from ..drafters.refiners.dartree import CorrectionHead
from ..heads.vocab_map import to_draft_ids
from ..models.batch import causal_batch
from .lilicorr import read_ids


def _features(target, ids: list[int], taps: tuple[int, ...]) -> torch.Tensor:
    """[n, taps, Ht] the target's taps at every position of `ids`."""
    cache = target.new_cache(1, len(ids))
    batch = causal_batch([torch.tensor(ids)], hidden_layers=tuple(sorted(set(taps))), scratch_row=cache.scratch_row,
                         device=target.device)
    out = target.forward(batch, cache)
    return torch.stack([out.hidden[t][0].float() for t in taps], dim=1).clone()


def _draft_ids(head, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids [m] -> (draft ids [m], kept [m] bool: the token is in the draft vocabulary)."""
    return to_draft_ids(head.w.draft_to_target, tokens, head.config.vocab_size)


def train(head, target, sequences: list[list[int]], steps: int, hidden: int = 256, anchors: int = 8,
          lr: float = 1e-3, seed: int = 0, log=print) -> CorrectionHead:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    H = head.config.hidden_size
    c = CorrectionHead(torch.nn.Parameter(torch.randn(hidden, 2 * H) * 0.02),
                       torch.nn.Parameter(torch.zeros(H, hidden)),
                       torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.ones(H)), head)
    params = [c.w1, c.w2, c.norm_h, c.norm_e]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    taps = head.config.taps(target.config.num_layers)
    B = head.block_size
    usable = [s for s in sequences if len(s) > B + 2]
    start, hits, base_hits, seen = time.perf_counter(), 0, 0, 0
    for step in range(steps):
        ids = rng.choice(usable)
        with torch.inference_mode():
            feats = _features(target, ids, taps)
            cache = head.new_cache(1, len(ids))
            head.write_context(cache, 0, 0, head.fuse(feats))
            points = sorted(rng.sample(range(1, len(ids) - B), min(anchors, len(ids) - B - 1)))
            blocks = torch.full((len(points), B), head.config.mask_token_id, dtype=torch.long)
            blocks[:, 0] = torch.tensor([ids[a] for a in points])
            base_logits, h = head.block(cache, [0] * len(points), points, blocks)  # [A, B-1, Vd], [A, B, H]
        tokens = torch.tensor(ids)
        rows = torch.tensor([[a + k for k in range(2, B)] for a in points])  # [A, B-2]: positions of slots 2..B-1
        parents, labels = tokens[rows - 1], tokens[rows]
        labels, kept = _draft_ids(head, labels.reshape(-1))
        hh = h[:, 2:].reshape(-1, H).clone()  # [A(B-2), H]
        logits = c.logits(hh, parents.reshape(-1))
        loss = F.cross_entropy(logits[kept], labels[kept]) if kept.any() else logits.sum() * 0
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            hits += int((logits.argmax(-1)[kept] == labels[kept]).sum())
            base_hits += int((base_logits[:, 1:].reshape(-1, base_logits.shape[-1]).argmax(-1)[kept] == labels[kept]).sum())
            seen += int(kept.sum())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"step {step + 1}/{steps} loss {float(loss.detach()):.3f} acc slots 2+: corrected {hits / max(seen, 1):.3f} "
                f"block {base_hits / max(seen, 1):.3f} ({time.perf_counter() - start:.0f} s)")
            hits = base_hits = seen = 0
    return CorrectionHead(*(p.detach() for p in params), head)


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="catalog name or model folder of the target")
    p.add_argument("--head", required=True, help="the DFlash head it corrects: a folder or a shipped head's name (dflash:NAME or NAME)")
    p.add_argument("--responses", required=True, help="regenerated.jsonl of this target (lines with `ids`)")
    p.add_argument("--out", required=True, help="output folder (dartree.safetensors); a DFlash head's folder ships it "
                   "beside the head, where `--refiner dartree` finds it")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps, one sequence each (default 400)")
    p.add_argument("--hidden", type=int, default=256, help="the correction MLP's width C (default 256)")
    p.add_argument("--anchors", type=int, default=8, help="blocks drafted per sequence and step (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, sequence and anchor order (default 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def run(args) -> int:
    from ..catalog.resolve import resolve_model
    from ..drafters.dflash import parse_argument
    from ..heads.dflash.format import load_dflash
    from ..weights.loader import load_decoder

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_decoder(resolve_model(args.target), "cpu")
    head = load_dflash(parse_argument(args.head.removeprefix("dflash:")), target)
    c = train(head, target, read_ids(args.responses), args.steps, args.hidden, args.anchors, args.lr, args.seed)
    print(c.save(args.out))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="outrider train dartree", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
