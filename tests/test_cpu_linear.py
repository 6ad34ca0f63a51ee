"""Every CPU matrix-product path against the float64 reference, and the per-machine choice.

Tolerance: float32 against float64, |error| <= 1e-5 * sum_i |x_i w_i| + 1e-6 per output (a
float32 dot product over `in` terms rounds each partial sum by 2**-24 relative; a wrong layout or
a wrong chunk is off by the size of the output itself).
"""

import pytest
import torch

from outrider.config import from_env
from outrider.errors import ConfigError
from outrider.kernels import cpu_linear
from outrider.models.layers import linear


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    expected = cpu_linear.reference(x.double(), w, b)  # float64
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert got.shape == expected.shape and got.dtype == x.dtype
    assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("path", cpu_linear.PATHS)
@pytest.mark.parametrize("shape", [(96, 64), (97, 40), (512, 256)])  # 97: no chunk divisor, falls back
def test_every_path_equals_reference(monkeypatch, path, shape, runtime):
    runtime(linear=path)
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g)
    b = torch.randn(shape[0], generator=g)
    for rows in (0, 1, 2, 3, 4, 5, 8, 16, 17, 33):
        x = torch.randn(rows, shape[1], generator=g)
        _close(cpu_linear.matmul(x, w), x, w, None)
        _close(cpu_linear.matmul(x, w, b), x, w, b)
        _close(cpu_linear.matmul(x, w, transient=True), x, w, None)


def test_chunked_really_chunks():
    """The chunked path must cut a weight into several cache-sized chunks (else it is F.linear)."""
    rows = cpu_linear._chunk_rows(49152, 576)
    assert 8 <= rows < 49152 and 49152 % rows == 0 and rows * 576 <= cpu_linear._CHUNK_VALUES
    assert cpu_linear._chunk_rows(97, 40) == 97  # all of it fits in one chunk
    assert cpu_linear._chunk_rows(4099, 4096) == 0  # a prime: no chunk of 8 rows or more


def test_layers_linear_follows_forced_path(monkeypatch, runtime):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    for path in cpu_linear.PATHS:
        runtime(linear=path)
        out = linear(x, w)
        assert out.shape == (2, 3, 96)
        _close(out.reshape(6, 96), x.reshape(6, 64), w, None)


def test_choice_is_made_once_and_kept(monkeypatch, runtime):
    runtime(linear=None)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(80, 48, generator=g) for _ in range(3)]
    cpu_linear.prepare(weights)
    key = (80, 48, torch.float32)
    chosen = cpu_linear.choices()[key]
    assert len(chosen) == 4 and set(chosen) <= set(cpu_linear.AUTO_PATHS)
    for rows in (1, 3, 8, 40):
        x = torch.randn(rows, 48, generator=g)
        _close(cpu_linear.matmul(x, weights[0]), x, weights[0], None)
    cpu_linear.prepare(weights)
    assert cpu_linear.choices()[key] == chosen  # never remeasured in the process


def test_buckets():
    assert [cpu_linear.bucket(r) for r in (1, 2, 4, 5, 16, 17, 100)] == [0, 1, 1, 2, 2, 3, 3]


def test_bad_forced_path_is_refused(runtime):
    with pytest.raises(ConfigError, match="config linear must be one of auto, linear"):
        runtime(linear="fastest")
    with pytest.raises(ConfigError, match="config linear must be one of auto, linear.*from the environment"):
        from_env({"OUTRIDER_LINEAR": "fastest"})


def test_choice_kept_on_disk_is_taken_by_the_next_process(monkeypatch, tmp_path, runtime):
    runtime(linear=None)
    monkeypatch.setattr(cpu_linear, "_CHOICE", {})
    g = torch.Generator().manual_seed(4)
    weights = [torch.randn(1024, 1032, generator=g) for _ in range(4)]  # 17 MB: kept on disk
    cpu_linear.prepare(weights, tmp_path)
    chosen = cpu_linear.choices()[(1024, 1032, torch.float32)]
    files = list(tmp_path.glob("linear-paths-*.json"))
    assert len(files) == 1

    monkeypatch.setattr(cpu_linear, "_CHOICE", {})  # a new process
    monkeypatch.setattr(cpu_linear, "choose", lambda *a, **k: pytest.fail("measured although saved"))
    cpu_linear.prepare(weights, tmp_path)
    assert cpu_linear.choices()[(1024, 1032, torch.float32)] == chosen

    files[0].write_text("{damaged")
    monkeypatch.setattr(cpu_linear, "_CHOICE", {})
    monkeypatch.setattr(cpu_linear, "choose", lambda *a, **k: ("linear", "linear", "linear", "mm_t"))
    cpu_linear.prepare(weights, tmp_path)  # measured again, and saved again
    assert cpu_linear.choices()[(1024, 1032, torch.float32)] == ("linear", "linear", "linear", "mm_t")
    assert "mm_t" in files[0].read_text()
