"""Data sources: synthetic pools, MedMNIST ``.npz`` files, csv manifests and segmentation folders.

A source is the whole pool of rows with their labels (and, where the source has them,
split and site per row). Its ``task`` is "classification" or "segmentation"; for
segmentation, ``class_names`` are the foreground classes (the model's output channels) and
``labels`` hold one int per image that only stratifies the splits. ``open_source`` is
cached per source identity (file path and modification time for files), so repeated calls
in one process are cheap.
"""

from __future__ import annotations

import os
import re
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
from torch.utils.data import Dataset

import medflower.data.segfolder as segfolder
import medflower.data.synthetic as synthetic
import medflower.data.synthetic_seg as synthetic_seg
import medflower.data.volumes as volumes

from .base import MAX_LABEL, NA_LABELS, Source, default_class_names
from .image_datasets import (
    ArrayImageDataset,
    ImageFileDataset,
    SegArrayDataset,
    SegFileDataset,
)
from .maskmap import parse_mask_values
from .readers import check_npz, opened_path
from .spec import SEGMENTATION_KINDS, SPLITS, DataError, DataSpec, list_rows

# Class names of the single-label 2D MedMNIST datasets (medmnist.INFO); others get "class-<i>".
MEDMNIST_CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "pathmnist": (
        "adipose",
        "background",
        "debris",
        "lymphocytes",
        "mucus",
        "smooth muscle",
        "normal colon mucosa",
        "cancer-associated stroma",
        "colorectal adenocarcinoma epithelium",
    ),
    "dermamnist": (
        "actinic keratoses and intraepithelial carcinoma",
        "basal cell carcinoma",
        "benign keratosis-like lesions",
        "dermatofibroma",
        "melanoma",
        "melanocytic nevi",
        "vascular lesions",
    ),
    "octmnist": ("choroidal neovascularization", "diabetic macular edema", "drusen", "normal"),
    "pneumoniamnist": ("normal", "pneumonia"),
    "retinamnist": ("0", "1", "2", "3", "4"),
    "breastmnist": ("malignant", "normal, benign"),
    "bloodmnist": (
        "basophil",
        "eosinophil",
        "erythroblast",
        "immature granulocytes",
        "lymphocyte",
        "monocyte",
        "neutrophil",
        "platelet",
    ),
    "tissuemnist": (
        "Collecting Duct, Connecting Tubule",
        "Distal Convoluted Tubule",
        "Glomerular endothelial cells",
        "Interstitial endothelial cells",
        "Leukocytes",
        "Podocytes",
        "Proximal Tubule Segments",
        "Thick Ascending Limb",
    ),
    **dict.fromkeys(
        ("organamnist", "organcmnist", "organsmnist"),
        (
            "bladder",
            "femur-left",
            "femur-right",
            "heart",
            "kidney-left",
            "kidney-right",
            "liver",
            "lung-left",
            "lung-right",
            "pancreas",
            "spleen",
        ),
    ),
}


class SyntheticSource(Source):
    """Synthetic gratings; the image style depends on the partition holding a row."""

    styled_by_partition = True

    def __init__(self, seed: int, size: int, num_classes: int) -> None:
        self.pool = synthetic.synthetic_pool(seed, size, num_classes)
        self.seed = seed
        self.name = f"synthetic (seed {seed}, {size} samples)"
        self.labels = self.pool.labels
        self.class_names = self.pool.class_names

    @staticmethod
    def site_name(partition_id: int, num_partitions: int) -> str:
        """'site-<id>', zero-padded so that names sort like the ids."""
        return f"site-{partition_id:0{len(str(num_partitions - 1))}d}"

    def sites(self, num_partitions: int) -> np.ndarray:
        """Row i belongs to site i % num_partitions."""
        names = np.array([self.site_name(p, num_partitions) for p in range(num_partitions)])
        return names[np.arange(len(self)) % num_partitions]

    def dataset(self, rows: np.ndarray, partition_id: int, spec: DataSpec) -> Dataset:
        size = min(spec.img_size, synthetic.MAX_RENDER_SIZE)
        style = synthetic.site_style(self.seed, partition_id)
        images = synthetic.render(self.pool, rows, style, size, noise_key=(self.seed, partition_id))
        return ArrayImageDataset(images, self.labels[rows], spec.img_size)


class SyntheticSegSource(SyntheticSource):
    """Synthetic shapes with masks (``synthetic_seg``); sites and styles as in ``SyntheticSource``."""

    task = "segmentation"

    def __init__(self, seed: int, size: int) -> None:
        self.pool = synthetic_seg.seg_pool(seed, size)
        self.seed, self.size = seed, size
        self.name = f"synthetic-seg (seed {seed}, {size} samples)"
        self.labels = self.pool.labels  # 1 if the image has a rectangle
        self.class_names = synthetic_seg.CLASS_NAMES

    def dataset(self, rows: np.ndarray, partition_id: int, spec: DataSpec) -> Dataset:
        """Rows as drawn by partition ``partition_id`` in its own style (``render_site`` picks other styles)."""
        images, masks = synthetic_seg.render_site(
            self.seed, partition_id, rows, self.size, spec.img_size, noise_key=(self.seed, partition_id)
        )
        return SegArrayDataset(images, masks, self.labels[rows], spec.img_size)


class MedmnistSource(Source):
    """A MedMNIST ``.npz``: official train/val/test splits pooled, each row remembers its split."""

    IMAGE_KEYS = tuple(f"{s}_images" for s in SPLITS)
    LABEL_KEYS = tuple(f"{s}_labels" for s in SPLITS)

    def __init__(self, flag: str, path: Path) -> None:
        self.flag, self.path = flag, path
        self.name = f"medmnist:{flag} ({path})"
        with self._open() as npz:
            missing = [k for k in self.IMAGE_KEYS + self.LABEL_KEYS if k not in npz.files]
            if missing:
                raise DataError(
                    f"{path}: npz is missing key(s) {', '.join(missing)}; "
                    f"found keys: {', '.join(sorted(npz.files)) or 'none'}"
                )
            split_labels = [self._check_labels(npz, key) for key in self.LABEL_KEYS]
        self.split_sizes = [len(lab) for lab in split_labels]
        self.labels = np.concatenate(split_labels)
        self.splits = np.repeat(np.array(SPLITS), self.split_sizes)
        known = MEDMNIST_CLASS_NAMES.get(flag)
        if known is not None and self.labels.max(initial=-1) >= len(known):
            raise DataError(
                f"{path}: label {self.labels.max()} is out of range for {flag}, "
                f"which has {len(known)} classes (0..{len(known) - 1})"
            )
        self.class_names = known or default_class_names(int(self.labels.max(initial=0)) + 1)

    def _open(self) -> np.lib.npyio.NpzFile:
        try:
            real = opened_path(self.path)  # confined when opened; every array's size read from its header first
            check_npz(real)
            return np.load(real, allow_pickle=False)
        except DataError:
            raise
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.path}: cannot read npz file: {exc}") from exc

    def _check_labels(self, npz, key: str) -> np.ndarray:
        try:
            raw = npz[key]
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.path}: cannot read {key}: {exc}") from exc
        if raw.ndim == 2 and raw.shape[1] > 1:
            raise DataError(
                f"{self.path}: {key} has shape {raw.shape}: multi-label data is not "
                f"supported (need one class per image, shape (N,) or (N, 1))"
            )
        if raw.ndim not in (1, 2):
            raise DataError(f"{self.path}: {key} has shape {raw.shape}; expected (N,) or (N, 1)")
        raw = raw.reshape(-1)
        if raw.dtype.kind not in "iubf":
            raise DataError(f"{self.path}: {key} must hold integer class indices, got dtype {raw.dtype}")
        if raw.dtype.kind == "f":  # float labels are fine when every one is a whole number
            for bad, what in (
                (~np.isfinite(raw), "non-finite (inf or NaN)"),
                (np.isfinite(raw) & (raw != np.round(raw)), "non-integer"),
            ):
                if bad.any():
                    raise DataError(
                        f"{self.path}: {key} must hold integer class indices; {bad.sum()} label(s) "
                        f"are {what}, e.g. {raw[bad][:3].tolist()} (rows "
                        f"{list_rows([str(r) for r in np.flatnonzero(bad)], 5)})"
                    )
        if raw.size and raw.min() < 0:
            raise DataError(f"{self.path}: {key} has negative label(s), e.g. {int(raw.min())}")
        if raw.size and raw.max() > MAX_LABEL:
            raise DataError(
                f"{self.path}: {key} has label(s) too large to be class indices (at most {MAX_LABEL}), e.g. {raw.max()}"
            )
        return raw.astype(np.int64)

    @cached_property
    def images(self) -> np.ndarray:
        """All images, train then val then test, uint8 (N, H, W) or (N, H, W, C)."""
        with self._open() as npz:
            parts = []
            for key, expected in zip(self.IMAGE_KEYS, self.split_sizes):
                images = npz[key]
                if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] not in (1, 3)):
                    raise DataError(f"{self.path}: {key} has shape {images.shape}; expected (N, H, W) or (N, H, W, 3)")
                if len(images) != expected:
                    raise DataError(
                        f"{self.path}: {key} has {len(images)} images but "
                        f"{key.replace('images', 'labels')} has {expected} labels"
                    )
                if images.dtype != np.uint8:
                    in_range = images.size == 0 or (images.min() >= 0 and images.max() <= 255)
                    if images.dtype.kind not in "iu" or not in_range:
                        raise DataError(f"{self.path}: {key} must hold uint8 pixels (0..255), got {images.dtype}")
                    images = images.astype(np.uint8)
                parts.append(images)
        if len({p.shape[1:] for p in parts}) > 1:
            raise DataError(
                f"{self.path}: image shapes differ between splits: "
                + ", ".join(f"{k} {p.shape[1:]}" for k, p in zip(self.IMAGE_KEYS, parts))
            )
        pooled = np.concatenate(parts)
        pooled.setflags(write=False)
        return pooled

    def dataset(self, rows: np.ndarray, partition_id: int, spec: DataSpec) -> Dataset:
        return ArrayImageDataset(self.images[rows], self.labels[rows], spec.img_size)


class CsvSource(Source):
    """A csv manifest with columns path,label[,site][,split][,group]; images are read lazily."""

    written_labels = True

    def __init__(self, manifest: Path) -> None:
        self.manifest = manifest
        self.name = f"csv:{manifest}"
        frame = self._read(manifest)
        self.lines = np.arange(len(frame)) + 2  # line 1 is the header
        self.labels, self.class_names = self._parse_labels(frame["label"])
        self.splits = self._parse_splits(frame["split"]) if "split" in frame else None
        self.site_values = frame["site"].to_numpy(dtype=str) if "site" in frame else None
        self.groups = self._parse_groups(frame["group"]) if "group" in frame else None
        self.paths = self._resolve_paths(frame["path"])

    @staticmethod
    def _read(manifest: Path) -> pd.DataFrame:
        try:
            frame = pd.read_csv(manifest, dtype=str, keep_default_na=False)
        except pd.errors.EmptyDataError as exc:
            raise DataError(f"{manifest}: manifest is empty (expected a header with path,label)") from exc
        except (pd.errors.ParserError, UnicodeDecodeError, OSError) as exc:
            raise DataError(f"{manifest}: cannot read manifest: {exc}") from exc
        frame.columns = [str(c).strip() for c in frame.columns]
        missing = [c for c in ("path", "label") if c not in frame.columns]
        if missing:
            raise DataError(
                f"{manifest}: missing required column(s) {', '.join(missing)}; "
                f"found columns: {', '.join(frame.columns)}"
            )
        if frame.empty:
            raise DataError(f"{manifest}: manifest has a header but no rows")
        return frame.apply(lambda column: column.str.strip())

    def _bad_rows(self, mask: np.ndarray, values: pd.Series) -> list[str]:
        return [f"line {line} ({value!r})" for line, value in zip(self.lines[mask], values[mask])]

    def _parse_labels(self, column: pd.Series) -> tuple[np.ndarray, tuple[str, ...]]:
        missing = column.isin(NA_LABELS).to_numpy()
        if missing.any():
            raise DataError(
                f"{self.manifest}: missing label in {missing.sum()} row(s) (empty, or a missing-value "
                f"marker such as NaN, NA, None, null): "
                + list_rows(self._bad_rows(missing, column))
                + "; give every row its class (a class cannot be named like a missing value)"
            )
        if column.str.fullmatch(r"[+-]?\d{1,9}").all():  # class indices (longer digit strings are names)
            labels = column.astype(np.int64).to_numpy()
            negative = labels < 0
            if negative.any():
                raise DataError(
                    f"{self.manifest}: negative label(s) in {negative.sum()} row(s): "
                    + list_rows(self._bad_rows(negative, column))
                )
            if labels.max() > MAX_LABEL:
                raise DataError(
                    f"{self.manifest}: label(s) too large to be class indices (at most {MAX_LABEL}), "
                    f"e.g. {labels.max()}"
                )
            return labels, default_class_names(int(labels.max()) + 1)
        names = tuple(sorted(column.unique()))
        self.labels_are_names = True
        return np.searchsorted(np.array(names), column.to_numpy(dtype=str)).astype(np.int64), names

    def _parse_splits(self, column: pd.Series) -> np.ndarray:
        splits = column.str.lower()
        bad = (~splits.isin(SPLITS + ("",))).to_numpy()
        if bad.any():
            raise DataError(
                f"{self.manifest}: split must be train, val, test or empty; "
                f"{bad.sum()} row(s) have other values: " + list_rows(self._bad_rows(bad, column))
            )
        return splits.to_numpy(dtype=str)

    def _parse_groups(self, column: pd.Series) -> np.ndarray:
        missing = column.isin(NA_LABELS).to_numpy()
        if missing.any():
            raise DataError(
                f"{self.manifest}: the group column (patient, case or video of a row) is empty in "
                f"{missing.sum()} row(s): "
                + list_rows(self._bad_rows(missing, column))
                + "; give every row its group, or drop the column"
            )
        return column.to_numpy(dtype=str)

    def _resolve_paths(self, column: pd.Series) -> list[str]:
        """Image paths resolved against the manifest's folder; a path that leaves it (absolute, '~', or '..'
        climbing out) is refused before any file is looked at."""
        base = self.manifest.parent
        escaping = np.array([escapes_folder(p) for p in column])
        if escaping.any():
            raise DataError(
                f"{self.manifest}: {escaping.sum()} image path(s) leave the manifest's folder (absolute "
                f"paths and '..' climbing out of it are refused; write paths relative to {base}): "
                + list_rows(self._bad_rows(escaping, column))
            )
        paths = [str(base / p) if p else "" for p in column]
        missing = np.array([not (p and Path(p).is_file()) for p in paths])
        if missing.any():
            raise DataError(
                f"{self.manifest}: {missing.sum()} image file(s) not found (paths are "
                f"relative to {base}): " + list_rows(self._bad_rows(missing, column))
            )
        return paths

    def sites(self, num_partitions: int) -> np.ndarray | None:
        return self.site_values

    def row_name(self, row: int) -> str:
        return f"line {self.lines[row]}"

    def dataset(self, rows: np.ndarray, partition_id: int, spec: DataSpec) -> Dataset:
        return ImageFileDataset(
            [self.paths[r] for r in rows],
            self.labels[rows],
            self.lines[rows],
            spec.img_size,
            str(self.manifest),
            spec.intensity,
        )


class SegFolderSource(Source):
    """A segmentation folder (``segfolder`` module): sites with images/ and masks/ (or masks-<structure>/), read
    lazily; split.csv and groups.csv give ``splits`` and ``groups``.

    ``mask_values`` (run-config mask-values, ``maskmap``) maps the values of masks/ files to structures. The
    classes (model outputs) are the map's structures, else the masks-<structure>/ folders', else ``foreground`` or
    ``class-1``..``class-K``; ``labels``, only used to stratify splits, are 1 when an image has any foreground.
    Opening it reads every mask once to check its values.
    """

    task = "segmentation"

    def __init__(self, root: Path, mask_values: str = "") -> None:
        self.root = root
        self.name = f"segfolder:{root}"
        try:
            self.mask_map = parse_mask_values(mask_values)
        except ValueError as exc:
            raise DataError(f"{self.name}: run-config mask-values {mask_values!r}: {exc}") from exc
        self.mask_values = mask_values
        self.folder = segfolder.scan_folder(root)
        amount, self.class_names = segfolder.scan_masks(self.folder, self.mask_map)
        self.planes = self.mask_map is not None or bool(self.folder.structures)
        self.labels = (amount > 0).astype(np.int64)  # 1 if the mask has any foreground
        self.site_values = np.array(self.folder.sites, dtype=str)
        self.splits = None if self.folder.splits is None else np.array(self.folder.splits, dtype=str)
        self.groups = None if self.folder.groups is None else np.array(self.folder.groups, dtype=str)

    def sites(self, num_partitions: int) -> np.ndarray:
        return self.site_values

    def row_name(self, row: int) -> str:
        return str(self.folder.images[row].relative_to(self.root))

    def dataset(self, rows: np.ndarray, partition_id: int, spec: DataSpec) -> Dataset:
        if parse_mask_values(spec.mask_values) != self.mask_map:
            raise DataError(
                f"{self.name} was opened with mask-values {self.mask_values!r} but the spec has "
                f"{spec.mask_values!r} (the source's key must include mask-values)"
            )
        masks = [self.folder.mask_sets[r] if self.folder.structures else self.folder.mask_sets[r][0] for r in rows]
        return SegFileDataset(
            [self.folder.images[r] for r in rows],
            masks,
            self.labels[rows],
            spec.img_size,
            intensity=spec.intensity,
            mask_map=self.mask_map,
        )


def escapes_folder(path: str) -> bool:
    """A manifest path that does not stay below the manifest's folder: absolute, starting with '~', or climbing
    out with '..' (judged on the text, before anything is opened; symlinks are data-roots' concern)."""
    if not path:
        return False
    if path.startswith("~") or Path(path).is_absolute() or Path(path).drive:
        return True
    normal = os.path.normpath(path)
    return normal == os.pardir or normal.startswith(os.pardir + os.sep)


def medmnist_path(flag: str, data_dir: str, img_size: int) -> Path:
    """``<data_dir>/<flag>.npz``, else ``<flag>_<size>.npz`` (smallest size >= img_size, else largest)."""
    folder = Path(data_dir).expanduser()
    exact = folder / f"{flag}.npz"
    if exact.is_file():
        return exact
    sized = {
        int(m.group(1)): p
        for p in folder.glob(f"{flag}_*.npz")
        if (m := re.fullmatch(rf"{re.escape(flag)}_(\d+)\.npz", p.name)) and p.is_file()
    }
    if sized:
        large_enough = [s for s in sized if s >= img_size]
        return sized[min(large_enough) if large_enough else max(sized)]
    raise DataError(
        f"medmnist:{flag}: file {exact} not found (nor {flag}_<size>.npz) in "
        f"data_dir {data_dir!r} (absolute: {folder.resolve()})"
    )


def source_key(spec: DataSpec) -> tuple:
    """Hashable identity of the spec's source; files are identified by path, mtime and size.

    A segfolder is identified by its resolved root, a fingerprint of its files (count, and a
    digest of names, sizes and mtimes) and the mask value map; a volume folder also by the settings
    that change its rows (size, intensity, slicing, empty-slice policy, mask map, seed) and the site's
    cache folder, where it keeps its decoded rows (``cache_dir``; '' = in memory only).
    """
    kind, arg = spec.source_kind, spec.source_arg
    if kind == "synthetic":
        return (kind, spec.seed, spec.synthetic_size, spec.synthetic_classes)
    if kind == "synthetic-seg":
        return (kind, spec.seed, spec.synthetic_size)
    if kind == "segfolder":
        root = Path(arg).expanduser().resolve()
        return (kind, arg, str(root), *segfolder.fingerprint(root), spec.mask_values)
    if kind == "volumes":  # rows are decoded, resized and filtered slices: the settings that change them count too
        root = Path(arg).expanduser().resolve()
        return (
            kind,
            arg,
            str(root),
            *volumes.fingerprint(root),
            spec.img_size,
            spec.intensity,
            spec.slice_axis,
            spec.empty_slices,
            spec.mask_values,
            spec.seed,
            spec.cache_dir,
        )
    if kind == "medmnist":
        path = medmnist_path(arg, spec.data_dir, spec.img_size).resolve()
    else:
        path = Path(arg).expanduser().resolve()
        if not path.is_file():
            raise DataError(f"{path}: csv manifest not found (dataset {spec.dataset!r})")
    stat = path.stat()
    return (kind, arg, str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def open_source_by_key(key: tuple) -> Source:
    """The source identified by ``source_key(spec)`` (cached)."""
    kind = key[0]
    if kind == "synthetic":
        return SyntheticSource(*key[1:])
    if kind == "synthetic-seg":
        return SyntheticSegSource(*key[1:])
    if kind == "segfolder":
        return SegFolderSource(Path(key[2]), key[5])
    if kind == "volumes":
        # img_size, intensity, slice_axis, empty_slices, mask_values, seed, cache_dir
        return volumes.VolumeSource(Path(key[2]), *key[5:])
    if kind == "medmnist":
        return MedmnistSource(key[1], Path(key[2]))
    return CsvSource(Path(key[2]))


def open_source(spec: DataSpec) -> Source:
    """The (cached) source of ``spec``; raises DataError for missing or malformed files."""
    return open_source_by_key(source_key(spec))


def describe_source(spec: DataSpec) -> tuple[int, list[str]]:
    """(num_classes, class_names) without loading images (a segfolder reads its masks once).

    For segmentation sources these are the foreground classes. Raises DataError for bad files.
    """
    source = open_source(spec)
    return source.num_classes, list(source.class_names)


def source_task(spec: DataSpec) -> str:
    """'classification' or 'segmentation', from the dataset kind alone (opens nothing)."""
    return "segmentation" if spec.source_kind in SEGMENTATION_KINDS else "classification"
