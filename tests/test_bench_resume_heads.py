"""`bench --resume` with drafters that read the target's features (EAGLE-3, DFlash, the hybrid of
suffix trees and a head): a run interrupted after its first prompt and resumed gives the outputs
and round counts of an uninterrupted run (before, the resumed run raised "eagle3 start needs the
prompt's features")."""

import json

import pytest
import torch
from eagle3_tiny import write_eagle3
from test_bench_resume import FIXTURES, fixed_figures
from tiny import add_tokenizer, make_tiny

from outrider.bench import run as bench_run
from outrider.cli import main


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A vocab-8, 4-layer Llama with a tokenizer, an EAGLE-3 head and a DFlash head for it."""
    from outrider.heads.dflash.trainable import DFlashTrainable
    from outrider.train.outputs import write_head
    from outrider.weights.loader import load_decoder

    root = tmp_path_factory.mktemp("bench-heads")
    target = add_tokenizer(make_tiny("llama", root / "t", vocab=8, layers=4), vocab=8)
    eagle = write_eagle3(root / "eagle3", json.loads((target / "config.json").read_text()), draft_vocab=6,
                         layer_ids=[0, 1, 2], semantics="sglang", seed=4)
    dflash = DFlashTrainable.for_target(load_decoder(target, "cpu"), torch.arange(8), seed=3, layers=1,
                                        block_size=4, mask_token_id=7, layer_ids=(0, 2))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in dflash.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    write_head(root / "dflash", dflash)
    return target, eagle, root / "dflash"


def methods_file(tmp_path, target, eagle, dflash):
    path = tmp_path / "methods.toml"
    path.write_text(f"""
models = ["{target}"]
workloads = ["jsonl:{FIXTURES / 'prompts.jsonl'}"]
max_new_tokens = 12

[[method]]
name = "eagle3"
drafter = "eagle3:{eagle}"
controller = "fixed:3"

[[method]]
name = "dflash"
drafter = "dflash:{dflash}"
controller = "fixed:3"

[[method]]
name = "hybrid"
drafter = "hybrid:2,eagle3:{eagle}"
controller = "fixed:4"

[[method]]
name = "suffix"
drafter = "suffix"
controller = "fixed:4"
""")
    return path


def test_heads_resume_as_an_uninterrupted_run(heads, tmp_path, capsys, monkeypatch):
    methods = methods_file(tmp_path, *heads)

    def bench(out, *extra):
        return main(["bench", "--methods", str(methods), "--out", str(out), "--threads", "1", "--no-progress",
                     *extra])

    assert bench(tmp_path / "full") == 0, capsys.readouterr().err
    full = json.loads((tmp_path / "full" / "results.json").read_text())
    assert full["audit"]["ok"]

    real, calls = bench_run.run_ours, []

    def interrupted(*args, **kwargs):  # warm-up, 5 runs of the first prompt, then 2 of the second
        calls.append(1)
        if len(calls) == 1 + 5 + 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_run, "run_ours", interrupted)
    out = tmp_path / "part"
    assert bench(out) == 130
    assert "interrupted: 1 of 3 prompts are saved" in capsys.readouterr().err
    monkeypatch.undo()

    assert main(["bench", "--out", str(out), "--resume", "--no-progress"]) == 0, capsys.readouterr().err
    resumed = json.loads((out / "results.json").read_text())
    assert fixed_figures(resumed) == fixed_figures(full)
    assert resumed["audit"] == full["audit"] and resumed["sessions"] == 2
    assert {r["method"] for r in resumed["runs"]} == {"autoregressive", "eagle3", "dflash", "hybrid", "suffix"}
