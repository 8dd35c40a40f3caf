"""SiFT's text-guided head: a tiny BERT written to a temp dir loads through the local text-encoder path,
embeddings files are checked row by row, the projector is rebuilt from its seed, the head's logits are
cos/τ and only what a variant names gets a gradient."""

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from medflower.models import ModelError
from medflower.models.text_head import CosineHead, encode_class_texts, load_class_embeddings, random_projector


def test_a_local_text_encoder_gives_one_cls_row_per_class(tiny_bert):
    from transformers import AutoModel, AutoTokenizer

    texts = ["normal", "pneumonia lung opacity", "chest"]
    rows = encode_class_texts(str(tiny_bert), texts)
    assert rows.shape == (3, 16) and np.isfinite(rows).all()
    tokenizer, model = AutoTokenizer.from_pretrained(str(tiny_bert)), AutoModel.from_pretrained(str(tiny_bert)).eval()
    with torch.no_grad():
        direct = model(**tokenizer(texts, padding=True, return_tensors="pt")).last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(rows, direct, rtol=1e-5, atol=1e-6)
    assert not np.allclose(rows[0], rows[1])


def test_a_missing_or_broken_encoder_is_named(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        encode_class_texts(str(tmp_path / "nope"), ["a"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="empty"):
        encode_class_texts(str(tmp_path / "empty"), ["a"])


def test_embedding_files_need_one_row_per_class(tmp_path):
    good = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    np.save(tmp_path / "e.npy", good)
    np.testing.assert_array_equal(load_class_embeddings(str(tmp_path / "e.npy"), 3), good)
    save_file({"embeddings": good}, str(tmp_path / "e.safetensors"))
    np.testing.assert_array_equal(load_class_embeddings(str(tmp_path / "e.safetensors"), 3), good)
    with pytest.raises(ModelError, match=r"expected one row per class: \[4, dim\]"):
        load_class_embeddings(str(tmp_path / "e.npy"), 4)
    save_file({"a": good, "b": good}, str(tmp_path / "two.safetensors"))
    with pytest.raises(ModelError, match="exactly one"):
        load_class_embeddings(str(tmp_path / "two.safetensors"), 3)
    with pytest.raises(ModelError, match="does not exist"):
        load_class_embeddings(str(tmp_path / "missing.npy"), 3)


def test_projector_is_rebuilt_from_the_seed_and_the_head_is_cosine_over_tau():
    p = random_projector(5, 8, 12)
    torch.testing.assert_close(p, random_projector(5, 8, 12))
    assert not torch.allclose(p, random_projector(6, 8, 12))
    embeddings = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    features = torch.randn(4, 12, requires_grad=True)
    head = CosineHead(embeddings, p, tau=0.07)
    logits = head(features)
    expected = (
        torch.nn.functional.cosine_similarity((features @ p.T)[:, None, :], torch.as_tensor(embeddings)[None], dim=-1)
        / 0.07
    )
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert list(head.parameters()) == []  # frozen: W and P are buffers
    logits.sum().backward()
    assert features.grad is not None
    trainable = CosineHead(embeddings, p, train_projector=True)
    trainable(features.detach()).sum().backward()
    assert trainable.weight.grad is None and trainable.projector.grad is not None
    with pytest.raises(ModelError, match="dim 8"):
        CosineHead(embeddings, random_projector(0, 5, 12))
