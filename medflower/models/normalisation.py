"""Each backbone's own input normalisation.

Every loader hands a model the same tensor: pixels in [0, 1] standardised with ImageNet's mean and std
(``data/transforms.py``, the convention of timm's ImageNet weights and of SAM, whose pixel mean and std are ImageNet's
× 255). A backbone whose weights saw something else gets an ``InputNorm`` in front of it that maps that tensor to its
own input, exactly (the ImageNet step is undone per channel first):

- ``min-max``: each image scaled to [0, 1] by its own minimum and maximum over all channels, what MedSAM and
  LiteMedSAM were trained on (``(x - min) / max(max - min, 1e-8)``);
- ``mean-std``: ``(pixels - mean) / std`` with the mean and std of the timm pretrained config the weights come from
  (for example 0.5 / 0.5 for timm's AugReg ViTs);
- ``imagenet``: the loader's tensor as it is (no module).

``input-norm='auto'`` picks by backbone and weights (``pick``): LiteMedSAM and MedSAM min-max; a timm backbone with
loaded weights its pretrained config's mean/std (SAM's equals ImageNet's); random weights ImageNet's (nothing to
match).
"""

from __future__ import annotations

import torch
from timm.data import IMAGENET_DEFAULT_MEAN as IMAGENET_MEAN
from timm.data import IMAGENET_DEFAULT_STD as IMAGENET_STD
from torch import nn

from .errors import ModelError

INPUT_NORMS = ("auto", "imagenet", "min-max", "mean-std")
MIN_MAX_BACKBONES = ("litemedsam", "medsam")


class InputNorm(nn.Module):
    """The loader's ImageNet-standardised tensor ``[B, 3, H, W]`` -> this backbone's input (module docstring)."""

    def __init__(self, kind: str, mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD):
        super().__init__()
        if kind not in ("min-max", "mean-std"):
            raise ModelError(f"InputNorm kind {kind!r}: min-max or mean-std")
        self.kind = kind
        self.register_buffer("imagenet_mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("imagenet_std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pixels = x * self.imagenet_std.to(x.dtype) + self.imagenet_mean.to(x.dtype)  # back to [0, 1]
        if self.kind == "mean-std":
            return (pixels - self.mean.to(x.dtype)) / self.std.to(x.dtype)
        low = pixels.amin(dim=(1, 2, 3), keepdim=True)
        high = pixels.amax(dim=(1, 2, 3), keepdim=True)
        return (pixels - low) / (high - low).clamp_min(1e-8)

    def extra_repr(self) -> str:
        if self.kind == "mean-std":
            return f"mean-std, mean={tuple(round(v, 4) for v in self.mean.flatten().tolist())}"
        return "min-max"


def pick(setting: str, backbone: str, timm_name: str | None, weights_source: str) -> tuple[str, InputNorm | None]:
    """(the normalisation's name, its module or None for ImageNet's) for run-config ``input-norm`` = ``setting``."""
    if setting not in INPUT_NORMS:
        raise ModelError(f"input-norm={setting!r} is invalid; choose one of {list(INPUT_NORMS)}")
    kind = setting
    if setting == "auto":
        if backbone in MIN_MAX_BACKBONES:
            kind = "min-max"
        elif weights_source == "random" or timm_name is None:
            kind = "imagenet"
        else:
            kind = "mean-std"
    if kind == "imagenet":
        return "imagenet", None
    if kind == "min-max":
        return "min-max", InputNorm("min-max")
    mean, std = timm_mean_std(timm_name)
    if _close(mean, IMAGENET_MEAN) and _close(std, IMAGENET_STD):
        return "imagenet", None  # the same numbers: nothing to do
    return f"mean-std {tuple(round(v, 4) for v in mean)}/{tuple(round(v, 4) for v in std)}", InputNorm(
        "mean-std", mean, std
    )


def timm_mean_std(timm_name: str | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std of timm's pretrained config for ``timm_name`` (its default tag); ImageNet's without one."""
    if timm_name is None:
        raise ModelError("input-norm='mean-std' reads a timm pretrained config; this backbone has none")
    import timm

    try:
        cfg = timm.models.get_pretrained_cfg(timm_name)
    except RuntimeError:
        cfg = None
    if cfg is None:
        return IMAGENET_MEAN, IMAGENET_STD
    mean, std = tuple(cfg.mean), tuple(cfg.std)
    if len(mean) == 1:
        mean, std = mean * 3, std * 3
    return mean, std


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-4 for x, y in zip(a, b))
