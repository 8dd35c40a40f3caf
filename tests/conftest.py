"""The fixtures and collection hooks of the suite; what tests share besides fixtures is in tests/helpers.py."""

import os
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import TINY, write_tiny_litemedsam

os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# decoded-image cache of the simulated sites (docs/data.md#decoded-image-cache): one fresh folder per test session
os.environ.setdefault("MEDFLOWER_CACHE_DIR", tempfile.mkdtemp(prefix="medflower-cache-"))


# Under pytest-xdist (`-n N`, what CI runs) each worker is a process of its own: the cores are split between them
# rather than every worker's torch using all of them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """With `--dist loadgroup` a group's tests run on one worker, so a module-scoped fixture is built once: each test
    file is a group, except that the contract and fault-injection suites are a group per strategy (their module
    fixture, parametrised by strategy, runs once per strategy) and each real-process (e2e) test is a group of its own,
    so the slow deployment tests spread over the workers."""
    for item in items:
        group = item.nodeid.split("::")[0]
        if item.get_closest_marker("e2e") is not None:  # real processes, own ports and homes: each test its own group
            group = item.nodeid.split("[")[0]
        params = getattr(getattr(item, "callspec", None), "params", {})
        for fixture in ("runs", "pair"):
            if fixture in params:
                group += f":{params[fixture]}"  # no "]": xdist reads a group only after the last "]"
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def tiny(tmp_path):
    """Run config for a tiny experiment writing into tmp_path."""

    def make(**overrides):
        return {**TINY, "output-dir": str(tmp_path / "outputs"), **overrides}

    return make


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory):
    """A 1-layer BERT with a 10-word vocabulary saved as a local transformers folder (nothing downloaded)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "normal", "pneumonia", "lung", "opacity", "chest"]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(str(folder))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    BertModel(config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_litemedsam(tmp_path_factory) -> Path:
    """A tiny LiteMedSAM weights file (see ``write_tiny_litemedsam``)."""
    return write_tiny_litemedsam(tmp_path_factory.mktemp("litemedsam") / "tiny_lite_medsam.pth")
