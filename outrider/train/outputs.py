"""What a training run writes besides its checkpoints: the head (EAGLE layout, each file renamed
into place), train_info.json, and the log trimmed back on --resume."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .budget import reproduce


def write_head(folder: Path, model, info: dict | None = None) -> None:
    """The head in the EAGLE layout (config.json + model.safetensors), each file renamed into place."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    writers = [("config.json", lambda p: p.write_text(json.dumps(model.export_config(), indent=1))),
               ("model.safetensors", lambda p: save_file(
                   {k: v.cpu().contiguous() for k, v in model.state_tensors().items()}, str(p)))]
    for name, save in getattr(model, "extra_files", dict)().items():  # e.g. AdaFlash's length head
        writers.append((name, save))
    if info is not None:
        writers.append(("snapshot.json", lambda p: p.write_text(json.dumps(info))))
    for name, write in writers:
        tmp = folder / (name + ".tmp")
        write(tmp)
        os.replace(tmp, folder / name)


def export(out: Path, o, model, corpus, step, tokens, elapsed, last) -> dict:
    """The head in the EAGLE layout (config.json + model.safetensors) and train_info.json."""
    write_head(out, model)
    info = {"command": o.command, "target": o.target, "data": corpus.sources, "skipped_items": corpus.skipped,
            "seed": o.seed, "steps": step, "tokens": tokens, "time_s": round(elapsed, 1),
            "final_loss": last.get("loss"), "final_step_acc": last.get("step_acc"),
            "options": {k: v for k, v in asdict(o).items() if k != "command"}}
    if o.time_budget is not None:  # the same run with its step count fixed (no clock in it)
        info["reproduce"] = reproduce(o.command, o.steps, o.warmup_steps)
    (out / "train_info.json").write_text(json.dumps(info, indent=1))
    return info


def trim_log(path: Path, step: int) -> None:
    """Keep the log lines of steps up to `step` (a resumed run rewrites what came after its checkpoint)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))
