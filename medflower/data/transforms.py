"""Batch transforms (uint8 images -> normalised float tensors, masks -> int64) and the seeded DataLoader."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def images_to_tensor(images: Sequence, img_size: int | None) -> torch.Tensor:
    """uint8 images (HxW, HxWx1 or HxWx3; numpy or tensor) -> float32 [B, 3, S, S], ImageNet-normalised.

    Images are resized (bilinear, antialiased) when ``img_size`` is given and differs.
    """
    if all(isinstance(image, torch.Tensor) for image in images):
        batch = torch.stack(list(images))
    else:
        batch = torch.from_numpy(np.stack([np.asarray(image) for image in images]))
    if batch.ndim == 3:
        batch = batch.unsqueeze(-1)
    x = batch.permute(0, 3, 1, 2).float()
    if img_size is not None and tuple(x.shape[-2:]) != (img_size, img_size):
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", antialias=True, align_corners=False)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x / 255.0 - mean) / std


def masks_to_tensor(masks: Sequence, img_size: int | None) -> torch.Tensor:
    """Class-index masks (HxW; numpy or tensor) -> int64 [B, S, S], resized nearest-neighbour."""
    if all(isinstance(mask, torch.Tensor) for mask in masks):
        batch = torch.stack(list(masks))
    else:
        batch = torch.from_numpy(np.stack([np.asarray(mask) for mask in masks]))
    y = batch.to(torch.int64)
    if img_size is not None and tuple(y.shape[-2:]) != (img_size, img_size):
        # nearest-exact samples pixel centres like the bilinear image resize (align_corners=False)
        y = F.interpolate(y[:, None].float(), size=(img_size, img_size), mode="nearest-exact")[:, 0].to(torch.int64)
    return y


def is_mask(target) -> bool:
    """A segmentation target (a 2-D array) rather than a class label."""
    return isinstance(target, (np.ndarray, torch.Tensor)) and target.ndim >= 2


class BatchTransform:
    """collate_fn: list of (image, label) -> (x float32 [B,3,S,S], y int64 [B]).

    Segmentation items (image, HxW mask) give y int64 [B,S,S] of class indices instead.
    """

    def __init__(self, img_size: int | None) -> None:
        self.img_size = img_size

    def __call__(self, batch: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        images, targets = zip(*batch)
        x = images_to_tensor(images, self.img_size)
        if is_mask(targets[0]):
            return x, masks_to_tensor(targets, self.img_size)
        return x, torch.as_tensor(targets, dtype=torch.int64)


def target_img_size(dataset: Dataset) -> int | None:
    """``img_size`` of the dataset, looking through wrappers such as ``Subset``."""
    while dataset is not None:
        if getattr(dataset, "img_size", None) is not None:
            return dataset.img_size
        dataset = getattr(dataset, "dataset", None)
    return None


def make_loader(dataset: Dataset, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    """Single-process DataLoader; the same ``seed`` gives the same batch order.

    A shuffled (training) loader drops a last batch of one sample: BatchNorm in train mode cannot normalise a
    single 1x1 feature map (ResNets at small inputs), and one shuffled sample per epoch is no loss.
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=shuffle and len(dataset) % batch_size == 1,
        generator=torch.Generator().manual_seed(seed),
        num_workers=0,
        collate_fn=BatchTransform(target_img_size(dataset)),
    )
