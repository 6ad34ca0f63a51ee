"""DFlash export, import and conformance (issue 27) on a tiny target with a tiny head: export ->
load gives the same block logits in every layout (zlab, vllm, sglang); a reduced draft vocabulary
exports to vllm only; check-head passes a good export and reproduces its golden tau exactly, and
FAILs in one line, exit 1, on a wrong hidden size, a missing tensor, a mask id or layer ids out of
range and a corrupt weights file; a shipped DFlash head resolves by `dflash:NAME`."""

import json
import shutil

import pytest
import torch
from enumerate_law import one_thread
from safetensors.torch import load_file, save_file
from tiny import add_tokenizer, make_tiny

from outrider.cli import main
from outrider.errors import ConfigError, ModelError
from outrider.heads import catalog
from outrider.heads.dflash.check import check_dflash
from outrider.heads.dflash.export import export_dflash
from outrider.heads.dflash.format import load_dflash, read_config
from outrider.heads.golden import GOLDEN, GoldenSettings
from outrider.heads.dflash.trainable import DFlashTrainable
from outrider.train.outputs import write_head
from outrider.weights.loader import load_decoder

FAST = GoldenSettings(max_new_tokens=10)
PROMPTS = ("w5 w6 w7", "w3 w4")


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def trained_like(decoder, used, seed):
    head = DFlashTrainable.for_target(decoder, used, seed=seed, layers=2, block_size=4, mask_token_id=7,
                                      layer_ids=(0, 2))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return head


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dfexport")
    target = add_tokenizer(make_tiny("llama", root / "t", vocab=8, layers=4), vocab=8)
    decoder = load_decoder(target, "cpu")
    full, reduced = root / "full", root / "reduced"
    write_head(full, trained_like(decoder, torch.arange(8), 1))
    write_head(reduced, trained_like(decoder, torch.tensor([0, 2, 3, 5, 6, 7]), 2))
    zlab = export_dflash(full, root / "zlab", "zlab", target, settings=FAST, prompts=PROMPTS)
    return root, target, decoder, full, reduced, zlab


def logits(folder, decoder):
    head = load_dflash(folder, decoder)
    g = torch.Generator().manual_seed(0)
    cache = head.new_cache(1, 16)
    head.write_context(cache, 0, 0, head.fuse(torch.randn(9, 2, 64, generator=g)))
    out, _ = head.block(cache, [0], [9], torch.tensor([[3, 7, 7, 7]]))
    return head.target_logits(out)


@pytest.mark.parametrize("fmt", ["zlab", "vllm", "sglang"])
def test_export_then_load_gives_the_same_block_logits(setup, tmp_path, fmt):
    _, target, decoder, full, reduced, _ = setup
    out = export_dflash(full, tmp_path / fmt, fmt, target, golden=False)
    assert torch.equal(logits(out, decoder), logits(full, decoder))
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"] == {"mask_token_id": 7,
                                                                                     "target_layer_ids": [0, 2]}
    assert ("eagle_aux_hidden_state_layer_ids" in raw) == (fmt == "vllm")  # vLLM's own ids: DFlash's + 1
    assert raw.get("eagle_aux_hidden_state_layer_ids", [1, 3]) == [1, 3]
    if fmt == "vllm":
        small = export_dflash(reduced, tmp_path / "small", fmt, target, golden=False, dtype="bf16")
        assert read_config(small).draft_vocab_size == 6
        torch.testing.assert_close(logits(small, decoder), logits(reduced, decoder), rtol=0.05, atol=0.2)
        assert load_file(str(small / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    else:
        with pytest.raises(ConfigError, match="export it with --format vllm"):
            export_dflash(reduced, tmp_path / "small", fmt, target, golden=False)


def test_check_head_passes_a_good_export_and_reproduces_its_golden(setup, capsys):
    _, target, _, _, _, zlab = setup
    checks = {c.name: c for c in check_dflash(zlab, target)}
    assert all(c.status in ("ok", "skipped") for c in checks.values()), [c.line() for c in checks.values()]
    assert checks["golden tau"].status == "ok" and "exact" in checks["golden tau"].detail
    golden = json.loads((zlab / GOLDEN).read_text())
    assert golden["rounds"] > 0 and golden["settings"]["depth"] == 3
    assert main(["check-head", str(zlab), "--target", str(target)]) == 0
    assert "conforms" in capsys.readouterr().out


def corrupt(src, dst, config_edit=None, tensor_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        raw = json.loads((dst / "config.json").read_text())
        config_edit(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensor_edit:
        tensors = load_file(str(dst / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("check, config_edit, tensor_edit, expected", [
    ("target", lambda c: c.update(hidden_size=128), None, "hidden states of size 128, this target's are 64"),
    ("tensors", None, lambda t: t.pop("layers.1.mlp.down_proj.weight"), "missing layers.1.mlp.down_proj.weight"),
    ("mask token", lambda c: c["dflash_config"].update(mask_token_id=8), None, "mask_token_id 8 is outside"),
    ("layer ids", lambda c: c["dflash_config"].update(target_layer_ids=[0, 4]), None, "not all layers of this target"),
    ("weights file", None, truncate, "truncated or corrupt"),
])
def test_check_head_refuses_in_one_line(setup, tmp_path, capsys, check, config_edit, tensor_edit, expected):
    _, target, decoder, _, _, zlab = setup
    bad = corrupt(zlab, tmp_path / "bad", config_edit, tensor_edit if tensor_edit is not truncate else None)
    if tensor_edit is truncate:
        truncate(bad)
    assert main(["check-head", str(bad), "--target", str(target)]) == 1
    out = capsys.readouterr().out.splitlines()
    failed = [line for line in out if line.startswith(check) and "FAIL: " in line]
    assert len(failed) == 1 and expected in failed[0], out
    assert any(line.startswith("golden tau") and "skipped" in line for line in out)
    with pytest.raises(ModelError) as err:  # the loader refuses the same folder in one line
        load_dflash(bad, decoder)
    assert "\n" not in str(err.value) and str(bad) in str(err.value)


def test_shipped_dflash_heads_resolve_by_kind_and_name(setup, tmp_path, monkeypatch, capsys):
    _, target, _, _, _, zlab = setup
    shipped = tmp_path / "shipped"
    shutil.copytree(zlab, shipped / "dflash" / "tiny-target")
    monkeypatch.setattr(catalog, "SHIPPED_DIR", shipped)
    assert catalog.resolve_head("tiny-target", "dflash") == shipped / "dflash" / "tiny-target"
    assert catalog.drafters_for("tiny-target") == ["dflash:tiny-target"]
    assert catalog.shipped_heads() == {}  # the dflash folder holds no EAGLE-3 head
    with pytest.raises(ConfigError, match="no shipped DFlash head of that name"):
        catalog.resolve_head("other", "dflash")
    assert main(["check-head", "dflash:tiny-target", "--no-golden"]) == 0  # its target: recorded at export
    assert main(["export", "dflash", "tiny-target", "--format", "sglang", "--out", str(tmp_path / "o"),
                 "--max-new-tokens", "4"]) == 0


def test_golden_blocks_at_all_anchors_are_each_blocks_own(setup):
    """The golden's DFlash slots (heads/dflash/golden.py `block_logits`: every anchor's block in one
    call over one context slot) are what each block gives alone, over its own context."""
    from outrider.heads.dflash.golden import block_logits, replay

    _, target, decoder, full, _, _ = setup
    head = load_dflash(full, decoder)
    text = [1, 3, 5, 7, 2, 4, 6, 1, 3, 5, 0, 2]
    _, _, own = replay(head, decoder, text, 4)
    anchors = list(range(4, len(text) - 1))
    together = block_logits(head, own, text, anchors)  # [A, B-1, V]
    for i, a in enumerate(anchors):
        alone = block_logits(head, own, text, [a])[0]
        torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(together[0], together[1])  # the anchors' blocks differ


def test_a_golden_of_format_1_still_checks_its_tau(setup, tmp_path):
    """A golden recorded before issue 43 (no "computes") gets its tau checked and "golden logits
    skipped", saying how to record them."""
    _, target, _, _, _, zlab = setup
    old = tmp_path / "old"
    shutil.copytree(zlab, old)
    golden = json.loads((old / GOLDEN).read_text())
    del golden["computes"]
    (old / GOLDEN).write_text(json.dumps({**golden, "format": 1}))
    checks = {c.name: c for c in check_dflash(old, target)}
    assert checks["golden tau"].status == "ok"
    assert checks["golden logits"].status == "skipped" and "outrider export dflash" in checks["golden logits"].detail
