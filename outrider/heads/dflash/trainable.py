"""The DFlash head as a trainable module: every anchor block of a sequence in one forward.

The runtime head (heads/dflash/head.py) drafts one block per sequence from a K/V cache of its context;
training runs A blocks per sequence at once, as SpecForge trains DFlash (learned-drafters.md,
section 3). Shapes: S sequences of T tokens, n taps of the target's hidden size Ht, H the head's
(= the target's), A anchors per sequence, B the block size, K = B - 1 predicted slots, Vd the
draft vocabulary (V when the head reads out through the target's own lm_head).

For an anchor a (a committed position whose next token is a label):

    context   c_p = hidden_norm(fc(taps of position p)), every p < a (strictly before the anchor)
    block     [x_a, MASK, ..., MASK] at positions a .. a+B-1
    label     slot k (1..K) predicts x_{a+k}, where that token exists and is in the loss mask
    weight    slot k's mean cross-entropy is weighted exp(-(k-1) / gamma) (DFlash: gamma 7)

One forward holds every block of a sequence: the queries are the A*B block rows, the keys the T
context rows then the A*B block rows, and the mask lets block i see the context rows p < a_i and
its own B rows (both ways), never another block: exactly the runtime head's `block` for the
context 0..a_i-1 (tested against heads/dflash/reference.py through `runtime_weights`).

Parameters carry z-lab's names (`fc.weight`, `hidden_norm.weight`, `layers.{l}.self_attn.q_proj.weight`,
..., `norm.weight`, and `lm_head.weight` for a reduced draft vocabulary). The target's embedding and,
without a reduced vocabulary, its lm_head are frozen buffers shared with the target. As the
EAGLE-3 trainer does (heads/eagle3/trainable.py), fc trains on the target's features divided by each
dimension's RMS (`calibrate`), folded into `fc.weight` on export.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..trainable import StepOutput
from .head import DFlashConfig, default_layer_ids


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32 (under bf16 autocast the inputs arrive in bf16)."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [S, heads, R, D], cos/sin: [S, 1, R, D] (half-split layout, as models/layers.py)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Norm(torch.nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))


class _Linear(torch.nn.Module):
    def __init__(self, rows: int, cols: int, gen: torch.Generator, std: float = 0.02):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, cols, generator=gen) * std)  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _Attention(torch.nn.Module):
    def __init__(self, c: DFlashConfig, gen: torch.Generator):
        super().__init__()
        H, nh, G, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj, self.k_proj = _Linear(nh * D, H, gen), _Linear(G * D, H, gen)
        self.v_proj, self.o_proj = _Linear(G * D, H, gen), _Linear(H, nh * D, gen)
        self.q_norm, self.k_norm = _Norm(D), _Norm(D)


class _MLP(torch.nn.Module):
    def __init__(self, c: DFlashConfig, gen: torch.Generator):
        super().__init__()
        H, I = c.hidden_size, c.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = _Linear(I, H, gen), _Linear(I, H, gen), _Linear(H, I, gen)


class _Layer(torch.nn.Module):
    def __init__(self, c: DFlashConfig, gen: torch.Generator):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(c.hidden_size), _Norm(c.hidden_size)
        self.self_attn, self.mlp = _Attention(c, gen), _MLP(c, gen)


class DFlashTrainable(torch.nn.Module):
    """Trainable weights of one DFlash head; the target's embedding (and lm_head) frozen buffers.

    `for_target` starts the final norm at a tenth of the target's: a block row starts as its
    token's embedding, and where the target ties its lm_head to the embedding (SmolLM2) the
    target's own scale reads every slot out as its input token with logits of about 100 (a first
    cross-entropy near 100 a slot; a tenth starts near the uniform one, ln V)."""

    kind = "dflash"

    def __init__(self, config: DFlashConfig, embed: torch.Tensor, lm_head: torch.Tensor, used: torch.Tensor, *,
                 seed: int = 0):
        super().__init__()
        c = config
        if c.target_layer_ids is None:
            raise ValueError("a trainable DFlash head needs explicit target_layer_ids")
        Vd = c.draft_vocab_size or c.vocab_size
        if used.ndim != 1 or used.numel() != Vd:
            raise ValueError(f"used must list the {Vd} draft-vocabulary ids, got shape {list(used.shape)}")
        self.config = c
        gen = torch.Generator().manual_seed(seed)
        n = len(c.target_layer_ids)
        self.fc = _Linear(c.hidden_size, n * c.target_hidden_size, gen)
        self.hidden_norm, self.norm = _Norm(c.hidden_size), _Norm(c.hidden_size)
        self.layers = torch.nn.ModuleList(_Layer(c, gen) for _ in range(c.num_layers))
        used = used.long().cpu()
        self.reduced = Vd < c.vocab_size
        if self.reduced:  # its own readout, started from the target's rows of the draft vocabulary
            self.lm_head = _Linear(Vd, c.hidden_size, gen)
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head.detach().float()[used])
        else:
            self.register_buffer("target_lm_head", lm_head.detach(), persistent=False)  # [V, H] frozen
        self.register_buffer("embed", embed.detach(), persistent=False)  # [V, H] the target's, frozen
        self.register_buffer("used", used, persistent=False)  # [Vd] target id of each draft id
        to_draft = torch.full((c.vocab_size,), -1, dtype=torch.long)
        to_draft[used] = torch.arange(Vd)
        self.register_buffer("to_draft", to_draft, persistent=False)  # [V] draft id or -1
        self.register_buffer("feature_scale", torch.ones(n * c.target_hidden_size), persistent=False)  # [n Ht]
        D = c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, D, 2).float() / D)),
                             persistent=False)

    @classmethod
    def for_target(cls, target, used: torch.Tensor, *, seed: int, layers: int, block_size: int,
                   mask_token_id: int, layer_ids=None) -> "DFlashTrainable":
        """A head sized like `target` (a Decoder): its hidden size, heads, head size and MLP
        width; `layers` draft layers; taps `layer_ids` (DFlash's convention) or DFlash's default."""
        t = target.config
        if not isinstance(target.lm_head, torch.Tensor) or not isinstance(target.embed, torch.Tensor):
            raise ValueError("train against a float target (--target-dtype float32 or bfloat16), not quantized weights")
        ids = tuple(layer_ids) if layer_ids is not None else default_layer_ids(t.num_layers, layers)
        config = DFlashConfig(
            hidden_size=t.hidden_size, target_hidden_size=t.hidden_size, vocab_size=t.vocab_size,
            num_layers=layers, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
            intermediate_size=t.intermediate_size, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
            block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
            draft_vocab_size=int(used.numel()) if used.numel() < t.vocab_size else None,
            num_target_layers=t.num_layers)
        head = cls(config, target.embed.float(), target.lm_head, used, seed=seed)
        with torch.no_grad():  # a tenth of the target's readout scale: see the class docstring
            head.norm.weight.copy_(0.1 * target.norm.float())
        return head

    def taps(self, num_target_layers: int) -> tuple[int, ...]:
        """The target hidden states to request (our Decoder indices: DFlash id l is l + 1)."""
        return self.config.taps(num_target_layers)

    def weights(self, gamma: float) -> list[float]:
        """Loss weight of slot k = 1..K (list index k-1): exp(-(k-1) / gamma) (DFlash: gamma 7)."""
        return [math.exp(-k / gamma) for k in range(self.config.block_size - 1)]

    @torch.no_grad()
    def calibrate(self, features: torch.Tensor, valid: torch.Tensor | None = None, keep_function: bool = False) -> None:
        """fc's per-dimension input scale from a batch of features [S, T, n, Ht] (as Eagle3Trainable)."""
        flat = features.reshape(-1, features.shape[-2] * features.shape[-1]).float()  # [rows, n Ht]
        if valid is not None and bool(valid.any()):
            flat = flat[valid.reshape(-1)]
        scale = (1.0 / flat.pow(2).mean(0).sqrt().clamp_min(1e-3)).to(self.feature_scale.device)
        if keep_function:
            self.fc.weight.mul_(self.feature_scale / scale)
        self.feature_scale.copy_(scale)

    # -- forward --------------------------------------------------------------------------------
    def block_logits(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                     with_hidden: bool = False):
        """features [S, T, n, Ht], tokens [S, T], anchors [S, A] long (positions 0..T-1) ->
        logits [S, A, K, Vd] of slots 1..B-1 of every anchor's block (module docstring);
        with_hidden: (logits, hidden [S, A, B, H] the last layer's output before the final norm,
        the runtime head's `block` hidden, which AdaFlash's length head reads)."""
        c = self.config
        S, T = tokens.shape
        A, B = anchors.shape[1], c.block_size
        nh, G, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        R = A * B
        dev = tokens.device
        scaled = features.reshape(S, T, -1).to(self.fc.weight.dtype) * self.feature_scale  # [S, T, n Ht]
        ctx = _rms(self.fc(scaled), self.hidden_norm.weight, eps).to(scaled.dtype)  # [S, T, H]
        block = torch.full((S, A, B), c.mask_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = tokens.gather(1, anchors)  # [S, A, B]: x_a then MASK
        h = F.embedding(block.reshape(S, R), self.embed).to(ctx.dtype)  # [S, R, H]
        slot_pos = (anchors.unsqueeze(-1) + torch.arange(B, device=dev)).reshape(S, R)  # [S, R]
        positions = torch.cat((torch.arange(T, device=dev).expand(S, T), slot_pos), dim=1)  # [S, T + R]
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        angle = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [S, 1, T + R, D]
        cos, sin = angle.cos().to(h.dtype), angle.sin().to(h.dtype)
        owner = torch.arange(A, device=dev).repeat_interleave(B)  # [R]: the block of each row
        sees_ctx = torch.arange(T, device=dev).view(1, 1, T) < anchors.repeat_interleave(B, dim=1).unsqueeze(-1)
        sees_blk = (owner.unsqueeze(1) == owner.unsqueeze(0)).expand(S, R, R)
        mask = torch.cat((sees_ctx, sees_blk), dim=2).unsqueeze(1)  # [S, 1, R, T + R] bool
        for layer in self.layers:
            att = layer.self_attn
            x = _rms(h, layer.input_layernorm.weight, eps).to(h.dtype)  # [S, R, H]
            q = _rms(att.q_proj(x).view(S, R, nh, D), att.q_norm.weight, eps).to(h.dtype).transpose(1, 2)
            both = torch.cat((ctx, x), dim=1)  # [S, T + R, H]: the context injected beside the blocks
            k = _rms(att.k_proj(both).view(S, T + R, G, D), att.k_norm.weight, eps).to(h.dtype).transpose(1, 2)
            v = att.v_proj(both).view(S, T + R, G, D).transpose(1, 2)  # [S, G, T + R, D]
            q, k = _rotate(q, cos[:, :, T:], sin[:, :, T:]), _rotate(k, cos, sin)
            k, v = k.repeat_interleave(nh // G, dim=1), v.repeat_interleave(nh // G, dim=1)  # [S, nh, T + R, D]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [S, nh, R, D]: no causal mask
            h = h + att.o_proj(out.transpose(1, 2).reshape(S, R, nh * D))
            m = _rms(h, layer.post_attention_layernorm.weight, eps).to(h.dtype)
            h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(m)) * layer.mlp.up_proj(m))
        out = _rms(h.view(S, A, B, -1)[:, :, 1:], self.norm.weight, eps).to(h.dtype)  # [S, A, K, H]
        readout = self.lm_head.weight if self.reduced else self.target_lm_head.to(out.dtype)
        logits = F.linear(out, readout)  # [S, A, K, Vd]
        return (logits, h.view(S, A, B, -1)) if with_hidden else logits

    def anchors(self, valid: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to `count` random anchors per sequence among the positions a >= 1 whose next token
        is a label (valid [S, T]: p predicts a label); (anchors [S, A] long, real [S, A] bool)."""
        S, T = valid.shape
        candidates = valid.clone().cpu()
        candidates[:, 0] = False
        A = max(1, min(count, int(candidates.sum(1).max())))
        anchors, real = torch.zeros(S, A, dtype=torch.long), torch.zeros(S, A, dtype=torch.bool)
        for s in range(S):
            pool = torch.nonzero(candidates[s]).flatten()
            take = pool[torch.randperm(pool.numel(), generator=generator)[:A]].sort().values
            anchors[s, : take.numel()], real[s, : take.numel()] = take, True
        return anchors.to(valid.device), real.to(valid.device)

    def step(self, tb, generator: torch.Generator, count: int) -> StepOutput:
        """One training step's loss on a target batch (train/target_pass.TargetBatch): `count`
        random anchors per sequence, cross-entropy of slot k against x_{a+k} (hard labels, the
        draft vocabulary's; a label outside it is not scored), per slot k."""
        c = self.config
        K = c.block_size - 1
        tokens, valid = tb.tokens, tb.valid
        S, T = tokens.shape
        anchors, real = self.anchors(valid, count, generator)  # [S, A]
        logits = self.block_logits(tb.features, tokens, anchors)  # [S, A, K, Vd]
        where = anchors.unsqueeze(-1) + torch.arange(1, K + 1, device=tokens.device)  # [S, A, K] label positions
        inside = where < T
        at = where.clamp(max=T - 1)
        labels = self.to_draft[tokens.gather(1, at.view(S, -1)).view_as(at)]  # [S, A, K] draft ids (-1: outside)
        scored = inside & valid.gather(1, (at - 1).view(S, -1)).view_as(at) & real.unsqueeze(-1) & (labels >= 0)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1),
                             reduction="none").view_as(labels)  # [S, A, K]
        right = (logits.argmax(-1) == labels) & scored  # [S, A, K]
        sums = [ce[..., k][scored[..., k]].sum() for k in range(K)]
        rows = [int(scored[..., k].sum()) for k in range(K)]
        hits = [float(right[..., k].sum()) for k in range(K)]
        first = scored[..., 0]  # [S, A] blocks whose slot 1 is scored
        run = right.long().cumprod(-1).sum(-1)  # [S, A] leading right predictions
        return StepOutput(sums, rows, hits, accepted=float(run[first].sum()), blocks=int(first.sum()))

    # -- weights on disk (heads/dflash/format.py reads them) ----------------------------------------
    def state_tensors(self, training: bool = False) -> dict[str, torch.Tensor]:
        """The head under z-lab's names (fc.weight with the input scale folded in), plus
        lm_head.weight, d2t (int64 offsets) and t2d (bool) for a reduced draft vocabulary; no
        embedding. training=True (checkpoints): fc.weight as trained and `train.feature_scale`."""
        out = {name: p.detach().clone().contiguous() for name, p in self.named_parameters()}
        if training:
            out["train.feature_scale"] = self.feature_scale.detach().clone()
        else:
            out["fc.weight"] = (self.fc.weight.detach() * self.feature_scale).contiguous()  # [H, n Ht]
        if self.reduced:
            used = self.used.cpu()
            out["d2t"] = used - torch.arange(used.numel())
            t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
            t2d[used] = True
            out["t2d"] = t2d
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy weights written by `state_tensors` into this head (same config and vocabulary)."""
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in tensors]
        if missing:
            raise ValueError(f"head tensors lack {', '.join(missing)}")
        if "d2t" in tensors and not torch.equal(torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long(),
                                                self.used.cpu()):
            raise ValueError("the tensors' draft vocabulary (d2t) differs from this head's")
        with torch.no_grad():
            for name, param in params.items():
                if tuple(tensors[name].shape) != tuple(param.shape):
                    raise ValueError(f"{name} has shape {list(tensors[name].shape)}, this head's is {list(param.shape)}")
                param.copy_(tensors[name])
            if "train.feature_scale" in tensors:
                self.feature_scale.copy_(tensors["train.feature_scale"])
            else:
                self.feature_scale.fill_(1.0)

    def export_config(self, **extra) -> dict:
        """config.json in the vllm layout, z-lab's plus what vLLM reads (heads/dflash/format.py)."""
        from .format import config_json

        return {**config_json(self.config, "vllm", dtype="float32"), **extra}


# -- the training job (heads/trainable.py: what train/loop.py drives) ---------------------------
@dataclass
class DFlashJob:
    model: DFlashTrainable
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
        return self.model.step(tb, generator, self.anchors)


def job(o, target, tokenizer, used: torch.Tensor, layer_ids=None):
    """The job of run options `o` (train/options.py) for `target` with draft vocabulary `used`
    [Vd] (its taps: --target-layers, `layer_ids` is EAGLE-3's). --init-from HEAD: the head's own
    layers, block size, MASK token and taps (the loop loads its weights). --objective: `sft` (this
    file's step), `opd` (AdaFlash's on-policy reverse KL, opd.py) or `length` (AdaFlash's length
    head on the frozen head, length_head.py)."""
    layers, block, mask, ids = o.layers, o.block_size, o.mask_token, o.target_layers
    if o.init_from is not None:
        from ..catalog import resolve_head
        from .format import read_config

        c = read_config(resolve_head(o.init_from, kind="dflash"))
        layers, block, mask, ids = c.num_layers, c.block_size, c.mask_token_id, c.layer_ids(target.config.num_layers)
    mask = mask if mask is not None else default_mask_token(tokenizer, target.config.vocab_size)
    model = DFlashTrainable.for_target(target, used, seed=o.seed, layers=layers, block_size=block,
                                       mask_token_id=mask, layer_ids=ids)
    objective = getattr(o, "objective", "sft")
    if objective == "opd":
        from .opd import OPDJob

        return OPDJob(model, target, o.seed, o.anchors, o.gamma)
    if objective == "length":
        from .length_head import LengthJob, LengthTrainable

        return LengthJob(LengthTrainable(model, 256, o.seed), target, o.seed, o.anchors)
    return DFlashJob(model, o.seed, o.anchors, o.gamma)


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """DFlash's MASK token when --mask-token is not given: the highest-id special token the
    tokenizer adds that is none of its named ones (bos, eos, pad, the chat template's), i.e. one
    that text never holds (SmolLM2: 16, `<empty_output>`); else the last id of the vocabulary."""
    named = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    spare = [i for i, tok in added.items() if getattr(tok, "special", False) and i not in named and i < vocab_size]
    return max(spare) if spare else vocab_size - 1
