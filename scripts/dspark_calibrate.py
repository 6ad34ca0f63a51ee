"""Fit a DSpark head's per-position temperatures on the target's own greedy text and write a
calibrated copy (heads/dspark/calibrate.py: left to right, ECE of the cumulative products).

    python scripts/dspark_calibrate.py HEAD OUT --target smollm2-135m-instruct --skip 4 --prompts 12

For each prompt (HumanEval's, after the first `--skip`, which the tau comparison uses) the target
generates greedily; at every generated position a the head drafts its greedy chain through the
Markov head (its own drafts fed back, as at run time); position k is "alive" when drafts 1..k all
equal the text. The confidence logits along the chain and those events give the temperatures.
Prints the ECE of each position's survival before and after, then exports OUT with them.
"""

from __future__ import annotations

import argparse
import json

import torch


@torch.inference_mode()
def collect(head, target, text: list[int], prompt_len: int):
    """(conf logits [A, G], alive [A, G] bool) over the generated positions a of `text`."""
    from outrider.heads.dspark.golden import replay

    n, B, G = len(text), head.block_size, head.gamma
    anchors = list(range(prompt_len, n - 1))
    if not anchors:
        return torch.zeros(0, G), torch.zeros(0, G, dtype=torch.bool)
    _, _, own = replay(head, target, text, prompt_len)
    block = torch.full((len(anchors), B), head.config.mask_token_id, dtype=torch.long)
    block[:, 0] = torch.tensor([text[a] for a in anchors])
    U, hbar = head.block(own, [0] * len(anchors), anchors, block)
    padded = torch.tensor(text + [-1] * (G + 1))
    prev, state, alive = block[:, 0], None, torch.ones(len(anchors), dtype=torch.bool)
    logits_out, alive_out = [], []
    for k in range(G):
        logits, state = head.step(U[:, k], hbar[:, k], prev, state)
        draft = head.target_ids(logits.argmax(-1))
        logits_out.append(head.conf.logit(hbar[:, k], head.markov.prev_embeddings(prev)))
        alive = alive & (draft == padded[torch.tensor(anchors) + 1 + k])
        alive_out.append(alive.clone())
        prev = draft
    return torch.stack(logits_out, 1), torch.stack(alive_out, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("head")
    ap.add_argument("out")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from outrider.bench.workloads import load_workload
    from outrider.heads.dspark.calibrate import ece, fit_temperatures
    from outrider.heads.dspark.export import export_dspark
    from outrider.heads.dspark.format import load_dspark
    from outrider.llm import LLM

    llm = LLM(args.target, dtype="float32")
    head = load_dspark(args.head, llm.target)
    prompts = load_workload("humaneval", limit=args.skip + args.prompts).prompts[args.skip:]
    parts = []
    for p in prompts:
        ids = llm.encode(p.text, False)
        out = list(llm.generate(p.text, args.max_new_tokens).token_ids)
        parts.append(collect(head, llm.target, ids + out, len(ids)))
    logits = torch.cat([a for a, _ in parts])
    alive = torch.cat([b for _, b in parts])
    temps = fit_temperatures(logits, alive)
    before = torch.cumprod(torch.sigmoid(logits), 1)
    after = torch.cumprod(torch.sigmoid(logits / torch.tensor(temps)), 1)
    report = {"anchors": int(logits.shape[0]), "temperatures": [round(t, 4) for t in temps],
              "alive_rate": [round(float(alive[:, k].float().mean()), 4) for k in range(alive.shape[1])],
              "ece_before": [round(ece(before[:, k], alive[:, k]), 4) for k in range(alive.shape[1])],
              "ece_after": [round(ece(after[:, k], alive[:, k]), 4) for k in range(alive.shape[1])]}
    print(json.dumps(report), flush=True)
    export_dspark(args.head, args.out, args.target, dtype=args.dtype, temperatures=temps)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
