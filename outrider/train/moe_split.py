"""Make a mixture of experts from a dense model (issue 41 item 2): each layer's FFN neurons grouped
into E equal experts by co-activation on real text, a linear router fitted to choose them, written
in the Qwen2-MoE layout (train/moe_checkpoint.py says why that layout and what "every expert
active" equals).

    python -m outrider.train.moe_split --base smollm2-135m-instruct --experts 8 --out DIR

Recipe (deterministic for a seed, one CPU thread):
  data    windows of the Python standard library's sources (train/distill_hybrid.py's split of
          files: every 10th file held out, never used here), --sequences x --seq-len tokens
  1. the dense model runs on them once; each layer's MLP input x [N, H] (post-attention norm)
     and intermediate activations a = silu(x gate^T) * (x up^T) [N, I] are kept
  2. neurons clustered (balanced k-means, cosine of the columns of |a|, seeded start): E groups
     of I/E neurons that fire on the same tokens
  3. the router: per token, expert e's importance r[n, e] = ||a[n, e's] down[:, e's]^T|| (the
     norm of what it adds to the stream); least squares fits logits x . W^T to r centred per token
     (softmax ignores a per-token shift), then W is scaled so the logits' largest per-token spread
     (max - min) is --spread (moe_checkpoint.py: the chosen experts' weights are then 1 +- ~spread)
     With --shared S, the S neurons of the largest mean square contribution form an always-active
     shared expert first, and the rest are clustered.
  4. written: config.json, model.safetensors (float32), the tokenizer files, split.safetensors
     in split/ (the neurons' order and the router: enough to rebuild without steps 1-3, --split)
     and recipe.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .moe_checkpoint import Split, check_dense, moe_config, moe_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def balanced_kmeans(feats: torch.Tensor, k: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    """feats [I, D] (rows unit-norm) -> assignment [I] long, each of the k clusters holding I/k rows:
    k-means on cosine similarity whose assignment step fills clusters greedily, most similar
    (row, cluster) pairs first, each cluster up to I/k."""
    n = feats.shape[0]
    cap = n // k
    centres = feats[torch.randperm(n, generator=gen)[:k]].clone()  # [k, D]
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        sim = feats @ centres.T  # [I, k]
        assign = _fill(sim, cap)
        for c in range(k):
            centres[c] = F.normalize(feats[assign == c].mean(0), dim=0)
    return assign


def _fill(sim: torch.Tensor, cap: int) -> torch.Tensor:
    """sim [I, k] -> [I]: each row to a cluster, most similar pairs first, no cluster over cap."""
    n, k = sim.shape
    assign = [-1] * n
    counts = [0] * k
    for flat in torch.argsort(sim.flatten(), descending=True, stable=True).tolist():
        i, c = divmod(flat, k)
        if assign[i] < 0 and counts[c] < cap:
            assign[i] = c
            counts[c] += 1
    return torch.tensor(assign, dtype=torch.long)


def importance(a: torch.Tensor, down: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """a [N, I], down [H, I], perm [I] (expert order) -> r [N, k]: the norm of each expert's output."""
    n = a.shape[1] // k
    cols = [perm[e * n:(e + 1) * n] for e in range(k)]
    return torch.stack([(a[:, c] @ down[:, c].T).norm(dim=-1) for c in cols], dim=-1)


def fit_router(x: torch.Tensor, r: torch.Tensor, spread: float) -> torch.Tensor:
    """x [N, H], r [N, E] -> W [E, H]: least squares of x W^T on r centred per row, scaled so the
    logits' largest per-row spread (max - min) on x is `spread`."""
    target = r - r.mean(dim=1, keepdim=True)  # [N, E]
    w = torch.linalg.lstsq(x.double(), target.double()).solution.T.float()  # [E, H]
    logits = x @ w.T  # [N, E]
    width = (logits.max(dim=1).values - logits.min(dim=1).values).max()
    return w * (spread / float(width))


def mass_captured(logits: torch.Tensor, r: torch.Tensor, k: int) -> float:
    """The share of all experts' output norm held by the k experts the logits choose."""
    chosen = torch.topk(logits, k, dim=-1)[1]
    return float(r.gather(1, chosen).sum() / r.sum())


def collect(model, tokens: torch.Tensor, batch: int = 8) -> list[torch.Tensor]:
    """The dense transformers model's MLP inputs on tokens [S, T]: per layer x [S*T, H]."""
    layers = model.model.layers
    got: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, args, l=l: got[l].append(args[0].reshape(-1, args[0].shape[-1])))
             for l, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for s in range(0, tokens.shape[0], batch):
                model(tokens[s:s + batch])
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(g) for g in got]


def make_split(dense: dict, raw: dict, xs: list[torch.Tensor], experts: int, spread: float, seed: int,
               shared: int = 0, iters: int = 12, log=print) -> tuple[Split, list[dict]]:
    """Steps 2 and 3 for every layer: (the split, per-layer figures on the fitting tokens)."""
    gen = torch.Generator().manual_seed(seed)
    perms, routers, figures = [], [], []
    for l, x in enumerate(xs):
        p = f"model.layers.{l}.mlp."
        a = F.silu(x @ dense[p + "gate_proj.weight"].T) * (x @ dense[p + "up_proj.weight"].T)  # [N, I]
        down = dense[p + "down_proj.weight"]  # [H, I]
        contrib = (a * down.norm(dim=0)).square().mean(0)  # [I] each neuron's mean square contribution
        order = torch.argsort(contrib, descending=True, stable=True)
        top, rest = order[:shared], order[shared:]  # the shared expert's neurons; the routed ones
        assign = balanced_kmeans(F.normalize(a[:, rest].abs().T, dim=1), experts, iters, gen)  # [I - S]
        routed = rest[torch.argsort(assign, stable=True)]  # [I - S] expert 0's neurons first
        r = importance(a[:, routed], down[:, routed], torch.arange(len(routed)), experts)  # [N, E]
        perm = torch.cat([top, routed])
        w = fit_router(x, r, spread)
        logits = x @ w.T
        fig = {"layer": l, **{f"mass_top{k}": round(mass_captured(logits, r, k), 4) for k in (1, 2, 4)},
               **{f"oracle_top{k}": round(mass_captured(r, r, k), 4) for k in (1, 2, 4)}}
        log(f"  layer {l}: router holds {fig['mass_top2']} of the output norm at top-2 (oracle {fig['oracle_top2']})")
        figures.append(fig)
        perms.append(perm)
        routers.append(w)
    return Split(torch.stack(perms), torch.stack(routers), shared), figures


def build(args, log=print) -> dict:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from ..catalog.resolve import resolve_model
    from ..weights.tokenizer import load_tokenizer
    from .distill_hybrid import split_files, windows

    torch.manual_seed(args.seed)
    base = resolve_model(args.base)
    raw = json.loads((base / "config.json").read_text())
    check_dense(raw, args.experts, args.shared)
    dense = load_file(str(base / "model.safetensors"))
    out = Path(args.out).expanduser()
    t0 = time.time()
    if args.split:
        split_t = load_file(args.split)
        split, figures = Split(split_t["perm"].long(), split_t["router"], int(split_t["shared"])), []
        log(f"split read from {args.split}")
    else:
        train_files, _ = split_files(Path(args.data_root))
        tokens = windows(train_files, load_tokenizer(base), args.sequences, args.seq_len, args.seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        xs = collect(model, tokens)
        del model
        log(f"{tokens.numel()} tokens of {len(train_files)} stdlib files; clustering {raw['num_hidden_layers']} layers")
        split, figures = make_split(dense, raw, xs, args.experts, args.spread, args.seed, args.shared, log=log)
    out.mkdir(parents=True, exist_ok=True)
    save_file(moe_tensors(dense, raw, split), str(out / "model.safetensors"))
    (out / "split").mkdir(exist_ok=True)  # not beside the model's tensors: loaders read every *.safetensors there
    save_file({"perm": split.perm.to(torch.int32).contiguous(), "router": split.router.contiguous(),
               "shared": torch.tensor(split.shared)},
              str(out / "split" / "split.safetensors"))
    (out / "config.json").write_text(json.dumps(moe_config(raw, args.experts, args.top_k, split.shared), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    recipe = {"command": "python -m outrider.train.moe_split " + " ".join(sys.argv[1:]) if args.cli else None,
              "base": args.base, "experts": args.experts, "shared": split.shared, "top_k": args.top_k, "seed": args.seed,
              "sequences": args.sequences, "seq_len": args.seq_len, "spread": args.spread,
              "data": f"{args.data_root}: stdlib .py files, every 10th (sorted) held out",
              "seconds": round(time.time() - t0, 1), "layers": figures}
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    recipe["model_sha256"] = _sha256(out / "model.safetensors")
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    log(f"written to {out} in {recipe['seconds']} s")
    return recipe


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m outrider.train.moe_split", description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="smollm2-135m-instruct", help="a packaged dense model (Llama or Qwen2)")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer (a power of two keeps 1/E exact)")
    ap.add_argument("--shared", type=int, default=0, help="neurons of the largest contribution kept in an always-active shared expert")
    ap.add_argument("--top-k", type=int, default=2, help="num_experts_per_tok written to config.json")
    ap.add_argument("--out", required=True, help="the folder to write")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--spread", type=float, default=1e-3, help="the router logits' largest per-token spread (max - min)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default=None, help="a split.safetensors to reuse (skips clustering and fitting)")
    ap.add_argument("--data-root", default=sysconfig.get_paths()["stdlib"])
    args = ap.parse_args(argv)
    args.cli = argv is None
    return args


def main(argv=None) -> int:
    torch.set_num_threads(1)
    build(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
