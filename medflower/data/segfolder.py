"""Segmentation folders (the layout of Fed-Prostate, Fed-Polyp, Fed-Fundus, Drishti-GS): finding, pairing, masks.

Layout: ``<root>/<site>/images/*`` with ``<root>/<site>/masks/*``, one site per sub-folder (sorted by name); or
``<root>/images`` with ``<root>/masks``, a single site named after ``<root>``. Instead of ``masks/`` a site may
hold one folder per structure, ``masks-<structure>/`` (Drishti-GS: ``masks-disc/``, ``masks-cup/``), each with
one binary mask per image; the structures are the folder names after ``masks-``, in sorted order (``cup``,
``disc``), and every site must have the same ones. Sub-folders without ``images/`` and a mask folder and names
starting with '.' or '_' are ignored; only image files (by extension) count.

Image files: PNG, JPEG, BMP, TIFF, GIF, WebP, PPM/PGM, DICOM (``.dcm``, ``.dicom``) and 2-D NIfTI (``.nii``,
``.nii.gz``), read by ``image_datasets.read_rgb`` (``readers``). Mask files: the same but DICOM; NIfTI label maps
are read with nibabel in the readers' voxel order (rows i, columns j), so they lie on their NIfTI images.

Pairing: by file stem, the name without its extension (``a.nii.gz`` -> ``a``); the mask may have another
extension and a ``_mask`` or ``_seg`` suffix (image ``a.jpg`` pairs with mask ``a.png`` or ``a_mask.png``).

Mask values (docs/data.md#masks). With a value map (run-config ``mask-values``, ``maskmap.MaskValueMap``) every
mask of ``masks/`` becomes one binary plane per structure of the map, ``uint8 [K, H, W]`` (structures may overlap
or nest: REFUGE's disc holds its cup). Without one, per file: a mask holding only 0 and 255 is binary (255 ->
class 1); otherwise its values are class indices 0..``MAX_MASK_CLASS`` (0 = background, so {0, 1} is binary
too), ``uint8 [H, W]``; other values (e.g. {0, 128, 255}) are a DataError naming the file and the values. The
number of foreground classes is then the largest class index found over all masks (at least 1). Masks of
``masks-<structure>/`` folders must be binary (0/255 or 0/1) and give one plane each, ``uint8 [K, H, W]``. JPEG
masks are lossy: they are binarised at 128, or with a value map each pixel takes the nearest listed value.

Splits and groups: an optional ``split.csv`` (columns ``stem,split``, split train/val/test or empty) and
``groups.csv`` (columns ``stem,group``: the patient, case or video sequence of an image) in a site folder, or in
the root for every site (then an optional ``site`` column tells sites apart when a stem is in several). A stem
that names no image is an error; every image of a site with its own ``groups.csv`` (or of any site, under a root
``groups.csv``) needs a group, and each image of a site without one is its own group. A group is per site: it is
named ``<site>/<group>``, so two sites' ``patient-1`` are two patients.

Sizes: images are resized bilinear and masks nearest to ``img_size`` x ``img_size``, so a mask whose size differs
from its image's is stretched to the image's frame.
"""

from __future__ import annotations

import csv
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .maskmap import MaskValueMap
from .readers import DICOM_EXTENSIONS, NIFTI_EXTENSIONS, PIL_EXTENSIONS, nifti_2d, open_pil
from .spec import DataError, list_rows

IMAGE_EXTENSIONS = (*PIL_EXTENSIONS, *DICOM_EXTENSIONS, *NIFTI_EXTENSIONS)
MASK_EXTENSIONS = tuple(e for e in IMAGE_EXTENSIONS if e not in DICOM_EXTENSIONS)
LOSSY_EXTENSIONS = (".jpg", ".jpeg")
MASK_SUFFIXES = ("_mask", "_seg")
MAX_MASK_CLASS = 32
MASKS, STRUCTURE_PREFIX = "masks", "masks-"  # masks/ (one mask per image) or masks-<structure>/ (one per structure)
SPLIT_FILE, GROUP_FILE = "split.csv", "groups.csv"
SPLITS = ("train", "val", "test")
REFUGE_HINT = (
    "set run-config mask-values to say which structures each value stands for, e.g. "
    "'0=disc+cup,128=disc,255=' for REFUGE's optic disc and cup (docs/data.md#masks)"
)


@dataclass(frozen=True)
class SegFolder:
    """The images of a segmentation folder with their masks, sorted by site then image name.

    ``mask_sets[i]``: the mask file of image i (a 1-tuple, ``masks/``) or its file in each ``masks-<structure>/``
    folder, in ``structures`` order. ``splits`` / ``groups``: per image, from split.csv / groups.csv (None
    without the file; '' = no split).
    """

    root: Path
    sites: tuple[str, ...]  # site of each image
    images: tuple[Path, ...]
    mask_sets: tuple[tuple[Path, ...], ...]
    structures: tuple[str, ...] = ()  # the masks-<structure>/ folders' structures; () for masks/
    splits: tuple[str, ...] | None = None
    groups: tuple[str, ...] | None = None

    @property
    def masks(self) -> tuple[Path, ...]:
        """Every mask file, in image order (then structure order)."""
        return tuple(path for paths in self.mask_sets for path in paths)


def file_extension(path: Path) -> str:
    """The lower-case extension, ``.nii.gz`` counted as one."""
    name = path.name.lower()
    return ".nii.gz" if name.endswith(".nii.gz") else Path(name).suffix


def file_stem(path: Path) -> str:
    """The name without its extension: ``a.png`` -> ``a``, ``a.nii.gz`` -> ``a`` (``Path.stem`` gives ``a.nii``)."""
    extension = file_extension(path)
    return path.name[: len(path.name) - len(extension)] if extension else path.name


def mask_folders(folder: Path) -> list[Path]:
    """The mask folders of a site folder: ``masks/``, or its ``masks-<structure>/`` folders sorted by name;
    DataError when it has both."""
    structures = sorted(
        p
        for p in folder.iterdir()
        if p.is_dir() and p.name.startswith(STRUCTURE_PREFIX) and len(p.name) > len(STRUCTURE_PREFIX)
    )
    if (folder / MASKS).is_dir():
        if structures:
            raise DataError(
                f"{folder}: has both masks/ and {', '.join(p.name + '/' for p in structures)}; keep "
                "masks/ (one mask per image) or one masks-<structure>/ folder per structure"
            )
        return [folder / MASKS]
    return structures


def has_layout(folder: Path) -> bool:
    """``folder`` has images/ and a mask folder (masks/ or masks-<structure>/): it is one site (one holding both
    kinds counts too; scanning it then says what is wrong)."""
    if not (folder / "images").is_dir():
        return False
    try:
        return bool(mask_folders(folder))
    except DataError:
        return True


def find_sites(root: Path) -> list[tuple[str, Path]]:
    """(site name, site folder) of each site under ``root``; DataError when there is none."""
    if not root.is_dir():
        raise DataError(f"{root}: segfolder root not found (or not a folder)")
    if (root / "images").is_dir() or mask_folders(root):
        _check_pair_folders(root)
        return [(root.name, root)]
    sites, half = [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        has_images, has_masks = (folder / "images").is_dir(), bool(mask_folders(folder))
        if has_images and has_masks:
            sites.append((folder.name, folder))
        elif has_images or has_masks:
            half.append(folder)
    if half:
        _check_pair_folders(half[0])
    if not sites:
        found = ", ".join(p.name for p in sorted(root.iterdir())[:10]) or "nothing"
        raise DataError(
            f"{root}: expected images/ and masks/ folders (or one masks-<structure>/ folder per "
            f"structure), in the root or in one sub-folder per site (<root>/<site>/images, "
            f"<root>/<site>/masks); found {found}"
        )
    return sites


def _check_pair_folders(folder: Path) -> None:
    if not (folder / "images").is_dir():
        raise DataError(
            f"{folder}: has {mask_folders(folder)[0].name}/ but no images/ folder (expected images/ and masks/)"
        )
    if not mask_folders(folder):
        raise DataError(
            f"{folder}: has images/ but no masks/ folder (expected images/ and masks/, or one "
            "masks-<structure>/ folder per structure)"
        )


def image_files(folder: Path, extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> list[Path]:
    """Files directly in ``folder`` with one of ``extensions``, sorted by name."""
    return sorted(
        p for p in folder.iterdir() if file_extension(p) in extensions and not p.name.startswith(".") and p.is_file()
    )


def pair_site(folder: Path) -> list[tuple[Path, tuple[Path, ...]]]:
    """(image, its masks) of one site folder: one mask (``masks/``) or one per ``masks-<structure>/`` folder;
    DataError naming the folder and the files for images without a mask and masks without an image."""
    images = image_files(folder / "images")
    if not images:
        raise DataError(f"{folder / 'images'}: no image files ({', '.join(IMAGE_EXTENSIONS)})")
    by_stem: dict[str, Path] = {}
    for image in images:
        stem = file_stem(image)
        if stem in by_stem:
            raise DataError(
                f"{folder / 'images'}: two images with the stem {stem!r}: {by_stem[stem].name}, {image.name}"
            )
        by_stem[stem] = image
    folders = mask_folders(folder)
    several = len(folders) > 1
    without_image, problems, found = [], [], []
    for masks_folder in folders:
        mask_of: dict[str, Path] = {}
        for mask in image_files(masks_folder, MASK_EXTENSIONS):
            stem = file_stem(mask)
            key = (
                stem
                if stem in by_stem
                else next(
                    (stem[: -len(s)] for s in MASK_SUFFIXES if stem.endswith(s) and stem[: -len(s)] in by_stem), None
                )
            )
            if key is None:
                without_image.append(f"{masks_folder.name}/{mask.name}" if several else mask.name)
            elif key in mask_of:
                raise DataError(
                    f"{masks_folder}: two masks for image {by_stem[key].name}: {mask_of[key].name}, {mask.name}"
                )
            else:
                mask_of[key] = mask
        missing = [image.name for stem, image in by_stem.items() if stem not in mask_of]
        if missing:
            problems.append(f"{len(missing)} image(s) without a mask in {masks_folder.name}/: {list_rows(missing)}")
        found.append(mask_of)
    if without_image:
        problems.append(f"{len(without_image)} mask(s) without an image in images/: {list_rows(without_image)}")
    if problems:
        raise DataError(
            f"{folder}: unpaired files ({'; '.join(problems)}); masks pair with images by file "
            f"stem, optionally with a suffix {' or '.join(MASK_SUFFIXES)}"
        )
    return [(by_stem[stem], tuple(mask_of[stem] for mask_of in found)) for stem in sorted(by_stem)]


def scan_folder(root: Path) -> SegFolder:
    """All images and masks under ``root``, with split.csv and groups.csv (see the module docstring)."""
    sites, images, mask_sets, structures = [], [], [], {}
    site_folders = find_sites(root)
    for site, folder in site_folders:
        folders = mask_folders(folder)
        structures[site] = tuple(p.name[len(STRUCTURE_PREFIX) :] for p in folders if p.name != MASKS)
        for image, masks in pair_site(folder):
            sites.append(site)
            images.append(image)
            mask_sets.append(masks)
    if len(set(structures.values())) > 1:
        shown = "; ".join(f"{site}: {', '.join(s) if s else 'masks/'}" for site, s in structures.items())
        raise DataError(
            f"{root}: the sites have different mask folders ({shown}); every site needs the same "
            "masks/ or masks-<structure>/ folders (one output per structure)"
        )
    keys = [(site, file_stem(image)) for site, image in zip(sites, images)]
    splits = _per_image(root, site_folders, keys, SPLIT_FILE, "split")
    groups = _per_image(root, site_folders, keys, GROUP_FILE, "group")
    if groups is not None:
        # A site with a groups.csv of its own (or under a root groups.csv) must name every image; the images of a
        # site without one are each their own group, which is what a folder without groups means.
        listed = {site for site, folder in site_folders if (folder / GROUP_FILE).is_file()}
        everywhere = (root / GROUP_FILE).is_file() and not any(folder == root for _, folder in site_folders)
        missing = [
            f"{site}/{stem}" for (site, stem), g in zip(keys, groups) if g is None and (everywhere or site in listed)
        ]
        if missing:
            raise DataError(
                f"{root}: {len(missing)} image(s) have no row in {GROUP_FILE} (each image needs its "
                f"patient, case or video): {list_rows(missing)}"
            )
        groups = [f"{site}/{g}" if g is not None else f"{site}/image:{stem}" for (site, stem), g in zip(keys, groups)]
    return SegFolder(
        root,
        tuple(sites),
        tuple(images),
        tuple(mask_sets),
        next(iter(structures.values())),
        None if splits is None else tuple(s or "" for s in splits),
        None if groups is None else tuple(groups),
    )


def _per_image(
    root: Path, site_folders: list[tuple[str, Path]], keys: list[tuple[str, str]], file_name: str, column: str
) -> list[str | None] | None:
    """The ``column`` value of each image (``keys``: site, stem) from ``file_name`` in its site folder and in the
    root (None for an image no row names); None when there is no such file. DataError for a malformed file, a row
    naming no image, and an image named twice."""
    tables = [(folder / file_name, site) for site, folder in site_folders if (folder / file_name).is_file()]
    if (root / file_name).is_file() and not any(folder == root for _, folder in site_folders):
        tables.append((root / file_name, None))
    if not tables:
        return None
    index = {key: i for i, key in enumerate(keys)}
    sites_of: dict[str, list[str]] = {}
    for site, stem in keys:
        sites_of.setdefault(stem, []).append(site)
    values: list[str | None] = [None] * len(keys)
    named_at: dict[int, str] = {}
    for path, site in tables:
        unknown, ambiguous, bad = [], [], []
        for line, row in _read_rows(path, column, site_column=site is None):
            stem, value = row["stem"], row[column]
            row_site = site if site is not None else row.get("site") or None
            candidates = [row_site] if row_site is not None else sites_of.get(stem, [])
            if len(candidates) > 1:
                ambiguous.append(f"line {line} ({stem!r}: {', '.join(candidates)})")
                continue
            i = index.get((candidates[0], stem)) if candidates else None
            if i is None:
                unknown.append(f"line {line} ({stem!r})")
                continue
            if column == "split" and value.lower() not in SPLITS + ("",):
                bad.append(f"line {line} ({value!r})")
            if column == "group" and not value:
                bad.append(f"line {line} ({stem!r})")
            if i in named_at:
                raise DataError(
                    f"{path}: line {line} names image {keys[i][0]}/{stem} again (already at "
                    f"{named_at[i]}); name each image once"
                )
            named_at[i] = f"{path} line {line}"
            values[i] = value.lower() if column == "split" else value
        where = f"site {site}" if site is not None else f"any site of {root}"
        if unknown:
            raise DataError(
                f"{path}: {len(unknown)} row(s) name no image of {where} (stem = the image file name "
                f"without its extension): {list_rows(unknown)}"
            )
        if ambiguous:
            raise DataError(
                f"{path}: {len(ambiguous)} stem(s) are images of several sites; add a site column: "
                f"{list_rows(ambiguous)}"
            )
        if bad:
            what = "split must be train, val, test or empty" if column == "split" else "the group is empty"
            raise DataError(f"{path}: {what} in {len(bad)} row(s): {list_rows(bad)}")
    return values


def _read_rows(path: Path, column: str, site_column: bool) -> list[tuple[int, dict[str, str]]]:
    """(line, row) of a csv with columns stem,<column> (and an optional site column), values stripped."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [str(c).strip() for c in reader.fieldnames or []]
            rows = [
                (i + 2, {h: (v or "").strip() for h, v in zip(header, row.values())}) for i, row in enumerate(reader)
            ]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot read {path.name}: {exc}") from exc
    missing = [c for c in ("stem", column) if c not in header]
    if missing:
        extra = " (and optionally site)" if site_column else ""
        raise DataError(
            f"{path}: missing column(s) {', '.join(missing)}; expected stem,{column}{extra}, found "
            f"{', '.join(header) or 'no header'}"
        )
    return [(line, row) for line, row in rows if any(row.values())]


def fingerprint(root: Path) -> tuple[int, str]:
    """(number of files, digest of their names, sizes and mtimes) of the layout's folders (images/, masks/,
    masks-<structure>/) and of split.csv and groups.csv; cheap."""
    digest = hashlib.blake2b(digest_size=12)
    count = 0
    if not root.is_dir():
        raise DataError(f"{root}: segfolder root not found (or not a folder)")
    with os.scandir(root) as entries:
        folders = [root] + sorted(Path(e.path) for e in entries if e.is_dir() and not e.name.startswith("."))
    for folder in folders:
        with os.scandir(folder) as entries:
            named = sorted(entries, key=lambda e: e.name)
        for entry in named:
            if entry.name in (SPLIT_FILE, GROUP_FILE) and entry.is_file():
                files = [entry]
            elif entry.is_dir() and (entry.name in ("images", MASKS) or entry.name.startswith(STRUCTURE_PREFIX)):
                with os.scandir(entry.path) as inside:
                    files = sorted((e for e in inside if e.is_file()), key=lambda e: e.name)
            else:
                continue
            for file in files:
                stat = file.stat()
                digest.update(f"{file.path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
                count += 1
    return count, digest.hexdigest()


# ----------------------------------------------------------------------------- mask values
def read_mask(path: Path, value_map: MaskValueMap | None = None) -> np.ndarray:
    """The mask of ``path``: uint8 (H, W) class indices, or with ``value_map`` uint8 (K, H, W) planes; DataError
    naming the file for values that follow no rule (or that the map does not list)."""
    if value_map is not None:
        return value_map.planes(mask_pixels(path, value_map), str(path))
    pixels = mask_pixels(path)
    classes = mask_classes(pixels)
    if classes is None:
        raise DataError(
            f"{path}: mask values {shown_values(pixels)} are neither binary (0/255 or 0/1) nor "
            f"class indices 0..{MAX_MASK_CLASS} (0 = background); {REFUGE_HINT}"
        )
    return classes


def read_masks(paths: Path | tuple[Path, ...], value_map: MaskValueMap | None = None) -> np.ndarray:
    """The mask of one image: its ``masks/`` file (``read_mask``), or its files in the ``masks-<structure>/``
    folders (a tuple, in structure order) stacked to uint8 (K, H, W) planes, each mask binary."""
    if isinstance(paths, Path):
        return read_mask(paths, value_map)
    planes = [binary_plane(path) for path in paths]
    if len({p.shape for p in planes}) > 1:
        raise DataError(
            "the masks of one image differ in size: "
            + ", ".join(f"{p} {plane.shape}" for p, plane in zip(paths, planes))
        )
    return np.stack(planes)


def binary_plane(path: Path) -> np.ndarray:
    """uint8 0/1 (H, W) of a mask in a ``masks-<structure>/`` folder; DataError unless it is binary."""
    pixels = mask_pixels(path)
    plane = _binary(pixels)
    if plane is None:
        raise DataError(
            f"{path}: mask values {shown_values(pixels)} are not binary (0/255 or 0/1); a "
            "masks-<structure>/ folder holds one binary mask per image"
        )
    return plane


def _binary(pixels: np.ndarray) -> np.ndarray | None:
    values = mask_values(pixels)
    if np.all(np.isin(values, (0, 255))) or np.all(np.isin(values, (0, 1))):
        return (pixels > 0).astype(np.uint8)
    return None


def mask_pixels(path: Path, value_map: MaskValueMap | None = None) -> np.ndarray:
    """The raw 2-D values of a mask file (PIL images, NIfTI label maps); a JPEG is binarised at 128, or with
    ``value_map`` snapped to the nearest listed value. DataError naming the file when it cannot be read."""
    extension = file_extension(path)
    if extension in NIFTI_EXTENSIONS:
        pixels = nifti_2d(path, f"{path}: NIfTI mask")
    else:
        pixels = _pil_pixels(path)
    if extension in LOSSY_EXTENSIONS:
        if value_map is None:
            pixels = np.where(pixels >= 128, 255, 0).astype(np.uint8)
        else:
            listed = np.asarray(value_map.values, dtype=np.float64)
            pixels = listed[np.abs(pixels[..., None].astype(np.float64) - listed).argmin(axis=-1)]
    return pixels


def _pil_pixels(path: Path) -> np.ndarray:
    try:
        with open_pil(path, f"{path}: cannot open mask") as image:
            if image.mode in ("1", "CMYK", "YCbCr", "LAB", "HSV"):
                image = image.convert("L")
            pixels = np.asarray(image)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{path}: cannot open mask: {exc}") from exc
    if pixels.ndim == 3:  # LA, RGB, RGBA: all colour channels must agree
        colour = pixels[..., :3] if pixels.shape[-1] >= 3 else pixels[..., :1]
        if np.any(colour != colour[..., :1]):
            raise DataError(
                f"{path}: colour mask (its channels differ); expected a grayscale or palette mask of class indices"
            )
        pixels = colour[..., 0]
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


def scan_masks(folder: SegFolder, value_map: MaskValueMap | None = None) -> tuple[np.ndarray, tuple[str, ...]]:
    """(per image: how much foreground it has, the structure names); reads every mask once.

    The names are ``value_map``'s structures, else the ``masks-<structure>/`` folders', else ``foreground`` (one
    class) or ``class-1``..``class-K`` for class-index masks. Per image: the number of structures present (planes),
    or the largest class index (class-index masks); 0 = background only. DataError listing every mask with bad
    values.
    """
    if value_map is not None and folder.structures:
        raise DataError(
            f"{folder.root}: run-config mask-values ({value_map.text()}) maps the values of masks/ "
            f"files, but the masks are in masks-<structure>/ folders (one binary mask per structure: "
            f"{', '.join(folder.structures)}); leave mask-values empty"
        )
    amount = np.zeros(len(folder.images), dtype=np.int64)
    bad = []
    for i, paths in enumerate(folder.mask_sets):
        for path in paths:
            pixels = mask_pixels(path, value_map)
            values = mask_values(pixels)
            if value_map is not None:
                unlisted = values[~np.isin(values, value_map.values)]
                if unlisted.size:
                    bad.append(
                        f"{path.relative_to(folder.root)} (values {shown_values(pixels)}; not in the map: "
                        f"{shown_values(unlisted)})"
                    )
                else:
                    planes = value_map.planes(pixels, str(path))
                    amount[i] = int(planes.reshape(len(planes), -1).any(axis=1).sum())
                continue
            classes = _binary(pixels) if folder.structures else mask_classes(pixels)
            if classes is None:
                bad.append(f"{path.relative_to(folder.root)} (values {shown_values(pixels)})")
            elif folder.structures:
                amount[i] += int(classes.any())
            else:
                amount[i] = int(classes.max(initial=0))
    if bad:
        if value_map is not None:
            rule = f"every value must be listed in run-config mask-values ({value_map.text()})"
        elif folder.structures:
            rule = "masks of masks-<structure>/ folders must be binary (0/255 or 0/1)"
        else:
            rule = (
                f"masks must be binary (0/255 or 0/1) or hold class indices 0..{MAX_MASK_CLASS} (0 = background);"
                f" {REFUGE_HINT}"
            )
        raise DataError(f"{folder.root}: {len(bad)} mask(s) with bad values: {list_rows(bad)}; {rule}")
    if value_map is not None:
        return amount, value_map.structures
    if folder.structures:
        return amount, folder.structures
    num_classes = max(1, int(amount.max(initial=0)))
    return amount, ("foreground",) if num_classes == 1 else tuple(f"class-{c}" for c in range(1, num_classes + 1))
