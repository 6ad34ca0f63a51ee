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


@pytest.fixture(autouse=True)
def _process_state_put_back():
    """What a test leaves in process-wide state is put back after it, so that no test's outcome
    depends on the tests before it in its worker: the runtime config, a forced kernel variant, a
    pretended CPU profile (kernels/dispatch.py decides from these two)."""
    from outrider import config, cpu
    from outrider.kernels import native

    saved, profile = config.current(), cpu.profile()
    asked = native.asked()
    yield
    if config.current() != saved:  # config.use() in a test, say
        config.use(saved)
    assert native.asked() == asked and cpu.profile() is profile, \
        "a test left a kernel variant or a pretended CPU profile in force (use native.use_variant / cpu.pretending)"


def pytest_collection_finish(session):
    """What is alive once every test module is imported (torch, transformers, the test modules)
    lives to the end: it is moved out of the garbage collector's sight (gc.freeze), so that each
    full collection after it (the loader runs one after every quantized or GGUF load, and Python
    its own from time to time) walks only what the tests made since, not the ~350,000 objects of
    the imports. What the tests make is collected as before. 11% less CPU on four files of model
    tests (test_quant_model, test_quant_smollm2, test_grammar, test_oilbird: 53.8 s -> 47.7 s)."""
    import gc

    gc.collect()
    gc.freeze()


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


# --- which kernel variants ran here: said at the end of every run ------------------------------

def pytest_sessionfinish(session):
    from kernel_variants import EXERCISED

    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: to the controller
        session.config.workeroutput["kernel_variants"] = sorted(EXERCISED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from kernel_variants import EXERCISED

    EXERCISED.update(getattr(node, "workeroutput", {}).get("kernel_variants", ()))


def pytest_terminal_summary(terminalreporter):
    from kernel_variants import EXERCISED

    from outrider.config import KERNEL_VARIANTS, kernel_variants_here
    from outrider.cpu import CpuProfile

    if not EXERCISED:
        return
    here = CpuProfile.here()
    missing = [f"{v} (this CPU lacks {' '.join(f for f in need if f not in here.flags) or 'x86-64'})"
               for v, need in KERNEL_VARIANTS.items() if v not in kernel_variants_here()]
    untried = [v for v in kernel_variants_here() if v not in EXERCISED]
    terminalreporter.write_line(
        f"kernel variants exercised on this machine: {', '.join(v for v in KERNEL_VARIANTS if v in EXERCISED)}; "
        f"not exercised: {', '.join(missing + [f'{v} (not run)' for v in untried]) or 'none'}; "
        f"the dispatch rules of every CPU: tests/test_dispatch.py")
