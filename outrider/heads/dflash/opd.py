"""AdaFlash's on-policy distillation of a DFlash head (`outrider train dflash --objective opd`).

The drafter proposes its own blocks, the target scores them along the drafted prefix, and the
drafter minimises the reverse KL per position (AdaFlash, SGLang PR #34171; seed card 2.28 (i)).
For an anchor a (a committed position, as in SFT: trainable.py's module notes), with the block
[x_a, MASK, ..., MASK] and K = B-1 slots:

    q_k       the head's distribution of slot k (k = 1..K), over the draft vocabulary, with grad
    x^_k      argmax q_k: the block the head proposes (what it drafts at temperature 0), no grad
    p_k       the frozen target's next-token distribution after x_0..x_a, x^_1..x^_{k-1}: the
              target run along the DRAFTED prefix (one target forward of [x_a, x^_1..x^_{K-1}]
              at positions a..a+K-1 over the K/V of x_0..x_{a-1}), not the data's tokens
    loss_k    KL(q_k || p_k) = sum_v q_k(v) (log q_k(v) - log p_k(v)), v over the draft vocabulary
              (q puts no mass elsewhere), weighted exp(-(k-1)/gamma) as SFT's slot k
    hit_k     x^_k == argmax p_k: exactly the greedy verifier's test of slot k on this prefix, so
              the leading run of hits is the block's accepted length (logged as `accepted`)

No label of the data is read: an anchor needs only a context (any position a >= 1 whose next
token is in the loss mask). Shapes: S sequences of T tokens, A anchors, K slots, Vd the draft
vocabulary, V the target's.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ...models.batch import causal_batch, pack
from ..trainable import StepOutput


def reverse_kl(draft_logits: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """draft_logits [..., Vd] (with grad), target_logp [..., Vd] the target's log-probabilities
    (normalised over its whole vocabulary) at the draft vocabulary's ids -> [...] KL(q || p) in
    nats, float32."""
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    return (logq.exp() * (logq - target_logp.float())).sum(-1)


def reverse_kl_reference(draft_logits: torch.Tensor, target_logits: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """The slow reference of `reverse_kl`: row by row in float64, from the target's full logits
    [..., V] and the draft vocabulary's ids `used` [Vd]."""
    d = draft_logits.detach().double().reshape(-1, draft_logits.shape[-1]).tolist()
    t = target_logits.detach().double().reshape(-1, target_logits.shape[-1]).tolist()
    out = []
    for row_d, row_t in zip(d, t):
        zq = sum(math.exp(x) for x in row_d)
        zp = sum(math.exp(x) for x in row_t)
        total = 0.0
        for j, v in enumerate(used.tolist()):
            q = math.exp(row_d[j]) / zq
            if q > 0:
                total += q * (math.log(q) - math.log(math.exp(row_t[v]) / zp))
        out.append(total)
    return torch.tensor(out, dtype=torch.float64).view(draft_logits.shape[:-1])


@torch.no_grad()
def target_along_drafts(target, tokens: torch.Tensor, lengths: list[int], anchors: torch.Tensor,
                        real: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """The target's logits of each slot along the drafted prefix.

    tokens [S, T] long, lengths [S], anchors / real [S, A], drafted [S, A, K] target ids ->
    logits [S, A, K, V] float32: row k-1 is the target after x_0..x_a, drafted_1..drafted_{k-1}.
    Per sequence: one prefill of its tokens into slot 0, its prefix x_0..x_{a-1} copied into a
    slot per anchor, then one forward of every anchor's chain [x_a, drafted_1..drafted_{K-1}]
    (anchors not real give zeros)."""
    S, A, K = drafted.shape
    out = torch.zeros(S, A, K, target.config.vocab_size)
    for s in range(S):
        n = lengths[s]
        cache = target.new_cache(A + 1, n + K)
        target.forward(causal_batch([tokens[s, :n].cpu()], scratch_row=cache.scratch_row, device=target.device),
                       cache)
        chosen = [j for j in range(A) if bool(real[s, j])]
        if not chosen:
            continue
        for j in chosen:
            cache.copy_rows(0, 1 + j, int(anchors[s, j]))
        chains = [torch.cat((tokens[s, anchors[s, j]].view(1).cpu(), drafted[s, j, : K - 1].cpu())) for j in chosen]
        batch = pack([1 + j for j in chosen], [int(anchors[s, j]) for j in chosen], chains, logits="all",
                     scratch_row=cache.scratch_row, device=target.device)
        logits = target.forward(batch, cache).logits  # [len(chosen), K, V]
        out[s, chosen] = logits.float().cpu().clone()
    return out


def opd_step(model, target, tb, generator: torch.Generator, count: int) -> StepOutput:
    """One on-policy step (module notes): per slot k, the summed reverse KL over the scored
    blocks, their count and the slots whose proposal the target's greedy choice agrees with."""
    c = model.config
    K = c.block_size - 1
    tokens, valid = tb.tokens, tb.valid
    S, T = tokens.shape
    lengths = [T] * S  # the padded rows whole: padding comes after every anchor, and attention is causal
    anchors, real = model.anchors(valid, count, generator)  # [S, A]
    logits = model.block_logits(tb.features, tokens, anchors)  # [S, A, K, Vd]
    drafted = model.used[logits.detach().argmax(-1)]  # [S, A, K] target ids of the proposal
    p = target_along_drafts(target, tokens, lengths, anchors, real, drafted).to(logits.device)  # [S, A, K, V]
    logp = torch.log_softmax(p, dim=-1)
    kl = reverse_kl(logits, logp.index_select(-1, model.used))  # [S, A, K]
    scored = real.unsqueeze(-1).expand(-1, -1, K)
    right = (drafted == p.argmax(-1)) & scored  # [S, A, K]
    sums = [kl[..., k][scored[..., k]].sum() for k in range(K)]
    rows = [int(scored[..., k].sum()) for k in range(K)]
    hits = [float(right[..., k].sum()) for k in range(K)]
    run = right.long().cumprod(-1).sum(-1)  # [S, A] the greedy verifier's accepted length
    return StepOutput(sums, rows, hits, accepted=float(run[real].sum()), blocks=int(real.sum()))


@dataclass
class OPDJob:
    """`outrider train dflash --objective opd`: the DFlash job (trainable.py) with the on-policy loss."""

    model: object  # trainable.DFlashTrainable
    target: object
    seed: int
    anchors: int
    gamma: float
    needs_logits = False
    first = 1

    def weights(self) -> list[float]:
        return self.model.weights(self.gamma)

    def step(self, tb, step: int, rank: int) -> StepOutput:
        key = hashlib.sha256(f"dflash-anchors:{self.seed}:{step}:{rank}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return opd_step(self.model, self.target, tb, generator, self.anchors)
