"""The EAGLE-3 head as a trainable module, with the training-time test (TTT) unroll.

The runtime head (heads/eagle3/head.py) drafts one tree at a time from a K/V cache; training runs
every position of a sequence at once and unrolls `steps` draft steps, so the head learns from
its own hidden states as it will meet them while drafting. Shapes: B sequences of T tokens,
H the head's hidden size (= the target's: the head shares its embedding), Ht the target's,
Vd the draft vocabulary, nh / G query / key-value heads of size D.

Row p of step s stands for the draft s steps past anchor p (the runtime's committed row p):

    step 0   hidden f_p = fc(features[p])        token x_{p+1}     RoPE position p
    step s   hidden = step s-1's output at row p  token x_{p+s+1}  RoPE position p+s
    label    softmax(target logits at position p+s+1, over the draft vocabulary): predicts x_{p+s+2}

Step s of row p attends to step 0's keys 0..p (the committed rows) and to its own row in steps
1..s (its ancestors in the draft chain and itself): exactly what the drafter's tree mask gives
the depth-s node hanging off row p (tested against heads/eagle3/reference.py). Tokens are the
ground truth (teacher forcing); the loss of step s is weighted decay**s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..trainable import StepOutput
from .head import Eagle3Config


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, with grad: sum over steps of decay**s * mean soft cross-entropy
    step_loss: list[float]  # per step, mean over its valid rows
    step_acc: list[float]  # per step: share of valid rows whose top draft is the target's top token
    rows: int  # valid rows of step 0
    step_sums: list[torch.Tensor]  # per step, the summed soft cross-entropy of its valid rows (with grad)
    step_rows: list[int]  # per step, its valid rows (data parallelism weights by the global counts)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32 (under bf16 autocast the inputs arrive in bf16; the norm stays exact-ish)."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D], cos/sin: [B, 1, T, D] (half-split layout, as models/layers.py)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Eagle3Trainable(torch.nn.Module):
    """Trainable weights of one EAGLE-3 head; the target's embedding is a frozen buffer."""

    def __init__(self, config: Eagle3Config, embed: torch.Tensor, used: torch.Tensor, *, seed: int = 0,
                 lm_head_init: torch.Tensor | None = None, norm_init: torch.Tensor | None = None):
        super().__init__()
        c = config
        if used.ndim != 1 or used.numel() != c.draft_vocab_size:
            raise ValueError(f"used must list the {c.draft_vocab_size} draft-vocabulary ids, got shape {list(used.shape)}")
        self.config = c
        H, Ht, nh, G, D, I = (c.hidden_size, c.target_hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                              c.intermediate_size)
        gen = torch.Generator().manual_seed(seed)

        def weight(rows: int, cols: int, std: float = 0.02) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(rows, cols, generator=gen) * std)

        self.fc = weight(H, 3 * Ht)
        self.q_proj, self.k_proj, self.v_proj = weight(nh * D, 2 * H), weight(G * D, 2 * H), weight(G * D, 2 * H)
        self.o_proj = weight(H, nh * D)
        self.gate_proj, self.up_proj, self.down_proj = weight(I, H), weight(I, H), weight(H, I)
        ones = lambda: torch.nn.Parameter(torch.ones(H))  # noqa: E731
        self.input_norm, self.hidden_norm, self.post_norm = ones(), ones(), ones()
        self.norm = torch.nn.Parameter(norm_init.detach().float().clone() if norm_init is not None else torch.ones(H))
        used = used.long().cpu()
        head = lm_head_init.detach().float()[used].clone() if lm_head_init is not None else torch.randn(
            c.draft_vocab_size, H, generator=gen) * 0.02
        self.lm_head = torch.nn.Parameter(head)  # [Vd, H]
        self.register_buffer("embed", embed.detach(), persistent=False)  # [V, H] the target's, frozen
        self.register_buffer("used", used, persistent=False)  # [Vd] target id of each draft id
        # fc's inputs are the target's raw hidden states, whose dimensions differ in scale by 10^4
        # (massive activations: RMS 4 in layer 2, 300 in later ones, single values of 3e4). fc
        # trains on inputs divided by each dimension's RMS (`calibrate`), so Adam's steps have the
        # same relative size everywhere; the scale is folded into fc.weight on export.
        self.register_buffer("feature_scale", torch.ones(3 * Ht), persistent=False)  # [3Ht]
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, D, 2).float() / D)),
                             persistent=False)

    @classmethod
    def for_target(cls, target, used: torch.Tensor, *, seed: int, layer_ids=None,
                   warm_start: bool = False) -> "Eagle3Trainable":
        """A head sized like `target` (a Decoder): same hidden size, heads and MLP width; weights
        random (std 0.02, seeded), norms 1. warm_start copies the target's lm_head rows and final
        norm (its own readout); on SmolLM2 that started from a far higher loss and learned slower
        over the first 40 steps than the random head (a probe on stdlib code, 2 x 512 tokens a step).
        Layer ids: `layer_ids` (vllm semantics) or 2, N//2, N-3."""
        t = target.config
        if not isinstance(target.lm_head, torch.Tensor) or not isinstance(target.embed, torch.Tensor):
            raise ValueError("train against a float target (--dtype float32 or bfloat16), not quantized weights")
        config = Eagle3Config(
            hidden_size=t.hidden_size, target_hidden_size=t.hidden_size, vocab_size=t.vocab_size,
            draft_vocab_size=int(used.numel()), num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim, intermediate_size=t.intermediate_size, rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_theta, norm_before_residual=False,
            layer_ids=tuple(layer_ids) if layer_ids is not None else (2, t.num_layers // 2, t.num_layers - 3),
            layer_convention="vllm")
        return cls(config, target.embed.float(), used, seed=seed, lm_head_init=target.lm_head if warm_start else None,
                   norm_init=target.norm if warm_start else None)

    def taps(self, num_target_layers: int) -> tuple[int, ...]:
        """The target hidden states to request (our Decoder indices, heads/eagle3/head.py `taps`)."""
        return self.config.taps(num_target_layers)

    @torch.no_grad()
    def calibrate(self, features: torch.Tensor, valid: torch.Tensor | None = None, keep_function: bool = False) -> None:
        """Set the per-dimension input scale of fc from a batch of target features [B, T, 3, Ht]:
        1 / RMS of each dimension over the batch's rows (`valid` rows only when given). Call once,
        before training; the exported fc.weight is the same function of the raw features.
        keep_function: rescale fc.weight too, so the head computes what it computed before (a
        head loaded from an export, whose scale is folded into fc.weight, keeps what it learned)."""
        flat = features.reshape(-1, features.shape[-2] * features.shape[-1]).float()  # [rows, 3Ht]
        if valid is not None and bool(valid.any()):
            flat = flat[valid.reshape(-1)]
        rms = flat.pow(2).mean(0).sqrt().clamp_min(1e-3)
        scale = (1.0 / rms).to(self.feature_scale.device)  # [3Ht]
        if keep_function:
            self.fc.mul_(self.feature_scale / scale)  # fc(x * old) == fc'(x * new), column by column
        self.feature_scale.copy_(scale)

    # -- forward ----------------------------------------------------------------------------------
    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """features [B, T, 3, Ht], tokens [B, T] (x_0..x_{T-1}) -> per step s, logits [B, T, Vd]
        of row p (predicting x_{p+s+2}); rows whose inputs run past the sequence see padding."""
        c = self.config
        B, T = tokens.shape
        nh, G, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        groups = nh // G
        padded = F.pad(tokens, (0, steps))  # [B, T + steps]: x_{T..} unknown, rows using them are masked
        rows = torch.arange(T, device=tokens.device)
        causal = rows.unsqueeze(1) >= rows.unsqueeze(0)  # [T, T]: row p sees step-0 keys 0..p
        scaled = features.reshape(B, T, -1).to(self.fc.dtype) * self.feature_scale  # [B, T, 3Ht]
        hidden = F.linear(scaled, self.fc)  # [B, T, H]
        keys, values, out = [], [], []
        for s in range(steps):
            emb = F.embedding(padded[:, s + 1: s + 1 + T], self.embed).to(hidden.dtype)  # token x_{p+s+1}
            normed = _rms(hidden, self.hidden_norm, eps)
            residual = normed if c.norm_before_residual else hidden
            x = torch.cat((_rms(emb, self.input_norm, eps), normed), dim=-1)  # [B, T, 2H]
            positions = (rows + s).expand(B, T)
            freqs = positions.unsqueeze(-1).float() * self.inv_freq
            angle = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, D]
            cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
            q = _rotate(F.linear(x, self.q_proj).view(B, T, nh, D).transpose(1, 2), cos, sin)  # [B, nh, T, D]
            k = _rotate(F.linear(x, self.k_proj).view(B, T, G, D).transpose(1, 2), cos, sin)  # [B, G, T, D]
            v = F.linear(x, self.v_proj).view(B, T, G, D).transpose(1, 2)
            keys.append(k.repeat_interleave(groups, dim=1))  # [B, nh, T, D]
            values.append(v.repeat_interleave(groups, dim=1))
            scale = 1.0 / math.sqrt(D)
            first = (q @ keys[0].transpose(-1, -2)) * scale  # [B, nh, T, T]
            first = first.masked_fill(~causal, float("-inf"))
            diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # s x [B, nh, T, 1]
            weights = torch.softmax(torch.cat([first, *diag], dim=-1), dim=-1)  # [B, nh, T, T + s]
            attn = weights[..., :T] @ values[0]  # [B, nh, T, D]
            for j, vj in enumerate(values[1:]):
                attn = attn + weights[..., T + j: T + j + 1] * vj
            h = residual + F.linear(attn.transpose(1, 2).reshape(B, T, nh * D), self.o_proj)
            m = _rms(h, self.post_norm, eps)
            h = h + F.linear(F.silu(F.linear(m, self.gate_proj)) * F.linear(m, self.up_proj), self.down_proj)
            out.append(F.linear(_rms(h, self.norm, eps), self.lm_head))  # [B, T, Vd]
            hidden = h  # the pre-norm output feeds the next step
        return out

    def ttt(self, features: torch.Tensor, tokens: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor,
            steps: int = 7, decay: float = 0.8) -> TTTOutput:
        """features [B, T, 3, Ht]; tokens [B, T]; target_logits [B, T, Vd]: the target's logits at
        position p (predicting x_{p+1}) over the draft vocabulary; valid [B, T] bool: position p's
        prediction counts. Step s, row p is scored against position p+s+1."""
        B, T = tokens.shape
        logits = self.unroll(features, tokens, steps)
        target_probs = torch.softmax(target_logits.float(), dim=-1)  # [B, T, Vd]
        target_top = target_logits.argmax(-1)  # [B, T]
        loss = features.new_zeros((), dtype=torch.float32)
        step_loss, step_acc, rows0, sums, counts = [], [], 0, [], []
        for s, head_logits in enumerate(logits):
            shift = s + 1
            if shift >= T:
                break
            mask = torch.zeros(B, T, dtype=torch.bool, device=tokens.device)
            mask[:, : T - shift] = valid[:, shift:]  # [B, T]: row p scored against position p+s+1
            n = int(mask.sum())
            if s == 0:
                rows0 = n
            counts.append(n)
            if n == 0:
                step_loss.append(0.0)
                step_acc.append(0.0)
                sums.append(loss.new_zeros(()) + 0.0 * head_logits.sum())  # keeps every step in the graph
                continue
            probs = torch.zeros_like(target_probs)
            probs[:, : T - shift] = target_probs[:, shift:]
            top = torch.zeros_like(target_top)
            top[:, : T - shift] = target_top[:, shift:]
            logp = torch.log_softmax(head_logits.float(), dim=-1)  # [B, T, Vd]
            per_row = -(probs * logp).sum(-1)  # [B, T]
            total = per_row[mask].sum()
            sums.append(total)
            mean = total / n
            loss = loss + (decay ** s) * mean
            step_loss.append(float(mean.detach()))
            step_acc.append(float((head_logits.argmax(-1) == top)[mask].float().mean()))
        return TTTOutput(loss=loss, step_loss=step_loss, step_acc=step_acc, rows=rows0, step_sums=sums,
                         step_rows=counts)

    # -- weights on disk (heads/eagle3/format.py reads them) ------------------------------------------
    _NAMES = {
        "fc": "fc.weight", "input_norm": "midlayer.input_layernorm.weight",
        "hidden_norm": "midlayer.hidden_norm.weight", "post_norm": "midlayer.post_attention_layernorm.weight",
        "q_proj": "midlayer.self_attn.q_proj.weight", "k_proj": "midlayer.self_attn.k_proj.weight",
        "v_proj": "midlayer.self_attn.v_proj.weight", "o_proj": "midlayer.self_attn.o_proj.weight",
        "gate_proj": "midlayer.mlp.gate_proj.weight", "up_proj": "midlayer.mlp.up_proj.weight",
        "down_proj": "midlayer.mlp.down_proj.weight", "norm": "norm.weight", "lm_head": "lm_head.weight",
    }

    def state_tensors(self, training: bool = False) -> dict[str, torch.Tensor]:
        """The head in the EAGLE layout: weights by their on-disk names (fc.weight with the input
        scale folded in), d2t (int64 offsets) and t2d (bool) when the draft vocabulary is smaller
        than the target's; no embedding. training=True (checkpoints): fc.weight as trained plus
        `train.feature_scale`, so that training resumes on the same parameters."""
        out = {disk: getattr(self, attr).detach().clone().contiguous() for attr, disk in self._NAMES.items()}
        if training:
            out["train.feature_scale"] = self.feature_scale.detach().clone()
        else:
            out["fc.weight"] = (self.fc.detach() * self.feature_scale).contiguous()  # [H, 3Ht]
        c = self.config
        if c.draft_vocab_size < c.vocab_size:
            used = self.used.cpu()
            out["d2t"] = used - torch.arange(used.numel())
            t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
            t2d[used] = True
            out["t2d"] = t2d
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy weights written by `state_tensors` into this head (same config); the vocab maps
        must name the same draft vocabulary."""
        missing = [disk for disk in self._NAMES.values() if disk not in tensors]
        if missing:
            raise ValueError(f"head tensors lack {', '.join(missing)}")
        if "d2t" in tensors:
            used = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
            if not torch.equal(used, self.used.cpu()):
                raise ValueError("the tensors' draft vocabulary (d2t) differs from this head's")
        with torch.no_grad():
            for attr, disk in self._NAMES.items():
                param = getattr(self, attr)
                if tuple(tensors[disk].shape) != tuple(param.shape):
                    raise ValueError(f"{disk} has shape {list(tensors[disk].shape)}, this head's is {list(param.shape)}")
                param.copy_(tensors[disk])
            if "train.feature_scale" in tensors:  # a checkpoint: fc as trained
                self.feature_scale.copy_(tensors["train.feature_scale"])
            else:  # an export: the scale is folded into fc.weight
                self.feature_scale.fill_(1.0)

    def export_config(self, **extra) -> dict:
        """config.json of the EAGLE layout (heads/eagle3/format.read_config reads it back)."""
        c = self.config
        config = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
            "norm_before_residual": c.norm_before_residual, "torch_dtype": "float32",
        }
        if c.layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.layer_ids),
                                      "eagle_aux_layer_semantics": c.layer_convention}
        config.update(extra)
        return config


# -- the training job (heads/trainable.py: what train/loop.py drives) ---------------------------
@dataclass
class Eagle3Job:
    model: Eagle3Trainable
    ttt_steps: int
    decay: float
    needs_logits = True
    first = 0

    def weights(self) -> list[float]:
        return [self.decay ** s for s in range(self.ttt_steps)]

    def step(self, tb, step: int, rank: int) -> StepOutput:
        r = self.model.ttt(tb.features, tb.tokens, tb.draft_logits, tb.valid, steps=self.ttt_steps, decay=self.decay)
        missing = self.ttt_steps - len(r.step_sums)  # steps past a short sequence
        zero = torch.zeros((), device=tb.tokens.device)
        return StepOutput(sums=list(r.step_sums) + [zero] * missing, rows=list(r.step_rows) + [0] * missing,
                          hits=[n * a for n, a in zip(r.step_rows, r.step_acc)] + [0.0] * missing)


def job(o, target, tokenizer, used: torch.Tensor, layer_ids=None) -> Eagle3Job:
    """The job of run options `o` (train/options.py) for `target` with draft vocabulary `used`
    [Vd]; layer_ids (vllm semantics) from a checkpoint or --init-from, else the default."""
    return Eagle3Job(Eagle3Trainable.for_target(target, used, seed=o.seed, layer_ids=layer_ids), o.ttt_steps, o.decay)
