import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import FAMILIES, add_tokenizer, make_tiny  # noqa: E402


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
