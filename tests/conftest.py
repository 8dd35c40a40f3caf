import os

import pytest

os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Small and fast: the synthetic source, a ViT-Tiny at 16x16 with 8x8 patches.
TINY = {
    "dataset": "synthetic",
    "synthetic-size": 320,
    "img-size": 16,
    "patch-size": 8,
    "backbone-weights": "none",
    "num-rounds": 3,
    "batch-size": 32,
    "lr": 0.01,
    "partition": "iid",
}


@pytest.fixture
def tiny(tmp_path):
    """Run config for a tiny experiment writing into tmp_path."""

    def make(**overrides):
        return {**TINY, "output-dir": str(tmp_path / "outputs"), **overrides}

    return make
