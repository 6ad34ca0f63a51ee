"""Make a gated-delta hybrid from a Llama model: replace most attention layers by gated-delta
mixers (train/delta_train.py), each started from its attention layer's projections and distilled
alone, in layer order, on real text (the Python standard library's sources).

    python -m outrider.train.distill_hybrid            # the shipped run (smollm2-135m-gdn)
    python -m outrider.train.distill_hybrid --smoke --base TINY_FOLDER --out DIR   # seconds

Per layer l, in order (sequential distillation): every training sequence's residual stream of the
hybrid so far (layers < l already replaced) is normed; an attention layer that stays runs as is; a
replaced one's target is the original attention's output on that same input, and the mixer is
trained to reproduce it (MSE over the target's mean square: "nmse"), so each mixer learns on the
inputs it will see and later layers absorb earlier ones' errors only through their own inputs. Held-out
sequences (the last `--val`) give each layer's nmse before and after training, and at the end the
teacher's and the hybrid's perplexity and top-1 agreement on them.

Writes to --out: gdn-0000k-of-0000n.safetensors (the new layers only, float16, under Hugging
Face names), hybrid.json (what catalog/composed.py adds to the base's config.json) and
recipe.json (command, data, seed, figures, sha256 of every weight file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..models.config import DeltaConfig
from ..models.llama_hybrid import ARCHITECTURE
from .delta_train import DeltaMixer
from .llama_teacher import LlamaLayers
from .sources import stdlib_files

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "shipped" / "smollm2-135m-gdn"
HELD_OUT_EVERY = 10  # stdlib file i (sorted) with i % 10 == 9 is held out for evaluation, never trained on


def split_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the stdlib at `root` (train/sources.py's selection)."""
    files = stdlib_files(root)
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held


def windows(files: list[Path], tokenizer, count: int, length: int, seed: int) -> torch.Tensor:
    """`count` windows of `length` tokens, one per file (files in a seeded order, a seeded offset
    in each; files shorter than a window skipped): long [count, length]."""
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    out = []
    for path in order:
        if len(out) == count:
            break
        try:
            text = path.read_text(encoding="utf-8")[:200_000]
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            continue
        start = rng.randrange(len(ids) - length + 1)
        out.append(ids[start:start + length])
    if len(out) < count:
        raise SystemExit(f"only {len(out)} files of at least {length} tokens for {count} windows")
    return torch.tensor(out, dtype=torch.long)


def kept(layers: int, every: int) -> list[bool]:
    """Which layers keep attention: i % every == 0 (the first layer, then every `every`-th)."""
    return [i % every == 0 for i in range(layers)]


def _batched(fn, x: torch.Tensor, size: int = 8) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([fn(x[i:i + size]) for i in range(0, x.shape[0], size)])


def train_mixer(mixer: DeltaMixer, hn, target, val_hn, val_target, steps: int, batch: int, lr: float,
                gen: torch.Generator, log) -> dict:
    """Adam on nmse with a cosine schedule; returns the validation nmse before (after the output's
    scale is fitted) and after."""
    scale = target.pow(2).mean()

    def val_nmse() -> float:
        return float(_batched(mixer, val_hn).sub(val_target).pow(2).mean() / scale)

    with torch.no_grad():  # the output's scale fitted first (least squares on a batch): nmse <= 1 from the start
        y, t = mixer(hn[:batch]), target[:batch]
        mixer.out.mul_((y * t).sum() / (y * y).sum().clamp_min(1e-12))
    before = val_nmse()
    opt = torch.optim.Adam(mixer.parameters(), lr=lr)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))
        pick = torch.randint(0, hn.shape[0], (batch,), generator=gen)
        loss = (mixer(hn[pick]) - target[pick]).pow(2).mean() / scale
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mixer.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            log(f"    step {step}: train nmse {loss.item():.4f}")
    return {"val_nmse_init": round(before, 5), "val_nmse": round(val_nmse(), 5)}


def _nll_and_top1(teacher: LlamaLayers, x: torch.Tensor, tokens: torch.Tensor):
    logits = _batched(teacher.logits, x, 2)[:, :-1]  # [N, T - 1, V]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return float(nll), logits.argmax(-1)


def distill(args, log=print) -> dict:
    from ..catalog.resolve import resolve_model
    from ..weights.tokenizer import load_tokenizer

    torch.manual_seed(args.seed)
    base = resolve_model(args.base)
    raw = json.loads((base / "config.json").read_text())
    tensors = load_file(str(base / "model.safetensors"))
    teacher = LlamaLayers(tensors, raw)
    tokenizer = load_tokenizer(base)
    root = Path(args.data_root)
    train_files, held_files = split_files(root)
    data = windows(train_files, tokenizer, args.sequences + args.val, args.seq_len, args.seed)
    train_tokens, val_tokens = data[:args.sequences], data[args.sequences:]
    cfg = DeltaConfig(teacher.KV, teacher.KV, teacher.D, teacher.D, args.conv)
    keep = kept(teacher.layers, args.keep_every)
    log(f"{len(train_files)} training files, {len(held_files)} held out; {args.sequences} x {args.seq_len} tokens "
        f"to train, {args.val} to validate; attention kept at layers {[i for i, k in enumerate(keep) if k]}")
    start = time.time()
    x = teacher.embed[data]  # [N, T, E] the hybrid's residual stream (training and validation sequences)
    x_teacher = x[args.sequences:].clone()  # the original model on the validation sequences
    mixers: dict[int, DeltaMixer] = {}
    figures = {}
    gen = torch.Generator().manual_seed(args.seed)
    n = args.sequences
    for layer in range(teacher.layers):
        hn = _batched(lambda t: teacher.input_norm(layer, t), x)
        x_teacher = _batched(lambda t: teacher.mlp_block(layer, t + teacher.attention(layer, teacher.input_norm(layer, t))),
                             x_teacher)
        target = _batched(lambda t: teacher.attention(layer, t), hn)
        if keep[layer]:
            y = target
        else:
            p = lambda name: teacher.p(layer, "self_attn." + name)  # noqa: E731
            mixer = DeltaMixer.from_attention(p("q_proj.weight"), p("k_proj.weight"), p("v_proj.weight"),
                                              p("o_proj.weight"), teacher.H, teacher.KV, cfg, teacher.eps,
                                              hn[:n].mean((0, 1)))
            t0 = time.time()
            figures[layer] = train_mixer(mixer, hn[:n], target[:n], hn[n:], target[n:], args.steps, args.batch,
                                         args.lr, gen, log)
            mixer.load_state_dict({k: v.half().float() for k, v in mixer.state_dict().items()})  # as shipped
            figures[layer]["seconds"] = round(time.time() - t0, 1)
            log(f"  layer {layer}: val nmse {figures[layer]['val_nmse_init']} -> {figures[layer]['val_nmse']} "
                f"({figures[layer]['seconds']} s)")
            mixers[layer] = mixer
            y = _batched(mixer, hn)
        x = _batched(lambda t: teacher.mlp_block(layer, t), x + y)
        del hn, target, y
    nll_teacher, top_teacher = _nll_and_top1(teacher, x_teacher, val_tokens)
    nll_hybrid, top_hybrid = _nll_and_top1(teacher, x[n:], val_tokens)
    summary = {"val_ppl_base": round(math.exp(nll_teacher), 3), "val_ppl_hybrid": round(math.exp(nll_hybrid), 3),
               "val_top1_agreement": round(float((top_teacher == top_hybrid).float().mean()), 4),
               "seconds": round(time.time() - start, 1)}
    log(f"validation: ppl base {summary['val_ppl_base']}, hybrid {summary['val_ppl_hybrid']}, "
        f"top-1 agreement {summary['val_top1_agreement']}; {summary['seconds']} s")
    _write(args, raw, cfg, keep, mixers, figures, summary, root, len(train_files), len(held_files))
    return summary


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(args, raw, cfg, keep, mixers, figures, summary, root, n_train, n_held) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("gdn-*.safetensors"):
        old.unlink()
    layers = sorted(mixers)
    parts = max(1, math.ceil(len(layers) / args.layers_per_file))
    names = []
    for k in range(parts):
        chunk = layers[k * args.layers_per_file:(k + 1) * args.layers_per_file]
        tensors = {}
        for layer in chunk:
            tensors.update(mixers[layer].tensors(f"model.layers.{layer}.", torch.float16))
        name = f"gdn-{k + 1:05d}-of-{parts:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        names.append(name)
    hybrid = {"architectures": [ARCHITECTURE], "model_type": "llama_hybrid",
              "layer_types": ["full_attention" if k else "linear_attention" for k in keep],
              "linear_num_key_heads": cfg.num_k_heads, "linear_num_value_heads": cfg.num_v_heads,
              "linear_key_head_dim": cfg.k_head_dim, "linear_value_head_dim": cfg.v_head_dim,
              "linear_conv_kernel_dim": cfg.conv_kernel}
    (out / "hybrid.json").write_text(json.dumps(hybrid, indent=1) + "\n")
    recipe = {
        "command": " ".join(["python -m outrider.train.distill_hybrid", *(sys.argv[1:] if args.record_argv else [])]),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "record_argv")},
        "base": args.base, "seed": args.seed,
        "data": {"source": f"Python {sys.version.split()[0]} standard library .py files under {root} "
                           "(train/sources.py stdlib_files: tests and code-edit modules excluded)",
                 "training_files": n_train, "held_out_files": n_held,
                 "held_out_rule": f"sorted file index i with i % {HELD_OUT_EVERY} == {HELD_OUT_EVERY - 1}",
                 "windows": f"{args.sequences} training + {args.val} validation windows of {args.seq_len} tokens, "
                            "one per training file, files and offsets drawn with the seed"},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "layers": {str(k): v for k, v in figures.items()}, "summary": summary,
        "files": {name: _sha256(out / name) for name in names},
    }
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m outrider.train.distill_hybrid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="smollm2-135m-instruct", help="catalog name or Llama model folder")
    ap.add_argument("--out", default=str(SHIPPED))
    ap.add_argument("--data-root", default=sysconfig.get_paths()["stdlib"], help="a folder of .py files")
    ap.add_argument("--keep-every", type=int, default=4, help="attention stays at layers i %% N == 0")
    ap.add_argument("--conv", type=int, default=4, help="the gated-delta convolution's taps")
    ap.add_argument("--sequences", type=int, default=96, help="training windows")
    ap.add_argument("--val", type=int, default=8, help="validation windows")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300, help="Adam steps per layer")
    ap.add_argument("--batch", type=int, default=4, help="windows per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers-per-file", type=int, default=11, help="new layers per safetensors file (<= 25 MB)")
    ap.add_argument("--smoke", action="store_true", help="a few seconds: 4 + 2 windows of 64 tokens, 3 steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sequences, args.val, args.seq_len, args.steps, args.batch = 4, 2, 64, 3, 2
    args.record_argv = argv is None
    return args


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    distill(args, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
