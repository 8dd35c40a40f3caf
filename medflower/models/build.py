"""build_model: the spec's task model, a classifier or a segmenter (adapted encoder, or a U-Net baseline)."""

from __future__ import annotations

from .adapted import AdaptedModel
from .classifier import build_classifier
from .segmentation import build_segmenter
from .spec import ModelSpec
from .unet import build_unet, is_unet


def build_model(spec: ModelSpec, num_classes: int) -> AdaptedModel:
    """The spec's task model: AdaptedClassifier (task 'classification'), AdaptedSegmenter ('segmentation'), or for
    the U-Net baselines (``backbone='unet'``/``'resunet'``...) a whole-model UNetSegmenter."""
    if is_unet(spec.backbone):
        return build_unet(spec, num_classes)
    if spec.task == "segmentation":
        return build_segmenter(spec, num_classes)
    return build_classifier(spec, num_classes)
