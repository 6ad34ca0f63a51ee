"""`outrider train dfly`: DFly's weights (heads/dflash/dfly.py) on a frozen DFlash head.

Starts from the DFlash head exactly (gate 0, correction 0: DFly then computes its DFlash head)
and trains only what DFly adds: the per-layer mix logits and gates, the shared projection of the
mixed raw features, and the predecessor correction. Per step: one training sequence of the code
stream (train/data.py, as `outrider train` reads it, seeded); one target forward gives every tap;
blocks at `anchors` random positions a, drafted through the slow differentiable path
(`block_logits`: each slot corrected by the text's token before it, teacher forcing); the loss is
cross-entropy of slot k against x_{a+k} weighted exp(-(k-1)/gamma) (DFlash's). Writes
OUT/dfly.safetensors and OUT/dfly_train.json (command, data, seed, steps, log); copy the file beside
the DFlash head (the shipped one's folder ships it) for `--drafter dfly:HEAD`.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="catalog name or model folder of the target")
    p.add_argument("--head", required=True, help="the DFlash head (a folder or a shipped head's name)")
    p.add_argument("--data", default="code", help="training sources (train/data.py; default code)")
    p.add_argument("--out", required=True, help="output folder (dfly.safetensors, dfly_train.json)")
    p.add_argument("--mix-layers", default=None, metavar="IDS", help="target layers the mix reads (DFlash's "
                   "convention, comma-separated; default: four spread over 1..N-3)")
    p.add_argument("--rank", type=int, default=64, help="rank r of the predecessor correction (default 64)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps, one sequence each (default 200)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS", help="stop after this many seconds")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (default 256)")
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence and step (default 16)")
    p.add_argument("--gamma", type=float, default=7.0, help="slot k's weight exp(-(k-1)/gamma) (default 7)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, data order and anchors (default 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def init_weights(base, num_target_layers: int, mix_ids, rank: int, seed: int):
    from ..heads.dflash.dfly import DFlyWeights
    from ..heads.dflash.head import default_layer_ids

    c = base.config
    ids = tuple(mix_ids) if mix_ids else default_layer_ids(num_target_layers, 4)
    g = torch.Generator().manual_seed(seed)
    H, Ht, L = c.hidden_size, c.target_hidden_size, c.num_layers
    return DFlyWeights(ids, torch.zeros(L, len(ids)), torch.zeros(L), torch.randn(H, Ht, generator=g) * 0.02,
                       torch.randn(rank, H, generator=g) * 0.02, torch.zeros(H, rank))


def run(args) -> int:
    from ..catalog.resolve import resolve_model
    from ..config import current, overriding
    from ..drafters.dflash import parse_argument
    from ..heads.dflash.dfly import DFlyHead, block_logits
    from ..heads.dflash.format import load_dflash
    from ..weights.loader import load_decoder
    from ..weights.tokenizer import load_tokenizer
    from .data import Encoder, Position, Stream, batches, load_corpus

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path = resolve_model(args.target)
    target = load_decoder(path, "cpu")
    head_dir = parse_argument(args.head.removeprefix("dflash:"))
    base = load_dflash(head_dir, target)
    mix = [int(x) for x in args.mix_layers.split(",")] if args.mix_layers else None
    extra = init_weights(base, target.config.num_layers, mix, args.rank, args.seed)
    params = list(extra.tensors().values())
    for p in params:
        p.requires_grad_(True)
    head = DFlyHead(base, extra, target.config.num_layers)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    corpus = load_corpus(args.data, regenerate=False, roots=None, fixtures=current().bench_fixtures)
    data = batches(Stream(corpus, Encoder(load_tokenizer(path), args.seq_len), args.seed, None), 1, Position(), group=1)
    B = base.block_size
    weights = torch.tensor([math.exp(-k / args.gamma) for k in range(B - 1)])  # slot k+1
    log, start, step = [], time.perf_counter(), 0
    hits = torch.zeros(B - 1)
    seen = 0
    while step < args.steps and (args.time_budget is None or time.perf_counter() - start < args.time_budget):
        _, examples = next(data)
        ids = list(examples[0].tokens)
        if len(ids) < B + 2:
            continue
        with torch.inference_mode():
            cache = target.new_cache(1, len(ids))
            from ..models.batch import causal_batch

            out = target.forward(causal_batch([torch.tensor(ids)], hidden_layers=tuple(sorted(head.taps)),
                                              scratch_row=cache.scratch_row), cache)
            feats = torch.stack([out.hidden[t][0] for t in head.taps], dim=1)  # [n, taps, Ht]
        feats = feats.clone()
        anchors = sorted(rng.sample(range(1, len(ids) - B + 1), min(args.anchors, len(ids) - B)))
        text = torch.tensor(ids)
        with overriding(linear="linear"):
            logits = block_logits(head, feats, text, anchors)  # [A, B-1, V]
        labels = text[torch.tensor(anchors).unsqueeze(1) + torch.arange(1, B)]  # [A, B-1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(labels)
        loss = (ce * weights).sum() / (len(anchors) * weights.sum())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            hits += (logits.argmax(-1) == labels).float().sum(0)
            seen += len(anchors)
        if step % 10 == 0:
            record = {"step": step, "loss": round(float(loss.detach()), 4), "acc": [round(float(h) / seen, 4) for h in hits],
                      "gate": [round(float(g), 4) for g in extra.gate.detach()], "elapsed_s": round(time.perf_counter() - start, 1)}
            log.append(record)
            print(json.dumps(record), file=sys.stderr)
            hits.zero_()
            seen = 0
    out = Path(args.out)
    extra.save(out)
    (out / "dfly_train.json").write_text(json.dumps({
        "command": ["outrider"] + sys.argv[1:], "target": args.target, "head": str(head_dir), "data": corpus.sources,
        "seed": args.seed, "steps": step, "seq_len": args.seq_len, "anchors": args.anchors, "rank": args.rank,
        "mix_ids": list(extra.mix_ids), "time_s": round(time.perf_counter() - start, 1), "log": log}, indent=1))
    print(f"wrote {out / 'dfly.safetensors'} ({step} steps)")
    return 0
