"""SiFT's text-guided classifier (docs/methods/sift.md): frozen class embeddings from a text encoder or a file, a frozen
random projector shared through a seed, and cosine logits ``cos(w_c, P·F(x)) / τ``.

Nothing is downloaded: a text encoder is a local model directory (transformers AutoTokenizer/AutoModel,
``local_files_only``), embeddings files are local ``.npy`` or ``.safetensors``. Every mismatch is a
``ModelError`` that names the path and the number of rows expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .errors import ModelError

EMBEDDING_SUFFIXES = (".npy", ".safetensors")


def load_class_embeddings(path: str, num_classes: int) -> np.ndarray:
    """[num_classes, D] float32 from a ``.npy`` file or a ``.safetensors`` file holding one tensor."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelError(f"class-embeddings file {file.resolve()} does not exist")
    if file.suffix == ".npy":
        array = np.load(file, allow_pickle=False)
    elif file.suffix == ".safetensors":
        from safetensors.numpy import load_file

        tensors = load_file(str(file))
        if len(tensors) != 1:
            raise ModelError(
                f"class-embeddings file {file} holds {len(tensors)} tensors ({sorted(tensors)[:4]}); "
                f"it must hold exactly one [classes, dim] tensor"
            )
        array = next(iter(tensors.values()))
    else:
        raise ModelError(f"class-embeddings file {file} must end in one of {list(EMBEDDING_SUFFIXES)}")
    if array.ndim != 2 or array.shape[0] != num_classes:
        raise ModelError(
            f"class-embeddings file {file} has shape {tuple(array.shape)}; expected one row per class: "
            f"[{num_classes}, dim]"
        )
    if not np.isfinite(array).all():
        raise ModelError(f"class-embeddings file {file} has NaN/Inf values")
    return array.astype(np.float32)


@torch.no_grad()
def encode_class_texts(model_dir: str, texts: Sequence[str]) -> np.ndarray:
    """Last-layer [CLS] embedding of each text from a local transformers encoder directory: [len(texts), D]."""
    from transformers import AutoModel, AutoTokenizer

    directory = Path(model_dir).expanduser()
    if not directory.is_dir():
        raise ModelError(
            f"text-encoder directory {directory.resolve()} does not exist (a local model folder with "
            f"config.json, tokenizer files and weights is needed; nothing is downloaded)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        encoder = AutoModel.from_pretrained(str(directory), local_files_only=True).eval()
    except (OSError, ValueError) as err:
        raise ModelError(
            f"text-encoder directory {directory}: cannot load a tokenizer and model from it: {err}"
        ) from err
    batch = tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
    return encoder(**batch).last_hidden_state[:, 0].float().numpy()


def random_projector(seed: int, out_dim: int, in_dim: int) -> torch.Tensor:
    """P [out_dim, in_dim], N(0, 1/in_dim) entries from ``seed`` alone: every node rebuilds the same matrix."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_dim, in_dim, generator=generator) / in_dim**0.5


class CosineHead(nn.Module):
    """``logits_c = cos(w_c, P·f) / τ`` with class embeddings W [C, D] and projector P [D, d].

    W is a frozen buffer; P too, unless ``train_projector`` (SiFT's 'trainable-proj' ablation).
    """

    def __init__(
        self,
        embeddings: np.ndarray | torch.Tensor,
        projector: torch.Tensor,
        tau: float = 0.07,
        train_projector: bool = False,
    ):
        super().__init__()
        weight = torch.as_tensor(np.asarray(embeddings), dtype=torch.float32)
        if weight.shape[1] != projector.shape[0]:
            raise ModelError(
                f"class embeddings have dim {weight.shape[1]} but the projector maps to {projector.shape[0]}"
            )
        self.tau = tau
        self.in_features = projector.shape[1]
        self.out_features = weight.shape[0]
        self.register_buffer("weight", weight.clone())
        if train_projector:
            self.projector = nn.Parameter(projector.clone())
        else:
            self.register_buffer("projector", projector.clone())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        projected = nn.functional.normalize(features @ self.projector.T, dim=-1)
        return projected @ nn.functional.normalize(self.weight, dim=-1).T / self.tau
