"""build_model: the spec's task model, a classifier or a segmenter."""

from __future__ import annotations

from .adapted import AdaptedModel
from .classifier import build_classifier
from .segmentation import build_segmenter
from .spec import ModelSpec


def build_model(spec: ModelSpec, num_classes: int) -> AdaptedModel:
    """The spec's task model: AdaptedClassifier (task 'classification') or AdaptedSegmenter ('segmentation')."""
    if spec.task == "segmentation":
        return build_segmenter(spec, num_classes)
    return build_classifier(spec, num_classes)
