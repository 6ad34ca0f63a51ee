"""Bad options give one line, not a traceback (issue 7): seeds, temperature, types, device, threads,
--max-new-tokens; and `outrider --version`.

The CLI cases name a model that does not exist: an option checked before the model is resolved
and loaded shows its own message, one checked later would show "unknown model" instead.
"""

import math

import numpy as np
import pytest
import torch

import outrider
from outrider import LLM, ConfigError, SamplingParams
from outrider.cli import main
from outrider.weights.loader import resolve_device
from outrider.sampling import MIN_TEMPERATURE, warp_probs

NO_MODEL = ("--model", "no-such-model")


def one_line_error(capsys, *argv, expect: str) -> str:
    """Run the CLI; it must exit 2 with exactly one stderr line, `error: ...`, containing `expect`."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expect in lines[0], lines[0]
    return lines[0]


# -- seeds -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64, 2**64 + 5, 2**70, -1, -(2**63)])
def test_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        SamplingParams(1.0, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1])
def test_seed_inside_64_bits_is_kept(seed):
    assert SamplingParams(1.0, seed=seed).seed == seed


def test_numpy_integers_become_python_ints():
    params = SamplingParams(np.float32(0.5), np.int64(3), np.float64(0.9), np.uint64(2**64 - 1))
    assert type(params.seed) is int and params.seed == 2**64 - 1
    assert type(params.top_k) is int and type(params.temperature) is float and type(params.top_p) is float


# -- temperature -------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1e-40, 1e-30, 5e-5, MIN_TEMPERATURE / 2])
def test_temperature_too_small_says_use_0_for_greedy(t):
    with pytest.raises(ConfigError, match="use 0 for greedy"):
        SamplingParams(t)


@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf, -1.0, -1e-9, pytest.param(10**400, id="10**400")])
def test_temperature_not_finite_or_negative_is_refused(t):
    with pytest.raises(ConfigError, match="temperature must be a finite number >= 0"):
        SamplingParams(t)


def test_warp_is_finite_at_the_smallest_temperature():
    """At MIN_TEMPERATURE the warp still gives a distribution, on logits far larger than real ones."""
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 30.0, 1e4):
        logits = torch.randn(4, 50, generator=g) * scale  # [4, 50] float32
        for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9), (7, 0.5)):
            probs = warp_probs(logits, SamplingParams(MIN_TEMPERATURE, top_k, top_p))
            assert torch.isfinite(probs).all() and (probs >= 0).all()
            assert torch.allclose(probs.sum(-1), torch.ones(4))
            assert (probs.argmax(-1) == logits.argmax(-1)).all()


def test_why_tiny_temperatures_are_refused():
    """Below the bound the logits overflow float32 and the warp turns into NaN: the refusal keeps
    NaN from ever reaching sampling (it was a RuntimeError from torch.multinomial)."""
    logits = torch.tensor([[2.0, 1.0, -3.0]])
    unchecked = SamplingParams(1.0)
    object.__setattr__(unchecked, "temperature", 1e-40)  # what the check now refuses
    assert torch.isnan(warp_probs(logits, unchecked)).any()


# -- types and ranges --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": "hot"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"temperature": None}, "temperature"), ({"top_k": 2.5}, "top_k"), ({"top_k": 5.0}, "top_k"),
    ({"top_k": True}, "top_k"), ({"top_k": "5"}, "top_k"), ({"top_p": "0.9"}, "top_p"),
    ({"top_p": None}, "top_p"), ({"seed": 1.5}, "seed"), ({"seed": "7"}, "seed"), ({"seed": False}, "seed"),
])
def test_wrong_types_raise_type_error(kwargs, name):
    with pytest.raises(TypeError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, expect", [
    ({"top_k": -1}, "top_k must be >= 0"), ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"), ({"top_p": math.nan}, "top_p must be in (0, 1]"),
    ({"top_p": -0.1}, "top_p must be in (0, 1]"),
])
def test_values_out_of_range_raise_config_error(kwargs, expect):
    with pytest.raises(ConfigError) as err:
        SamplingParams(1.0, **kwargs)
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_valid_values_are_accepted():
    params = SamplingParams(1, 0, 1)  # ints where floats are expected are fine
    assert params.temperature == 1.0 and params.top_p == 1.0 and not params.greedy
    assert SamplingParams(0).greedy and SamplingParams(MIN_TEMPERATURE, 3, 0.5, 7).top_k == 3


# -- device ------------------------------------------------------------------------------------
def without_cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)


def with_gpus(monkeypatch, count: int):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("name", ["tpu", "gpu", "CPU", "cuda:x", "cuda:", "cpu:1", "mps:2", ""])
def test_unknown_device_lists_the_valid_ones(name):
    with pytest.raises(ConfigError, match=r"unknown device .*: use cpu, cuda, cuda:N or mps"):
        resolve_device(name)


def test_cpu_is_always_accepted():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_cuda_without_a_cuda_build(monkeypatch):
    without_cuda_build(monkeypatch)
    for name in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(ConfigError, match="needs a CUDA build of PyTorch.*use --device cpu"):
            resolve_device(name)


def test_cuda_build_without_a_gpu(monkeypatch):
    with_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="no CUDA GPU is visible.*use --device cpu"):
        resolve_device("cuda")


def test_cuda_index_beyond_the_gpus(monkeypatch):
    with_gpus(monkeypatch, 2)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match="'cuda:2' does not exist.*cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_mps_only_where_available(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'mps' is not available.*use --device cpu"):
        resolve_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("mps") == torch.device("mps")


def test_device_of_a_wrong_type():
    with pytest.raises(TypeError, match="device must be a string"):
        resolve_device(0)


def test_device_and_threads_are_checked_before_the_model():
    """An unknown model would be reported if the checks came after resolving it."""
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        LLM("no-such-model", device="tpu")
    with pytest.raises(ConfigError, match="threads must be a positive integer, got 0"):
        LLM("no-such-model", threads=0)
    with pytest.raises(TypeError, match="threads must be an integer"):
        LLM("no-such-model", threads="2")


# -- the CLI -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, expect", [
    (("--seed", str(2**64)), f"seed must be an integer in [0, 2**64), got {2**64}"),
    (("--seed", "-1"), "seed must be an integer in [0, 2**64), got -1"),
    (("--temperature", "1e-40"), "use 0 for greedy"),
    (("--temperature", "nan"), "temperature must be a finite number"),
    (("--temperature", "inf"), "temperature must be a finite number"),
    (("--device", "tpu"), "unknown device 'tpu': use cpu, cuda, cuda:N or mps"),
    (("--threads", "0"), "--threads must be a positive integer, got 0"),
    (("--max-new-tokens", "-1"), "--max-new-tokens must be a positive integer, got -1"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be a positive integer, got 0"),
])
def test_cli_bad_option_is_one_line_before_loading(capsys, argv, expect):
    one_line_error(capsys, "generate", *NO_MODEL, *argv, "x", expect=expect)


def test_cli_cuda_on_a_build_without_cuda(capsys, monkeypatch):
    without_cuda_build(monkeypatch)
    line = one_line_error(capsys, "generate", *NO_MODEL, "--device", "cuda", "x", expect="CUDA build")
    assert "--device cpu" in line


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"outrider {outrider.__version__}\n"
