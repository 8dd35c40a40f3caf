"""Models layer: timm backbones with peft / bottleneck adapters and a linear head or a segmentation
decoder, exchanged as named arrays."""

from .adapted import AdaptedModel
from .adapters import ADAPTERS, Bottleneck
from .backbones import BACKBONE_ALIASES, WEIGHT_MODES, resolve_backbone
from .build import build_model
from .classifier import AdaptedClassifier, build_classifier
from .errors import ModelError, PretrainedWeightsWarning
from .naming import adapter_module, adapter_modules, lowest_adapter_names
from .segmentation import AdaptedSegmenter, LightDecoder, build_segmenter
from .spec import TASKS, ModelSpec

__all__ = [
    "ADAPTERS",
    "BACKBONE_ALIASES",
    "TASKS",
    "WEIGHT_MODES",
    "AdaptedClassifier",
    "AdaptedModel",
    "AdaptedSegmenter",
    "Bottleneck",
    "LightDecoder",
    "ModelError",
    "ModelSpec",
    "PretrainedWeightsWarning",
    "adapter_module",
    "adapter_modules",
    "build_classifier",
    "build_model",
    "build_segmenter",
    "lowest_adapter_names",
    "resolve_backbone",
]
