"""AdaptedClassifier (pooled backbone features into a linear head or SiFT's cosine head) and build_classifier."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from .adapted import (
    HEAD_SEED_OFFSET,
    PROJECTOR_SEED_OFFSET,
    AdaptedModel,
    build_backbone_with_adapter,
    check_num_classes,
)
from .errors import ModelError
from .spec import ModelSpec
from .text_head import CosineHead, encode_class_texts, load_class_embeddings, random_projector


class AdaptedClassifier(AdaptedModel):
    """``head(backbone(x))``: pooled backbone features into a linear head or SiFT's cosine head."""

    task = "classification"
    task_module = "head"

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module,
        adapter_param_names: Iterable[str] = (),
        spec: ModelSpec | None = None,
        weights_source: str = "random",
    ):
        super().__init__(backbone, adapter_param_names, spec, weights_source)
        self.head = head
        self.feature_dim = head.in_features
        self._freeze_all_but_trainable(adapter_param_names)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled backbone features ``[B, feature_dim]`` of images ``x``."""
        return self.backbone(self.input_norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder_output(x))

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, pooled features) from one backbone pass."""
        features = self.encoder_output(x)
        return self.head(features), features

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled backbone features ``[B, feature_dim]``."""
        return self.encoder_output(x)


def cosine_head(spec: ModelSpec, num_classes: int, feature_dim: int) -> CosineHead:
    """SiFT's head (docs/methods/sift.md): W from the spec's class-embedding source (or random with its shape), P a
    Gaussian [dim, feature_dim] from the spec's seed alone, so every node rebuilds the same frozen W and P."""
    embeddings = class_embedding_matrix(spec, num_classes)
    if spec.head == "random":
        rng = np.random.default_rng(spec.seed + HEAD_SEED_OFFSET)
        embeddings = rng.standard_normal(embeddings.shape).astype(np.float32)
    projector = random_projector(spec.seed + PROJECTOR_SEED_OFFSET, embeddings.shape[1], feature_dim)
    return CosineHead(embeddings, projector, tau=spec.head_tau, train_projector=spec.train_projector)


def class_embedding_matrix(spec: ModelSpec, num_classes: int) -> np.ndarray:
    """[num_classes, dim]: the ``class_embeddings`` file, else ``text_encoder``'s [CLS] rows of ``class_texts``."""
    if spec.class_embeddings:
        return load_class_embeddings(spec.class_embeddings, num_classes)
    if not spec.text_encoder:
        raise ModelError(
            f"head={spec.head!r} needs class embeddings: set run-config 'class-embeddings' (a .npy or "
            f".safetensors file, one row per class) or 'text-encoder' (a local model folder)"
        )
    if len(spec.class_texts) != num_classes:
        raise ModelError(
            f"text-encoder {spec.text_encoder}: {len(spec.class_texts)} class texts for {num_classes} "
            f"classes; give one text per class (run-config 'class-texts', separated by ';')"
        )
    return _encoded_texts(spec.text_encoder, spec.class_texts)


@functools.lru_cache(maxsize=4)
def _encoded_texts(model_dir: str, texts: tuple[str, ...]) -> np.ndarray:
    """One encoder pass per (folder, texts) in a process: every round rebuilds nothing."""
    return encode_class_texts(model_dir, texts)


def build_classifier(spec: ModelSpec, num_classes: int) -> AdaptedClassifier:
    """Build backbone, load weights, inject the adapter and add a head; deterministic for a given spec."""
    check_num_classes(num_classes)
    with torch.random.fork_rng(devices=[]):  # seed locally, leave the caller's RNG untouched
        backbone, adapter_param_names, weights_source, feature_dim = build_backbone_with_adapter(spec)
        torch.manual_seed(spec.seed + HEAD_SEED_OFFSET)
        head = (
            nn.Linear(feature_dim, num_classes)
            if spec.head == "linear"
            else cosine_head(spec, num_classes, feature_dim)
        )
    return AdaptedClassifier(backbone, head, adapter_param_names, spec=spec, weights_source=weights_source)
