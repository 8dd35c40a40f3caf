"""Volume folders (dataset ``volumes:<root>``): 3-D images with label volumes, sliced into 2-D segmentation rows.

Layout (docs/data.md#volumes):

- ``<root>/images/<case>.nii[.gz]`` (or a DICOM series folder ``<root>/images/<case>/``, or a multi-frame DICOM
  file ``<root>/images/<case>.dcm``) with ``<root>/masks/<case>.nii[.gz]``: the same case name, the mask optionally
  with a ``_mask`` or ``_seg`` suffix. Names starting with '.' or '_' are ignored.
- optional ``<root>/cases.csv``: a ``case`` column and optionally ``site`` (the site of the case, for
  ``partition='natural'``) and ``split`` (train, val or test for all slices of the case). Other columns are ignored;
  a table whose site column has another name (e.g. ``group``) gets a ``site`` column by renaming that header. Every
  case must have its row and every row its files.

Each case is read once when the source opens (``readers.load_volume``), its intensities mapped to 0..255 over the
whole volume (``DataSpec.intensity``), and cut into 2-D slices across array axis ``DataSpec.slice_axis`` (nibabel's
voxel order i, j, k; for an axial NIfTI, k = 2 is the slice direction). Image slices are resized bilinear and masks
nearest to ``img_size``; images are uint8 (S, S, 3). Masks are label maps: class indices 0..K (0 = background, {0, 255}
binary) or, with ``DataSpec.mask_values``, one binary plane per structure, uint8 (K, S, S). A slice is labelled 1 when
it holds foreground; ``DataSpec.empty_slices`` keeps all, none, or a seeded share of each case's slices without it.
Every slice carries its case as group, so no case spans two splits or two sites.

With a cache folder (``DataSpec.cache_dir``, the site's; docs/data.md#decoded-image-cache) the decoded rows (grey
slices, masks, labels, cases, slice indices and the largest class found) are stored there once (``cache.ArraySet``,
``<digest>-<name>.npy``, each written to a temporary file and renamed), and a later process memory-maps them and reads
no volume. The digest covers the case names and files (resolved path, size, modification time of every file below
images/ and masks/) and every setting that changes the rows; an entry that is missing, unreadable or does not fit
is decoded again and rewritten, a folder that cannot be written warns and keeps the rows in memory. The folders and
cases.csv are listed and checked at every open.
"""

from __future__ import annotations

import hashlib
import os
import warnings
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image
from torch.utils.data import Dataset

from .base import NA_LABELS, Source
from .cache import ArraySet, entry_digest, file_identity
from .image_datasets import SegArrayDataset
from .maskmap import parse_mask_values
from .readers import DICOM_EXTENSIONS, NIFTI_EXTENSIONS, load_volume, volume_intensity
from .segfolder import MASK_SUFFIXES, MAX_MASK_CLASS, file_extension, file_stem, mask_classes, shown_values
from .spec import SPLITS, DataError, DataSpec, list_rows, parse_empty_slices

CASES_TABLE = "cases.csv"
IMAGE_FILE_EXTENSIONS = NIFTI_EXTENSIONS + DICOM_EXTENSIONS
CACHE_FORMAT = 1  # bump when the decoding or slicing changes what the cached rows hold
CACHED_ROWS = ("gray", "masks", "labels", "cases", "slices", "largest")  # the arrays of a cache entry


def case_name(path: Path) -> str | None:
    """The case a file or folder of images/ or masks/ stands for (its name without the volume extension), or None
    for names that are ignored or not volumes."""
    name = path.name
    if name.startswith((".", "_")):
        return None
    if path.is_dir():
        return name
    return file_stem(path) if file_extension(path) in IMAGE_FILE_EXTENSIONS else None


def find_cases(root: Path) -> list[tuple[str, Path, Path]]:
    """(case, image volume, mask volume) of every case under ``root``, sorted by case; DataError for a missing layout
    or unpaired files."""
    if not root.is_dir():
        raise DataError(f"{root}: volumes root not found (or not a folder)")
    for sub in ("images", "masks"):
        if not (root / sub).is_dir():
            found = ", ".join(p.name for p in sorted(root.iterdir())[:10]) or "nothing"
            raise DataError(
                f"{root}: no {sub}/ folder; a volumes root holds images/ (NIfTI files or DICOM series "
                f"folders) and masks/ (NIfTI label volumes); found {found}"
            )
    images = _named(root / "images", folders=True)
    masks = _named(root / "masks", folders=False, suffixes=MASK_SUFFIXES, cases=images)
    if not images:
        raise DataError(
            f"{root / 'images'}: no volumes (.nii, .nii.gz, multi-frame .dcm, or one folder of DICOM files per case)"
        )
    problems = []
    if missing := sorted(set(images) - set(masks)):
        problems.append(f"{len(missing)} case(s) without a label volume in masks/: {list_rows(missing)}")
    if orphans := sorted(set(masks) - set(images)):
        problems.append(f"{len(orphans)} label volume(s) without an image in images/: {list_rows(orphans)}")
    if problems:
        raise DataError(
            f"{root}: unpaired volumes ({'; '.join(problems)}); masks/<case>.nii[.gz] (optionally with a "
            f"suffix {' or '.join(MASK_SUFFIXES)}) pairs with images/<case>.nii[.gz] or images/<case>/"
        )
    return [(case, images[case], masks[case]) for case in sorted(images)]


def _named(folder: Path, folders: bool, suffixes: tuple[str, ...] = (), cases: dict | None = None) -> dict[str, Path]:
    """{case: path} of the volumes in ``folder``; a mask named <case><suffix> counts for <case>."""
    named: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.is_dir() and not folders:
            continue
        case = case_name(path)
        if case is None:
            continue
        if cases is not None and case not in cases:
            case = next((case[: -len(s)] for s in suffixes if case.endswith(s) and case[: -len(s)] in cases), case)
        if case in named:
            raise DataError(f"{folder}: two volumes for case {case!r}: {named[case].name}, {path.name}")
        named[case] = path
    return named


def read_cases_table(root: Path, cases: list[str]) -> pd.DataFrame | None:
    """``<root>/cases.csv`` indexed by case (columns site and split when present), checked against the cases found;
    None when there is no table."""
    path = root / CASES_TABLE
    if not path.is_file():
        return None
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as exc:
        raise DataError(f"{path}: cannot read the cases table: {exc}") from exc
    table.columns = [str(c).strip() for c in table.columns]
    if "case" not in table.columns:
        raise DataError(
            f"{path}: no 'case' column; found columns: {', '.join(table.columns) or 'none'} (a cases "
            "table has case[,site][,split]; a site column of another name can be renamed to 'site')"
        )
    table = table.apply(lambda column: column.str.strip())
    if repeated := sorted(set(table["case"][table["case"].duplicated()])):
        raise DataError(f"{path}: case(s) listed twice: {list_rows(repeated)}")
    problems = []
    if without_files := sorted(set(table["case"]) - set(cases)):
        problems.append(
            f"{len(without_files)} case(s) in the table have no files in images/ and masks/: {list_rows(without_files)}"
        )
    if without_row := sorted(set(cases) - set(table["case"])):
        problems.append(f"{len(without_row)} case(s) in images/ have no row in the table: {list_rows(without_row)}")
    if problems:
        raise DataError(f"{path}: the table and the folders disagree: {'; '.join(problems)}")
    table = table.set_index("case")
    if "site" in table and (blank := sorted(table.index[table["site"].isin(NA_LABELS)])):
        raise DataError(
            f"{path}: the site column is empty for {len(blank)} case(s): {list_rows(blank)}; give every "
            "case its site, or drop the column"
        )
    if "split" in table:
        table["split"] = table["split"].str.lower()
        if bad := sorted(table.index[~table["split"].isin(SPLITS + ("",))]):
            raise DataError(
                f"{path}: split must be train, val, test or empty; {len(bad)} case(s) have other values: "
                f"{list_rows(bad)}"
            )
    return table


def fingerprint(root: Path) -> tuple[int, str]:
    """(number of files, digest of their paths, sizes and mtimes): images/ (and its series folders), masks/ and the
    cases table."""
    digest = hashlib.blake2b(digest_size=12)
    files = list_files(root)
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return len(files), digest.hexdigest()


def list_files(root: Path) -> list[Path]:
    """Every file the source of ``root`` may read: images/ (one level of series folders), masks/, cases.csv."""
    if not root.is_dir():
        raise DataError(f"{root}: volumes root not found (or not a folder)")
    files = []
    for sub in ("images", "masks"):
        folder = root / sub
        if not folder.is_dir():
            continue
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_file():
                    files.append(Path(entry.path))
                elif entry.is_dir() and sub == "images":
                    with os.scandir(entry.path) as inner:
                        files.extend(sorted(Path(e.path) for e in inner if e.is_file()))
    if (root / CASES_TABLE).is_file():
        files.append(root / CASES_TABLE)
    return files


class VolumeSource(Source):
    """A volumes folder sliced into 2-D rows (module docstring); every volume is decoded once, at open time, or the
    rows are loaded from the site's cache folder ``cache_dir`` ('' = none) when an earlier process stored them."""

    task = "segmentation"

    def __init__(
        self,
        root: Path,
        img_size: int,
        intensity: str = "auto",
        slice_axis: int = 2,
        empty_slices: str = "keep",
        mask_values: str = "",
        seed: int = 0,
        cache_dir: str = "",
    ) -> None:
        self.root = root
        self.name = f"volumes:{root}"
        self.img_size, self.intensity, self.slice_axis = img_size, intensity, slice_axis
        keep_empty = parse_empty_slices(empty_slices)
        value_map = parse_mask_values(mask_values)
        found = find_cases(root)
        table = read_cases_table(root, [case for case, _, _ in found])
        settings = (img_size, intensity, slice_axis, empty_slices, mask_values, seed)
        identity = _volume_identity(root) if cache_dir else ""  # taken before any volume is read
        entry = _cache_entry(cache_dir, root, found, identity, settings) if cache_dir else None
        planes = None if value_map is None else len(value_map.structures)
        check = _RowCheck(img_size, planes, {case for case, _, _ in found})
        rows = entry.load(check) if entry is not None else None
        self.cached_on_disk = rows is not None  # no volume was read in this process
        if rows is None:
            rows = self._decode(found, value_map, keep_empty, seed, empty_slices)
            if entry is not None and _volume_identity(root) == identity:  # else a file changed while being read
                rows = _stored(entry, rows, check, cache_dir)
        self.gray = rows["gray"]  # uint8 (N, S, S): grey slices, repeated to 3 channels by ``dataset``
        self.masks = rows["masks"]  # uint8 (N, S, S) class indices or (N, K, S, S) planes
        self.labels = np.array(rows["labels"], dtype=np.int64)
        self.cases = np.array(rows["cases"], dtype=str)
        self.slice_index = np.array(rows["slices"], dtype=np.int64)
        self.groups = self.cases  # every slice of a case in one split and one site
        self.planes = value_map is not None
        if value_map is not None:
            self.class_names = value_map.structures
        else:
            num_classes = max(1, int(rows["largest"]))
            self.class_names = (
                ("foreground",) if num_classes == 1 else tuple(f"class-{c}" for c in range(1, num_classes + 1))
            )
        self.site_values = (
            table.loc[self.cases, "site"].to_numpy(dtype=str) if table is not None and "site" in table else None
        )
        self.splits = (
            table.loc[self.cases, "split"].to_numpy(dtype=str) if table is not None and "split" in table else None
        )

    def _decode(
        self, found: list[tuple[str, Path, Path]], value_map, keep_empty: float, seed: int, empty_slices: str
    ) -> dict[str, np.ndarray]:
        """The rows of every case, read from its volumes (arrays named as ``CACHED_ROWS``)."""
        images, masks, labels, cases, slices = [], [], [], [], []
        largest = 0
        for case, image_path, mask_path in found:
            image, mask, foreground, top = self._read_case(image_path, mask_path, value_map)
            largest = max(largest, top)
            kept = _kept_slices(foreground, keep_empty, (seed, zlib.crc32(case.encode())))
            images.append(image[kept])
            masks.append(mask[kept])
            labels.append(foreground[kept].astype(np.int64))
            cases += [case] * len(kept)
            slices.append(kept)
        if not cases:
            raise DataError(
                f"{self.root}: no slice is left (empty-slices {empty_slices!r} dropped every slice without "
                "foreground, and no slice has any)"
            )
        return {
            "gray": np.concatenate(images),
            "masks": np.concatenate(masks),
            "labels": np.concatenate(labels),
            "cases": np.array(cases, dtype=str),
            "slices": np.concatenate(slices).astype(np.int64),
            "largest": np.array(largest, dtype=np.int64),
        }

    def _read_case(
        self, image_path: Path, mask_path: Path, value_map
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(uint8 image slices (n, S, S), uint8 mask slices, foreground per slice, largest class index) of one case."""
        volume = load_volume(image_path)
        labels = load_volume(mask_path).array
        if labels.shape != volume.array.shape:
            raise DataError(
                f"{mask_path}: label volume of shape {labels.shape} does not match its image {image_path} "
                f"of shape {volume.array.shape}"
            )
        whole = np.isfinite(labels) & (labels == np.round(labels))
        if not whole.all():
            raise DataError(
                f"{mask_path}: label values must be whole numbers; {int((~whole).sum())} voxel(s) are not, "
                f"e.g. {np.unique(labels[~whole])[:5].tolist()}"
            )
        small = labels.size and labels.min() >= 0 and labels.max() <= 255  # uint8 labels count their values quickly
        labels = labels.astype(np.uint8 if small else np.int64)
        pixels = volume_intensity(volume, self.intensity)
        axis = self.slice_axis
        if value_map is not None:
            flat = labels.reshape(labels.shape[0], -1)  # planes() takes a 2-D label map
            planes = value_map.planes(flat, str(mask_path)).reshape((-1,) + labels.shape)
            per_slice = np.moveaxis(planes, axis + 1, 0)  # (n, K, a, b)
            foreground = per_slice.reshape(len(per_slice), -1).any(axis=1)
            top = len(value_map.structures)
        else:
            classes = mask_classes(labels)
            if classes is None:
                raise DataError(
                    f"{mask_path}: label values {shown_values(labels)} are neither binary (0/255 or 0/1) "
                    f"nor class indices 0..{MAX_MASK_CLASS} (0 = background); set mask-values to map them"
                )
            per_slice = np.moveaxis(classes, axis, 0)  # (n, a, b)
            foreground = per_slice.reshape(len(per_slice), -1).any(axis=1)
            top = int(classes.max(initial=0))
        size = (self.img_size, self.img_size)
        image_slices = np.stack([_resized(s, size, Image.Resampling.BILINEAR) for s in np.moveaxis(pixels, axis, 0)])
        if per_slice.ndim == 4:
            mask_slices = np.stack(
                [np.stack([_resized(p, size, Image.Resampling.NEAREST) for p in planes_k]) for planes_k in per_slice]
            )
        else:
            mask_slices = np.stack([_resized(s, size, Image.Resampling.NEAREST) for s in per_slice])
        return image_slices, mask_slices, foreground, top

    def sites(self, num_partitions: int) -> np.ndarray | None:
        return self.site_values

    def row_name(self, row: int) -> str:
        return f"{self.cases[row]} slice {self.slice_index[row]}"

    def dataset(self, rows: np.ndarray, partition_id: int, spec: DataSpec) -> Dataset:
        images = np.repeat(self.gray[rows][..., None], 3, axis=-1)
        return SegArrayDataset(images, self.masks[rows], self.labels[rows], spec.img_size)


def _volume_identity(root: Path) -> str:
    """Digest of the resolved path, size and modification time of every file below images/ and masks/ (cases.csv
    is left out: it is read at every open and changes no row)."""
    return file_identity([path for path in list_files(root) if path.name != CASES_TABLE or path.parent != root])


def _cache_entry(
    cache_dir: str, root: Path, found: list[tuple[str, Path, Path]], identity: str, settings: tuple
) -> ArraySet:
    """The cache entry of these cases' rows: named by the case names and files (names as found, and ``identity``:
    what they resolve to, sizes, modification times) and the settings that change the rows."""
    named = tuple((case, image.name, mask.name) for case, image, mask in found)
    digest = entry_digest("volumes", CACHE_FORMAT, os.path.realpath(root), named, identity, settings)
    return ArraySet(Path(cache_dir), digest, CACHED_ROWS)


class _RowCheck:
    """Whether cached arrays are rows this source could have decoded: one length, dtypes, the image size, the mask
    layout (K planes with a value map, else class indices) and known case names; else they are decoded again."""

    def __init__(self, img_size: int, planes: int | None, cases: set[str]) -> None:
        self.img_size, self.planes, self.cases = img_size, planes, cases

    def __call__(self, rows: dict[str, np.ndarray]) -> bool:
        gray, masks, labels, names, slices, largest = (rows[name] for name in CACHED_ROWS)
        if labels.ndim != 1:
            return False
        n, size = len(labels), (self.img_size, self.img_size)
        mask_shape = (n, *size) if self.planes is None else (n, self.planes, *size)
        return bool(
            n > 0
            and labels.shape == (n,)
            and labels.dtype == np.int64
            and np.isin(labels, (0, 1)).all()
            and gray.shape == (n, *size)
            and gray.dtype == np.uint8
            and masks.shape == mask_shape
            and masks.dtype == np.uint8
            and names.shape == (n,)
            and names.dtype.kind == "U"
            and set(np.unique(names)) <= self.cases
            and slices.shape == (n,)
            and slices.dtype == np.int64
            and (slices >= 0).all()
            and largest.shape == ()
            and largest.dtype == np.int64
            and 0 <= int(largest) <= MAX_MASK_CLASS
        )


def _stored(entry: ArraySet, rows: dict[str, np.ndarray], check: _RowCheck, cache_dir: str) -> dict[str, np.ndarray]:
    """``rows`` written to the cache entry and memory-mapped from there; unchanged (in memory) when the folder cannot
    be written (a warning)."""
    try:
        entry.store(rows)
    except OSError as exc:
        warnings.warn(
            f"{cache_dir}: decoded-volume cache not written ({exc}); keeping the slices in memory", stacklevel=3
        )
        return rows
    return entry.load(check) or rows


def _resized(pixels: np.ndarray, size: tuple[int, int], resample: Image.Resampling) -> np.ndarray:
    image = Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8))
    return np.asarray(image if image.size == size else image.resize(size, resample), dtype=np.uint8)


def _kept_slices(foreground: np.ndarray, keep_empty: float, seed: tuple[int, int]) -> np.ndarray:
    """Slice indices kept: every slice with foreground and round(keep_empty x the empty ones), a seeded choice."""
    empty = np.flatnonzero(~foreground)
    count = int(round(keep_empty * len(empty)))
    chosen = np.random.default_rng(list(seed)).choice(empty, size=count, replace=False) if count < len(empty) else empty
    return np.sort(np.concatenate([np.flatnonzero(foreground), chosen])).astype(np.int64)
