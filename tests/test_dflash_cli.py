"""`outrider generate` with a DFlash head and block refiners (issue 27): `--refiner` is folded into
the drafter, the output equals autoregressive decoding, and what cannot work is refused in one
line with a non-zero exit before anything is generated."""

import json

import pytest
import torch
from enumerate_law import one_thread
from tiny import add_tokenizer, make_tiny

from outrider.cli import main
from outrider.heads.dflash.trainable import DFlashTrainable
from outrider.train.outputs import write_head
from outrider.weights.loader import load_decoder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dfcli")
    target = add_tokenizer(make_tiny("llama", root / "t", vocab=8, layers=4), vocab=8)
    decoder = load_decoder(target, "cpu")
    head = DFlashTrainable.for_target(decoder, torch.arange(8), seed=3, layers=1, block_size=4, mask_token_id=7,
                                      layer_ids=(0, 2))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    write_head(root / "head", head)
    return target, root / "head"


def generate(capsys, *args):
    with one_thread():
        code = main(["generate", "--max-new-tokens", "12", "--json", "--threads", "1", *args, "w3 w4 w5"])
    out = capsys.readouterr()
    return code, (json.loads(out.out)["token_ids"] if code == 0 else None), out.err


def test_refined_generation_equals_autoregressive(setup, capsys):
    target, head = setup
    code, plain, _ = generate(capsys, "--model", str(target))
    assert code == 0
    for extra in (["--tree", "ddtree:4"], ["--tree", "ddtree:5", "--refiner", "cure,retrace"], []):
        code, ids, err = generate(capsys, "--model", str(target), "--drafter", f"dflash:{head}", *extra)
        assert code == 0, err
        assert ids == plain


@pytest.mark.parametrize("args,words", [
    (["--refiner", "cure"], "ddtree"),  # a chain cannot hold a refiner's tree
    (["--refiner", "nope", "--tree", "ddtree:4"], "unknown refiner 'nope'"),
    (["--refiner", "dartree", "--tree", "ddtree:4"], "dartree needs its correction head"),
])
def test_bad_refiners_are_refused_in_one_line(setup, capsys, args, words):
    target, head = setup
    code, _, err = generate(capsys, "--model", str(target), "--drafter", f"dflash:{head}", *args)
    assert code != 0 and words in err and len(err.strip().splitlines()) == 1


def test_a_refiner_needs_a_block_drafter(setup, capsys):
    target, _ = setup
    code, _, err = generate(capsys, "--model", str(target), "--drafter", "suffix", "--refiner", "cure")
    assert code != 0 and "drafts no block" in err and len(err.strip().splitlines()) == 1
