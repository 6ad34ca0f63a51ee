"""Train DBLast's mixture head (drafters/dblast_mixture.py) on a frozen DFlash head, for acceptance.

Per step: one token sequence (raw code, tokenized by the target's tokenizer); one target forward
gives the head's taps and the target's logits at every position; the frozen block head drafts
blocks at `anchors` random anchors a (each sees positions < a only); the mixture turns each block
into M components. With the sequence's own tokens as the drafted prefix, the posterior-marginalised
rows q(. | x_<k) (drafters/dblast_chain.py `posterior_log_rows`) are compared with the target's
p_k = softmax(target logits at a+k-1 / T), T drawn per step from `--temperatures`:

    alpha_k = sum_x min(p_k(x), q_k(x | x_<k))      (1 - total variation: the chance k is accepted)
    tau     = sum_k prod_{j<=k} alpha_j              (expected accepted drafts of the block)
    loss    = -tau / K  +  ce * (-1/K) sum_k log q_k(x_k | x_<k) at T = 1

the acceptance-oriented objective (expected verified length, as the card has it) plus the
mixture's own likelihood of the text. The same tau of the DFlash block's independent rows is
logged beside it, and at the end both are measured at every temperature on held-out sequences.

    python -m outrider.train.dblast --target smollm2-135m-instruct --head smollm2-135m-instruct \\
        --data code:400 --out DIR [--steps N --time-budget S --components 4 --rank 32 ...]

writes DIR/dblast.safetensors and DIR/recipe.json (command, data, seed, held-out tau).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

from ..drafters.dblast_chain import posterior_log_rows
from ..drafters.dblast_mixture import MixtureWeights, mixture_parts
from ..models.batch import causal_batch


def target_pass(target, ids: list[int], taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, taps, Ht] the target's taps, [n, V] its logits) at every position of `ids`."""
    cache = target.new_cache(1, len(ids))
    batch = causal_batch([torch.tensor(ids)], hidden_layers=tuple(sorted(set(taps))), scratch_row=cache.scratch_row,
                         device=target.device)
    batch = dataclasses.replace(batch, logits_rows=torch.arange(len(ids)).unsqueeze(0))  # [1, n]: every row's logits
    with torch.inference_mode():
        out = target.forward(batch, cache)
    feats = torch.stack([out.hidden[t][0].float() for t in taps], dim=1).clone()
    return feats, out.logits[0].float().clone()


def blocks(head, feats: torch.Tensor, ids: list[int], points: list[int]):
    """The frozen head's blocks at anchors `points`: (base logits [A, K, Vd], hidden [A, B, H])."""
    B = head.block_size
    with torch.inference_mode():
        cache = head.new_cache(1, len(ids))
        head.write_context(cache, 0, 0, head.fuse(feats))
        tokens = torch.full((len(points), B), head.config.mask_token_id, dtype=torch.long)
        tokens[:, 0] = torch.tensor([ids[a] for a in points])
        logits, hidden = head.block(cache, [0] * len(points), points, tokens)
    return logits.clone(), hidden.float().clone()


def expected_tau(p: torch.Tensor, log_rows: torch.Tensor) -> torch.Tensor:
    """p: [..., K, V] target rows, log_rows: [..., K, V] the draft's log q -> [...] sum_k prod_{j<=k} alpha_j."""
    alpha = torch.minimum(p, log_rows.exp()).sum(-1)  # [..., K]
    return alpha.cumprod(-1).sum(-1)


def candidates(t_logits: torch.Tensor, base: torch.Tensor, labels: torch.Tensor, top: int):
    """Training's vocabulary per position: the target's and the block's `top` likeliest tokens and
    the label. -> (ids [A, K, N] long, keep [A, K, N] bool: False on a repeat, label index [A, K])."""
    ids = torch.cat((t_logits.topk(top, -1).indices, base.topk(top, -1).indices, labels.unsqueeze(-1)), -1)
    same = ids.unsqueeze(-1) == ids.unsqueeze(-2)  # [A, K, N, N]
    earlier = torch.ones(ids.shape[-1], ids.shape[-1], dtype=torch.bool).tril(-1)
    keep = ~(same & earlier).any(-1)  # the first of equal ids kept
    at = (ids == labels.unsqueeze(-1)).float().argmax(-1)  # [A, K] first occurrence
    return ids, keep, at


def block_terms(w, lm_head, head, hidden, base, t_logits, labels, temperature, top: int | None = None):
    """(tau of the mixture [A], tau of the block's own rows [A], log q of the labels at T = 1 [A, K]).

    hidden [A, B, H], base [A, K, V], t_logits [A, K, V] (the target's, predicting each label),
    labels [A, K]. `top`: the rows and alpha over `candidates` only (the components still
    normalised over the whole vocabulary, so alpha is a lower bound: mass off the candidates is
    not counted); None: the whole vocabulary (evaluation)."""
    eps = head.config.rms_norm_eps
    log_pi, a = mixture_parts(w, hidden, base.shape[-2], head.w.norm, eps)  # [A, M], [A, M, K, r]
    logits = base.unsqueeze(1) + a @ (lm_head @ w.proj).T  # [A, M, K, V]
    log_t, log_1 = torch.log_softmax(logits / temperature, -1), torch.log_softmax(logits, -1)
    p = torch.softmax(t_logits / temperature, -1)  # [A, K, V]
    log_b = torch.log_softmax(base / temperature, -1).detach()  # the block's own rows
    at = labels
    if top is not None:
        ids, keep, at = candidates(t_logits, base, labels, top)  # [A, K, N]
        hide = torch.where(keep, 0.0, -1e4)  # a repeat gets no mass (finite: no NaN gradients)
        wide = ids.unsqueeze(1).expand(-1, logits.shape[1], -1, -1)  # [A, M, K, N]
        log_t, log_1 = log_t.gather(-1, wide) + hide.unsqueeze(1), log_1.gather(-1, wide) + hide.unsqueeze(1)
        p, log_b = p.gather(-1, ids) * keep, log_b.gather(-1, ids) + hide  # the block's tau on the same candidates
    base_tau = expected_tau(p, log_b)
    rows_t = posterior_log_rows(log_t, log_pi, at)  # [A, K, N or V]
    rows_1 = posterior_log_rows(log_1, log_pi, at)
    return expected_tau(p, rows_t), base_tau, rows_1.gather(-1, at.unsqueeze(-1)).squeeze(-1)


def sample(head, target, seq, taps, anchors, rng):
    """One sequence's blocks at random anchors past its prompt: (hidden [A, B, H], base [A, K, V],
    the target's logits [A, K, V], labels [A, K]). seq: (ids, prompt length)."""
    ids, prompt = seq
    K = head.block_size - 1
    feats, t_logits = target_pass(target, ids, taps)
    first = max(1, prompt - 1)
    points = sorted(rng.sample(range(first, len(ids) - K), min(anchors, len(ids) - K - first)))
    base, hidden = blocks(head, feats, ids, points)
    rows = torch.tensor([[a + k for k in range(1, K + 1)] for a in points])  # [A, K] positions of the labels
    return hidden, base, t_logits[rows - 1], torch.tensor(ids)[rows]


def train(head, target, train_seqs, held_seqs, o, log=print) -> tuple[MixtureWeights, dict]:
    if head.w.draft_to_target is not None:
        raise SystemExit("train/dblast.py trains over a head with the target's whole vocabulary (no vocab=)")
    torch.manual_seed(o.seed)
    rng = random.Random(o.seed)
    c = head.config
    K = head.block_size - 1
    w = MixtureWeights.init(o.components, o.rank, K, c.hidden_size, seed=o.seed)
    params = [w.comp, w.bias, w.proj, w.gate, w.gate_bias]
    for t in params:
        t.requires_grad_(True)
    lm_head = head.w.lm_head.float()  # [V, H]
    opt = torch.optim.Adam(params, lr=o.lr)
    taps = c.taps(target.config.num_layers)
    temps = [float(t) for t in o.temperatures.split(",")]
    began, step, sums = time.perf_counter(), 0, [0.0, 0.0, 0]
    while step < o.steps and time.perf_counter() - began < o.time_budget:
        hidden, base, t_logits, labels = sample(head, target, rng.choice(train_seqs), taps, o.anchors, rng)
        for part in torch.arange(hidden.shape[0]).split(o.batch):  # a few steps per target pass
            temperature = rng.choice(temps)
            tau, base_tau, log_q = block_terms(w, lm_head, head, hidden[part], base[part], t_logits[part],
                                               labels[part], temperature, o.top)
            loss = -tau.mean() / K - o.ce * log_q.mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            sums = [sums[0] + float(tau.detach().mean()), sums[1] + float(base_tau.mean()), sums[2] + 1]
            if step % 25 == 0:
                log(f"step {step} loss {float(loss.detach()):.3f} tau (candidates) mixture {sums[0] / sums[2]:.3f} "
                    f"block {sums[1] / sums[2]:.3f} ({time.perf_counter() - began:.0f} s)")
                sums = [0.0, 0.0, 0]
    for t in params:
        t.requires_grad_(False)
    return w, {"steps": step, "time_s": round(time.perf_counter() - began, 1),
               "held_out": evaluate(w, head, target, held_seqs, temps, o.anchors, o.seed)}


@torch.no_grad()
def evaluate(w, head, target, seqs, temps, anchors, seed) -> dict:
    """Held-out expected tau per block over the whole vocabulary (the sequences' own tokens as the
    drafted prefix), the mixture's posterior rows against the block's independent rows."""
    rng = random.Random(seed + 1)
    taps = head.config.taps(target.config.num_layers)
    lm_head = head.w.lm_head.float()
    drawn = [sample(head, target, s, taps, min(anchors, 8), rng) for s in seqs]
    result = {}
    for temperature in temps:
        mix, ind = [], []
        for hidden, base, t_logits, labels in drawn:
            tau, base_tau, _ = block_terms(w, lm_head, head, hidden, base, t_logits, labels, temperature)
            mix.append(tau)
            ind.append(base_tau)
        result[str(temperature)] = {"mixture": round(float(torch.cat(mix).mean()), 4),
                                    "independent": round(float(torch.cat(ind).mean()), 4),
                                    "blocks": int(sum(t.numel() for t in mix))}
    return result


def sampled_responses(target, path, data: str, count: int, max_tokens: int, temps: list[float], seed: int,
                      log=print) -> list[tuple[list[int], int]]:
    """The target's own sampled answers to `count` prompts of `data` (prompt items, e.g.
    code-completions), temperature cycling through `temps`, seeded: [(prompt + answer ids, prompt length)]."""
    from ..engine.generate import generate_ids
    from ..engine.request import Request
    from ..sampling import SamplingParams
    from ..weights.tokenizer import eos_ids_of, load_tokenizer
    from .data import Encoder, load_corpus

    tokenizer = load_tokenizer(path)
    encoder = Encoder(tokenizer, 1 << 16)
    items = [i for i in load_corpus(data, regenerate=True).items if i.kind != "text"][:count]
    prompts = [encoder.prompt_ids(i) for i in items]
    requests = [Request(p, max_tokens, SamplingParams(temperature=temps[n % len(temps)], seed=seed + n))
                for n, p in enumerate(prompts)]
    began = time.perf_counter()
    done = generate_ids(target, requests, eos_ids_of(path, tokenizer))
    log(f"sampled {len(done)} answers, {sum(len(d.token_ids) for d in done)} tokens "
        f"({time.perf_counter() - began:.0f} s)")
    return [(p + list(d.token_ids), len(p)) for p, d in zip(prompts, done)]


def own_responses(path, data: str, count: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """The items' own responses (code-completions: the stdlib function's body) instead of the
    target's: [(prompt + response ids, prompt length)], the response cut to `max_tokens`."""
    from ..weights.tokenizer import load_tokenizer
    from .data import Encoder, load_corpus

    encoder = Encoder(load_tokenizer(path), 1 << 16)
    out = []
    for item in [i for i in load_corpus(data, regenerate=False).items if i.kind != "text"][:count]:
        for e in encoder.examples(item):
            prompt = e.mask.index(True)
            out.append((e.tokens[: prompt + max_tokens], prompt))
    return out


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="catalog name or model folder of the target")
    p.add_argument("--head", required=True, help="the frozen DFlash head: a folder or a shipped head's name")
    p.add_argument("--data", default="code-completions:160", help="prompt sources the target answers "
                   "(train/data.py; default code-completions:160: stdlib defs and docstrings, not HumanEval)")
    p.add_argument("--count", type=int, default=160, help="prompts answered (default 160)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per sampled answer (default 128)")
    p.add_argument("--own-responses", action="store_true", help="train on the items' own responses (the stdlib "
                   "bodies) instead of answers the target samples (no generation: all the time to training)")
    p.add_argument("--out", required=True, help="output folder (dblast.safetensors, recipe.json)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    p.add_argument("--time-budget", type=float, default=480.0, help="stop training after this many seconds (default 480)")
    p.add_argument("--components", type=int, default=4, help="mixture components M (default 4; the card: 4-8)")
    p.add_argument("--rank", type=int, default=32, help="rank r of each component's logit offset (default 32)")
    p.add_argument("--anchors", type=int, default=32, help="blocks per answer and target pass (default 32)")
    p.add_argument("--batch", type=int, default=8, help="blocks per optimizer step (default 8)")
    p.add_argument("--top", type=int, default=64, help="training's vocabulary: the target's and the block's top "
                   "tokens and the label per position (default 64; evaluation uses the whole vocabulary)")
    p.add_argument("--temperatures", default="0.3,0.7,1.0", help="sampling temperatures of the answers, and T "
                   "drawn per step for the acceptance term (default 0.3,0.7,1.0)")
    p.add_argument("--ce", type=float, default=0.0, help="weight of the mixture's log-likelihood term (default 0: at 0.02 it outweighed the acceptance "
                   "term about 7x)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    p.add_argument("--held-out", type=int, default=12, help="answers kept out for the final tau (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)


def run(args) -> int:
    from ..catalog.resolve import resolve_model
    from ..drafters.dflash import parse_argument
    from ..heads.dflash.format import load_dflash
    from ..weights.loader import load_decoder

    torch.set_num_threads(args.threads)
    path = resolve_model(args.target)
    target = load_decoder(path, "cpu")
    head = load_dflash(parse_argument(args.head.removeprefix("dflash:")), target)
    temps = [float(t) for t in args.temperatures.split(",")]
    drawn = own_responses(path, args.data, args.count, args.max_tokens) if args.own_responses else \
        sampled_responses(target, path, args.data, args.count, args.max_tokens, temps, args.seed)
    seqs = [s for s in drawn if len(s[0]) - s[1] > head.block_size + 4]
    random.Random(args.seed).shuffle(seqs)
    held, train_seqs = seqs[: args.held_out], seqs[args.held_out:]
    print(f"data {args.data}: {len(seqs)} answers ({len(held)} held out)", flush=True)
    w, info = train(head, target, train_seqs, held, args, log=lambda m: print(m, flush=True))
    out = Path(args.out)
    w.save(out)
    recipe = {"command": "python -m outrider.train.dblast " + " ".join(sys.argv[1:]), "data": args.data,
              "seed": args.seed, "options": {k: v for k, v in vars(args).items() if k != "run"},
              "answers": len(train_seqs), **info}
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    print(json.dumps(info["held_out"]), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m outrider.train.dblast", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
