"""Check tests/qwen35_gguf.py (our writer of a Qwen3.5 / Qwen3-Next GGUF in llama.cpp's converter's layout)
against the real converter, and Outrider's load of the converter's own output against the
safetensors it came from.

    .venv/bin/python scripts/check_qwen35_gguf_layout.py --llama-cpp DIR [--tokenizer DIR]

DIR: llama.cpp's source tree with convert_hf_to_gguf.py and gguf-py (llama-cpp-python's sdist
vendors one: `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`, unpacked,
vendor/llama.cpp). The converter refuses a tokenizer it does not know, so the tiny model takes a
real BPE tokenizer's files (--tokenizer, default: the pulled SmolLM2's) and its vocab_size
(49,152). Norm weights, A_log and dt_bias are drawn at random (transformers initialises them to
constants), so the +1 folding and the value-head reorder are seen; a multi-token-prediction head
(`mtp.*`: one attention layer, fc and its norms, as Qwen3.5 checkpoints keep one and transformers
does not save it) is added to the folder.

For --outtype f32 and q8_0 with --no-mtp, and f32 with the MTP head kept (the converter's
default; f32 and q8_0 are the types the converter writes itself, others come from llama.cpp's C++
quantizer), and for a tiny Qwen3-Next (every MLP a mixture of experts: the converter has no names
for a dense one) at f32 and q8_0 with --no-mtp, it checks: every tensor's name, type, shape and bytes equal between the
converter's file and ours; the model's metadata (`qwen35.*`) equal; and the converter's file
imported into Outrider gives the safetensors load's logits (f32: bit for bit; q8_0: the float model
of the same file's values, dequantized, within float rounding). Prints one line a check; exit 1 on
any difference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def build(folder: Path, tokenizer: Path, family: str = "qwen3_5") -> None:
    from safetensors.torch import load_file, save_file

    from tiny import make_tiny

    make_tiny(family, folder, vocab=49152, layers=4, **({"mlp_only_layers": []} if family == "qwen3_next" else {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if t.dim() == 1:  # norms, A_log, dt_bias: random instead of transformers' constants
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
    E = tensors["model.norm.weight"].shape[0]
    if family == "qwen3_next":  # (its MTP head: not checked here; the naming is Qwen3.5's)
        save_file(tensors, str(path), metadata={"format": "pt"})
        return
    for name in [n for n in tensors if n.startswith("model.layers.3.")]:  # an attention layer's tensors
        tensors["mtp.layers.0." + name.removeprefix("model.layers.3.")] = torch.randn(tensors[name].shape, generator=g)
    tensors["mtp.fc.weight"] = torch.randn(E, 2 * E, generator=g)
    for part in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{part}.weight"] = torch.randn(E, generator=g) * 0.3
    save_file(tensors, str(path), metadata={"format": "pt"})


def convert(llama_cpp: Path, folder: Path, out: Path, outtype: str, mtp: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out),
           "--outtype", outtype] + ([] if mtp else ["--no-mtp"])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the converter failed:\n{done.stderr[-3000:]}")


def compare(theirs: Path, ours: Path) -> list[str]:
    import gguf

    a, b = gguf.GGUFReader(str(theirs)), gguf.GGUFReader(str(ours))
    problems = []
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if set(ta) != set(tb):
        problems.append(f"tensor names differ: only theirs {sorted(set(ta) - set(tb))}, only ours {sorted(set(tb) - set(ta))}")
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            problems.append(f"{name}: {x.tensor_type.name} {list(x.shape)} vs ours {y.tensor_type.name} {list(y.shape)}")
        elif not np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            problems.append(f"{name}: bytes differ")
    arch = a.fields["general.architecture"].contents()  # the model's metadata: "<arch>.*"
    ma = {k: f.contents() for k, f in a.fields.items() if k.startswith(arch + ".") or k == "general.architecture"}
    mb = {k: f.contents() for k, f in b.fields.items() if k.startswith(arch + ".") or k == "general.architecture"}
    for k in sorted(set(ma) | set(mb)):
        if ma.get(k) != mb.get(k):
            problems.append(f"metadata {k}: {ma.get(k)!r} vs ours {mb.get(k)!r}")
    return problems


def gguf_names(path: Path) -> list[str]:
    import gguf

    return [t.name for t in gguf.GGUFReader(str(path)).tensors]


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    from outrider.models.batch import pack

    cache = model.new_cache(1, len(tokens) + 1)
    return model.forward(pack([0], [0], [tokens], scratch_row=cache.scratch_row), cache).logits[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=Path.home() / ".cache/outrider/models/smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="qwen35-gguf-"))
    os.environ["OUTRIDER_CACHE_DIR"] = str(work / "cache")
    from outrider.catalog.imported import import_gguf
    from outrider.weights.loader import load_decoder
    from qwen35_gguf import write_qwen35_gguf

    tokens = torch.tensor([3, 9, 4, 11, 7, 8, 20, 5, 3, 9, 60, 61, 62, 63, 12, 30, 31, 2, 9, 4])
    folders, wants = {}, {}
    for family in ("qwen3_5", "qwen3_next"):
        folders[family] = work / family
        build(folders[family], args.tokenizer, family)
        wants[family] = logits(load_decoder(folders[family], "cpu", torch.float32), tokens)
    failed = False
    cases = [("qwen3_5", "f32", "F32", False), ("qwen3_5", "q8_0", "Q8_0", False), ("qwen3_5", "f32", "F32", True),
             ("qwen3_next", "f32", "F32", False), ("qwen3_next", "q8_0", "Q8_0", False)]
    for family, outtype, qtype, mtp in cases:
        folder, want = folders[family], wants[family]
        case = f"{family} {outtype}" + (" with the MTP head" if mtp else "")
        stem = f"{family}-{outtype}{'-mtp' if mtp else ''}"
        theirs, ours = work / f"converter-{stem}.gguf", work / f"ours-{stem}.gguf"
        convert(args.llama_cpp, folder, theirs, outtype, mtp)
        write_qwen35_gguf(folder, ours, qtype, tokenizer=False, mtp=mtp)
        problems = compare(theirs, ours)
        failed |= bool(problems)
        count = len(gguf_names(theirs))
        print(f"{case}: layout " + (f"equal ({count} tensors' names, types, shapes, bytes; the model's metadata)"
                                    if not problems else "DIFFERS: " + "; ".join(problems)))
        imported = import_gguf(theirs, name=f"converter-{stem}", log=lambda line: None)
        got = logits(load_decoder(imported, "cpu", torch.float32), tokens)
        if outtype == "f32":
            same = torch.equal(got, want)
            failed |= not same
            print(f"{case}: converter's file in Outrider vs the safetensors load: "
                  f"{'bit-equal logits' if same else 'DIFFER by %g' % (got - want).abs().max()}")
        else:
            blocks = logits(load_decoder(imported, "cpu", "gguf"), tokens)
            diff = float((blocks - got).abs().max())
            failed |= diff > 1e-4
            print(f"{case}: --dtype gguf (its blocks) vs float32 (its values dequantized): max |diff| {diff:.2e}; "
                  f"vs the unquantized safetensors: {float((got - want).abs().max()):.3f} (Q8_0's own error)")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
