import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import FAMILIES, make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model per family (tied embeddings) plus an untied Qwen2."""
    root = tmp_path_factory.mktemp("tiny")
    folders = {fam: make_tiny(fam, root / fam) for fam in FAMILIES}
    folders["qwen2-untied"] = make_tiny("qwen2", root / "qwen2-untied", seed=3, tied=False)
    return folders
