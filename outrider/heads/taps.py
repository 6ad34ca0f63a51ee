"""Which hidden states of the target a head reads (its taps), in our convention: `Decoder` hidden[l]
is the output of layer l (1-based), 0 the embeddings, which is Hugging Face's hidden_states[l].

Heads store their layer ids in one of two conventions:
- "vllm" (EAGLE, vLLM, speculators): id l reads hidden_states[l], the residual entering layer l:
  ours is l;
- "sglang" (SpecForge, SGLang, and DFlash's own ids): id l is the output of layer l, 0-based:
  ours is l + 1.
The drafter declares the taps as `needs_hidden` (drafters/capabilities.py), so the target's verify
forward returns them at no extra pass; the head fuses them (its `fuse`: [..., n taps, Ht] -> [..., H]).
"""

from __future__ import annotations

CONVENTIONS = ("vllm", "sglang")


def taps(layer_ids, convention: str) -> tuple[int, ...]:
    """Stored layer ids in `convention` -> the target layers in ours."""
    if convention not in CONVENTIONS:
        raise ValueError(f"layer id convention {convention!r}: one of {', '.join(CONVENTIONS)}")
    return tuple(i + 1 for i in layer_ids) if convention == "sglang" else tuple(layer_ids)
