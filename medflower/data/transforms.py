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
    return normalise(image_batch(images, img_size))


def image_batch(images: Sequence, img_size: int | None) -> torch.Tensor:
    """uint8 images (HxW, HxWx1 or HxWx3; numpy or tensor) -> float32 [B, 1 or 3, S, S] in 0..255, resized
    (bilinear, antialiased) when ``img_size`` is given and differs."""
    if all(isinstance(image, torch.Tensor) for image in images):
        batch = torch.stack(list(images))
    else:
        batch = torch.from_numpy(np.stack([np.asarray(image) for image in images]))
    if batch.ndim == 3:
        batch = batch.unsqueeze(-1)
    x = batch.permute(0, 3, 1, 2).float()
    if img_size is not None and tuple(x.shape[-2:]) != (img_size, img_size):
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", antialias=True, align_corners=False)
    return x


def normalise(x: torch.Tensor) -> torch.Tensor:
    """float [B, 1 or 3, S, S] in 0..255 -> [B, 3, S, S], ImageNet-normalised (grayscale repeated)."""
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x / 255.0 - mean) / std


def masks_to_tensor(masks: Sequence, img_size: int | None) -> torch.Tensor:
    """Masks (numpy or tensor) -> int64, resized nearest-neighbour: class-index masks HxW -> [B, S, S], binary
    planes KxHxW (one per structure) -> [B, K, S, S], each plane resized on its own."""
    if all(isinstance(mask, torch.Tensor) for mask in masks):
        batch = torch.stack(list(masks))
    else:
        batch = torch.from_numpy(np.stack([np.asarray(mask) for mask in masks]))
    y = batch.to(torch.int64)
    if img_size is not None and tuple(y.shape[-2:]) != (img_size, img_size):
        # nearest-exact samples pixel centres like the bilinear image resize (align_corners=False)
        planes = y.ndim == 4
        y = F.interpolate((y if planes else y[:, None]).float(), size=(img_size, img_size), mode="nearest-exact")
        y = (y if planes else y[:, 0]).to(torch.int64)
    return y


def is_mask(target) -> bool:
    """A segmentation target (an HxW class-index mask or KxHxW binary planes) rather than a class label."""
    return isinstance(target, (np.ndarray, torch.Tensor)) and target.ndim in (2, 3)


class BatchTransform:
    """collate_fn: list of (image, label) -> (x float32 [B,3,S,S], y int64 [B]).

    Segmentation items (image, HxW mask) give y int64 [B,S,S] of class indices instead ([B,K,S,S] for KxHxW
    planes). With a non-empty ``augment`` setting, every batch is augmented (``augment.Augmenter``, seeded by
    ``seed``) after resizing and before the ImageNet normalisation; without one, nothing random happens.

    ``encoded``: the items hold encoder outputs (``data/encoded.py``), stacked as float32 as they are. ``box_prompts``
    = K > 0: K box planes (``box_planes``, from the batch's masks after augmentation) are appended to x as channels,
    at x's own resolution (an encoder output's grid: a cell is in a box when any of its pixels is), the prompts of
    LiteMedSAM's ``sam-prompt='box'`` (models/litemedsam.py).
    """

    def __init__(
        self, img_size: int | None, augment: str = "", seed: int = 0, encoded: bool = False, box_prompts: int = 0
    ) -> None:
        self.img_size = img_size
        self.encoded = encoded
        self.box_prompts = box_prompts
        self.augmenter = None
        if augment and not encoded:
            from .augment import Augmenter

            self.augmenter = Augmenter(augment, seed) or None

    def __call__(self, batch: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        images, targets = zip(*batch)
        x = torch.from_numpy(np.stack(images)).float() if self.encoded else image_batch(images, self.img_size)
        if is_mask(targets[0]):
            y = masks_to_tensor(targets, self.img_size)
            if self.augmenter is not None:
                x, y = self.augmenter(x, y)
        else:
            y = torch.as_tensor(targets, dtype=torch.int64)
            if self.augmenter is not None:
                x, _ = self.augmenter(x)
        if not self.encoded:
            x = normalise(x)
        if self.box_prompts:
            planes = box_planes(y, self.box_prompts)
            if tuple(planes.shape[-2:]) != tuple(x.shape[-2:]):
                planes = F.adaptive_max_pool2d(planes, tuple(x.shape[-2:]))
            x = torch.cat([x, planes], dim=1)
        return x, y


def box_planes(y: torch.Tensor, structures: int) -> torch.Tensor:
    """float [B, K, S, S]: 1 inside the bounding box of each structure's ground truth (all 0 where it is absent), from
    class-index masks [B, S, S] (structure k = label k + 1) or binary planes [B, K, S, S]."""
    if y.ndim == 3:
        on = torch.stack([y == k + 1 for k in range(structures)], dim=1)
    else:
        on = y[:, :structures] > 0
    rows, cols = on.any(dim=3), on.any(dim=2)  # [B, K, S]
    # A box spans from the first to the last row (column) with the structure: the cumulative "seen" from either end.
    inside_rows = (rows.cumsum(-1) > 0) & (rows.flip(-1).cumsum(-1).flip(-1) > 0)
    inside_cols = (cols.cumsum(-1) > 0) & (cols.flip(-1).cumsum(-1).flip(-1) > 0)
    return (inside_rows[..., :, None] & inside_cols[..., None, :]).float()


def target_img_size(dataset: Dataset) -> int | None:
    """``img_size`` of the dataset, looking through wrappers such as ``Subset``."""
    return target_attribute(dataset, "img_size")


def target_attribute(dataset: Dataset, name: str, default=None):
    """The first ``name`` attribute found on the dataset or a dataset it wraps; ``default`` if none has it."""
    while dataset is not None:
        if getattr(dataset, name, None) is not None:
            return getattr(dataset, name)
        dataset = getattr(dataset, "dataset", None)
    return default


def target_augment(dataset: Dataset) -> str:
    """The ``augment`` setting the dataset carries (a train split does), looking through wrappers; '' if none."""
    while dataset is not None:
        if getattr(dataset, "augment", None):
            return dataset.augment
        dataset = getattr(dataset, "dataset", None)
    return ""


def make_loader(
    dataset: Dataset, batch_size: int, shuffle: bool, seed: int, pin_memory: bool = False, workers: int = 0
) -> DataLoader:
    """DataLoader, single-process unless ``workers`` > 0 (``pin_memory`` for CUDA); the same ``seed`` gives the same
    batch order.

    A shuffled (training) loader drops a last batch of one sample: BatchNorm in train mode cannot normalise a
    single 1x1 feature map (ResNets at small inputs), and one shuffled sample per epoch is no loss. A shuffled
    loader of a dataset carrying an ``augment`` setting (the train split, ``client.split_rows``) augments its
    batches, seeded by ``seed`` (docs/data.md#augmentation); an unshuffled (evaluation) loader never does.
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=shuffle and len(dataset) % batch_size == 1,
        generator=torch.Generator().manual_seed(seed),
        num_workers=workers,
        pin_memory=pin_memory,
        collate_fn=BatchTransform(
            target_img_size(dataset),
            target_augment(dataset) if shuffle else "",
            seed,
            encoded=bool(target_attribute(dataset, "encoded", False)),
            box_prompts=int(target_attribute(dataset, "box_prompts", 0)),
        ),
    )
