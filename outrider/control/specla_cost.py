"""SpecLA's verify cost: the bytes one verify forward reads and writes, by the target's layers'
state, and the flops it does, priced on a roofline calibrated on this machine.

One verify forward of N tree nodes (the root counted) over a sequence of `context` committed
positions, per layer kind (shapes from the model's config; E hidden, V vocabulary, I the MLP's):

    weights        every matrix once a forward, as stored (float32, bfloat16 or quantized blocks)
    gated delta    fixed:    the committed state S [HV, dk, dv] read, the convolution's last K - 1
                             inputs [K - 1, C] read, and at commit S read and written (the fold)
                   per node, compact factors (TreeWY, ours): the node's stash written, HV (dk + dv
                             + 1) values (k in float32, u and gamma in the state's dtype, as
                             DeltaState.hold keeps them), and its convolution input [C]
                   per node, snapshots (the baseline SpecLA and TreeWY replace): the node's own
                             state [HV, dk, dv] and window [K - 1, C] written, then read by its
                             children or the commit
    attention      fixed:    the context's K/V rows read, context x 2 G D
                   per node: the node's K/V row written, 2 G D

    flops          per node: 2 x the matrices' weights (the products), 4 H D context per attention
                   layer, ~6 HV dk dv per gated-delta layer (S^T k, S^T q, the solve's rank-1 terms)

`Roofline.time(bytes, flops) = max(bytes / bandwidth, flops / rate)`: a forward is bound by
memory or by arithmetic, whichever is slower. `calibrate` takes the bandwidth and the rate this
machine reached on the target's measured verify-cost profile (control/profile.py): the most
bytes a second and the most flops a second of any measured size, so the roofline meets the
profile where each bound binds (few nodes: memory, the weights read once; many: arithmetic).
On an H100 the memory bound holds far further; per-node state bytes then price the tree (the
paper's setting); on a 2-core CPU arithmetic binds after a few nodes (docs/methods.md, SpecLA).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.family import GATED_DELTA

LAYOUTS = ("factors", "snapshots")  # compact factors (TreeWY's stash) or per-node state snapshots


@dataclass(frozen=True)
class StateBytes:
    """A target's verify traffic by layer kind (the module's notes). Element sizes in bytes:
    `state` the recurrent state's and stash's (8: ours, float64), `act` activations' (the
    convolution inputs), `kv` the K/V cache's."""

    weight_bytes: int  # every matrix (and the output head) once
    weight_params: int  # their parameter count (2 flops each a row)
    delta_layers: int
    attention_layers: int
    HV: int = 0
    dk: int = 0
    dv: int = 0
    conv_dim: int = 0
    conv_kernel: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    state: int = 8
    act: int = 4
    kv: int = 4

    @staticmethod
    def of_config(config, weight_bytes: int | None = None, weight_element: float = 4.0, state: int = 8,
                  act: int = 4, kv: int = 4) -> "StateBytes":
        """From a ModelConfig; `weight_bytes` as held (default: parameters x weight_element)."""
        c = config
        E, I, H, G, D = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
        deltas = sum(1 for i in range(c.num_layers) if c.kind(i) == GATED_DELTA)
        attentions = c.num_layers - deltas
        params = c.num_layers * 3 * E * I + c.vocab_size * E  # MLPs, output head
        params += attentions * ((H + 2 * G) * D * E + E * H * D + (H * D * E if c.attn_output_gate else 0))
        d = c.delta
        if d is not None:
            params += deltas * ((d.conv_dim + 2 * d.num_v_heads * d.v_head_dim + 2 * d.num_v_heads) * E)
        kw = {} if d is None else dict(HV=d.num_v_heads, dk=d.k_head_dim, dv=d.v_head_dim, conv_dim=d.conv_dim,
                                       conv_kernel=d.conv_kernel)
        return StateBytes(int(weight_bytes if weight_bytes is not None else params * weight_element), params,
                          deltas, attentions, heads=H, kv_heads=G, head_dim=D, state=state, act=act, kv=kv, **kw)

    @staticmethod
    def of_model(model, state: int = 8) -> "StateBytes":
        """From a loaded Decoder: its weights' bytes as it holds them (quantized blocks counted as
        stored), its K/V dtype, its activations' dtype."""
        held = [m for w in model.layers for m in w.matrices] + [model.lm_head]
        act = model.dtype.itemsize
        kv = (model.kv_dtype or model.dtype).itemsize
        return StateBytes.of_config(model.config, sum(_nbytes(m) for m in held), state=state, act=act, kv=kv)

    # -- bytes -------------------------------------------------------------------------------------
    def node_bytes(self, layout: str = "factors") -> int:
        """Bytes a tree node adds to a verify: its gated-delta state (compact factors or a
        snapshot written and read once) and its attention K/V row."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
        if layout == "factors":
            delta = self.HV * (4 * self.dk + (self.dv + 1) * self.state) + self.conv_dim * self.act
        else:
            delta = 2 * (self.HV * self.dk * self.dv * self.state + (self.conv_kernel - 1) * self.conv_dim * self.act)
        return self.delta_layers * delta + self.attention_layers * 2 * self.kv_heads * self.head_dim * self.kv

    def fixed_bytes(self, context: int) -> int:
        """Bytes a verify reads and writes whatever its size: the weights, each gated-delta layer's
        committed state and window (read, and the state written back at commit), the context's K/V."""
        S = self.HV * self.dk * self.dv * self.state
        delta = 3 * S + (self.conv_kernel - 1) * self.conv_dim * self.act
        return (self.weight_bytes + self.delta_layers * delta
                + self.attention_layers * context * 2 * self.kv_heads * self.head_dim * self.kv)

    def bytes(self, nodes: int, context: int, layout: str = "factors") -> int:
        return self.fixed_bytes(context) + nodes * self.node_bytes(layout)

    def flops(self, nodes: int, context: int) -> float:
        per_node = (2.0 * self.weight_params + self.attention_layers * 4.0 * self.heads * self.head_dim * context
                    + self.delta_layers * 6.0 * self.HV * self.dk * self.dv)
        return nodes * per_node

    def state_share(self, nodes: int, context: int, layout: str = "factors") -> float:
        """The part of a verify's bytes that is state (everything but the weights)."""
        total = self.bytes(nodes, context, layout)
        return (total - self.weight_bytes) / total


def _nbytes(weight) -> int:
    n = getattr(weight, "nbytes", None)
    if callable(n):  # QuantLinear, QuantBlocks: as the kernel keeps it
        return int(n())
    return int(n) if n is not None else int(weight.numel() * weight.element_size())


@dataclass(frozen=True)
class Roofline:
    bandwidth: float  # bytes a second
    rate: float  # flops a second

    def time(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.rate)

    def bound(self, nbytes: float, flops: float) -> str:
        """Which floor binds: "memory" or "arithmetic"."""
        return "memory" if nbytes / self.bandwidth >= flops / self.rate else "arithmetic"


def calibrate(state: StateBytes, profile, context: int = 256) -> Roofline:
    """The bandwidth and flop rate this machine reached in the target's verify-cost profile
    (sizes n: seconds, measured at `context` committed positions: control/profile.py)."""
    bandwidth = max(state.bytes(n, context) / t for n, t in zip(profile.sizes, profile.seconds))
    rate = max(state.flops(n, context) / t for n, t in zip(profile.sizes, profile.seconds))
    return Roofline(bandwidth, rate)
