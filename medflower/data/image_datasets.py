"""Torch datasets yielding ``(uint8 HxW[x3] numpy image, int label)`` or, for segmentation,
``(uint8 HxW[x3] image, uint8 HxW mask of class indices, 0 = background)``.

Each dataset carries ``task`` ("classification" | "segmentation"), ``labels`` (int64 array,
for cheap histograms and stratified splits; for segmentation one int per image that is only
used for splitting), ``img_size`` (the size the batch transform resizes to) and
``take(positions)`` (a subset of the same type).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from .maskmap import MaskValueMap
from .readers import read_image
from .segfolder import read_masks


class ArrayImageDataset(Dataset):
    """Images held in memory as a uint8 array (N, H, W) or (N, H, W, C)."""

    task = "classification"

    def __init__(self, images: np.ndarray, labels: np.ndarray, img_size: int) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.img_size = img_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.images[i], int(self.labels[i])

    def take(self, positions: np.ndarray) -> ArrayImageDataset:
        """Subset at ``positions`` (copies the selected images)."""
        return ArrayImageDataset(self.images[positions], self.labels[positions], self.img_size)


class ImageFileDataset(Dataset):
    """Images read lazily from files (any format ``read_rgb`` reads), as RGB resized to ``img_size``."""

    task = "classification"

    def __init__(
        self,
        paths: list[str],
        labels: np.ndarray,
        lines: np.ndarray,
        img_size: int,
        manifest: str,
        intensity: str = "auto",
    ) -> None:
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.lines = np.asarray(lines, dtype=np.int64)  # manifest line of each row, for messages
        self.img_size = img_size
        self.manifest = manifest
        self.intensity = intensity  # DataSpec.intensity: how >8-bit, float, DICOM and NIfTI images become 0..255

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        where = f"{self.manifest}: cannot open image of line {self.lines[i]} ({self.paths[i]})"
        return read_rgb(self.paths[i], self.img_size, where, self.intensity), int(self.labels[i])

    def take(self, positions: np.ndarray) -> ImageFileDataset:
        """Subset at ``positions``."""
        return ImageFileDataset(
            [self.paths[p] for p in positions],
            self.labels[positions],
            self.lines[positions],
            self.img_size,
            self.manifest,
            self.intensity,
        )


def read_rgb(path: str | Path, img_size: int, where: str | None = None, intensity: str = "auto") -> np.ndarray:
    """uint8 (img_size, img_size, 3) image of ``path`` (bilinear resize): DICOM, NIfTI, 8-bit, 16-bit and float
    images (``readers.read_image``; ``intensity`` as in ``DataSpec``, 8-bit images unchanged by it). DataError
    naming the file (``where`` replaces the default "<path>: cannot open image" prefix of the message)."""
    return read_image(path, img_size, intensity, where)


class SegArrayDataset(Dataset):
    """Images (N, H, W[, C]) and class-index masks (N, H, W) held in memory as uint8 arrays."""

    task = "segmentation"

    def __init__(self, images: np.ndarray, masks: np.ndarray, labels: np.ndarray, img_size: int) -> None:
        if not len(images) == len(masks) == len(labels):
            raise ValueError(f"{len(images)} images, {len(masks)} masks and {len(labels)} labels")
        self.images, self.masks = images, masks
        self.labels = np.asarray(labels, dtype=np.int64)
        self.img_size = img_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.images[i], self.masks[i]

    def take(self, positions: np.ndarray) -> SegArrayDataset:
        """Subset at ``positions`` (copies the selected images and masks)."""
        return SegArrayDataset(self.images[positions], self.masks[positions], self.labels[positions], self.img_size)


class SegFileDataset(Dataset):
    """Image/mask file pairs read lazily: images RGB (``read_rgb``, ``intensity`` for >8-bit ones), bilinear; masks
    nearest; both ``img_size``. An item's mask is uint8 [S, S] class indices (one masks/ file, 0 = background) or
    uint8 [K, S, S] binary planes, one per structure (a value map ``mask_map``, or a tuple of masks-<structure>/
    files), planes resized each (docs/data.md#masks)."""

    task = "segmentation"

    def __init__(
        self,
        images: list[Path],
        masks: list[Path | tuple[Path, ...]],
        labels: np.ndarray,
        img_size: int,
        intensity: str = "auto",
        mask_map: MaskValueMap | None = None,
    ) -> None:
        if not len(images) == len(masks) == len(labels):
            raise ValueError(f"{len(images)} images, {len(masks)} masks and {len(labels)} labels")
        self.image_paths, self.mask_paths = list(images), list(masks)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.img_size = img_size
        self.intensity, self.mask_map = intensity, mask_map

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        image = read_rgb(self.image_paths[i], self.img_size, intensity=self.intensity)
        mask = read_masks(self.mask_paths[i], self.mask_map)
        size = (self.img_size, self.img_size)
        if mask.shape[-2:] != size:
            planes = mask.reshape(-1, *mask.shape[-2:])
            resized = [np.asarray(Image.fromarray(p).resize(size, Image.Resampling.NEAREST)) for p in planes]
            mask = np.stack(resized).reshape(*mask.shape[:-2], *size)
        return image, mask

    def take(self, positions: np.ndarray) -> SegFileDataset:
        """Subset at ``positions``."""
        return SegFileDataset(
            [self.image_paths[p] for p in positions],
            [self.mask_paths[p] for p in positions],
            self.labels[positions],
            self.img_size,
            self.intensity,
            self.mask_map,
        )
