"""Fit a DSpark head's Markov head alone (backbone and confidence head frozen), for PCTree's comparison.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python scripts/dspark_markov_fit.py --out DIR
        [--head smollm2-135m-instruct] [--target smollm2-135m-instruct] [--minutes 10] [--seq-len 256]
        [--anchors 48] [--lr 5e-3] [--seed 0]

Why: PCTree (drafters/pctree.py) differs from DDTree on a block's marginals only through the
Markov head's bias, and the shipped DSpark head's (16 training steps, frozen backbone) is nearly
zero (|bias| <= 0.013 logits on random parents), so there PCTree's tree is DDTree's. This fits the
vanilla Markov head (W1 [V, r], W2 [Vd, r]) on top of the head's frozen block, starting from its
weights, so the comparison can see what a parent-conditioned score does.

Data: the stdlib's .py files (train/sources.py `stdlib_files`: tests and the code-edit workload's
modules left out), shuffled by the seed, cut into seq-len-token pieces. Each step: one target
forward over a piece (the target's default dtype, as the drafter runs it) gives the tapped hidden
states; the head's context is written; one batched
backbone pass over `anchors` random anchors gives U [A, gamma, Vd]; the Markov bias of the text's
previous tokens is added and the loss is cross-entropy towards the text's next tokens (teacher
forcing, as DSpark's CE term; no target logits, which would cost the target's readout over every
row), every position weighted alike; Adam on W1 and W2 only. Written: a copy of
the head folder with the two Markov tensors replaced (in the head's dtype) and fit_info.json (this
command, the data, the seed, the steps, per-position top-1 agreement with the text before and
after on held-out pieces). No golden is rewritten: the copy is a measurement's head, not a shipped one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pieces(tokenizer, seq_len: int, seed: int):
    """Token pieces of seq_len + 1 from the stdlib's files, in a seeded order (endless)."""
    import sysconfig

    from outrider.train.sources import stdlib_files

    files = stdlib_files(Path(sysconfig.get_paths()["stdlib"]))
    random.Random(seed).shuffle(files)
    while True:
        for path in files:
            try:
                ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
            except (UnicodeDecodeError, OSError):
                continue
            for start in range(0, len(ids) - seq_len - 1, seq_len):
                yield ids[start: start + seq_len + 1]


def batch_of(head, target, ids: list[int], anchors: int, gen: random.Random):
    """(U [A, gamma, Vd], prev [A, gamma] text ids, labels [A, gamma] the next text ids)."""
    import torch

    from outrider.models.batch import pack

    n = len(ids)
    taps = head.config.taps(target.config.num_layers)
    with torch.inference_mode():
        cache = target.new_cache(1, n)
        out = target.forward(pack([0], [0], [torch.tensor(ids)], logits="none", hidden_layers=tuple(sorted(set(taps))),
                                  scratch_row=cache.scratch_row, device=target.device), cache)
        features = torch.stack([out.hidden[t][0] for t in taps], dim=1)  # [n, taps, Ht]
        own = head.new_cache(1, n + head.block_size)
        head.write_context(own, 0, 0, head.fuse(features))
        G = head.gamma
        at = sorted(gen.sample(range(1, n - G - 1), min(anchors, n - G - 2)))
        tokens = torch.full((len(at), head.block_size), head.config.mask_token_id, dtype=torch.long)
        tokens[:, 0] = torch.tensor([ids[a] for a in at])
        U, _ = head.block(own, [0] * len(at), at, tokens)  # [A, G, Vd]
        prev = torch.tensor([[ids[a + k] for k in range(G)] for a in at])  # x_{a..a+G-1}: position k's parent
        labels = torch.tensor([[ids[a + 1 + k] for k in range(G)] for a in at])  # x_{a+1..a+G}
    return U.clone(), prev.clone(), labels.clone()  # out of inference mode: autograd may save them


def agreement(head, W1, W2, batches) -> list[float]:
    """Per position: top-1 of U + bias equal to the text's next token, over `batches`."""
    import torch
    import torch.nn.functional as F

    hits, total = None, 0
    with torch.no_grad():
        for U, prev, labels in batches:
            logits = U + F.linear(F.embedding(prev, W1), W2)  # [A, G, Vd]
            got = head.target_ids(logits.argmax(-1)) == labels  # [A, G]
            hits = got.sum(0) if hits is None else hits + got.sum(0)
            total += got.shape[0]
    return [round(float(h) / max(total, 1), 4) for h in hits]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--head", default="smollm2-135m-instruct", help="a DSpark head folder or shipped name")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--anchors", type=int, default=96)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", type=int, default=6, help="pieces kept aside for the agreement figures")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    from outrider.heads.catalog import resolve_head
    from outrider.heads.dspark.format import load_dspark
    from outrider.llm import LLM

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"--out {out} exists; give a new folder")
    source = resolve_head(args.head, "dspark")
    llm = LLM(args.target)
    head = load_dspark(source, llm.target)
    if head.spec.markov_variant != "vanilla":
        raise SystemExit(f"this fits the vanilla Markov head; {source} has {head.spec.markov_variant}")
    W1 = head.markov.prev_embed.weight.detach().float().clone().requires_grad_(True)  # [V, r]
    W2 = head.markov.out_proj.weight.detach().float().clone().requires_grad_(True)  # [Vd, r]
    opt = torch.optim.Adam([W1, W2], lr=args.lr)
    gen = random.Random(args.seed)
    stream = pieces(llm.tokenizer, args.seq_len, args.seed)
    held = [batch_of(head, llm.target, next(stream), args.anchors, gen) for _ in range(args.held_out)]
    before = agreement(head, W1, W2, held)
    print(f"held-out top-1 agreement by position, before: {before}", flush=True)
    start, step, seen, losses = time.monotonic(), 0, 0, []
    while time.monotonic() - start < 60 * args.minutes:
        U, prev, labels = batch_of(head, llm.target, next(stream), args.anchors, gen)
        logits = U + F.linear(F.embedding(prev, W1), W2)  # [A, G, Vd]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step, seen = step + 1, seen + labels.numel()
        losses.append(float(loss.detach()))
        if step % 20 == 0:
            print(f"step {step} loss {sum(losses[-20:]) / 20:.4f} ({time.monotonic() - start:.0f} s)", flush=True)
    after = agreement(head, W1, W2, held)
    print(f"held-out top-1 agreement by position, after {step} steps: {after}", flush=True)
    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, value in (("markov_head.prev_embed.weight", W1), ("markov_head.out_proj.weight", W2)):
        if name not in tensors:
            raise SystemExit(f"{source}/model.safetensors has no {name}")
        tensors[name] = value.detach().to(tensors[name].dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "outrider_golden.json").unlink(missing_ok=True)  # it recorded the shipped head's computation
    info = {"command": sys.argv, "source_head": str(source), "target": args.target, "seed": args.seed,
            "data": "stdlib .py files (train/sources.py stdlib_files), seeded order, seq-len pieces",
            "steps": step, "positions_trained": seen, "minutes": args.minutes, "lr": args.lr,
            "anchors": args.anchors, "seq_len": args.seq_len, "final_loss": sum(losses[-20:]) / max(len(losses[-20:]), 1),
            "held_out_agreement_before": before, "held_out_agreement_after": after,
            "trained": "markov_head.prev_embed and out_proj only; backbone, confidence head, temperatures as the source"}
    (out / "fit_info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: info[k] for k in ("steps", "positions_trained", "final_loss")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
