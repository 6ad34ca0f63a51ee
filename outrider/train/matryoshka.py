"""`outrider train matryoshka`: a Matryoshka suite of nested Llama-shaped models trained from scratch on
code, jointly (cross-entropy per slice plus distillation from the largest: train/matryoshka_model.py),
or with --independent one model per slice size at the same token budget (the baseline).

Data: the `code` source (train/data.py: the standard library's .py files, tests and code-edit
modules out), its items sorted by id with every tenth (index % 10 == 9) held out for validation;
tokens from the base model's tokenizer cut to its first --vocab ids (train/cut_vocab.py). Per step
one batch of --batch-size chunks of --seq-len tokens drawn at random from a buffer of the next
--shuffle-buffer chunks in the seeded order (data.Stream), AdamW
(weight decay 0.1 on matrices), linear warmup then cosine decay to a tenth, gradients clipped.

    OUT/config.json, model.safetensors, tokenizer files   the suite (its largest slice; config.json
                          lists the slices: `--drafter matryoshka[:K]` drafts with them)
    OUT/slice-K/          with --independent: the K-th size's own model (a plain Llama folder)
    OUT/train_info.json   command, data, seed, tokens, seconds, validation perplexity per slice
    OUT/train_log.jsonl   one line every --log-every steps: step, loss, ce per slice, kl, lr, elapsed_s
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.matryoshka import Slice

DEFAULT_SLICES = "2/2/128,4/4/256,6/6/512"


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--base", default="smollm2-135m-instruct",
                   help="catalog name or folder whose tokenizer is cut (default smollm2-135m-instruct)")
    p.add_argument("--vocab", type=int, default=4096, help="the tokenizer's first N ids kept (default 4096)")
    p.add_argument("--hidden", type=int, default=192, help="hidden size E, shared by every slice (default 192)")
    p.add_argument("--head-dim", type=int, default=32, help="head dimension D (default 32)")
    p.add_argument("--slices", type=_slices, default=_slices(DEFAULT_SLICES), metavar="L/H/F,...",
                   help=f"slices smallest first, layers/heads/FFN neurons each (default {DEFAULT_SLICES})")
    p.add_argument("--independent", action="store_true",
                   help="train one model per slice size instead (the baseline), each on the same batches")
    p.add_argument("--weights", type=_floats, default=None, metavar="W1,W2,...",
                   help="each slice's cross-entropy weight, smallest first (default 1 each)")
    p.add_argument("--kd", type=float, default=1.0, help="weight of the distillation from the largest (default 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (default 1)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (default 256)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (default 5%% of the steps)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (default 1)")
    p.add_argument("--val-sequences", type=int, default=32, help="held-out chunks for perplexity (default 32)")
    p.add_argument("--shuffle-buffer", type=int, default=512,
                   help="examples the batches are drawn from at random (default 512; 1: stream order)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order (default 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines (default 10)")


def _floats(text: str) -> list[float]:
    import argparse

    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _slices(text: str) -> list[Slice]:
    import argparse

    try:
        slices = [Slice(*(int(x) for x in part.split("/"))) for part in text.split(",")]
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected L/H/F,... (layers/heads/FFN per slice), got {text!r}") from None
    for a, b in zip(slices, slices[1:]):
        if a.layers > b.layers or a.heads > b.heads or a.ffn > b.ffn:
            raise argparse.ArgumentTypeError(f"slice {a} is not nested in the next one, {b}: give them smallest first")
    if min(min(s.layers, s.heads, s.ffn) for s in slices) < 1:
        raise argparse.ArgumentTypeError("every slice needs at least one layer, head and FFN neuron")
    return slices


def split_items(items: list) -> tuple[list, list]:
    """(training items, held-out items): sorted by id, every tenth (index % 10 == 9) held out."""
    ordered = sorted(items, key=lambda i: i.id)
    return ([i for n, i in enumerate(ordered) if n % 10 != 9], [i for n, i in enumerate(ordered) if n % 10 == 9])


def pad(examples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """data.Example list -> tokens [B, T] long, mask [B, T] bool (padding: token 0, not a label)."""
    T = max(len(e.tokens) for e in examples)
    tokens = torch.zeros(len(examples), T, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.bool)
    for b, e in enumerate(examples):
        tokens[b, : len(e.tokens)] = torch.tensor(e.tokens)
        mask[b, : len(e.tokens)] = torch.tensor(e.mask)
    return tokens, mask


def shuffled(stream, batch_size: int, buffer: int, seed: int):
    """Batches of `batch_size` examples drawn at random (seeded) from a buffer of the stream's next
    `buffer` examples, refilled as it empties: a long file's chunks, consecutive in the stream, are
    spread over many batches instead of filling one (yields (None, examples) like data.batches)."""
    g = torch.Generator().manual_seed(seed)
    it = stream.examples()
    pool = []
    while True:
        while len(pool) < buffer:
            pool.append(next(it)[1])
        picks = sorted(torch.randperm(len(pool), generator=g)[:batch_size].tolist(), reverse=True)
        yield None, [pool.pop(i) for i in picks]


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def perplexity(model, s: Slice, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """exp of the mean next-token cross-entropy of slice s over the held-out batches."""
    import torch.nn.functional as F

    total, count = 0.0, 0
    for tokens, mask in val:
        logits = model(tokens[:, :-1], s)
        ce = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        keep = mask[:, 1:].flatten()
        total += float((ce * keep).sum())
        count += int(keep.sum())
    return math.exp(total / max(1, count))


def run(args) -> int:
    from ..catalog.resolve import resolve_model
    from ..weights.tokenizer import load_tokenizer
    from .cut_vocab import cut_tokenizer
    from .data import Corpus, Encoder, Stream, load_corpus
    from .matryoshka_model import NestedLM, joint_loss

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty: give a new folder")
    slices = args.slices
    if args.steps < 1:
        raise ConfigError("--steps must be positive")
    weights = args.weights or [1.0] * len(slices)
    if len(weights) != len(slices):
        raise ConfigError(f"--weights gives {len(weights)} numbers for {len(slices)} slices")
    began = time.perf_counter()
    cut_tokenizer(resolve_model(args.base), args.vocab, out)
    tokenizer = load_tokenizer(out)
    corpus = load_corpus("code", regenerate=False)
    train_items, held = split_items(corpus.items)
    encoder = Encoder(tokenizer, args.seq_len)
    val_examples = [e for item in held for e in encoder.examples(item)[:1]][: args.val_sequences]
    val = [pad(val_examples[i:i + 8]) for i in range(0, len(val_examples), 8)]
    stream = Stream(Corpus(train_items, 0, corpus.sources), encoder, args.seed)
    big = slices[-1]
    make = lambda s: NestedLM(args.vocab, args.hidden, s.layers, s.heads, args.head_dim, s.ffn, seed=args.seed)  # noqa: E731
    if args.independent:  # one model a size, each its own single slice, CE only
        runs = [(make(s), [s]) for s in slices]
    else:
        runs = [(make(big), slices)]
    optimizers = []
    for model, _ in runs:
        decay = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        optimizers.append(torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95)))
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
    log = (out / "train_log.jsonl").open("w")
    tokens_seen, start = 0, time.perf_counter()
    it = shuffled(stream, args.batch_size, args.shuffle_buffer, args.seed)
    for step in range(args.steps):
        _, examples = next(it)
        tokens, mask = pad(examples)
        tokens_seen += int(mask.sum())
        lr = lr_at(step, args.steps, warmup, args.lr)
        record = {"step": step + 1, "tokens": tokens_seen, "lr": lr, "ce": [], "kl": []}
        for (model, own), opt in zip(runs, optimizers):
            for group in opt.param_groups:
                group["lr"] = lr
            loss, terms = joint_loss(model, tokens, mask, own, [1.0] if args.independent else weights,
                                     0.0 if args.independent else args.kd,
                                     args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            record["ce"] += terms["ce"]
            record["kl"] += terms["kl"]
        record["elapsed_s"] = round(time.perf_counter() - start, 2)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(f"step {step + 1}/{args.steps} ce {' '.join(f'{c:.3f}' for c in record['ce'])} "
                  f"kl {' '.join(f'{k:.3f}' for k in record['kl'])} {record['elapsed_s']:.0f}s", file=sys.stderr)
    seconds = time.perf_counter() - start
    ppl = {}
    recipe = {"command": ["outrider"] + sys.argv[1:], "seed": args.seed, "data": corpus.sources,
              "held_out_rule": "code items sorted by id, index % 10 == 9", "base_tokenizer": args.base,
              "vocab": args.vocab, "slices": [s.to_json() for s in slices], "independent": args.independent,
              "kd": 0.0 if args.independent else args.kd, "weights": None if args.independent else weights, "temperature": args.temperature, "steps": args.steps,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
              "shuffle_buffer": args.shuffle_buffer, "hidden": args.hidden, "head_dim": args.head_dim,
              "tokens_per_model": tokens_seen, "train_seconds": round(seconds, 1), "threads": torch.get_num_threads(),
              "torch": torch.__version__}
    if args.independent:
        for k, ((model, own), s) in enumerate(zip(runs, slices), 1):
            folder = out / f"slice-{k}"
            model.save(folder)
            cut_tokenizer(resolve_model(args.base), args.vocab, folder)
            ppl[f"slice-{k}"] = perplexity(model, s, val)
    else:
        model = runs[0][0]
        model.save(out, slices)
        for k, s in enumerate(slices, 1):
            ppl[f"slice-{k}"] = perplexity(model, s, val)
    recipe["val_perplexity"] = {k: round(v, 3) for k, v in ppl.items()}
    recipe["val_tokens"] = sum(int(m[:, 1:].sum()) for _, m in val)
    recipe["total_seconds"] = round(time.perf_counter() - began, 1)
    (out / "train_info.json").write_text(json.dumps(recipe, indent=1) + "\n")
    print(f"validation perplexity: {recipe['val_perplexity']}", file=sys.stderr)
    return 0
