"""The verify-cost profile when its folder cannot be written: measured, kept in memory, one warning.

As root, chmod does not stop writes, so the folder is made unwritable honestly by putting it under
a regular file: mkdir and open below it fail with ENOTDIR, the OSError a read-only cache gives.
"""

from __future__ import annotations

import pytest
import torch

from outrider.cli import main
from outrider.control import profile
from outrider.weights.loader import load_decoder


@pytest.fixture
def blocker(tmp_path, monkeypatch):
    monkeypatch.setattr(profile, "_IN_MEMORY", {})
    monkeypatch.setattr(profile, "_WARNED", set())
    path = tmp_path / "a-file"
    path.write_text("")
    return path


def test_unwritable_folder_measures_once_keeps_it_in_memory_and_warns_once(tiny_folders, blocker,
                                                                             monkeypatch, capsys):
    target = load_decoder(tiny_folders["llama"], "cpu")
    calls = []
    real = profile.measure
    monkeypatch.setattr(profile, "measure", lambda t: calls.append(1) or real(t, repeats=1))
    first = profile.load_or_measure(tiny_folders["llama"], target, blocker / "profiles")
    again = profile.load_or_measure(tiny_folders["llama"], target, blocker / "profiles")
    assert again == first and len(calls) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and str(blocker / "profiles") in lines[0]
    assert "kept in memory" in lines[0]


def test_cost_controller_with_an_unwritable_cache_generates(tiny_folders, blocker, monkeypatch, capsys, runtime):
    runtime(cache_dir=str(blocker / "cache"))
    code = main(["generate", "--model", str(tiny_folders["llama"]), "--drafter", "ngram",
                 "--controller", "cost", "--max-new-tokens", "4", "--json", "w5 w6 w7"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("warning:")]


def test_a_rebuilt_kernel_or_the_torch_layer_measures_the_profile_again(monkeypatch, tiny_folders, runtime):
    """The profile's key names the native kernel as built (its file name hashes the sources, flags,
    compiler and CPU) and whether the native layer runs: verify costs measured with other kernels
    (or another layer) are not reused."""
    from pathlib import Path

    from outrider.control import profile as profile_module
    from outrider.kernels import native
    from outrider.weights.loader import load_decoder

    target = load_decoder(tiny_folders["llama"], "cpu", torch.float32)
    key = profile_module.profile_key(tiny_folders["llama"], target)
    runtime(native_layer="0")
    assert profile_module.profile_key(tiny_folders["llama"], target) != key
    runtime(native_layer=None)
    if native.library() is not None:
        monkeypatch.setitem(native._state, "path", Path("qmatmul-0000000000000000.so"))
        assert profile_module.profile_key(tiny_folders["llama"], target) != key
