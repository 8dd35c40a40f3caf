"""Models layer: timm backbones with peft / bottleneck adapters and a linear head, exchanged as named arrays."""

from .adapters import ADAPTERS, Bottleneck
from .backbones import BACKBONE_ALIASES, WEIGHT_MODES, resolve_backbone
from .classifier import AdaptedClassifier, build_classifier
from .errors import ModelError, PretrainedWeightsWarning
from .spec import ModelSpec

__all__ = [
    "ADAPTERS",
    "BACKBONE_ALIASES",
    "WEIGHT_MODES",
    "AdaptedClassifier",
    "Bottleneck",
    "ModelError",
    "ModelSpec",
    "PretrainedWeightsWarning",
    "build_classifier",
    "resolve_backbone",
]
