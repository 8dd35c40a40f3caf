"""build_model: the spec's task model, a classifier or a segmenter (adapted encoder, or a U-Net baseline)."""

from __future__ import annotations

from .adapted import AdaptedModel
from .classifier import build_classifier
from .errors import ModelError
from .segmentation import build_segmenter
from .spec import ModelSpec
from .unet import build_unet, is_unet

MEDSAM_AUTO = (
    "backbone 'medsam' is SAM ViT-B's architecture; timm has no MedSAM weights, so weights='auto' would load SAM's "
    "(or random ones) under MedSAM's name. Pass MedSAM's checkpoint as a local file "
    "(backbone-weights=/path/to/medsam_vit_b.pth) or use weights='none' for a random encoder"
)


def check_medsam_weights(spec: ModelSpec) -> None:
    """Refuse ``medsam`` with ``auto`` weights, for a classifier as for a segmenter."""
    if spec.backbone == "medsam" and spec.weights == "auto":
        raise ModelError(MEDSAM_AUTO)


def build_model(spec: ModelSpec, num_classes: int) -> AdaptedModel:
    """The spec's task model: AdaptedClassifier (task 'classification'), AdaptedSegmenter ('segmentation'), or for
    the U-Net baselines (``backbone='unet'``/``'resunet'``...) a whole-model UNetSegmenter."""
    if is_unet(spec.backbone):
        return build_unet(spec, num_classes)
    check_medsam_weights(spec)
    if spec.task == "segmentation":
        return build_segmenter(spec, num_classes)
    return build_classifier(spec, num_classes)
