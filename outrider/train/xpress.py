"""Train xPress's refiner head (drafters/refiners/xpress_head.py) on a frozen DFlash head.

Two phases. Collect: per sequence one target forward gives the block head's taps and the target's
own next-token argmax at every position; the block head's context is written once and blocks are
drafted at random anchors a (each block sees positions < a only); a block keeps its hidden states
[B, H], its predecessors prev = x_{a-1}, x_a, .., x_{a+B-2} (teacher forcing: the text's own tokens)
and its labels, the target's argmax after each of x_a .. x_{a+B-2} (the token a greedy verify
accepts there, given that prefix; `--labels text` takes the text's next token instead). Train:
minibatches of collected blocks, cross-entropy of the refined logits of slots 1..B-1 over the
block head's readout, slot k weighted exp(-(k-1)/gamma) as DFlash trains its slots. The block
head, the target's embedding and output head stay frozen. Held-out blocks (every tenth) report the
block's own and the refined per-slot accuracy, both with true predecessors (what Jacobi converges
to when the earlier slots are right).

Data: `--data SPEC` (train/data.py sources; items' own text and responses: the code sources need
no --regenerate) or `--responses FILE` (a regenerated.jsonl, lines with `ids`).
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
import torch.nn.functional as F

from ..drafters.refiners.xpress_head import XPressHead, XPressWeights
from ..heads.vocab_map import to_draft_ids
from ..models.batch import causal_batch
from ..models.layers import linear, rms_norm


def target_view(target, ids: list[int], taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [n, taps, Ht] the target's taps at every position, top [n] long its argmax after
    each position: the greedy next token given ids[:p+1])."""
    N = target.config.num_layers
    cache = target.new_cache(1, len(ids))
    batch = causal_batch([torch.tensor(ids)], hidden_layers=tuple(sorted(set(taps) | {N})),
                         scratch_row=cache.scratch_row, device=target.device)
    out = target.forward(batch, cache)
    feats = torch.stack([out.hidden[t][0].float() for t in taps], dim=1).clone()
    last = rms_norm(out.hidden[N][0], target.norm, target.config.rms_norm_eps)  # [n, Ht]
    return feats, linear(last, target.lm_head).argmax(-1).clone()


def collect(head, target, sequences: list[list[int]], anchors: int, max_blocks: int, rng: random.Random,
            labels: str = "target", seconds: float | None = None, log=print):
    """-> (hidden [N, B, H], prev [N, B] long, labels [N, B-1] long target ids, base [N, B-1] long:
    the block's own argmax in target ids, seq [N] long: the sequence each block came from)."""
    taps = head.config.taps(target.config.num_layers)
    B = head.block_size
    hs, prevs, labs, bases, seqs = [], [], [], [], []
    start, tokens = time.perf_counter(), 0
    order = [s for s in sequences if len(s) > B + 2]
    rng.shuffle(order)
    for ids in order:
        if sum(h.shape[0] for h in hs) >= max_blocks or (seconds and time.perf_counter() - start > seconds):
            break
        with torch.inference_mode():
            feats, top = target_view(target, ids, taps)
            cache = head.new_cache(1, len(ids))
            head.write_context(cache, 0, 0, head.fuse(feats))
            points = sorted(rng.sample(range(1, len(ids) - B + 1), min(anchors, len(ids) - B)))
            blocks = torch.full((len(points), B), head.config.mask_token_id, dtype=torch.long)
            blocks[:, 0] = torch.tensor([ids[a] for a in points])
            logits, h = head.block(cache, [0] * len(points), points, blocks)  # [A, B-1, Vd], [A, B, H]
        t = torch.tensor(ids)
        at = torch.tensor(points).unsqueeze(1) + torch.arange(B)  # [A, B]: positions a .. a+B-1
        prevs.append(t[at - 1])  # x_{a-1} .. x_{a+B-2}
        labs.append(top[at[:, :-1]] if labels == "target" else t[at[:, 1:]])  # after x_a .. x_{a+B-2}
        bases.append(head.target_ids(logits.argmax(-1)))
        hs.append(h.clone())
        seqs.append(torch.full((len(points),), len(seqs)))
        tokens += len(ids)
    log(f"collected {sum(h.shape[0] for h in hs)} blocks from {tokens} tokens ({time.perf_counter() - start:.0f} s)")
    return torch.cat(hs), torch.cat(prevs), torch.cat(labs), torch.cat(bases), torch.cat(seqs)


def slot_weights(B: int, gamma: float) -> torch.Tensor:
    return torch.exp(-torch.arange(B - 1, dtype=torch.float32) / gamma)  # [B-1]


def loss_of(x: XPressHead, head, hidden, prev, labels, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy of the refined logits and their argmax (target ids) [n, B-1]."""
    logits = x.logits(hidden, prev)  # [n, B-1, Vd]
    want, kept = to_draft_ids(head.w.draft_to_target, labels.reshape(-1), head.config.vocab_size)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), want, reduction="none")  # [n(B-1)]
    w = (weights.expand_as(labels).reshape(-1) * kept).float()
    return (ce * w).sum() / w.sum().clamp(min=1e-9), head.target_ids(logits.argmax(-1))


def accuracy(pred: torch.Tensor, labels: torch.Tensor) -> list[float]:
    return (pred == labels).float().mean(0).tolist()  # per slot


def train(head, target, sequences: list[list[int]], steps: int, rank: int = 256, anchors: int = 32,
          batch: int = 64, lr: float = 2e-3, seed: int = 0, gamma: float = 7.0, labels: str = "target",
          max_blocks: int = 20000, collect_seconds: float | None = None, weight_decay: float = 0.0,
          keep_best: bool = False, log=print) -> XPressWeights:
    """keep_best: every 100 steps measure the held-out accuracy (mean over slots) and return the
    weights of the best check instead of the last step's."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    B = head.block_size
    hidden, prev, lab, base, seq = collect(head, target, sequences, anchors, max_blocks, rng, labels, collect_seconds,
                                           log)
    held = seq % 10 == 0  # every tenth sequence's blocks (blocks of one sequence overlap)
    train_idx = (~held).nonzero()[:, 0]
    init = XPressWeights.init(head.config.hidden_size, rank, B, seed)
    params = {k: torch.nn.Parameter(v.to(head.dtype)) for k, v in init.tensors().items()}
    x = XPressHead(XPressWeights(**params), head, product=F.linear)
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=weight_decay)
    w = slot_weights(B, gamma)
    warm = max(1, steps // 20)
    start, best = time.perf_counter(), None
    for step in range(steps):
        for g in opt.param_groups:  # linear warmup, cosine decay
            g["lr"] = lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        pick = train_idx[torch.randint(0, train_idx.numel(), (min(batch, train_idx.numel()),))]
        loss, _ = loss_of(x, head, hidden[pick], prev[pick], lab[pick], w)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        if step == 0 or (step + 1) % 100 == 0 or step + 1 == steps:
            note = ""
            if keep_best and ((step + 1) % 100 == 0 or step + 1 == steps):
                score = sum(held_accuracy(x, head, hidden[held], prev[held], lab[held], w)) / (B - 1)
                if best is None or score > best[0]:
                    best = (score, step + 1, {k: v.detach().clone() for k, v in params.items()})
                note = f" held-out {score:.3f}"
            log(f"step {step + 1}/{steps} loss {float(loss.detach()):.3f}{note} ({time.perf_counter() - start:.0f} s)")
    if best is not None:
        log(f"kept step {best[1]} (held-out {best[0]:.3f})")
        with torch.no_grad():
            for k, v in best[2].items():
                params[k].copy_(v)
    own = accuracy(base[held], lab[held])
    refined = held_accuracy(x, head, hidden[held], prev[held], lab[held], w)
    log("held-out accuracy per slot (true predecessors): block " + " ".join(f"{a:.3f}" for a in own)
        + " | xpress " + " ".join(f"{a:.3f}" for a in refined))
    return XPressWeights(**{k: v.detach().float() for k, v in params.items()})


@torch.no_grad()
def held_accuracy(x: XPressHead, head, hidden, prev, labels, weights) -> list[float]:
    """Per-slot accuracy of the refined argmax with the true predecessors."""
    preds = torch.cat([loss_of(x, head, hidden[i:i + 256], prev[i:i + 256], labels[i:i + 256], weights)[1]
                       for i in range(0, hidden.shape[0], 256)])
    return accuracy(preds, labels)


def sequences_from(args, target_folder) -> list[list[int]]:
    if args.responses:
        from .lilicorr import read_ids

        return read_ids(args.responses)
    from ..weights.tokenizer import load_tokenizer
    from .data import Encoder, epoch_order, load_corpus

    corpus = load_corpus(args.data, regenerate=False)
    enc = Encoder(load_tokenizer(target_folder), args.seq_len)
    return [e.tokens for item in epoch_order(corpus.items, args.seed, 0) for e in enc.examples(item)]


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="catalog name or model folder of the target")
    p.add_argument("--head", required=True, help="the DFlash head it refines: a folder or a shipped head's name "
                   "(dflash:NAME or NAME)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="training sources (train/data.py: code, code-completions, ...; their own text)")
    src.add_argument("--responses", help="a regenerated.jsonl of this target (lines with `ids`)")
    p.add_argument("--out", required=True, help="output folder (xpress.safetensors); a DFlash head's folder ships it "
                   "beside the head, where `--refiner xpress` finds it")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps over collected blocks (default 1500)")
    p.add_argument("--vocab", type=int, default=8192, help="train through the block head's readout cut to the first N "
                   "token ids (dflash_vocab.py; default 8192, 0: the whole vocabulary). The refiner's weights do not "
                   "depend on the readout: they serve any `dflash:NAME[,vocab=N]`")
    p.add_argument("--rank", type=int, default=256, help="the rank r (default 256, the card's)")
    p.add_argument("--anchors", type=int, default=32, help="blocks drafted per sequence (default 32)")
    p.add_argument("--batch", type=int, default=64, help="blocks per step (default 64)")
    p.add_argument("--max-blocks", type=int, default=20000, help="blocks collected at most (default 20000)")
    p.add_argument("--collect-seconds", type=float, default=None, help="stop collecting after this long")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence from --data (default 512)")
    p.add_argument("--labels", choices=("target", "text"), default="target",
                   help="target: the target's own argmax after each prefix (default); text: the next token")
    p.add_argument("--gamma", type=float, default=7.0, help="slot k's loss weight is exp(-(k-1)/gamma) (default 7)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate (default 2e-3)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--keep-best", action="store_true", help="check the held-out accuracy every 100 steps and keep "
                   "the best check's weights (default: the last step's)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, sequence and anchor order (default 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def run(args) -> int:
    from ..catalog.resolve import resolve_model
    from ..drafters.dflash import parse_argument
    from ..heads.dflash.format import load_dflash
    from ..weights.loader import load_decoder

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.target)
    target = load_decoder(folder, "cpu")
    head = load_dflash(parse_argument(args.head.removeprefix("dflash:")), target)
    if args.vocab:
        from ..drafters.dflash_vocab import reduce_readout

        head = reduce_readout(head, folder, args.vocab)
    w = train(head, target, sequences_from(args, folder), args.steps, args.rank, args.anchors, args.batch, args.lr,
              args.seed, args.gamma, args.labels, args.max_blocks, args.collect_seconds, args.weight_decay,
              args.keep_best)
    print(w.save(args.out))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="outrider train xpress", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
