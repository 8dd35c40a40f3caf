"""A deployed site's own data, named by its SuperNode's node-config ``data-path``, numbered the run's way.

Every site's data goes through one mapping step (``SiteClasses.map_labels``), so that a class index means the
same class on every site: with run-config ``class-names`` a label is matched to those names (a manifest's text
labels by name, class indices 0..K-1 as they are), without them labels must be class indices
0..num-classes-1. A site never numbers its own label names (docs/data.md#class-names-for-site-data).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .client import ClientData, split_rows
from .readers import NIFTI_EXTENSIONS
from .segfolder import file_extension, has_layout
from .sources import Source, open_source_by_key, source_key, source_task
from .spec import DataError, DataSpec

INTEGER = re.compile(r"[+-]?\d+")
SHOWN_LABELS = 3  # at most this many label values in a message


def shown(values, limit: int = SHOWN_LABELS) -> str:
    """A few values for messages: 'a', 'b', 'c' (+2 more), or 2, 7 for numbers."""
    values = [v.item() if isinstance(v, np.generic) else v for v in values]
    text = ", ".join(repr(v) for v in values[:limit])
    return text + (f" (+{len(values) - limit} more)" if len(values) > limit else "")


@dataclass(frozen=True)
class SiteClasses:
    """The run's classes as every site numbers them: ``num_classes`` (the num-classes the server sends, else the
    run config's) and ``names``, run-config class-names in index order (empty = unset)."""

    num_classes: int
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_classes < 1:
            raise DataError("the run's number of classes is unknown: the run needs num-classes > 0 or class-names")
        if self.names and len(self.names) != self.num_classes:
            raise DataError(
                f"run-config class-names lists {len(self.names)} classes but the run has "
                f"{self.num_classes} (num-classes)"
            )

    def class_names(self, task: str) -> tuple[str, ...]:
        """class-names; else the indices as text, as the server names them, or for segmentation the foreground
        classes as segmentation folders name them ('foreground', or 'class-1'..'class-K')."""
        if self.names:
            return self.names
        if task == "segmentation":
            return (
                ("foreground",)
                if self.num_classes == 1
                else tuple(f"class-{c}" for c in range(1, self.num_classes + 1))
            )
        return tuple(str(c) for c in range(self.num_classes))

    def map_labels(self, source: Source) -> np.ndarray:
        """``source``'s labels as indices into the run's classes; DataError for a label the run has no class for.

        Text labels (a manifest's names) are matched to class-names, and refused without them. Class indices (an
        npz, a manifest's integer labels) are kept and must be < num_classes; a manifest's integer labels are
        matched as text instead when class-names itself lists integers (e.g. grades '1,2,3')."""
        if source.labels_are_names and not self.names:
            raise DataError(
                f"{source.name}: the labels are class names ({len(source.class_names)} distinct: "
                f"{shown(source.class_names)}) but run-config class-names is unset; a site does not number its own "
                f"label names (another site would give the same index to another class): set run-config "
                f"class-names (comma-separated, in index order) or write the labels as class indices "
                f"0..{self.num_classes - 1}"
            )
        by_text = bool(self.names) and (
            source.labels_are_names or (source.written_labels and any(INTEGER.fullmatch(n) for n in self.names))
        )
        if by_text:
            written = (
                np.asarray(source.class_names, dtype=str)[source.labels]
                if source.labels_are_names
                else source.labels.astype(str)
            )
            return self._by_name(source, written)
        outside = source.labels >= self.num_classes
        if outside.any():
            what = "class-names" if self.names else "num-classes"
            raise DataError(
                f"{source.name}: {outside.sum()} row(s) have class indices outside "
                f"0..{self.num_classes - 1} (the run has {self.num_classes} classes, run-config {what}): "
                f"{shown(np.unique(source.labels[outside]))}"
            )
        return source.labels

    def _by_name(self, source: Source, written: np.ndarray) -> np.ndarray:
        index = {name: i for i, name in enumerate(self.names)}
        unknown = sorted(set(np.unique(written).tolist()) - index.keys())
        if unknown:
            rows = np.isin(written, unknown)
            raise DataError(
                f"{source.name}: {len(unknown)} label(s) in {rows.sum()} row(s) are not in run-config "
                f"class-names: {shown(unknown)} (class-names: {shown(self.names, 12)})"
            )
        return np.array([index[w] for w in written.tolist()], dtype=np.int64)


def load_site_data(base: DataSpec, data_path: str, classes: SiteClasses, task: str | None = None) -> ClientData:
    """All of a site's data at ``data_path`` (``site_data_spec``), labels mapped onto the run's ``classes``, split
    into train/val/test with ``base``'s settings. ``task`` (when given) is the task the run trains; other data is
    refused. Cached per file identity (path, modification time, size; a folder's fingerprint)."""
    spec = site_data_spec(base, data_path)
    held = source_task(spec)
    if task is not None and held != task:
        raise DataError(f"{data_path}: this site holds {held} data but the run trains a {task} model (run-config task)")
    return _site_data(source_key(spec), spec, classes)


@lru_cache(maxsize=8)
def _site_data(key: tuple, spec: DataSpec, classes: SiteClasses) -> ClientData:
    source = open_source_by_key(key)
    if source.task == "segmentation":  # masks hold class indices or structure planes: nothing to map, only to bound
        if source.planes and source.num_classes != classes.num_classes:
            raise DataError(
                f"{source.name}: the masks hold {source.num_classes} structures "
                f"({', '.join(source.class_names)}) but the run has {classes.num_classes} outputs "
                "(run-config num-classes or class-names): every site must give the same structures"
            )
        if source.planes and classes.names and tuple(classes.names) != tuple(source.class_names):
            raise DataError(
                f"{source.name}: the structures are {', '.join(source.class_names)} in this order but "
                f"run-config class-names says {', '.join(classes.names)}"
            )
        if source.num_classes > classes.num_classes:
            raise DataError(
                f"{source.name}: the masks hold foreground classes up to {source.num_classes} but the "
                f"run has {classes.num_classes} (run-config num-classes)"
            )
        labels = source.labels
    else:
        labels = classes.map_labels(source)
    names = source.class_names if source.planes else classes.class_names(source.task)  # structures keep their names
    mapped = source.relabelled(labels, names)
    return split_rows(mapped, spec, np.arange(len(mapped)), 0, 1, None)


def site_data_spec(base: DataSpec, data_path: str) -> DataSpec:
    """The spec of a site whose data lives at ``data_path``; the site uses all of it (one partition).

    ``data_path`` is a MedMNIST-layout ``.npz`` file, a ``.csv`` manifest, or a folder holding
    exactly one of them (``manifest.csv`` is preferred when both kinds are present). A folder
    with ``images/`` of NIfTI volumes or DICOM series folders and ``masks/`` is a volume folder,
    ``volumes:<path>``; one with ``images/`` and ``masks/`` or ``masks-<structure>/`` folders (or
    site sub-folders that have them) is a segmentation folder, ``segfolder:<path>``. Either wins
    over files next to it; its sites are pooled into the site's one partition.
    """
    path = Path(data_path).expanduser()
    if path.is_dir() and is_volume_folder(path):
        return dataclasses.replace(base, dataset=f"volumes:{path}", partition="iid")
    if path.is_dir() and is_segfolder(path):
        return dataclasses.replace(base, dataset=f"segfolder:{path}", partition="iid")
    if path.is_dir():
        manifests = [path / "manifest.csv"] if (path / "manifest.csv").is_file() else sorted(path.glob("*.csv"))
        npz = sorted(path.glob("*.npz"))
        candidates = manifests or npz
        if len(candidates) != 1:
            found = ", ".join(p.name for p in manifests + npz) or "nothing"
            raise DataError(
                f"node-config data-path {path}: expected one manifest .csv or one .npz in the folder, found {found}"
            )
        path = candidates[0]
    if not path.is_file():
        raise DataError(f"node-config data-path {path} does not exist")
    if path.suffix == ".npz":
        dataset, data_dir = f"medmnist:{path.stem}", str(path.parent)
    elif path.suffix == ".csv":
        dataset, data_dir = f"csv:{path}", base.data_dir
    else:
        raise DataError(f"node-config data-path {path}: expected a .npz (MedMNIST layout) or a .csv manifest")
    # A site holds its own data: no further partitioning ("iid" over a single partition).
    return dataclasses.replace(base, dataset=dataset, data_dir=data_dir, partition="iid")


def is_segfolder(path: Path) -> bool:
    """``path`` holds images/ and a mask folder (masks/ or masks-<structure>/), or a sub-folder does (the segfolder
    layout)."""
    return has_layout(path) or any(
        has_layout(p) for p in path.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
    )


def is_volume_folder(path: Path) -> bool:
    """``path`` is a volume folder (docs/data.md#volumes): images/ and masks/ where images/ holds NIfTI files or
    DICOM series folders. A 2-D NIfTI is a volume of one slice, so it reads the same either way."""
    images = path / "images"
    if not (images.is_dir() and (path / "masks").is_dir()):
        return False
    return any(
        file_extension(p) in NIFTI_EXTENSIONS or p.is_dir() for p in images.iterdir() if not p.name.startswith(".")
    )
