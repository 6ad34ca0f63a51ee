"""`--drafter dblast:HEAD[,mix=PATH]`: DBLast, dependent block drafting over a DFlash head.

The DFlash head (drafters/dflash.py, heads/dflash/) drafts its block in one forward as usual; a
small mixture head (dblast_mixture.py) turns the block's hidden states into M components, each a
distribution per position, and mixture weights. Drafts are sampled by component and verified with
the posterior-marginalised conditional q (dblast_chain.py), so the chain verifier stays exact:

    unseeded sampling   z ~ pi, then every position from its component; rejection sampling with
                        q(x_i | x_<i) = sum_z pi(z | x_<i) q_i(x_i | z)
    seeded sampling     the walk; each draft drawn from q(. | x_<i) with the walk's own uniform
    greedy              the argmax of q(. | x_<i) at each position, the greedy chain verifier

Only `--tree chain`. HEAD: a DFlash head folder or a shipped head's target name (as `dflash:`);
PATH: a `dblast.safetensors` file or its folder. Without `mix=`: the mixture shipped for that
target (`heads/shipped/dblast/<target>/dblast.safetensors`) for a shipped name, else the head
folder's own `dblast.safetensors`. Trained by `python -m outrider.train.dblast` (train/dblast.py).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..spec.shapes import TreeShape
from ..spec.types import Budget, DraftTree
from .block import Block
from .capabilities import Capabilities, Drafts
from .dblast_chain import MixtureBlock, coupled_chain, greedy_mixture_chain, sampled_by_component
from .dblast_mixture import FILE, MixtureHead, load_weights
from .dflash import DFlashDrafter
from .registry import DrafterEntry, register
from .window import parse_options

TREES = {"chain": Drafts("chain", gives_probs=True)}  # sampled: drafts by component, rows the posterior q
SHIPPED = Path(__file__).resolve().parents[1] / "heads" / "shipped" / "dblast"
USAGE = "dblast:HEAD[,mix=PATH]"


class DBLastDrafter(DFlashDrafter):
    """A DFlash drafter whose chain comes from the mixture (`mixture`: MixtureHead over `head`)."""

    def __init__(self, head, mixture: MixtureHead, shape: TreeShape, taps: tuple[int, ...], name: str = "dblast"):
        if shape.kind != "chain":
            raise ConfigError(f"dblast drafts a chain (its q is the posterior along the drafted prefix): use "
                              f"--tree chain, not --tree {shape}")
        super().__init__(head, shape, taps, (), name=name)
        self.mixture = mixture
        self.capabilities = Capabilities(trees=TREES, needs_hidden=tuple(taps), couples=True)
        self._coupled: dict[int, bool] = {}  # by slot: drawn with the walk's uniforms

    def start(self, seq_id, prompt, params=None, hidden=None, coupled: bool = False) -> None:
        super().start(seq_id, prompt, params, hidden, coupled)
        self._coupled[self._states[seq_id].slot] = coupled

    def _tree(self, st, block: Block, tokens: list[int], budget: Budget) -> DraftTree:
        depth = min(budget.depth, budget.nodes, block.size)
        log_pi, logits = self.mixture(block.hidden, block.logits)  # [M], [M, K, Vd]
        mixed = MixtureBlock(block.root, log_pi, logits, block.vocab, block.to_target)
        if st.params.greedy:
            return greedy_mixture_chain(mixed, depth, budget.min_confidence, budget.stop)
        draw = coupled_chain if self._coupled.get(st.slot) else sampled_by_component
        return draw(mixed, depth, st.params, st.rng.at(len(tokens)), budget.min_confidence, budget.stop)


# -- registration ---------------------------------------------------------------------------------
def _split(argument: str) -> tuple[str, str | None]:
    head, options = parse_options(argument, ("mix",))
    return head, options.get("mix")


def _mixture_path(head_text: str, folder: Path, mix: str | None) -> Path:
    if mix:
        path = Path(mix).expanduser()
        return path / FILE if path.is_dir() else path
    shipped = SHIPPED / head_text / FILE
    if shipped.is_file():
        return shipped
    return folder / FILE


def parse_argument(text: str) -> str:
    from ..heads.catalog import resolve_head

    head_text, mix = _split(text)
    if not head_text:
        raise ConfigError(f"{USAGE}: give a DFlash head (a folder or a shipped head's name) and, unless one is "
                          "shipped or beside the head, its mixture (mix=PATH)")
    folder = resolve_head(head_text, kind="dflash")
    path = _mixture_path(head_text, folder, mix)
    if not path.is_file():
        where = str(path) if mix else f"{SHIPPED / head_text / FILE} (shipped) or {folder / FILE} (beside the head)"
        raise ConfigError(f"no DBLast mixture at {where}: give mix=PATH (a {FILE} from python -m outrider.train.dblast)")
    return f"{folder},mix={path}"


def check_fits(argument: str, target_config, target_path: Path) -> str | None:
    from ..heads.dflash.format import misfit, read_config

    return misfit(read_config(_split(argument)[0]), target_config)


def build(argument: str, shape: TreeShape, target, target_path: Path) -> DBLastDrafter:
    from ..heads.dflash.format import load_dflash

    folder, mix = _split(argument)
    head = load_dflash(folder, target)
    mixture = MixtureHead(load_weights(mix), head)
    return DBLastDrafter(head, mixture, shape, head.config.taps(target.config.num_layers), name=f"dblast:{argument}")


register(DrafterEntry("dblast", USAGE, Capabilities(trees=TREES, couples=True), build=build,
                      parse_argument=parse_argument, check_fits=check_fits))
