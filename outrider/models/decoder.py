"""The decoder-only transformer shared by the Llama, Qwen2 and Qwen3 families.

`Decoder.forward(batch, cache)` runs a batch of slots (see `batch.py`): it writes each new
token's K/V into its slot's cache rows, and returns logits for the rows asked for and hidden
states at the layers asked for, from the same pass. Nothing here reads a tensor back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import cache_dir, current, note_kernel
from ..kernels import cpu_linear, dispatch, quant_linear
from ..kernels.dispatch import PrefillPath
from .batch import ForwardBatch, pack
from .config import ModelConfig
from .attention_layer import SpanView, attention_mixer
from .delta_layer import DeltaWeights, delta_mixer
from .delta_state import DeltaState
from .family import GATED_DELTA
from .kv_cache import KVCache
from .latent_cache import LatentCache
from .latent_layer import LatentWeights, latent_mixer
from .layers import embedding, fold_mask, linear, rms_norm, rotary_tables, swiglu_mlp
from .moe_layer import MoeWeights, moe_mlp
from .paged_cache import PagedKVCache
from .paged_native import run_native
from .rope import frequencies
from .sandwich_layer import sandwich_layer
from .ring_attention import ring_views
from .sliding import sliding_views
from .sliding_state import SlidingState
from .state import HybridState

# The native layer's workspace for a prefill (every row's qkv, attention output, MLP activations
# and attention scores at once, float32; kernels/decoder_layer.py LayerCall) past which the prefill keeps
# the torch layers: 256 MB (the Qwen 1.5B's prompts up to ~1,400 tokens, SmolLM2's ~2,500).
NATIVE_FILL_FLOATS = 1 << 26


@dataclass
class LayerWeights:
    """One layer: a token mixer of its kind (attention: qkv .. k_norm, gate; gated delta: `delta`,
    the attention fields None), then an MLP of its kind (the SwiGLU's gate_up and down; a mixture of
    experts: `moe`, gate_up and down None)."""

    input_norm: torch.Tensor  # [E]
    qkv: torch.Tensor | None  # [(H + 2G) * D, E]
    qkv_bias: torch.Tensor | None  # [(H + 2G) * D]
    o: torch.Tensor | None  # [E, H * D]
    q_norm: torch.Tensor | None  # [D]
    k_norm: torch.Tensor | None  # [D]
    post_norm: torch.Tensor  # [E]
    gate_up: torch.Tensor | None  # [2I, E]
    down: torch.Tensor | None  # [E, I]
    gate: torch.Tensor | None = None  # [H * D, E]: attention's output gate (Qwen3.5)
    attn_out_norm: torch.Tensor | None = None  # [E]: the sandwich's norms on the attention's and the
    mlp_out_norm: torch.Tensor | None = None  # [E]  MLP's outputs (Gemma 3: sandwich_layer.py)
    delta: DeltaWeights | None = None  # a gated-delta layer's weights (delta_layer.py)
    moe: MoeWeights | None = None  # a mixture-of-experts MLP's weights (moe_layer.py)
    latent: LatentWeights | None = None  # a latent-attention layer's (latent_layer.py; `o` is its o_proj)

    @property
    def matrices(self) -> list:
        """Its projection weights (what the CPU product paths are measured on)."""
        mlp = self.moe.matrices if self.moe is not None else [self.gate_up, self.down]
        if self.delta is not None:
            return [self.delta.in_proj, self.delta.out, *mlp]
        if self.latent is not None:
            return [*self.latent.matrices, self.o, *mlp]
        return [m for m in (self.qkv, self.o, self.gate, *mlp) if m is not None]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, R, vocab] float32 (R = T when all rows were asked for); [N, vocab] for logits_flat
    hidden: dict[int, torch.Tensor]  # layer -> [B, T, E]
    # forward(attention=True) in the native layer: per batch entry, layer, K/V head and cache row,
    # the attention weights the entry's rows gave that key, summed over the rows and the K/V head's
    # query heads [B, layers, G, kv_len] float32; None when not asked or not the native layer
    attention: torch.Tensor | None = None


class Decoder:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor, quantization: str | None = None, *,
                 head_ids: torch.Tensor | None = None, kv_dtype: torch.dtype | None = None, drafter: bool = False):
        self.config = config
        self.embed = embed  # [vocab, E], or QuantBlocks when quantized
        self.layers = layers
        self.norm = norm  # [E]
        self.lm_head = lm_head  # [vocab, E]; the same tensor as embed when tied (a QuantLinear when quantized)
        self.quantization = quantization  # None, or "q8_0" / "q4": what load_decoder was asked for
        # long [n] sorted token ids when the head keeps only their rows (a drafter's reduced
        # vocabulary; logits column i is token head_ids[i]); None: every token, in id order
        self.head_ids = head_ids
        self._native = None  # kernels/decoder_layer.py NativeLayers, chosen at the first forward
        self._linear_paths_chosen = False
        self.vision = None  # a vision-language model's image side (models/vision_encoder.py VisionTower): the loader's
        # a draft model's: its prompt may be multiplied in bfloat16 (dispatch.Plan.prefill; its
        # numerics change only what it proposes, never what is committed)
        self.drafter_prefill_bf16 = drafter
        # set by an engine with the prefix cache (engine/prefix_cache.py exact_prefill): a prefill the
        # float GEMM would take by config gemm_prefill=auto runs in the native layer instead, the same
        # bits in any chunks
        self.exact_prefill = False
        # the K/V cache's dtype: None, the compute dtype; torch.float16 halves the bytes attention
        # reads (llama.cpp's default cache type; a model of its own, exact under speculation)
        self.kv_dtype = kv_dtype
        c = config
        # [rotary / 2] float32, and the factor cos and sin are scaled by (YaRN's; 1 otherwise)
        self.inv_freq, self.rope_scale = frequencies(c.rope, c.rotary, c.max_position_embeddings)
        self.inv_freq = self.inv_freq.to(embed.device)
        self.inv_freq_local = None  # the sliding-window layers' own RoPE (Gemma 3), and its scale
        if c.rope_local is not None:
            self.inv_freq_local, self.rope_scale_local = frequencies(c.rope_local, c.rotary, c.max_position_embeddings)
            self.inv_freq_local = self.inv_freq_local.to(embed.device)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations, K/V); quantized weights compute in it too."""
        return self.embed.dtype

    def new_cache(self, num_slots: int, max_len: int, num_layers: int | None = None, rings: bool = True,
                  pages: int | None = None, page_size: int = 16):
        """The slots' state for the first `num_layers` layers (all by default): a KVCache, or for a
        model with gated-delta layers a HybridState (models/state.py), or for one with sliding-window
        layers a SlidingState (their rows in rings of their window; config sliding_ring=off, or
        rings=False: a KVCache, every row kept and masked). pages: a PagedKVCache of that many
        pages of `page_size` rows instead (plain K/V models only: paged_cache.py)."""
        c = self.config
        upto = num_layers or c.num_layers
        dtype = self.kv_dtype or self.dtype
        if pages is not None:
            if c.delta is not None or c.mla is not None or c.layer_windows:
                kind = "gated-delta" if c.delta is not None else "latent" if c.mla is not None else "sliding-window"
                raise ValueError(f"paged K/V holds plain attention rows; this model's {kind} layers keep a "
                                 "per-slot state: run it without --kv-memory")
            return PagedKVCache(upto, num_slots, max_len, c.num_kv_heads, c.head_dim, dtype, self.device, pages,
                                page_size)
        if c.layer_windows and c.delta is None and c.mla is None and rings and current().sliding_ring:
            return SlidingState.build([c.window(l) for l in range(upto)], num_slots, max_len, c.num_kv_heads,
                                      c.head_dim, c.num_heads // c.num_kv_heads, dtype, self.device)
        if c.mla is not None:  # latent attention: one row of r + R dr a token and layer (latent_cache.py)
            return LatentCache(upto, num_slots, max_len, c.mla.row_width, dtype, self.device)
        if c.delta is None:
            return KVCache(upto, num_slots, max_len, c.num_kv_heads, c.head_dim, dtype, self.device)
        attention = [l for l in c.attention_layers if l < upto]
        kv = KVCache(len(attention), num_slots, max_len, c.num_kv_heads, c.head_dim, dtype, self.device)
        delta = DeltaState([l for l in range(upto) if c.kind(l) == GATED_DELTA], num_slots, c.delta,
                           self.dtype, self.device)
        return HybridState(kv, delta, attention, upto)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, num_layers: int | None = None,
                attention: bool = False, *, rows: torch.Tensor | None = None, head: bool = True) -> ForwardOutput:
        """Run the first `num_layers` layers (all by default), then the final norm and head.

        Fewer layers give the self-speculative early-exit drafter; it needs its own cache.
        attention: also return ForwardOutput.attention where the native layer runs the forward (the
        scores option, kernels/decoder_layer.py: the outputs are the same bits with it or without).
        A pipeline stage (cluster/pipeline_stage.py) holds some layers only: rows [B, T, E] enter its
        first layer in place of the tokens' embeddings (a stage after the first), and head=False
        stops after its last layer: logits None, those rows in hidden[len(layers)] (a stage before the last).
        """
        c = self.config
        self._choose_linear_paths()
        B, T = batch.tokens.shape
        native = self._native if not (attention and isinstance(cache, PagedKVCache)) else None
        if num_layers is None and native is not None and batch.fills_only:
            part = self._fill_part_rows(batch)
            if part is not None:  # one long prompt past the native workspace: in parts, the same bits
                return self._fill_in_parts(batch, cache, part, rows, head)
        cos, sin = rotary_tables(batch.positions, self.inv_freq, self.dtype, self.rope_scale)
        if rows is not None:  # a pipeline stage after the first: the previous stage's output rows
            return self._layers_and_head(batch, cache, rows, cos, sin, num_layers, attention, head, native, {})
        x = embedding(batch.tokens, self.embed)  # [B, T, E]
        if c.embed_scale:  # Gemma: times sqrt(E), the factor rounded to the embedding's dtype as transformers does
            x = x * torch.tensor(c.hidden_size ** 0.5, dtype=x.dtype)
        if c.embed_multiplier != 1.0:  # MiniCPM3's scale_emb, rounded to the embedding's dtype as transformers does
            x = x * torch.tensor(c.embed_multiplier, dtype=x.dtype)
        if batch.embeds is not None:  # a VLM's image rows in place of its image tokens' (models/image_prompt.py)
            x = x.reshape(B * T, -1).index_copy(0, batch.embeds[0], batch.embeds[1].to(x.dtype)).view(B, T, -1)
        hidden = {}
        if 0 in batch.hidden_layers:
            hidden[0] = x
        return self._layers_and_head(batch, cache, x, cos, sin, num_layers, attention, head, native, hidden)

    def _layers_and_head(self, batch: ForwardBatch, cache, x: torch.Tensor, cos, sin, num_layers, attention: bool,
                         head: bool, native, hidden: dict) -> ForwardOutput:
        """forward's layers over x [B, T, E], then (head) the final norm and head."""
        c = self.config
        B, T = batch.tokens.shape
        layers = self.layers[: num_layers or len(self.layers)]
        path = self.prefill_path(batch) if batch.fills_only and native is not None else None
        mass = at = None
        if native is not None and path is not PrefillPath.TORCH:  # one native call a span
            if attention:
                mass, at = self._attention_buffer(batch, cache, len(layers))
            fill = path.fill if path is not None else 0
            if isinstance(cache, PagedKVCache):  # its pages read in place (paged_native.py)
                x = run_native(self._native, self, batch, cache, x, cos, sin, len(layers), hidden, fill=fill,
                               mass=mass, mass_at=at)
            else:
                x = self._native.run(self, batch, cache, x, cos, sin, len(layers), hidden, fill=fill, mass=mass,
                                     mass_at=at)
        else:
            x = self._torch_layers(layers, batch, cache, x, cos, sin, hidden)
        if not head:  # a pipeline stage before the last: its rows go on to the next stage
            hidden[len(layers)] = x
            return ForwardOutput(logits=None, hidden=hidden, attention=mass)
        if batch.logits_flat is not None:  # real rows only: padding gets no lm_head
            x = x.reshape(B * T, x.shape[-1]).index_select(0, batch.logits_flat)  # [N, E]
        elif batch.logits_rows is not None:
            x = torch.gather(x, 1, batch.logits_rows.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = rms_norm(x, self.norm, c.rms_norm_eps)
        if c.logit_divisor != 1.0:  # MiniCPM3: hidden_size / dim_model_base
            x = x / c.logit_divisor
        logits = linear(x, self.lm_head).float()
        return ForwardOutput(logits=logits, hidden=hidden, attention=mass)

    def _attention_buffer(self, batch: ForwardBatch, cache: KVCache, layers: int) -> tuple:
        """The scores option's buffer [B, layers, G, kv_len] (zeros) and each row's entry [B * T]:
        its batch row, -1 for padding (rows written to the scratch row)."""
        B, T = batch.tokens.shape
        mass = torch.zeros(B, layers, self.config.num_kv_heads, batch.kv_len, dtype=torch.float32)
        entry = torch.arange(B).view(B, 1).expand(B, T)
        padding = (batch.rows == cache.scratch_row) | (batch.rows < 0)  # [B, T]
        return mass, torch.where(padding, -1, entry).reshape(B * T)

    def _torch_layers(self, layers, batch: ForwardBatch, cache, x: torch.Tensor, cos, sin,
                      hidden: dict) -> torch.Tensor:
        """`layers` over x [B, T, E] in torch ops (the reference for kernels/decoder_layer.py, and every
        prefill), each layer's mixer and MLP by its kind (attention_layer.py, delta_layer.py;
        layers.swiglu_mlp, moe_layer.py); hidden[l] gets
        x after layer l for l in batch.hidden_layers."""
        c = self.config
        H, G = c.num_heads, c.num_kv_heads
        first, span, place = batch.span_first, batch.span_size, batch.span_place
        mask = batch.attn_mask if place is None else _span_mask(batch.attn_mask, place, span)
        folded = None if mask is None else fold_mask(mask, H // G, self.dtype)  # once for all layers
        view = SpanView(mask, folded, place, first, span)
        deltas = [i for i in range(len(layers)) if layers[i].delta is not None]
        # the sliding-window layers' masks (Gemma 3, Mistral, Qwen2 with windows), made once
        # (in rings when the state keeps them so: ring_attention.py; else masks over every row: sliding.py)
        windowed = {}
        if isinstance(cache, SlidingState):
            windowed = ring_views(batch, cache, self.dtype, _span_mask)
        elif c.layer_windows:
            windowed = sliding_views(batch, c, self.dtype, view, _span_mask)
        if c.sandwich_norms:  # Gemma 3: its sliding-window layers' RoPE tables
            local = (cos, sin) if self.inv_freq_local is None else rotary_tables(
                batch.positions, self.inv_freq_local, self.dtype, self.rope_scale_local)
        with quant_linear.filling(batch.fills_only, bf16=self.drafter_prefill_bf16):  # many rows: a GEMM
            for index, w in enumerate(layers):
                if c.sandwich_norms:  # sandwich_layer.py, with the layer's window and RoPE
                    window = c.window(index)
                    x = sandwich_layer(w, c, x, batch, cache, index, *(local if window else (cos, sin)),
                                       windowed[window] if window else view)
                    if index + 1 in batch.hidden_layers:
                        hidden[index + 1] = x
                    continue
                h = rms_norm(x, w.input_norm, c.rms_norm_eps)
                if w.delta is not None:
                    x = x + delta_mixer(w.delta, c.delta, h, batch, cache, index, c.rms_norm_eps,
                                        last_delta_layer=index == deltas[-1])
                elif w.latent is not None:
                    x = _residual(x, latent_mixer(w, c, h, batch, cache, index, cos, sin, view), c.residual_scale)
                else:
                    x = x + attention_mixer(w, c, h, batch, cache, index, cos, sin, windowed.get(c.window(index), view))
                h = rms_norm(x, w.post_norm, c.rms_norm_eps)
                mlp = swiglu_mlp(h, w.gate_up, w.down) if w.moe is None else moe_mlp(w.moe, c.moe, h)
                x = _residual(x, mlp, c.residual_scale)
                if index + 1 in batch.hidden_layers:
                    hidden[index + 1] = x
        return x

    def _fill_rows_floats(self, rows: int, kv_len: int) -> int:
        """The native layer's workspace for a prefill of `rows` rows over `kv_len` cache rows, in
        floats (LayerCall.work's)."""
        c = self.config
        per_row = ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim + c.hidden_size
                   + 3 * c.intermediate_size + c.num_heads * (kv_len + 8))
        return rows * per_row

    def _fill_part_rows(self, batch: ForwardBatch) -> int | None:
        """Rows a part when one sequence's prefill would take the native layer but for its workspace
        (past NATIVE_FILL_FLOATS), so that it is filled in parts of the native layer rather than by
        the torch layers (with outrider_qmatmul's products the parts give the bits of a whole
        prefill; on the tile unit a last part under TILE_ROWS rows takes the row kernel); None
        otherwise."""
        if (batch.tokens.shape[0] != 1 or batch.attn_mask is not None or batch.hidden_layers
                or batch.span_place is not None or batch.embeds is not None):
            return None
        if self._fill_rows_floats(batch.tokens.shape[1], batch.kv_len) <= NATIVE_FILL_FLOATS:
            return None
        part = NATIVE_FILL_FLOATS // self._fill_rows_floats(1, batch.kv_len)
        return part if part >= 1 and self._cpu_prefill(part) is not PrefillPath.TORCH else None

    def _fill_in_parts(self, batch: ForwardBatch, cache: KVCache, part: int, rows: torch.Tensor | None = None,
                       head: bool = True) -> ForwardOutput:
        """One sequence's cache filled `part` rows at a time (its rows consecutive cache rows);
        rows, head: a pipeline stage's (forward), its rows [1, T, E] cut the same way and, without
        the head, its output rows joined again."""
        slot, start = batch.slot_ids[0], int(batch.rows[0, 0])
        tokens = batch.tokens[0]
        out, outs = None, []
        for i in range(0, tokens.shape[0], part):
            piece = pack([slot], [start + i], [tokens[i:i + part]], logits="none", device=tokens.device)
            if rows is None and head:
                out = self.forward(piece, cache)
            else:  # a pipeline stage's part
                out = self.forward(piece, cache, rows=None if rows is None else rows[:, i:i + part], head=head)
            outs.append(out)
        if not head:
            key = len(self.layers)
            out.hidden[key] = torch.cat([o.hidden[key] for o in outs], dim=1)  # [1, T, E]
        return out

    def prefill_path(self, batch: ForwardBatch) -> PrefillPath:
        """How a prefill (a forward that only fills the cache) runs: the CPU's rule
        (kernels/dispatch.py Plan.prefill: tiles, the native layer's row and fill kernels, or the
        torch layers and their float GEMM), or the torch layers where the native layer does not
        run this model or its workspace would pass NATIVE_FILL_FLOATS."""
        self._choose_linear_paths()
        if self._native is None or self._fill_rows_floats(batch.tokens.numel(), batch.kv_len) > NATIVE_FILL_FLOATS:
            return PrefillPath.TORCH
        path = self._cpu_prefill(batch.tokens.numel())
        if path in (PrefillPath.TILES, PrefillPath.TILES_BF16):
            note_kernel("matmul_amx.c (prefill)")
        return path

    def _cpu_prefill(self, rows: int) -> PrefillPath:
        """The CPU's rule for a prefill of `rows` rows in this model (its weights' layout, whether
        it is a drafter's)."""
        plan = dispatch.plan()
        path = plan.prefill(rows, lanes=self._native.lanes, drafter=self.drafter_prefill_bf16)
        if (path is PrefillPath.TORCH and getattr(self, "exact_prefill", False) and current().gemm_prefill == "auto"
                and not plan.lossy_bf16 and not (self.drafter_prefill_bf16 and plan.drafter_bf16)):
            return PrefillPath.NATIVE  # the GEMM's bits depend on the chunk; the prefix cache needs them not to
        return path

    def _choose_linear_paths(self) -> None:
        """Measure the CPU's fastest matrix-product path for this model's weight shapes, once per
        process and shape (cpu_linear.py), before the first product uses one; and take the native
        layer (kernels/decoder_layer.py) when every layer's matrices run in the native kernel (set
        config native_layer off for the torch layer: the reference, and a measurement baseline).
        Done once, at the first forward or the first question about paths."""
        if self._linear_paths_chosen:
            return
        from ..kernels.decoder_layer import NativeLayers

        self._native = NativeLayers.of(self)
        if self._native is not None:
            note_kernel("decoder_layer.c" + (" (int8 activations)" if self._native.lanes else ""))
        if self.device.type == "cpu":
            weights = [t for w in self.layers for t in w.matrices] + [self.lm_head]
            cpu_linear.prepare(weights, cache_dir() / "profiles")
        self._linear_paths_chosen = True


def _residual(x: torch.Tensor, branch: torch.Tensor, scale: float) -> torch.Tensor:
    """x + branch, the branch times `scale` first where it is not 1 (MiniCPM3's scale_depth / sqrt(layers))."""
    return x + branch if scale == 1.0 else x + branch * scale


def _span_mask(mask: torch.Tensor, place: torch.Tensor, span: int) -> torch.Tensor:
    """[B, 1, T, L] bool -> [S, 1, T, L]: batch row b at span row place[b]; a hole sees row 0 only."""
    out = torch.zeros((span, *mask.shape[1:]), dtype=torch.bool, device=mask.device)
    out[..., 0] = True
    return out.index_copy_(0, place, mask)
