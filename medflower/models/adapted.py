"""AdaptedModel: a frozen timm backbone with adapters plus a trainable task module, exchanged as named arrays;
and the backbone-with-adapter build both task models share (classifier.py, segmentation.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import nn

import medflower.models.arrays as arrays

from .adapters import inject_adapter
from .backbones import NON_TIMM_FAMILIES, backbone_family, create_backbone, resolve_backbone
from .errors import ModelError
from .normalisation import pick as pick_input_norm
from .spec import ModelSpec

# Offsets added to spec.seed per build stage, so each stage's init is fixed whatever the earlier stages consumed.
ADAPTER_SEED_OFFSET = 1_000_003
HEAD_SEED_OFFSET = 2_000_006
PROJECTOR_SEED_OFFSET = 3_000_009


class AdaptedModel(nn.Module):
    """A frozen timm backbone with adapters plus a small task module; only adapters and task module train.

    ``task_module`` is the attribute holding the head (``head``) or decoder (``decoder``). The exchanged
    ("trainable") arrays are fixed at construction: ``trainable_names()`` lists them in forward order
    (block depth ascending, task module last) with peft's ``.default`` adapter name stripped.

    ``encode`` is the backbone with its adapters, after the backbone's own input normalisation (``input_norm``,
    models/normalisation.py); the task module reads its output. With ``spec.encoded_inputs`` the model takes
    ``encode``'s output instead of images (the frozen-encoder mode, docs/models.md#frozen-encoder-mode:
    the sites compute it once and cache it).
    With a frozen backbone, its BatchNorm layers stay in eval mode in ``train()``, so frozen running
    statistics never drift locally (they are not exchanged). With ``adapter='full'`` the whole backbone
    trains, BatchNorm updates its statistics, and ``running_mean``/``running_var`` travel with the
    parameters (after them, in ``get_trainable``), so every message sets them and simulated sites sharing
    one model object never see each other's statistics.
    """

    task: str = ""
    task_module: str = ""

    def __init__(
        self,
        backbone: nn.Module,
        adapter_param_names: Iterable[str] = (),
        spec: ModelSpec | None = None,
        weights_source: str = "random",
    ):
        super().__init__()
        self.backbone = backbone
        self.spec = spec
        self.weights_source = weights_source
        self.encoded_inputs = bool(spec is not None and spec.encoded_inputs)
        self.input_norm_name, norm = _input_norm(spec, weights_source)
        self.input_norm = norm if norm is not None else nn.Identity()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's output for images ``x`` (what the frozen-encoder mode caches)."""
        raise NotImplementedError

    def encoder_output(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself when the model takes encoder outputs, else ``encode(x)``."""
        return x if self.encoded_inputs else self.encode(x)

    def image_size(self, x: torch.Tensor) -> tuple[int, int]:
        if self.encoded_inputs:
            return (self.spec.img_size, self.spec.img_size)
        return tuple(x.shape[-2:])

    def _freeze_all_but_trainable(
        self, adapter_param_names: Iterable[str], frozen_task_params: Iterable[str] = ()
    ) -> None:
        """Fix the trainable set: the adapters' parameters and every parameter of the task module but
        ``frozen_task_params`` (names inside it that get no gradient)."""
        adapter_params = {f"backbone.{n}" for n in adapter_param_names}
        frozen = {f"{self.task_module}.{n}" for n in frozen_task_params}
        raw = [
            n
            for n, _ in self.named_parameters()
            if n in adapter_params or (n.startswith(self.task_module + ".") and n not in frozen)
        ]
        unknown = adapter_params - set(raw)
        if unknown:
            raise ModelError(f"adapter parameters not found in the backbone: {sorted(unknown)[:4]}")
        clean = [arrays.clean_param_name(n) for n in raw]
        if len(set(clean)) != len(clean):
            raise ModelError(f"trainable parameter names collide after cleaning: {clean}")
        self._trainable_raw = OrderedDict(zip(clean, raw))  # clean name -> name in named_parameters()
        for name, p in self.named_parameters():
            p.requires_grad_(name in raw)
        self.trains_backbone = self.spec is not None and self.spec.adapter == "full"
        statistics = [
            n
            for n, _ in self.named_buffers()
            if self.trains_backbone and n.startswith("backbone.") and arrays.is_running_statistic(n)
        ]
        self._statistics_raw = OrderedDict((arrays.clean_param_name(n), n) for n in statistics)

    def train(self, mode: bool = True) -> AdaptedModel:
        super().train(mode)
        if self.trains_backbone:
            return self
        for m in self.backbone.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()  # frozen statistics, see class docstring
        return self

    def trainable_names(self) -> list[str]:
        """Exchanged array names: trainable parameters, then (full backbone training) BatchNorm statistics."""
        return [*self._trainable_raw, *self._statistics_raw]

    def parameter_paths(self) -> OrderedDict[str, str]:
        """Clean trainable name -> its path in ``named_parameters()`` (what ``torch.func.functional_call`` takes)."""
        return OrderedDict(self._trainable_raw)

    def trainable_parameters(self) -> OrderedDict[str, nn.Parameter]:
        params = dict(self.named_parameters())
        return OrderedDict((clean, params[raw]) for clean, raw in self._trainable_raw.items())

    def _exchanged_tensors(self) -> OrderedDict[str, torch.Tensor]:
        """Trainable parameters, then the BatchNorm statistics that travel with them (see the class docstring)."""
        buffers = dict(self.named_buffers())
        return OrderedDict(
            [
                *self.trainable_parameters().items(),
                *((clean, buffers[raw]) for clean, raw in self._statistics_raw.items()),
            ]
        )

    def get_trainable(self) -> OrderedDict[str, np.ndarray]:
        """float32 numpy copies of the exchanged arrays (trainable parameters + travelling statistics)."""
        return arrays.to_numpy(self._exchanged_tensors())

    def set_trainable(self, values: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Copy arrays into the exchanged tensors; ModelError (nothing changed) on name/shape mismatch.

        ``strict=False`` skips missing and unknown names (shapes are still checked).
        """
        arrays.copy_into(self._exchanged_tensors(), values, strict)

    def trainable_spec(self) -> OrderedDict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype) of ``get_trainable()``'s arrays."""
        return arrays.array_spec(self._exchanged_tensors())


def build_backbone_with_adapter(spec: ModelSpec) -> tuple[nn.Module, list[str], str, int]:
    """(backbone with the spec's adapter, adapter parameter names, weights source, feature width)."""
    timm_name = resolve_backbone(spec.backbone)
    family = backbone_family(timm_name)
    backbone, weights_source = create_backbone(
        timm_name, img_size=spec.img_size, patch_size=spec.patch_size, weights=spec.weights, seed=spec.seed
    )
    base_params = {id(p) for p in backbone.parameters()}
    torch.manual_seed(spec.seed + ADAPTER_SEED_OFFSET)
    inject_adapter(
        backbone,
        spec.adapter,
        family,
        targets=spec.adapter_targets,
        lora_rank=spec.lora_rank,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        bottleneck_ratio=spec.bottleneck_ratio,
        n_frequency=spec.n_frequency,
        fourier_scale=spec.fourier_scale,
        backbone_name=spec.backbone,
    )
    adapter_param_names = [
        n for n, p in backbone.named_parameters() if id(p) not in base_params or spec.adapter == "full"
    ]
    feature_dim = getattr(backbone, "head_hidden_size", None) or backbone.num_features
    return backbone, adapter_param_names, weights_source, feature_dim


def _input_norm(spec: ModelSpec | None, weights_source: str) -> tuple[str, nn.Module | None]:
    """The spec's input normalisation (models/normalisation.py); ImageNet's for models built without a spec or from
    no timm architecture (the U-Net baselines, trained from scratch)."""
    if spec is None:
        return "imagenet", None
    try:
        name = resolve_backbone(spec.backbone)
    except ModelError:
        return "imagenet", None
    return pick_input_norm(spec.input_norm, spec.backbone, None if name in NON_TIMM_FAMILIES else name, weights_source)


def check_num_classes(num_classes: int) -> None:
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ModelError(f"num_classes must be an integer >= 1, got {num_classes!r}")
