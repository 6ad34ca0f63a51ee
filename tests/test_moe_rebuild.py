"""The MoE catalog models rebuilt on pull from a shipped split (catalog/moe_rebuild.py via
catalog/composed.py; issue 41 item 2), on a tiny random Llama: the rebuild is the same bytes
every time and the recipe's sha256 of them is checked; a corrupted, missing or wrong split is a
one-line error; the catalog names the two entries and says how to pull them."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.catalog.cli import list_command
from outrider.catalog import composed
from outrider.catalog.composed import COMPOSED, MARKER, compose, pull_composed
from outrider.catalog.moe_rebuild import MOE_SPLITS, SPLIT, file_sha256
from outrider.catalog.resolve import known_names, resolve_model
from outrider.errors import ModelError
from outrider.train.moe_checkpoint import Split, moe_tensors
from tiny import add_tokenizer, make_tiny

E, SHARED = 4, 16  # the tiny Llama's 112 neurons: a shared expert of 16, 4 experts of 24


def _split(raw, seed):
    gen = torch.Generator().manual_seed(seed)
    L, inter, H = raw["num_hidden_layers"], raw["intermediate_size"], raw["hidden_size"]
    perm = torch.stack([torch.randperm(inter, generator=gen) for _ in range(L)])  # [L, I]
    return Split(perm, torch.randn(L, E, H, generator=gen) * 1e-3, SHARED)


def _ship(folder, raw, dense, split):
    """A shipped folder as train/moe_split.py's recipe records it: the split, its sha256, and the
    sha256 of the model file that train/moe_split.py writes from it (computed here, independently)."""
    folder.mkdir()
    save_file({"perm": split.perm.to(torch.int32).contiguous(), "router": split.router.contiguous(),
               "shared": torch.tensor(split.shared)}, str(folder / SPLIT))
    save_file(moe_tensors(dense, raw, split), str(folder / "expected.safetensors"))
    recipe = {"base": "tiny", "top_k": 2, "model_sha256": file_sha256(folder / "expected.safetensors"),
              "files": {SPLIT: file_sha256(folder / SPLIT)}}
    (folder / "expected.safetensors").unlink()
    (folder / "recipe.json").write_text(json.dumps(recipe))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe_rebuild")
    base = add_tokenizer(make_tiny("llama", work / "llama", layers=2))
    raw = json.loads((base / "config.json").read_text())
    dense = load_file(str(base / "model.safetensors"))
    return work, base, raw, dense, _ship(work / "shipped", raw, dense, _split(raw, 0))


def test_the_rebuild_is_deterministic_and_checked(tiny):
    work, base, raw, dense, shipped = tiny
    a, b = compose(base, shipped, work / "a"), compose(base, shipped, work / "b")
    recipe = json.loads((shipped / "recipe.json").read_text())
    assert file_sha256(a / "model.safetensors") == file_sha256(b / "model.safetensors") == recipe["model_sha256"]
    config = json.loads((a / "config.json").read_text())
    assert (config["architectures"], config["num_experts"], config["num_experts_per_tok"],
            config["shared_expert_intermediate_size"]) == (["Qwen2MoeForCausalLM"], E, 2, SHARED)
    assert (a / "tokenizer.json").is_file() and json.loads((a / MARKER).read_text())["files"] == recipe["files"]
    assert not list(work.glob(".a.partial-*"))


def test_a_corrupted_or_missing_split_is_refused(tiny):
    work, base, raw, dense, shipped = tiny
    bad = work / "corrupt"
    bad.mkdir()
    (bad / "recipe.json").write_text((shipped / "recipe.json").read_text())
    data = bytearray((shipped / SPLIT).read_bytes())
    data[-5] ^= 1  # one bit of the router
    (bad / SPLIT).write_bytes(bytes(data))
    with pytest.raises(ModelError, match="does not have the sha256 recipe.json records; reinstall outrider"):
        compose(base, bad, work / "c")
    (bad / SPLIT).unlink()
    with pytest.raises(ModelError, match="is incomplete.*reinstall outrider") as err:
        compose(base, bad, work / "c")
    assert "\n" not in str(err.value) and not (work / "c").exists() and not list(work.glob(".c.partial-*"))


def test_another_split_with_its_own_sha256_but_the_old_model_sha256_is_refused(tiny):
    """The model file's checksum catches what the split's cannot: a split (or base) other than the
    one the recorded model was rebuilt from."""
    work, base, raw, dense, shipped = tiny
    other = _ship(work / "other", raw, dense, _split(raw, 1))
    recipe = json.loads((other / "recipe.json").read_text())
    recipe["model_sha256"] = json.loads((shipped / "recipe.json").read_text())["model_sha256"]
    (other / "recipe.json").write_text(json.dumps(recipe))
    with pytest.raises(ModelError, match=r"records .*: repair the base with `outrider models pull tiny --force`"):
        compose(base, other, work / "o")
    assert not (work / "o").exists() and not list(work.glob(".o.partial-*"))


def test_pull_rebuilds_once_then_finds_it(tiny, monkeypatch, tmp_path, runtime):
    work, base, raw, dense, shipped = tiny
    runtime(cache_dir=str(tmp_path))
    monkeypatch.setitem(COMPOSED, "tiny-moe4", ("tiny", shipped))
    with pytest.raises(ModelError, match="run `outrider models pull tiny-moe4`"):
        resolve_model("tiny-moe4")
    pulls = []
    folder = pull_composed("tiny-moe4", lambda name, log: pulls.append(name) or base, log=lambda line: None)
    assert folder == tmp_path / "models" / "tiny-moe4" and resolve_model("tiny-moe4") == folder and pulls == ["tiny"]
    assert pull_composed("tiny-moe4", lambda name, log: pulls.append(name) or base, log=lambda line: None) == folder
    assert pulls == ["tiny"]  # already rebuilt from this split: not again


def test_the_catalog_lists_the_moe_entries(tmp_path, capsys, monkeypatch):
    assert MOE_SPLITS["smollm2-135m-moe8"][0] == "smollm2-135m-instruct"
    assert MOE_SPLITS["qwen2.5-coder-0.5b-moe8"][0] == "qwen2.5-coder-0.5b-instruct"
    for name, (_, shipped) in MOE_SPLITS.items():
        assert COMPOSED[name] == MOE_SPLITS[name] and name in known_names()
        recipe = json.loads((shipped / "recipe.json").read_text())
        assert list(recipe["files"]) == [SPLIT] and len(recipe["model_sha256"]) == 64
        assert file_sha256(shipped / SPLIT) == recipe["files"][SPLIT]
    # the composed folders looked for in an empty folder: not pulled (the cache itself is left as it
    # is: an empty cache would build the native kernel again, which `list` describes)
    monkeypatch.setattr(composed, "composed_path", lambda name: tmp_path / name)
    list_command(None)
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["smollm2-135m-moe8"][1:6] == ["135M", "-", "as", "smollm2-135m-instruct", "no"]
    assert rows["qwen2.5-coder-0.5b-moe8"][1:6] == ["0.5B", "-", "as", "qwen2.5-coder-0.5b-instruct", "no"]
