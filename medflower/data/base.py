"""What every data source is: the ``Source`` base class (a pool of labelled rows that makes a site's datasets), the
split names and the strings a label manifest may use for a missing label. The sources themselves are in
``sources.py`` (synthetic, MedMNIST, csv, segmentation folders) and ``volumes.py`` (NIfTI and DICOM volumes).
"""

from __future__ import annotations

import copy

import numpy as np
from torch.utils.data import Dataset

from .spec import DataSpec

# pandas' default NA strings (pandas._libs.parsers.STR_NA_VALUES): a manifest label written as one of these is a
# missing label, never a class.
NA_LABELS = frozenset(
    {
        "",
        "#N/A",
        "#N/A N/A",
        "#NA",
        "-1.#IND",
        "-1.#QNAN",
        "-NaN",
        "-nan",
        "1.#IND",
        "1.#QNAN",
        "<NA>",
        "N/A",
        "NA",
        "NULL",
        "NaN",
        "None",
        "n/a",
        "nan",
        "null",
    }
)
MAX_LABEL = 99_999  # the largest class index a source may hold (a class per index is named, so no more)


def default_class_names(num_classes: int) -> tuple[str, ...]:
    """'class-0', 'class-1', ..."""
    return tuple(f"class-{c}" for c in range(num_classes))


class Source:
    """A pool of labelled rows; subclasses make the images of a client's rows."""

    name: str  # names the source (and its file) in messages
    labels: np.ndarray  # int64 (N,)
    class_names: tuple[str, ...]  # segmentation: the foreground classes (mask values 1..K)
    splits: np.ndarray | None = None  # per row "train" | "val" | "test" | "" (no split)
    # per row: the patient, case or video sequence it comes from; no group spans two partitions or two splits
    groups: np.ndarray | None = None
    planes: bool = False  # segmentation: masks are named structures, one binary plane each (docs/data.md#masks)
    task: str = "classification"  # or "segmentation"
    styled_by_partition: bool = False  # each partition renders its rows in its own site style
    # True when the rows named their classes (a manifest with text labels): ``class_names`` are those names,
    # sorted; False when the rows hold class indices and ``class_names`` are the source's convention
    labels_are_names: bool = False
    written_labels: bool = False  # labels were read as text (a manifest), so integer labels can be matched by name

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def relabelled(self, labels: np.ndarray, class_names: tuple[str, ...]) -> Source:
        """The same rows with other class indices and names (a site mapping its labels onto the run's classes)."""
        if len(labels) != len(self):
            raise ValueError(f"{len(labels)} labels for {len(self)} rows")
        other = copy.copy(self)
        other.labels, other.class_names = np.asarray(labels, dtype=np.int64), tuple(class_names)
        other.labels_are_names = False
        return other

    def __len__(self) -> int:
        return len(self.labels)

    def sites(self, num_partitions: int) -> np.ndarray | None:
        """Natural site of each row, or None when the source has no sites."""
        return None

    def row_name(self, row: int) -> str:
        """How messages refer to pool row ``row``."""
        return f"row {row}"

    def dataset(self, rows: np.ndarray, partition_id: int, spec: DataSpec) -> Dataset:
        """Dataset of pool ``rows`` as held by partition ``partition_id``."""
        raise NotImplementedError
