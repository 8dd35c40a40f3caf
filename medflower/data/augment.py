"""Training-only augmentation (run-config ``augment``, docs/data.md#augmentation) with MONAI dictionary transforms.

``Augmenter`` transforms a batch sample by sample, before the ImageNet normalisation: images as float
[B, C, H, W] in 0..255, segmentation masks as int64 class indices [B, H, W] or binary planes [B, K, H, W].
Image and mask of a sample get the same geometric transform (the image bilinear, every mask plane nearest);
intensity jitter changes the image only. Every random transform is seeded from the loader's seed
(``set_random_state``), so the same seed gives the same augmented batches, and draws go on from batch to batch
and epoch to epoch, so every sample and every epoch gets its own transform.

Items of the setting (``spec.parse_augment``), applied in this order:

- ``crop:<f>``: a random square crop of side f * side (MONAI ``RandScaleCropd``), resized back (``Resized``);
  FedSCA (Zhang et al., preprint; docs/methods/sgca.md) trains on random 320x320 crops, which for 384x384
  images is ``crop:0.833``;
- ``flip`` / ``vflip``: a horizontal / vertical flip with probability 0.5 (``RandFlipd``);
- ``rotate:<d>``: a rotation by a uniform angle in [-d, d] degrees, zeros outside the image (``RandRotated``);
- ``jitter:<s>``: brightness scaled by a uniform factor in [1 - s, 1 + s] (``RandScaleIntensityd``), then
  contrast around the image's mean by another (``RandScaleIntensityFixedMeand``), clipped to 0..255.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .spec import parse_augment

IMAGE, MASK = "image", "mask"
_SEED_TAG = 5151  # keeps the augmentation's random stream apart from the loader's shuffling


class Augmenter:
    """Seeded per-sample augmentation of batches; ``augment`` is the run-config setting (or its parsed form)."""

    def __init__(self, augment: str | dict[str, float], seed: int) -> None:
        self.items = parse_augment(augment) if isinstance(augment, str) else dict(augment)
        self.steps = _steps(self.items)
        seeds = np.random.SeedSequence([seed & (2**64 - 1), _SEED_TAG]).generate_state(len(self.steps))
        for step, step_seed in zip(self.steps, seeds):
            if step is not None:
                step.set_random_state(seed=int(step_seed))

    def __bool__(self) -> bool:
        return bool(self.items)

    def __call__(
        self, images: torch.Tensor, masks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(images, masks) augmented; ``images`` float [B, C, H, W] in 0..255, ``masks`` int64 [B, H, W] or
        [B, K, H, W] of the images' size, or None (classification)."""
        if masks is not None and tuple(masks.shape[-2:]) != tuple(images.shape[-2:]):
            raise ValueError(f"masks of size {tuple(masks.shape[-2:])} for images of size {tuple(images.shape[-2:])}")
        size = tuple(images.shape[-2:])
        planes = masks is not None and masks.ndim == 4
        out_images, out_masks = [], []
        for i in range(len(images)):
            sample = {IMAGE: images[i]}
            if masks is not None:
                sample[MASK] = (masks[i] if planes else masks[i][None]).float()
            for step in self.steps:
                sample = (_resize(size) if step is None else step)(sample)
            out_images.append(_plain(sample[IMAGE]).clamp(0, 255))
            if masks is not None:
                mask = _plain(sample[MASK]).round().to(torch.int64)
                out_masks.append(mask if planes else mask[0])
        return torch.stack(out_images), torch.stack(out_masks) if masks is not None else None


def _steps(items: dict[str, float]) -> list:
    """The MONAI transforms of ``items`` in application order; None marks the resize back after a crop."""
    if not items:
        return []
    from monai.transforms import (  # heavy import, only when augmenting
        RandFlipd,
        RandRotated,
        RandScaleCropd,
        RandScaleIntensityd,
        RandScaleIntensityFixedMeand,
    )

    keys = dict(keys=(IMAGE, MASK), allow_missing_keys=True)
    steps: list = []
    if "crop" in items:
        steps += [RandScaleCropd(roi_scale=items["crop"], random_size=False, **keys), None]
    if "flip" in items:  # channel-first [C, H, W]: spatial axis 1 is the width
        steps.append(RandFlipd(prob=0.5, spatial_axis=1, **keys))
    if "vflip" in items:
        steps.append(RandFlipd(prob=0.5, spatial_axis=0, **keys))
    if "rotate" in items:
        steps.append(
            RandRotated(
                range_x=math.radians(items["rotate"]),
                prob=1.0,
                keep_size=True,
                mode=("bilinear", "nearest"),
                padding_mode="zeros",
                **keys,
            )
        )
    if "jitter" in items:
        steps += [
            RandScaleIntensityd(keys=IMAGE, factors=items["jitter"], prob=1.0),
            RandScaleIntensityFixedMeand(keys=IMAGE, factors=items["jitter"], fixed_mean=True, prob=1.0),
        ]
    return steps


def _resize(size: tuple[int, int]):
    from monai.transforms import Resized

    return Resized(
        keys=(IMAGE, MASK),
        spatial_size=size,
        mode=("bilinear", "nearest"),
        align_corners=(False, None),
        allow_missing_keys=True,
    )


def _plain(tensor) -> torch.Tensor:
    """A MONAI MetaTensor (or array) as a plain float32 tensor."""
    from monai.utils import convert_to_tensor

    return convert_to_tensor(tensor, dtype=torch.float32, track_meta=False)
