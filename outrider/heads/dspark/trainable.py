"""The DSpark head as a trainable module: every anchor block of a sequence in one forward, the
Markov head teacher-forced, the confidence head towards the analytic acceptance.

DFlash's trainable (heads/dflash/trainable.py) with the changes the DSpark paper makes (card F5;
DeepSpec `deepspec/modeling/dspark/qwen3/modeling.py`): for an anchor a, the block [x_a, MASK...]
at positions a .. a+gamma-1 sees the context p < a and its own slots both ways, and EVERY slot is
read out: slot j (0-based) predicts x_{a+1+j}. Then, per slot, with prev_j = x_{a+j} (the true
previous token: teacher forcing) and p_t the target's distribution at position a+j:

    logits_j = U_j + markov(prev_j, hbar_j)          p_d = softmax(logits_j)
    c*_j     = 1 - 1/2 |p_d - p_t|_1                 the analytic acceptance of slot j (detached)
    loss_j   = 0.1 CE(logits_j, x_{a+1+j}) + 0.9 w_j |p_d - p_t|_1 + 1.0 BCE(conf_j, c*_j),
               w_j = exp(-j / gamma_w)               (the paper's alphas (0.1, 0.9, 1.0))

Slots score while their labels form a leading run inside the sequence and the loss mask
(DeepSpec's cumulative eval mask). `--backbone-mode frozen` (ours, not the paper's) keeps a DFlash
backbone's own readout (slot j+1 predicts x_{a+1+j}, `anchor_predicts` false) and trains only the
Markov and confidence heads on it. Parameters carry z-lab's backbone names plus
`markov_head.*` and `confidence_head.proj.*` (heads/dspark/format.py); `--backbone HEAD` starts
fc, hidden_norm, the layers and norm from a DFlash head (the shipped one for SmolLM2).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..dflash.head import DFlashConfig, default_layer_ids
from ..dflash.trainable import DFlashTrainable
from ..trainable import StepOutput
from .head import DSparkConfig
from .markov import ConfidenceHead, MarkovHead

ALPHA_CE, ALPHA_TV, ALPHA_CONF = 0.1, 0.9, 1.0


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32 (under bf16 autocast the inputs arrive in bf16), as DFlash's trainer."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [S, heads, R, D], cos/sin: [S, 1, R, D] (half-split layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DSparkTrainable(DFlashTrainable):
    """DFlashTrainable's backbone (its parameters and buffers) + `markov_head` + `confidence_head`."""

    kind = "dspark"

    def __init__(self, config: DFlashConfig, embed: torch.Tensor, lm_head: torch.Tensor, used: torch.Tensor, *,
                 seed: int = 0, variant: str = "vanilla", rank: int = 64, anchor_predicts: bool = True):
        super().__init__(config, embed, lm_head, used, seed=seed)
        self.first = 0 if anchor_predicts else 1  # the block slot of position 1
        c = config
        self.markov_head = MarkovHead(variant, rank, c.hidden_size, c.vocab_size, c.draft_vocab_size, seed=seed)
        self.confidence_head = ConfidenceHead(c.hidden_size, rank, seed=seed)
        self.from_backbone = False
        self.temperatures: tuple[float, ...] = ()

    @classmethod
    def for_target(cls, target, used: torch.Tensor, *, seed: int, layers: int, block_size: int, mask_token_id: int,
                   layer_ids=None, variant: str = "vanilla", rank: int = 64,
                   anchor_predicts: bool = True) -> "DSparkTrainable":
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
        head = cls(config, target.embed.float(), target.lm_head, used, seed=seed, variant=variant, rank=rank,
                   anchor_predicts=anchor_predicts)
        with torch.no_grad():  # as DFlash's: a tenth of the target's readout scale
            head.norm.weight.copy_(0.1 * target.norm.float())
        return head

    def spec(self) -> DSparkConfig:
        m = self.markov_head
        return DSparkConfig(self.config, m.variant, m.rank, True, tuple(self.temperatures), self.first == 0)

    def freeze_backbone(self) -> None:
        """Train only the Markov and confidence heads (the backbone's parameters left as loaded)."""
        for name, param in self.named_parameters():
            if not name.startswith(("markov_head.", "confidence_head.")):
                param.requires_grad_(False)

    def load_backbone(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start fc, hidden_norm, the layers and norm from a DFlash head's tensors (z-lab's names,
        fc with its input scale folded in); the Markov and confidence heads stay as initialised."""
        own = {n: p for n, p in self.named_parameters() if not n.startswith(("markov_head.", "confidence_head."))}
        missing = [n for n in own if n not in tensors]
        if missing:
            raise ValueError(f"the backbone lacks {', '.join(missing[:4])}: is it a DFlash head of this shape?")
        with torch.no_grad():
            for name, param in own.items():
                if tuple(tensors[name].shape) != tuple(param.shape):
                    raise ValueError(f"backbone tensor {name} has shape {list(tensors[name].shape)}, "
                                     f"this head's is {list(param.shape)}")
                param.copy_(tensors[name].float())
            self.feature_scale.fill_(1.0)
        self.from_backbone = True

    @torch.no_grad()
    def calibrate(self, features: torch.Tensor, valid: torch.Tensor | None = None, keep_function: bool = False) -> None:
        super().calibrate(features, valid, keep_function=keep_function or self.from_backbone)

    def weights(self, gamma: float) -> list[float]:
        """Every slot's loss is weighted inside `step` (the TV term's w_j); the loop adds them evenly."""
        return [1.0] * (self.config.block_size - self.first)

    # -- forward --------------------------------------------------------------------------------
    def block_hidden(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """features [S, T, n, Ht], tokens [S, T], anchors [S, A] -> hbar [S, A, gamma, H]: every
        slot's last hidden state after the final norm (DFlashTrainable.block_logits' forward, all slots)."""
        c = self.config
        S, T = tokens.shape
        A, B = anchors.shape[1], c.block_size
        nh, G, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        R, dev = A * B, tokens.device
        scaled = features.reshape(S, T, -1).to(self.fc.weight.dtype) * self.feature_scale  # [S, T, n Ht]
        ctx = _rms(self.fc(scaled), self.hidden_norm.weight, eps).to(scaled.dtype)  # [S, T, H]
        block = torch.full((S, A, B), c.mask_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = tokens.gather(1, anchors)  # [S, A, B]: x_a then MASK
        h = F.embedding(block.reshape(S, R), self.embed).to(ctx.dtype)  # [S, R, H]
        slot_pos = (anchors.unsqueeze(-1) + torch.arange(B, device=dev)).reshape(S, R)
        positions = torch.cat((torch.arange(T, device=dev).expand(S, T), slot_pos), dim=1)  # [S, T + R]
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        angle = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [S, 1, T + R, D]
        cos, sin = angle.cos().to(h.dtype), angle.sin().to(h.dtype)
        owner = torch.arange(A, device=dev).repeat_interleave(B)  # [R]
        sees_ctx = torch.arange(T, device=dev).view(1, 1, T) < anchors.repeat_interleave(B, dim=1).unsqueeze(-1)
        sees_blk = (owner.unsqueeze(1) == owner.unsqueeze(0)).expand(S, R, R)
        mask = torch.cat((sees_ctx, sees_blk), dim=2).unsqueeze(1)  # [S, 1, R, T + R]
        for layer in self.layers:
            att = layer.self_attn
            x = _rms(h, layer.input_layernorm.weight, eps).to(h.dtype)
            q = _rms(att.q_proj(x).view(S, R, nh, D), att.q_norm.weight, eps).to(h.dtype).transpose(1, 2)
            both = torch.cat((ctx, x), dim=1)
            k = _rms(att.k_proj(both).view(S, T + R, G, D), att.k_norm.weight, eps).to(h.dtype).transpose(1, 2)
            v = att.v_proj(both).view(S, T + R, G, D).transpose(1, 2)
            q, k = _rotate(q, cos[:, :, T:], sin[:, :, T:]), _rotate(k, cos, sin)
            k, v = k.repeat_interleave(nh // G, dim=1), v.repeat_interleave(nh // G, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [S, nh, R, D]
            h = h + att.o_proj(out.transpose(1, 2).reshape(S, R, nh * D))
            m = _rms(h, layer.post_attention_layernorm.weight, eps).to(h.dtype)
            h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(m)) * layer.mlp.up_proj(m))
        return _rms(h.view(S, A, B, -1), self.norm.weight, eps).to(h.dtype)  # [S, A, gamma, H]

    def readout(self, hbar: torch.Tensor) -> torch.Tensor:
        """hbar [..., H] -> U [..., Vd]."""
        weight = self.lm_head.weight if self.reduced else self.target_lm_head.to(hbar.dtype)
        return F.linear(hbar, weight)

    def block_logits_all(self, features, tokens, anchors, prev):
        """(logits [S, A, gamma, Vd] with the Markov correction, conf logit [S, A, gamma]); prev
        [S, A, gamma] the previous tokens (teacher forcing)."""
        hbar = self.block_hidden(features, tokens, anchors)[:, :, self.first:]  # [S, A, gamma, H]
        logits = self.readout(hbar) + self.markov_head.block_bias(prev, hbar)
        conf = self.confidence_head.logit(hbar, self.markov_head.prev_embeddings(prev))
        return logits, conf

    def step(self, tb, generator: torch.Generator, count: int, decay: float = 7.0) -> StepOutput:
        """One step on a target batch (its logits on the draft vocabulary: tb.draft_logits)."""
        B = self.config.block_size - self.first  # gamma positions
        tokens, valid = tb.tokens, tb.valid
        S, T = tokens.shape
        anchors, real = self.anchors(valid, count, generator)  # [S, A]
        dev = tokens.device
        offs = torch.arange(B, device=dev)
        at = (anchors.unsqueeze(-1) + offs).clamp(max=T - 1)  # [S, A, B] position a+j: prev token, target's row
        where = anchors.unsqueeze(-1) + 1 + offs  # [S, A, B] label positions
        prev = tokens.gather(1, at.view(S, -1)).view_as(at)
        labels = self.to_draft[tokens.gather(1, where.clamp(max=T - 1).view(S, -1)).view_as(at)]
        ok = (where < T) & valid.gather(1, at.view(S, -1)).view_as(at) & real.unsqueeze(-1) & (labels >= 0)
        scored = ok.long().cumprod(-1).bool()  # [S, A, B]: a leading run (DeepSpec's eval mask)
        logits, conf = self.block_logits_all(tb.features, tokens, anchors, prev)
        logits = logits.float()
        target = tb.draft_logits.gather(1, at.view(S, -1, 1).expand(-1, -1, tb.draft_logits.shape[-1]))
        p_t = torch.softmax(target.view(S, *at.shape[1:], -1).float(), -1)  # [S, A, B, Vd]
        logp = torch.log_softmax(logits, -1)
        tv = (logp.exp() - p_t).abs().sum(-1)  # [S, A, B] |p_d - p_t|_1
        ce = F.nll_loss(logp.reshape(-1, logp.shape[-1]), labels.clamp(min=0).reshape(-1),
                        reduction="none").view_as(labels)
        accept = (1 - 0.5 * tv).detach().clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
        w = torch.exp(-offs.float() / decay)  # [B]
        loss = ALPHA_CE * ce + ALPHA_TV * w * tv + ALPHA_CONF * bce  # [S, A, B]
        right = (logits.argmax(-1) == labels) & scored
        sums = [loss[..., j][scored[..., j]].sum() for j in range(B)]
        rows = [int(scored[..., j].sum()) for j in range(B)]
        hits = [float(right[..., j].sum()) for j in range(B)]
        first = scored[..., 0]
        run = right.long().cumprod(-1).sum(-1)
        return StepOutput(sums, rows, hits, accepted=float(run[first].sum()), blocks=int(first.sum()))

    # -- weights on disk ------------------------------------------------------------------------
    def export_config(self, **extra) -> dict:
        from .format import config_json

        return {**config_json(self.spec(), dtype="float32"), **extra}

    def runtime_head(self, target):
        """This module's weights as a DSparkHead drafting for `target` (tests, calibration)."""
        from .format import head_from_tensors

        return head_from_tensors(self.state_tensors(), self.spec(), target)


# -- the training job (heads/trainable.py: what train/loop.py drives) ---------------------------
@dataclass
class DSparkJob:
    model: DSparkTrainable
    seed: int
    anchors: int
    gamma: float
    needs_logits = True  # the TV term and the confidence labels need the target's distribution
    first = 1

    def weights(self) -> list[float]:
        return self.model.weights(self.gamma)

    def step(self, tb, step: int, rank: int) -> StepOutput:
        key = hashlib.sha256(f"dspark-anchors:{self.seed}:{step}:{rank}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return self.model.step(tb, generator, self.anchors, self.gamma)


def job(o, target, tokenizer, used: torch.Tensor, layer_ids=None) -> DSparkJob:
    """The job of run options `o`: with --backbone HEAD (a DFlash head folder or shipped name) its
    layers, block size, taps and mask token are the backbone's and its weights the start."""
    from ..dflash.trainable import default_mask_token

    mask = o.mask_token if o.mask_token is not None else default_mask_token(tokenizer, target.config.vocab_size)
    layers, block, ids, tensors = o.layers, o.block_size, o.target_layers, None
    frozen = getattr(o, "backbone_mode", "paper") == "frozen"
    if getattr(o, "backbone", None):
        from safetensors.torch import load_file

        from ..catalog import resolve_head
        from ..dflash.format import read_config

        folder = resolve_head(o.backbone, kind="dflash")
        bc = read_config(folder)
        layers, block, mask = bc.num_layers, bc.block_size, bc.mask_token_id
        ids = list(bc.layer_ids(target.config.num_layers))
        tensors = load_file(str(folder / "model.safetensors"))
    model = DSparkTrainable.for_target(target, used, seed=o.seed, layers=layers, block_size=block, mask_token_id=mask,
                                       layer_ids=ids, variant=getattr(o, "markov", "vanilla"),
                                       rank=getattr(o, "markov_rank", 64), anchor_predicts=not frozen)
    if tensors is not None:
        model.load_backbone(tensors)
    if frozen:
        if tensors is None:
            from ...errors import ConfigError

            raise ConfigError("--backbone-mode frozen keeps a DFlash head's backbone: give it with --backbone HEAD")
        model.freeze_backbone()
    return DSparkJob(model, o.seed, o.anchors, o.gamma)

