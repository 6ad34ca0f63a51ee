"""DSpark's forward written out plainly, one sequence, nothing cached: the slow references the
fast paths are tested against (tests/test_dspark.py).

`reference_block` is the backbone with every slot read out (DFlash's reference, heads/dflash/
reference.py, from slot 0); `reference_chain` applies the Markov head position by position from
its formulas (heads/dspark/markov.py's docstring) with plain matrix products and explicit
sigmoids, for a given sequence of previous tokens.
"""

from __future__ import annotations

import torch

from ..dflash.reference import reference_block as dflash_reference


def reference_block(head, features: torch.Tensor, tokens: torch.Tensor):
    """features [n, taps, Ht] (the context), tokens [B] (anchor, MASK...) -> U [gamma, Vd] float32."""
    return dflash_reference(head.backbone, features, tokens, first=head.spec.first).float()


def _sig(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


@torch.no_grad()
def reference_chain(head, U: torch.Tensor, hbar: torch.Tensor, prev: list[int]):
    """U [G, Vd], hbar [G, H] (normed), prev [G] the tokens before positions 1..G (x_0 the anchor)
    -> (logits [G, Vd], confidence [G]) float32, from the formulas."""
    m = head.markov
    W1, W2 = m.prev_embed.weight.float(), m.out_proj.weight.float().T  # [V, r], [r, Vd]
    s = torch.zeros(m.rank)
    logits, conf = [], []
    for k, x in enumerate(prev):
        e, h = W1[x], hbar[k].float()
        if m.variant == "vanilla":
            bias = e @ W2
        elif m.variant == "gated":
            bias = (_sig(m.gate_proj.weight.float() @ torch.cat((h, e))) * e) @ W2
        else:
            z = torch.cat((s, e, h))
            u = _sig(m.gate_proj.weight.float() @ z)
            bias = torch.tanh(m.mix_proj.weight.float() @ z) @ W2
            s = u * s + (1 - u) * torch.tanh(m.cand_proj.weight.float() @ z)
        logits.append(U[k].float() + bias)
        if head.conf is not None:
            w, b = head.conf.proj.weight.float()[0], head.conf.proj.bias.float()[0]
            conf.append(_sig((w @ torch.cat((h, e)) + b) / head.spec.temperature(k)))
    return torch.stack(logits), (torch.stack(conf) if conf else None)


def normed(head, h: torch.Tensor) -> torch.Tensor:
    """The backbone's final norm, plainly (hbar from the pre-norm hidden states)."""
    w, eps = head.w.norm.float(), head.config.rms_norm_eps
    return w * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps))
