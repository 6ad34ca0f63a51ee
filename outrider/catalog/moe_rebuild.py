"""The mixtures of experts made from the packaged dense models (issue 41 item 2), rebuilt on pull
from a split shipped in the package: no MoE weights ship, only each layer's neuron order and router.

    MOE_SPLITS["smollm2-135m-moe8"]        # base "smollm2-135m-instruct" + models/shipped/smollm2-135m-moe8
    write_moe(base_folder, shipped, part)  # config.json, model.safetensors, tokenizer files into `part`
    outrider models pull smollm2-135m-moe8 # catalog/composed.py: the base pulled, then this, then the marker

The shipped folder holds `split.safetensors` (train/moe_split.py's: perm [L, I] int32, router
[L, E, H], shared) and `recipe.json`: `files` (the split's sha256, checked by composed.py before
anything is written), `model_sha256` (the rebuilt model.safetensors', checked here after writing
it: train/moe_checkpoint.py's tensors of the pulled base, written by safetensors, are the same
bytes every time, so a different base or writer is refused, not run) and `top_k`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import ConfigError, ModelError
from ..train.moe_checkpoint import Split, moe_config, moe_tensors

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "shipped"
SPLIT = "split.safetensors"
MOE_SPLITS = {
    "smollm2-135m-moe8": ("smollm2-135m-instruct", SHIPPED / "smollm2-135m-moe8"),
    "qwen2.5-coder-0.5b-moe8": ("qwen2.5-coder-0.5b-instruct", SHIPPED / "qwen2.5-coder-0.5b-moe8"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def is_split(shipped: Path) -> bool:
    """True for a shipped folder that rebuilds an MoE (its recipe names the split), not a hybrid's layers."""
    return SPLIT in json.loads((Path(shipped) / "recipe.json").read_text()).get("files", {})


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def write_moe(base: Path, shipped: Path, part: Path) -> None:
    """Write the MoE of the dense model folder `base` split as `shipped` says into the (new, empty)
    folder `part`, and check the model file's sha256 against the recipe's; ModelError if it differs."""
    base, shipped, part = Path(base), Path(shipped), Path(part)
    recipe = json.loads((shipped / "recipe.json").read_text())
    try:
        t = load_file(str(shipped / SPLIT))
        split = Split(t["perm"].long(), t["router"].float(), int(t["shared"]))
    except (SafetensorError, KeyError, OSError) as err:
        raise ModelError(f"{shipped / SPLIT} cannot be read ({err}); reinstall outrider") from None
    raw = json.loads((base / "config.json").read_text())
    try:
        tensors = moe_tensors(load_file(str(base / "model.safetensors")), raw, split)
        config = moe_config(raw, split.experts, int(recipe["top_k"]), split.shared)
    except ConfigError as err:
        raise ModelError(f"{shipped / SPLIT} does not fit the model in {base}: {err}") from None
    save_file(tensors, str(part / "model.safetensors"))  # as train/moe_split.py writes it (no metadata)
    got = file_sha256(part / "model.safetensors")
    if got != recipe["model_sha256"]:
        raise ModelError(f"the MoE rebuilt from {base} and {shipped / SPLIT} has sha256 {got[:12]}..., recipe.json "
                         f"records {recipe['model_sha256'][:12]}...: repair the base with `outrider models pull "
                         f"{recipe.get('base', base.name)} --force`, then pull this model again")
    (part / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, part / name)
