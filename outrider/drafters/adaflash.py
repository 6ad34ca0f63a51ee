"""`--drafter adaflash:PATH_OR_NAME[,length=FILE|off][,margin=M][,vocab=N]`: a DFlash block head whose
blocks are cut to the length AdaFlash's length head predicts (heads/dflash/length_head.py).

PATH_OR_NAME is a DFlash head (as `dflash:`: a folder in z-lab's layout or a shipped head's
name) with its length head beside it (`adaflash.safetensors`, written by `outrider train dflash
--objective length --init-from HEAD`); for a shipped head's name, the length head shipped for it
(`heads/shipped/adaflash/<name>/adaflash.safetensors`, recipe.json beside it); `length=FILE` names
another, `length=off` drafts as plain `dflash:` does (the OPD-trained head alone). Each round the head drafts its block in one forward
(drafters/dflash.py) and the length head reads the block's hidden states (mean-pooled and last
row) to choose how many of its K = B-1 tokens the target verifies:
`clamp(round(ratio * K) + margin, 1, K)` (margin default 1), within the controller's depth. The
cut is decided from draft-side features before the target runs and the target verifies a prefix
of the block, so speculation stays exact: greedy output is token for token plain decoding's, and a
sampled chain is still drawn from each position's q (it is only shorter).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree
from .block import Block
from .capabilities import Capabilities
from .dflash import TREES, DFlashDrafter
from .dflash_vocab import parse_vocab, reduce_readout
from .registry import DrafterEntry, register
from .window import parse_options

USAGE = "adaflash:PATH_OR_NAME[,length=FILE|off][,margin=M][,vocab=N]"
SHIPPED = Path(__file__).resolve().parents[1] / "heads" / "shipped" / "adaflash"  # <target name>/adaflash.safetensors


class AdaFlashDrafter(DFlashDrafter):
    """A DFlash drafter whose block depth is the length head's verify length (None: no cut)."""

    def __init__(self, head, shape: TreeShape, taps: tuple[int, ...], length=None, margin: int = 1,
                 name: str = "adaflash"):
        super().__init__(head, shape, taps, (), name=name)
        self.length = length
        self.margin = margin
        self.verified: list[int] = []  # the length chosen each round (read by tests and the bench's notes)

    def _tree(self, st, block: Block, tokens: list[int], budget: Budget) -> DraftTree:
        if self.length is not None:
            keep = self.length.verified(block.hidden.float(), self.margin)
            self.verified.append(keep)
            budget = replace(budget, depth=min(budget.depth, keep))
        return super()._tree(st, block, tokens, budget)


def _split(argument: str) -> tuple[str, str | None, int, int | None]:
    """`FOLDER[,length=FILE|off][,margin=M][,vocab=N]` -> (folder, length file or "off" or None, margin, vocab)."""
    if Path(argument).expanduser().is_dir():
        return argument, None, 1, None
    folder, options = parse_options(argument, ("length", "margin", "vocab"))
    margin = options.get("margin", "1")
    if not margin.lstrip("-").isdigit() or int(margin) < 0:
        raise ConfigError(f"margin={margin}: give a whole number of tokens >= 0 added to the predicted length")
    return folder, options.get("length"), int(margin), parse_vocab(options.get("vocab"))


def _join(folder: str, length: str | None, margin: int, vocab: int | None) -> str:
    return (folder + (f",length={length}" if length else "") + (f",margin={margin}" if margin != 1 else "")
            + (f",vocab={vocab}" if vocab else ""))


def _length_file(folder: str, length: str | None) -> Path | None:
    from ..heads.dflash.length_head import FILE

    if length == "off":
        return None
    return Path(length).expanduser() if length else Path(folder) / FILE


def parse_argument(text: str) -> str:
    folder, length, margin, vocab = _split(text)
    if not folder:
        raise ConfigError("adaflash:PATH needs the folder of a DFlash head (config.json + model.safetensors, "
                          "adaflash.safetensors beside it) or the name of a shipped head")
    from ..heads.catalog import resolve_head
    from ..heads.dflash.length_head import FILE

    named = not Path(folder).expanduser().is_dir()
    if named and length is None and (SHIPPED / folder / FILE).is_file():
        length = str(SHIPPED / folder / FILE)  # the length head shipped for this shipped head
    folder = str(resolve_head(folder, kind="dflash"))  # a folder, or a shipped DFlash head by its target's name
    path = _length_file(folder, length)
    if path is not None and not path.is_file():
        raise ConfigError(f"no AdaFlash length head at {path}: train one with `outrider train dflash --objective "
                          f"length --init-from {folder}`, give length=FILE, or length=off")
    return _join(folder, length, margin, vocab)


def check_fits(argument: str, target_config, target_path: Path) -> str | None:
    from ..heads.dflash.format import misfit, read_config

    return misfit(read_config(_split(argument)[0]), target_config)


def build(argument: str, shape: TreeShape, target, target_path: Path) -> AdaFlashDrafter:
    from ..heads.dflash.format import load_dflash
    from ..heads.dflash.length_head import LengthHead

    folder, length, margin, vocab = _split(argument)
    head = load_dflash(folder, target)
    if vocab is not None:
        head = reduce_readout(head, Path(target_path), vocab)
    path = _length_file(folder, length)
    predictor = None
    if path is not None:
        predictor = LengthHead.load(path)
        if predictor.hidden_size != head.config.hidden_size or predictor.block_size != head.block_size:
            raise ConfigError(f"{path}: a length head for hidden size {predictor.hidden_size} and blocks of "
                              f"{predictor.block_size}, this DFlash head's are {head.config.hidden_size} and "
                              f"{head.block_size}; train one for this head")
    return AdaFlashDrafter(head, shape, head.config.taps(target.config.num_layers), predictor, margin,
                           name="adaflash:" + _join(folder, length, margin, vocab))


register(DrafterEntry("adaflash", USAGE, Capabilities(trees=TREES, couples=True), build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
