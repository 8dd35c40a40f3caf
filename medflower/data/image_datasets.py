"""Torch datasets yielding ``(uint8 HxW[x3] numpy image, int label)``.

Each dataset carries ``labels`` (int64 array, for cheap histograms), ``img_size`` (the size
the batch transform resizes to) and ``take(positions)`` (a subset of the same type).
"""

from __future__ import annotations

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from .spec import DataError


class ArrayImageDataset(Dataset):
    """Images held in memory as a uint8 array (N, H, W) or (N, H, W, C)."""

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
    """Images read lazily from files with PIL, converted to RGB and resized to ``img_size``."""

    def __init__(self, paths: list[str], labels: np.ndarray, lines: np.ndarray, img_size: int,
                 manifest: str) -> None:
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.lines = np.asarray(lines, dtype=np.int64)  # manifest line of each row, for messages
        self.img_size = img_size
        self.manifest = manifest

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        path = self.paths[i]
        try:
            with Image.open(path) as image:
                image = image.convert("RGB").resize((self.img_size, self.img_size), Image.Resampling.BILINEAR)
                pixels = np.asarray(image, dtype=np.uint8)
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise DataError(
                f"{self.manifest}: cannot open image of line {self.lines[i]} ({path}): {exc}") from exc
        return pixels, int(self.labels[i])

    def take(self, positions: np.ndarray) -> ImageFileDataset:
        """Subset at ``positions``."""
        return ImageFileDataset([self.paths[p] for p in positions], self.labels[positions],
                                self.lines[positions], self.img_size, self.manifest)
