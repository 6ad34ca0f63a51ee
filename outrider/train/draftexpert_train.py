"""Self-distil DraftExpert's draft experts (models/draft_experts.py) from a frozen MoE target.

    python -m outrider.train.draftexpert_train --moe DIR --out FILE [--size 64] [--sequences 48]
        [--seq-len 128] [--steps 400] [--seed 0]

Data: windows of the Python standard library's .py files (train/distill_hybrid.py's selection,
every 10th file held out; the data train/moe_split.py split the packaged models on). The target's
forward over them gives each MoE layer's input rows x (RouterWatch). Per MoE layer l the target
adds M(x) (its top-k experts and the shared expert) and the draft without a draft expert adds
B(x) (the top-1 expert and the shared expert); the draft expert D_l is fitted so that

    g(x) * D_l(x) ~ M(x) - B(x)          (the residual loss, mean squared error, Adam)

g(x) the shared expert's gate where the target has one, else 1 (the draft expert sits under it:
draft_experts.py). The inputs are the target's own (teacher-forced); the card's logit and
router-agreement losses are not used (docs/methods.md, DraftExpert). Each layer's fit is reported as
the residual's share left unexplained on the held-out rows (1 - R^2), and the whole draft by its
next-token agreement with the target on held-out windows, beside the draft without a draft expert
and the draft with neither shared nor draft expert (the card's three drafts).

Deterministic on one thread: a seeded init and seeded minibatches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..models.batch import pack
from ..models.draft_experts import DraftExperts, DraftLayers, RouterWatch, moe_layers
from ..models.layers import linear, swiglu_mlp
from ..models.moe_layer import moe_mlp


def init_experts(target, size: int, seed: int, scale: float = 1.0) -> DraftExperts:
    """Random draft experts of `size` neurons for each MoE layer of `target` (seeded): gate and up
    rows ~ N(0, scale / E), down ~ N(0, 1e-3 scale)."""
    gen = torch.Generator().manual_seed(seed)
    E = target.config.hidden_size
    gate_up, down = {}, {}
    for l in moe_layers(target):
        gate_up[l] = torch.randn(2 * size, E, generator=gen) * (scale / E ** 0.5)
        down[l] = torch.randn(E, size, generator=gen) * (1e-3 * scale)
    router = target.layers[moe_layers(target)[0]].moe.router.float().clone()
    return DraftExperts(gate_up, down, router, {"hidden_size": str(E), "num_layers": str(target.config.num_layers),
                                                "num_experts": str(target.config.moe.num_experts)})


def layer_inputs(target, windows: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each MoE layer's input rows over the windows [S, T]: {layer: [S T, E]} (target forwards)."""
    rows: dict[int, list] = {l: [] for l in moe_layers(target)}
    saved = [w.moe.router for w in target.layers if w.moe is not None]

    def sink(layer, x, logits):
        rows[layer].append(x.detach().float().clone())

    try:
        for l in rows:
            target.layers[l].moe.router = RouterWatch(target.layers[l].moe.router, l, sink)
        for seq in windows:
            cache = target.new_cache(1, len(seq) + 1)
            target.forward(pack([0], [0], [seq], logits="none", scratch_row=cache.scratch_row), cache)
    finally:
        for l, r in zip(rows, saved):
            target.layers[l].moe.router = r
    return {l: torch.cat(v) for l, v in rows.items()}


def residual_targets(target, layer: int, x: torch.Tensor, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, E] -> (M(x) - B(x) [M, E], g(x) [M, 1]): what the draft expert stands in for, and its gate."""
    w, cfg = target.layers[layer].moe, target.config.moe
    out, gates = [], []
    with torch.no_grad():
        for part in x.split(chunk):
            part = part.to(target.dtype)
            full = moe_mlp(w, cfg, part)  # [m, E]
            base = moe_mlp(w, replace(cfg, top_k=1), part)  # [m, E]
            out.append((full - base).float())
            g = torch.sigmoid(linear(part, w.shared_gate)).float() if w.shared_gate is not None \
                else torch.ones(part.shape[0], 1)
            gates.append(g)
    return torch.cat(out), torch.cat(gates)


def fit_layer(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, r: torch.Tensor, g: torch.Tensor,
              steps: int, batch: int, lr: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam on the mean squared error of g * SwiGLU(x) against r (x, r [M, E], g [M, 1])."""
    gu = gate_up.clone().requires_grad_(True)
    dn = down.clone().requires_grad_(True)
    opt = torch.optim.Adam([gu, dn], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        at = torch.randint(0, x.shape[0], (min(batch, x.shape[0]),), generator=gen)
        loss = ((g[at] * swiglu_mlp(x[at], gu, dn) - r[at]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return gu.detach(), dn.detach()


def unexplained(gate_up, down, x, r, g) -> float:
    """1 - R^2: the residual's squared norm left after the draft expert, as a share of it."""
    with torch.no_grad():
        left = ((g * swiglu_mlp(x, gate_up, down) - r) ** 2).sum()
    return float(left / (r ** 2).sum().clamp_min(1e-30))


def train(target, windows: torch.Tensor, held: torch.Tensor, size: int, steps: int, seed: int,
          batch: int = 512, lr: float = 3e-3, log=print) -> tuple[DraftExperts, dict]:
    """The fitted draft experts and the figures (per layer 1 - R^2 before and after, held out)."""
    torch.manual_seed(seed)
    experts = init_experts(target, size, seed)
    xs, xs_held = layer_inputs(target, windows), layer_inputs(target, held)
    figures = []
    for l in moe_layers(target):
        r, g = residual_targets(target, l, xs[l])
        r_h, g_h = residual_targets(target, l, xs_held[l])
        x, x_h = xs[l].float(), xs_held[l].float()
        before = unexplained(experts.gate_up[l], experts.down[l], x_h, r_h, g_h)
        gu, dn = fit_layer(experts.gate_up[l], experts.down[l], x, r, g, steps, batch, lr, seed + l)
        experts.gate_up[l], experts.down[l] = gu, dn
        row = {"layer": l, "unexplained_before": round(before, 4), "unexplained_after": round(unexplained(gu, dn, x_h, r_h, g_h), 4)}
        figures.append(row)
        log(json.dumps(row))
    return experts, {"layers": figures}


def agreement(target, experts: DraftExperts, windows: torch.Tensor) -> dict:
    """Next-token agreement with the target (teacher-forced, every position of the windows) of
    the draft: top-1 only, top-1 + shared, top-1 + shared + draft expert."""
    def logits_of(config, layers):
        dec = _with(target, config, layers)
        out = []
        for seq in windows:
            cache = dec.new_cache(1, len(seq) + 1)
            out.append(dec.forward(pack([0], [0], [seq], scratch_row=cache.scratch_row), cache).logits[0].argmax(-1))
        return torch.cat(out)

    ref = logits_of(target.config, target.layers)
    draft = DraftLayers(experts)
    cfg1 = draft.config(target.config)
    plain = [w if w.moe is None else replace(w, moe=replace(w.moe)) for w in target.layers]
    no_shared = [w if w.moe is None else replace(w, moe=replace(w.moe, shared_gate_up=None, shared_down=None,
                                                                shared_gate=None)) for w in target.layers]
    rows = {"top1": logits_of(cfg1, no_shared), "top1+shared": logits_of(cfg1, plain),
            "top1+shared+draft": logits_of(cfg1, draft.layers(target))}
    return {k: round(float((v == ref).float().mean()), 4) for k, v in rows.items()}


def _with(target, config, layers):
    import copy

    dec = copy.copy(target)
    dec._native, dec._linear_paths_chosen = None, True
    dec.config, dec.layers = config, layers
    return dec


def parse(argv=None) -> argparse.Namespace:
    import sysconfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moe", required=True, help="the MoE model's folder (e.g. made by outrider.train.moe_split)")
    ap.add_argument("--out", required=True, help="the draft-expert safetensors file to write")
    ap.add_argument("--base", default="smollm2-135m-instruct", help="the packaged model the MoE was made from (recorded)")
    ap.add_argument("--size", type=int, default=64, help="neurons of each layer's draft expert")
    ap.add_argument("--sequences", type=int, default=48)
    ap.add_argument("--held", type=int, default=8, help="held-out windows (from the held-out files)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400, help="Adam steps per layer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-root", default=sysconfig.get_paths()["stdlib"])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from ..weights.loader import load_decoder
    from ..weights.tokenizer import load_tokenizer
    from .distill_hybrid import split_files, windows

    args = parse(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    target = load_decoder(args.moe, "cpu", torch.float32)
    tok = load_tokenizer(Path(args.moe))
    train_files, held_files = split_files(Path(args.data_root))
    data = windows(train_files, tok, args.sequences, args.seq_len, args.seed)
    held = windows(held_files, tok, args.held, args.seq_len, args.seed)
    experts, figures = train(target, data, held, args.size, args.steps, args.seed)
    figures["agreement_held_out"] = agreement(target, experts, held)
    recipe = {"command": "python -m outrider.train.draftexpert_train " + " ".join(sys.argv[1:] if argv is None else argv),
              "base": args.base, "moe": str(args.moe), "size": args.size, "sequences": args.sequences,
              "held": args.held, "seq_len": args.seq_len, "steps": args.steps, "seed": args.seed,
              "data": f"{args.data_root}: stdlib .py files, every 10th (sorted) held out",
              "seconds": round(time.time() - t0, 1), **figures}
    experts.meta |= {"base": args.base, "recipe": json.dumps(recipe)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    experts.save(out)
    (out.parent / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    print(json.dumps({"agreement_held_out": figures["agreement_held_out"], "seconds": recipe["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
