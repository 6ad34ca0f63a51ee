import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import CACHE, FAMILIES, add_tokenizer, make_tiny  # noqa: E402

if CACHE:  # under scripts/mutate.py: import what the fixtures use once, before mutmut forks a process per mutant
    import transformers  # noqa: E402, F401
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402, F401


def pytest_configure(config):
    """One torch thread per test process (OUTRIDER_TEST_THREADS=N for more). The tests' tensors
    are small and the machines are shared 2-core ones: with other processes busy, a SmolLM2 forward
    on two threads was 3 to 8 times slower than on one (the threads wait on each other). `make test`
    runs two processes instead (pytest-xdist, `-n 2`)."""
    torch.set_num_threads(int(os.environ.get("OUTRIDER_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model per family, a tied-embedding Llama, and a second Llama to draft.

    Untied by default: a tiny random model with tied embeddings mostly repeats its input token,
    which would make speculative tests too easy."""
    root = tmp_path_factory.mktemp("tiny")
    folders = {fam: make_tiny(fam, root / fam) for fam in FAMILIES}
    folders["llama-tied"] = make_tiny("llama", root / "llama-tied", seed=2, tied=True)
    folders["llama-draft"] = make_tiny("llama", root / "llama-draft", seed=3)
    for folder in folders.values():
        add_tokenizer(folder)
    return folders


@pytest.fixture
def runtime(monkeypatch):
    """runtime(key=value, ...): the runtime config (outrider/config.py) changed for one test, in
    this process and, through its OUTRIDER_<KEY> variable, in the processes it starts; put back
    after. A value of None unsets the key (its default)."""
    from contextlib import ExitStack

    from outrider import config

    with ExitStack() as stack:
        def set_(**changes):
            for key, value in changes.items():
                name = config.env_name(key)
                for alias in (name, *config.ENV_ALIASES.get(key, ())):
                    monkeypatch.delenv(alias, raising=False)
                if value is not None:
                    monkeypatch.setenv(name, str(value))
            defaults = config.RuntimeConfig()
            return stack.enter_context(config.overriding(
                **{k: (getattr(defaults, k) if v is None else v) for k, v in changes.items()}))

        yield set_


# --- the packaged SmolLM2-135M (pulled by `make test`), loaded once per test process -------------

@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The folder of the pulled default model; fails, saying what to do, when it is not pulled."""
    from outrider.errors import ModelError
    from outrider.catalog.packages import DEFAULT_MODEL
    from outrider.catalog.resolve import resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelError as err:
        pytest.fail(f"{err} (or deselect with -m 'not model')")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.fixture(scope="session")
def smollm2_decoder(smollm2_path):
    """Our runtime's SmolLM2 (float32, CPU). Stateless between calls: every run brings its cache."""
    from outrider.weights.loader import load_decoder

    return load_decoder(smollm2_path, "cpu", torch.float32)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_path):
    """transformers' own modeling code on the same folder (float32, eval): the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
