"""`outrider models list | pull | import | path`: the sub-commands' handlers (the parser is
outrider/cli.py's)."""

from __future__ import annotations

import sys

def list_command(args) -> int:
    from ..heads.catalog import drafters_for
    from .resolve import list_models
    from .imported import list_imported

    from ..weights.loader import auto_dtype

    rows = list_models()
    header = ("name", "params", "size", "licence", "present", "dtype", "drafters")
    present = {"pulled": "yes", "not pulled": "no"}

    def dtype(r):  # what it runs in by default on this machine (loader.auto_dtype)
        return (auto_dtype(r["path"], "cpu") or "float32") if r["state"] == "pulled" else "-"

    table = [header] + [(r["name"], str(r["params"]), str(r["size"]), str(r["licence"]),
                         present.get(r["state"], f"damaged: run outrider models pull {r['name']}"), dtype(r),
                         " ".join(drafters_for(r["name"])) or "-")  # shipped heads (heads/catalog.py)
                        for r in rows]
    for r in list_imported():  # GGUFs of one's own (`models import`); damaged: the GGUF gone or changed since
        present = f"damaged: {r['problem']}" if r["problem"] else "imported"
        table.append((r["name"], "-", f"{r['size'] / 1e6:.0f} MB", "-", present,
                      dtype({**r, "state": "damaged" if r["problem"] else "pulled"}), "-"))
    from .composed import COMPOSED, composed_path, is_composed
    from .packages import CATALOG

    for name, (base, _) in COMPOSED.items():  # a pulled base plus shipped layers or an MoE split (composed.py)
        pulled = is_composed(composed_path(name))
        table.append((name, CATALOG[base].params, "-", f"as {base}", "yes" if pulled else "no",
                      "float32" if pulled else "-", " ".join(drafters_for(name)) or "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    from ..kernels import native

    print(native.describe(), file=sys.stderr)  # why a GGUF model's default dtype is what it is here
    return 0


def pull_command(args) -> int:
    from .pull import pull

    print(pull(args.name, log=lambda msg: print(msg, file=sys.stderr), force=args.force))
    return 0


def import_command(args) -> int:
    from .imported import import_gguf

    print(import_gguf(args.file, args.name, args.force, log=lambda msg: print(msg, file=sys.stderr)))
    return 0


def path_command(args) -> int:
    from .resolve import resolve_model

    print(resolve_model(args.name))
    return 0


def check_command(args) -> int:
    """One line: what of a model folder is not supported (the architecture, a config field, a
    tensor), or that it runs, with what it is; exit 1 when it does not."""
    from ..errors import ModelError
    from ..weights.loader import load_decoder
    from .resolve import resolve_model

    try:
        folder = resolve_model(args.model)  # a GGUF of one's own is imported: its metadata read, its tensors named
        model = load_decoder(folder, shapes_only=True)  # safetensors or the GGUF: names and shapes
    except ModelError as err:
        print(f"unsupported: {err}")
        return 1
    c = model.config
    kinds = sorted(set(c.layer_kinds or ("attention",)))
    rope = c.rope.rope_type + (f", rotary {c.rotary} of {c.head_dim}" if c.rotary != c.head_dim else "")
    if c.layer_windows:  # Gemma 3: the sliding-window layers, and their own RoPE base
        sliding = [w for w in c.layer_windows if w]
        kinds = [f"attention, {len(sliding)} of them within a window of {max(sliding)}" if sliding else "attention"]
        rope += f" (theta {c.rope.theta:g}; sliding layers {c.rope_local.theta:g})" if c.rope_local else ""
    if c.mla is not None:  # latent attention: what a token keeps a layer
        m = c.mla
        kinds = [f"latent attention, rank {m.kv_rank} + {m.rope_heads} x {m.rope_dim} rotated: {m.row_width} "
                 "values a token and layer"]
    moe = ""
    if c.moe is not None:  # which layers' MLPs are mixtures of experts, and of what
        sparse = sum(c.mlp_kind(i) == "moe" for i in range(c.num_layers))
        groups = f" in {c.moe.topk_group} of {c.moe.n_group} groups" if c.moe.n_group > 1 else ""
        scaled = f", times {c.moe.routed_scale:g}" if c.moe.routed_scale != 1.0 else ""
        scored = f" by {c.moe.scoring}" if c.moe.scoring != "softmax" else ""
        moe = (f", MoE MLPs in {sparse} layers ({c.moe.num_experts} experts, top {c.moe.top_k}{groups}{scored}"
               f"{scaled}{', a shared expert' if c.moe.shared_size else ''})")
    windows = _window_bytes(c) if c.layer_windows and c.mla is None and c.delta is None else ""
    v = c.vision  # a vision-language model's tower (models/vision_encoder.py)
    vision = (f", a vision tower ({v.num_layers} layers, {v.image_size} x {v.image_size} tiles of "
              f"{v.rows_per_image} image tokens)" if v is not None else "")
    print(f"supported: {folder}: {c.architecture}, {c.num_layers} layers ({', '.join(kinds)}){moe}, "
          f"hidden {c.hidden_size}, vocab {c.vocab_size}, RoPE {rope}{windows}{vision}")
    return 0


def _window_bytes(c) -> str:
    """K/V bytes a token with every row kept, and with the sliding layers in rings (float32;
    models/sliding_state.py)."""
    from ..models.ring_cache import ROWS

    row = 2 * c.num_kv_heads * c.head_dim * 4  # K and V of one position in one layer, float32
    sliding = [w for w in c.layer_windows if w]
    rings = sum(row * (w - 1 + min(ROWS, w) + 1) for w in sliding)
    return (f"; K/V (float32) {row * c.num_layers / 1024:g} KiB a token with every row kept, with the "
            f"{len(sliding)} sliding layers in rings {row * (c.num_layers - len(sliding)) / 1024:g} KiB a token "
            f"+ {rings / (1 << 20):.2f} MiB a slot (config sliding_ring)")
