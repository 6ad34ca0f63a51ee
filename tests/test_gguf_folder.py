"""A GGUF of one's own as a model (catalog/imported.py): `outrider models import FILE.gguf`, or
`--model FILE.gguf`, with no float32 copy written, the same model as a pulled folder of that GGUF."""

from __future__ import annotations

import json
import os

import pytest
import torch

import test_gguf_import as writer
from outrider.cli import main
from outrider.errors import ModelError
from outrider.catalog.resolve import resolve_model
from outrider.catalog.imported import IMPORTED_NAME, default_name, import_gguf, imported_folder, list_imported
from outrider.weights.gguf_convert import convert_gguf
from outrider.weights.loader import load_decoder

TOKENS = [5, 17, 3, 88, 41, 41, 9, 200]


@pytest.fixture
def cache(tmp_path, monkeypatch, runtime):
    runtime(cache_dir=str(tmp_path / "cache"))
    return tmp_path / "cache"


def logits_of(model) -> torch.Tensor:
    from outrider.models.batch import pack

    cache = model.new_cache(1, len(TOKENS) + 1)
    return model.forward(pack([0], [0], [torch.tensor(TOKENS)], logits="all", scratch_row=cache.scratch_row), cache).logits


def quiet(line: str) -> None:
    pass


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen2", "Q8_0")])
def test_imported_gguf_is_the_pulled_folders_model(tmp_path, cache, arch, qtype, runtime):
    """No float copy: float32 dequantizes the GGUF at load to the very values the float folder
    converted from it holds, and the quantized default reads the same blocks: equal logits both ways.
    One float product path for both (linear=linear): each folder keeps the path measured for its
    own shapes (kernels/cpu_linear.py), and on a busy machine two measurements may choose apart."""
    runtime(linear="linear")
    gguf = tmp_path / f"Tiny {arch} {qtype}.gguf"
    writer.write_tiny_gguf(gguf, arch, qtype, tied=arch == "llama")
    folder = import_gguf(gguf, log=quiet)
    assert folder == cache / "imported" / default_name(gguf) and folder.name == f"tiny-{arch}-{qtype.lower()}"
    assert not list(folder.glob("*.safetensors"))
    assert (folder / "original.gguf").stat().st_ino == gguf.stat().st_ino  # a hard link: no copy
    facts = json.loads((folder / IMPORTED_NAME).read_text())
    assert facts["source"] == str(gguf.resolve()) and len(facts["sha256"]) == 64
    pulled = tmp_path / "pulled"  # as `models pull` lays a folder out: float32 safetensors + the GGUF
    convert_gguf(gguf, pulled, log=quiet)
    os.link(gguf, pulled / "original.gguf")
    assert torch.equal(logits_of(load_decoder(folder, "cpu")), logits_of(load_decoder(pulled, "cpu")))
    own = "q4" if qtype == "Q4_1" else "q8_0"
    assert torch.equal(logits_of(load_decoder(folder, "cpu", own)), logits_of(load_decoder(pulled, "cpu", own)))


def test_resolved_by_name_and_by_path_imported_once(tmp_path, cache):
    gguf = tmp_path / "model.gguf"
    writer.write_tiny_gguf(gguf, "llama", "Q8_0")
    lines = []
    folder = resolve_model(gguf, log=lines.append)
    assert any("imported" in line for line in lines)
    lines.clear()
    assert resolve_model(gguf, log=lines.append) == folder and not lines  # the second time: found, not imported
    assert resolve_model("model") == folder
    assert [r["name"] for r in list_imported()] == ["model"]
    other = tmp_path / "elsewhere" / "model.gguf"  # another file of the same name, named by its path
    other.parent.mkdir()
    writer.write_tiny_gguf(other, "llama", "Q8_0", seed=1)
    second = resolve_model(other, log=quiet)
    assert second != folder and second.name.startswith("model-")
    with pytest.raises(ModelError, match="already imported from .*--force"):
        import_gguf(other, log=quiet)  # by name: refused, not replaced


def test_a_gguf_changed_since_import(tmp_path, cache):
    """The hard link sees a file rewritten in place: by name it is refused (import it again); by
    path it is imported again."""
    gguf = tmp_path / "model.gguf"
    writer.write_tiny_gguf(gguf, "llama", "Q8_0")
    first = json.loads((import_gguf(gguf, log=quiet) / IMPORTED_NAME).read_text())["sha256"]
    writer.write_tiny_gguf(gguf, "llama", "Q8_0", seed=3)
    os.utime(gguf, ns=(1, 1))  # a distinct mtime even on a coarse clock
    with pytest.raises(ModelError, match="changed since it was imported.*--force"):
        resolve_model("model")
    folder = resolve_model(gguf, log=quiet)
    assert json.loads((folder / IMPORTED_NAME).read_text())["sha256"] != first
    assert imported_folder("model") == folder


def test_bad_files_and_names_get_one_line(tmp_path, cache):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError, match="not a readable GGUF"):
        import_gguf(bad, log=quiet)
    with pytest.raises(ModelError, match="no such GGUF"):
        import_gguf(tmp_path / "missing.gguf", log=quiet)
    text = tmp_path / "model.bin"
    text.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf file"):
        import_gguf(text, log=quiet)
    with pytest.raises(ModelError, match="is a file: give a GGUF"):
        resolve_model(text)
    gguf = tmp_path / "ok.gguf"
    writer.write_tiny_gguf(gguf, "llama", "Q8_0")
    with pytest.raises(ModelError, match="packaged model's name"):
        import_gguf(gguf, name="smollm2-135m-instruct", log=quiet)
    with pytest.raises(ModelError, match="not a model name"):
        import_gguf(gguf, name="Has Spaces", log=quiet)
    assert not (cache / "imported").exists() or not list((cache / "imported").iterdir())  # nothing half-made


def test_cli_import_list_and_generate(tmp_path, cache, capsys):
    gguf = tmp_path / "Tiny Chat.gguf"
    writer.write_tiny_gguf(gguf, "qwen2", "Q8_0", tied=False)
    assert main(["models", "import", str(gguf), "--name", "tiny-chat"]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "imported" / "tiny-chat")
    assert main(["models", "list"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny-chat")]
    assert listed and "imported" in listed[0]
    args = ["generate", "--max-new-tokens", "6", "--json", "the"]
    assert main([*args[:1], "--model", "tiny-chat", *args[1:]]) == 0
    by_name = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*args[:1], "--model", str(gguf), *args[1:]]) == 0  # by path: the same file, another name
    assert json.loads(capsys.readouterr().out)["token_ids"] == by_name and len(by_name) == 6
    assert main(["models", "import", str(tmp_path / "none.gguf")]) != 0
    assert capsys.readouterr().err.strip().startswith("error: ")


def test_a_missing_gguf_path_and_the_known_models(tmp_path, cache, capsys):
    """--model PATH.gguf that is not there: "no such file", not "unknown model"; an unknown name
    lists the imported models beside the catalog's."""
    gguf = tmp_path / "mine.gguf"
    writer.write_tiny_gguf(gguf, "llama", "Q8_0")
    import_gguf(gguf, log=quiet)
    missing = tmp_path / "typo" / "mine.gguf"
    assert main(["generate", "--model", str(missing), "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == err.splitlines()[0] and f"no such file: {missing}" in err and "unknown model" not in err, err
    assert "mine" in err  # what to name instead
    assert main(["generate", "--model", "no-such-model", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown model" in err and "smollm2-135m-instruct" in err and ", mine" in err, err


def test_the_name_the_user_gave_keeps_working(tmp_path, cache, capsys):
    """`my smol model.gguf` is imported as my-smol-model (the log says so); `--model "my smol model"`,
    the name as the user knows it, finds it too, as does any spelling the import makes that name of."""
    gguf = tmp_path / "my smol model.gguf"
    writer.write_tiny_gguf(gguf, "llama", "Q8_0")
    lines = []
    folder = import_gguf(gguf, log=lines.append)
    assert folder.name == "my-smol-model" and any("as 'my-smol-model'" in line for line in lines)
    for typed in ("my smol model", "My Smol Model", "my-smol-model"):
        assert resolve_model(typed) == folder, typed
    assert main(["models", "path", "my smol model"]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
    with pytest.raises(ModelError, match="unknown model 'my other model'"):
        resolve_model("my other model")
    with pytest.raises(ModelError, match=r"not a model name.*e\.g\. --name my-smol-model"):
        import_gguf(gguf, name="My Smol Model", log=quiet)  # an explicit --name is not changed behind one's back


def test_models_list_shows_a_truncated_import_damaged(tmp_path, cache, capsys):
    gguf = tmp_path / "cut.gguf"
    writer.write_tiny_gguf(gguf, "llama", "Q8_0")
    import_gguf(gguf, log=quiet)
    assert main(["models", "list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("cut "))
    assert "imported" in row and "damaged" not in row
    size = gguf.stat().st_size
    with open(gguf, "r+b") as f:  # the import is a link to this very file
        f.truncate(size // 2)
    assert [r["problem"] != "" for r in list_imported()] == [True]
    assert main(["models", "list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("cut "))
    assert "damaged" in row and f"outrider models import {gguf.resolve()} --name cut --force" in row, row
    assert "float32" not in row and "q8_0" not in row, row  # no dtype claimed for a file that is not whole
