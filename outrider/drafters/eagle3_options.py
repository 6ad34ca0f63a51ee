"""`--drafter eagle3:PATH_OR_NAME[@DTYPE][,window=W[,sink=S]][,vocab=N]`: the argument of the
EAGLE-3 drafter (eagle3.py), the dtype its head drafts in, and whether a head fits a target,
all decided before anything loads.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..heads.catalog import resolve_head
from ..heads.eagle3.format import HEAD_QUANTS, misfit, read_config
from .dflash_vocab import parse_vocab
from .window import Window, parse_options, window_misfit, window_of

HEAD_DTYPES = HEAD_QUANTS + ("float",)  # `eagle3:PATH@DTYPE`: float = the target's own float dtype


USAGE = "eagle3:PATH_OR_NAME[@DTYPE][,window=W[,sink=S]][,vocab=N]"
OPTIONS = ("window", "sink", "vocab")


def parse_argument(text: str) -> str:
    """`PATH_OR_NAME[@DTYPE][,window=W[,sink=S]][,vocab=N]`: a head folder, or a shipped head by
    its target's catalog name (heads/catalog.py); DTYPE one of HEAD_DTYPES (default: see
    `head_dtype`); vocab=N: the readout cut to the draft tokens among target ids 0..N-1 and the
    added tokens (heads/eagle3/vocab.py). Returns the folder, with the @DTYPE kept when given, then
    the options."""
    options = {}
    if not Path(text).expanduser().is_dir():
        text, options = parse_options(text, OPTIONS)
    window = window_of(options, "eagle3:NAME")
    vocab = parse_vocab(options.get("vocab"), "eagle3")
    name, at, dtype = text.rpartition("@") if "@" in text and not Path(text).expanduser().is_dir() else (text, "", "")
    if at and dtype not in HEAD_DTYPES:
        raise ConfigError(f"eagle3:{text}: the head's dtype after '@' must be one of {', '.join(HEAD_DTYPES)}")
    if not name:
        raise ConfigError("eagle3:PATH needs the folder of an EAGLE-3 head (config.json + model.safetensors) "
                          "or the name of a shipped head")
    return (str(resolve_head(name)) + (f"@{dtype}" if at else "") + (f",{window}" if window else "")
            + (f",vocab={vocab}" if vocab else ""))


def split_dtype(argument: str) -> tuple[str, str | None]:
    """parse_argument's result less its window -> (folder, dtype or None); a folder whose own name
    holds '@' stays whole."""
    path, at, dtype = argument.rpartition("@")
    return (path, dtype) if at and dtype in HEAD_DTYPES and not Path(argument).is_dir() else (argument, None)


def argument_options(argument: str) -> tuple[str, Window | None, int | None]:
    """parse_argument's result -> (the rest, its window or None, its vocab= or None)."""
    if Path(argument).is_dir():
        return argument, None, None
    rest, options = parse_options(argument, OPTIONS)
    return rest, window_of(options, "eagle3:NAME"), parse_vocab(options.get("vocab"), "eagle3")


def head_dtype(asked: str | None, target) -> str | None:
    """The kind the head's matrices are kept in (None: the target's float dtype). By default q4_0
    beside a target whose weights are kept quantized on a CPU where the native kernel runs: the
    head then reads an eighth of the float32 bytes per drafting step and drafts as well (q4_0,
    q4_1 and q8_0 heads compared: docs/benchmarks/2026-11-30-intel-xeon-avx512-amx.md,
    EAGLE-3 preset, "The head's precision"); otherwise float, as the target computes."""
    from ..kernels import native

    if asked is not None:
        return None if asked == "float" else asked
    if target.quantization is not None and target.device.type == "cpu" and native.available():
        return "q4_0-i8" if target.quantization.endswith("-i8") else "q4_0"  # as the target multiplies
    return None


def check_fits(path: str, target_config, target_path: Path) -> str | None:
    path, window, _ = argument_options(path)
    return window_misfit(window, target_config) or misfit(read_config(split_dtype(path)[0]), target_config,
                                                          has_embed=True, has_lm_head=True)  # tensors: at load
