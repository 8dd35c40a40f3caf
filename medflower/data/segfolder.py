"""Segmentation folders (the layout of Fed-Prostate, Fed-Polyp, Fed-Fundus): finding, pairing, masks.

Layout: ``<root>/<site>/images/*`` with ``<root>/<site>/masks/*``, one site per sub-folder
(sorted by name); or ``<root>/images`` with ``<root>/masks``, a single site named after
``<root>``. Sub-folders without ``images/`` and ``masks/`` and names starting with '.' or '_'
are ignored; only image files (by extension) count.

Pairing: by file stem; the mask may have another extension and a ``_mask`` or ``_seg``
suffix (image ``a.jpg`` pairs with mask ``a.png`` or ``a_mask.png``).

Mask values, per file: a mask holding only 0 and 255 is binary (255 -> class 1); otherwise
its values are class indices 0..``MAX_MASK_CLASS`` (0 = background, so {0, 1} is binary too).
JPEG masks are lossy and are binarised at 128 first. Other values (e.g. {0, 128, 255}) are a
DataError naming the file and the values. The number of foreground classes is the largest
class index found over all masks (at least 1).

Sizes: images are resized bilinear and masks nearest to ``img_size`` x ``img_size``, so a
mask whose size differs from its image's is stretched to the image's frame.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .spec import DataError, list_rows

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".gif", ".webp", ".ppm", ".pgm")
LOSSY_EXTENSIONS = (".jpg", ".jpeg")
MASK_SUFFIXES = ("_mask", "_seg")
MAX_MASK_CLASS = 32


@dataclass(frozen=True)
class SegFolder:
    """The image/mask pairs of a segmentation folder, sorted by site then image name."""

    root: Path
    sites: tuple[str, ...]  # site of each pair
    images: tuple[Path, ...]
    masks: tuple[Path, ...]


def find_sites(root: Path) -> list[tuple[str, Path]]:
    """(site name, site folder) of each site under ``root``; DataError when there is none."""
    if not root.is_dir():
        raise DataError(f"{root}: segfolder root not found (or not a folder)")
    if (root / "images").is_dir() or (root / "masks").is_dir():
        _check_pair_folders(root)
        return [(root.name, root)]
    sites, half = [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        has = [(folder / sub).is_dir() for sub in ("images", "masks")]
        if all(has):
            sites.append((folder.name, folder))
        elif any(has):
            half.append(folder)
    if half:
        _check_pair_folders(half[0])
    if not sites:
        found = ", ".join(p.name for p in sorted(root.iterdir())[:10]) or "nothing"
        raise DataError(f"{root}: expected images/ and masks/ folders, in the root or in one sub-folder per "
                        f"site (<root>/<site>/images, <root>/<site>/masks); found {found}")
    return sites


def _check_pair_folders(folder: Path) -> None:
    for sub, other in (("images", "masks"), ("masks", "images")):
        if not (folder / sub).is_dir():
            raise DataError(f"{folder}: has {other}/ but no {sub}/ folder (expected images/ and masks/)")


def image_files(folder: Path) -> list[Path]:
    """Image files directly in ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir()
                  if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".") and p.is_file())


def pair_site(folder: Path) -> list[tuple[Path, Path]]:
    """(image, mask) pairs of one site folder; DataError naming the folder for unpaired files."""
    images, masks = image_files(folder / "images"), image_files(folder / "masks")
    if not images:
        raise DataError(f"{folder / 'images'}: no image files ({', '.join(IMAGE_EXTENSIONS)})")
    by_stem: dict[str, Path] = {}
    for image in images:
        if image.stem in by_stem:
            raise DataError(f"{folder / 'images'}: two images with the stem {image.stem!r}: "
                            f"{by_stem[image.stem].name}, {image.name}")
        by_stem[image.stem] = image
    mask_of: dict[str, Path] = {}
    orphan_masks = []
    for mask in masks:
        stem = mask.stem
        key = stem if stem in by_stem else next(
            (stem[:-len(s)] for s in MASK_SUFFIXES if stem.endswith(s) and stem[:-len(s)] in by_stem), None)
        if key is None:
            orphan_masks.append(mask.name)
        elif key in mask_of:
            raise DataError(f"{folder / 'masks'}: two masks for image {by_stem[key].name}: "
                            f"{mask_of[key].name}, {mask.name}")
        else:
            mask_of[key] = mask
    orphan_images = [image.name for stem, image in by_stem.items() if stem not in mask_of]
    if orphan_images or orphan_masks:
        problems = []
        if orphan_images:
            problems.append(f"{len(orphan_images)} image(s) without a mask in masks/: {list_rows(orphan_images)}")
        if orphan_masks:
            problems.append(f"{len(orphan_masks)} mask(s) without an image in images/: {list_rows(orphan_masks)}")
        raise DataError(f"{folder}: unpaired files ({'; '.join(problems)}); masks pair with images by file "
                        f"stem, optionally with a suffix {' or '.join(MASK_SUFFIXES)}")
    return [(by_stem[stem], mask_of[stem]) for stem in sorted(by_stem)]


def scan_folder(root: Path) -> SegFolder:
    """All pairs under ``root`` (see the module docstring for the layout)."""
    sites, images, masks = [], [], []
    for site, folder in find_sites(root):
        for image, mask in pair_site(folder):
            sites.append(site)
            images.append(image)
            masks.append(mask)
    return SegFolder(root, tuple(sites), tuple(images), tuple(masks))


def fingerprint(root: Path) -> tuple[int, str]:
    """(number of files, digest of their names, sizes and mtimes) of the layout folders; cheap."""
    digest = hashlib.blake2b(digest_size=12)
    count = 0
    if not root.is_dir():
        raise DataError(f"{root}: segfolder root not found (or not a folder)")
    with os.scandir(root) as entries:
        folders = [root] + sorted(Path(e.path) for e in entries if e.is_dir() and not e.name.startswith("."))
    for folder in folders:
        for sub in ("images", "masks"):
            if not (folder / sub).is_dir():
                continue
            with os.scandir(folder / sub) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    if entry.is_file():
                        stat = entry.stat()
                        digest.update(f"{entry.path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
                        count += 1
    return count, digest.hexdigest()


def read_mask(path: Path) -> np.ndarray:
    """Class-index mask of ``path`` as uint8 (H, W); DataError naming the file for bad values."""
    pixels = _mask_pixels(path)
    classes = mask_classes(pixels)
    if classes is None:
        raise DataError(f"{path}: mask values {shown_values(pixels)} are neither binary (0/255 or 0/1) nor "
                        f"class indices 0..{MAX_MASK_CLASS} (0 = background)")
    return classes


def _mask_pixels(path: Path) -> np.ndarray:
    try:
        with Image.open(path) as image:
            if image.mode in ("1", "CMYK", "YCbCr", "LAB", "HSV"):
                image = image.convert("L")
            pixels = np.asarray(image)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{path}: cannot open mask: {exc}") from exc
    if pixels.ndim == 3:  # LA, RGB, RGBA: all colour channels must agree
        colour = pixels[..., :3] if pixels.shape[-1] >= 3 else pixels[..., :1]
        if np.any(colour != colour[..., :1]):
            raise DataError(f"{path}: colour mask (its channels differ); expected a grayscale or palette "
                            "mask of class indices")
        pixels = colour[..., 0]
    if path.suffix.lower() in LOSSY_EXTENSIONS:
        pixels = np.where(pixels >= 128, 255, 0).astype(np.uint8)
    return pixels


def mask_values(pixels: np.ndarray) -> np.ndarray:
    """Distinct values of a mask."""
    if pixels.dtype == np.uint8:
        return np.flatnonzero(np.bincount(pixels.ravel(), minlength=256))
    return np.unique(pixels)


def mask_classes(pixels: np.ndarray) -> np.ndarray | None:
    """uint8 class indices of raw mask pixels, or None when the values follow no rule."""
    values = mask_values(pixels)
    if values.size == 0:
        return pixels.astype(np.uint8)
    if np.all(np.isin(values, (0, 255))) and values.max() == 255:
        return (pixels == 255).astype(np.uint8)
    if values.min() >= 0 and values.max() <= MAX_MASK_CLASS and np.all(values == np.round(values)):
        return pixels.astype(np.uint8)
    return None


def shown_values(pixels: np.ndarray, limit: int = 12) -> str:
    """'{0, 128, 255}': the distinct values of a mask for messages."""
    values = mask_values(pixels).tolist()
    return "{" + ", ".join(str(v) for v in values[:limit]) + (" ..." if len(values) > limit else "") + "}"


def scan_masks(folder: SegFolder) -> tuple[np.ndarray, int]:
    """(largest class index of each mask, number of foreground classes); reads every mask once.

    DataError listing every mask with bad values.
    """
    largest = np.zeros(len(folder.masks), dtype=np.int64)
    bad = []
    for i, path in enumerate(folder.masks):
        pixels = _mask_pixels(path)
        classes = mask_classes(pixels)
        if classes is None:
            bad.append(f"{path.relative_to(folder.root)} (values {shown_values(pixels)})")
        else:
            largest[i] = int(classes.max(initial=0))
    if bad:
        raise DataError(f"{folder.root}: {len(bad)} mask(s) with bad values: {list_rows(bad)}; masks must be "
                        f"binary (0/255 or 0/1) or hold class indices 0..{MAX_MASK_CLASS} (0 = background)")
    return largest, max(1, int(largest.max(initial=0)))
