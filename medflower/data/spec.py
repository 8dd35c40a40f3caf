"""What data a run uses (`DataSpec`), the error the data layer raises and its row lists."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import DataError
from .maskmap import parse_mask_values

SOURCE_KINDS = ("synthetic", "medmnist", "csv", "synthetic-seg", "segfolder", "volumes")
ARGLESS_KINDS = ("synthetic", "synthetic-seg")  # kinds written without ":<argument>"
SEGMENTATION_KINDS = ("synthetic-seg", "segfolder", "volumes")
PARTITIONS = ("natural", "iid", "dirichlet", "pathological", "qbli")
LABEL_PARTITIONS = ("dirichlet", "pathological", "qbli")  # skew by class label: classification sources only
SITELESS_KINDS = ("medmnist",)  # a MedMNIST file has no site per row, so no natural partition
MAX_LISTED_ROWS = 10


def supported_partitions(kind: str) -> tuple[str, ...]:
    """The partitions a source kind can make. Segmentation sources have no class label to skew by; a csv
    manifest supports 'natural' only with a site column, which only reading it tells."""
    return tuple(
        p
        for p in PARTITIONS
        if not (kind in SEGMENTATION_KINDS and p in LABEL_PARTITIONS)
        and not (kind in SITELESS_KINDS and p == "natural")
    )


def unsupported_partition(dataset: str, partition: str) -> str | None:
    """Why ``dataset``'s source kind cannot make ``partition`` (one sentence naming the valid ones), or None.
    The config check and the sites' partitioning both raise with it."""
    kind = dataset.partition(":")[0]
    valid = supported_partitions(kind)
    if partition in valid:
        return None
    why = (
        "is a segmentation source (no class label to skew by)"
        if kind in SEGMENTATION_KINDS
        else "has no site per row, which partition 'natural' needs"
    )
    return f"dataset {dataset!r} {why}; valid choices are {', '.join(valid)}"


def list_rows(items: list[str], limit: int = MAX_LISTED_ROWS) -> str:
    """'a, b, c ... (+N more, M in total)' for error messages."""
    shown = ", ".join(items[:limit])
    if len(items) <= limit:
        return shown
    return f"{shown} ... (+{len(items) - limit} more, {len(items)} in total)"


@dataclass(frozen=True)
class DataSpec:
    """Where the data comes from and how it is split over clients (hashable, used as cache key)."""

    # "synthetic" | "medmnist:<flag>" | "csv:<manifest path>" | "synthetic-seg" | "segfolder:<root>"
    # | "volumes:<root>"
    dataset: str = "synthetic"
    data_dir: str = "data"  # folder of <flag>.npz / <flag>_<size>.npz for medmnist
    partition: str = "dirichlet"  # natural | iid | dirichlet | pathological | qbli
    dirichlet_alpha: float = 0.5
    pathological_k: int = 2  # classes per client
    # qbli: every client holds qbli_classes classes of each group of classes_per_task consecutive classes of
    # the task order task_classes ('' = the dataset's order), i.e. of each class-incremental task
    qbli_classes: int = 1
    task_classes: str = ""
    classes_per_task: int = 2
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    img_size: int = 32
    seed: int = 0
    synthetic_size: int = 2400  # total samples of the synthetic (and synthetic-seg) pool
    synthetic_classes: int = 8  # synthetic only; synthetic-seg always has 2 foreground classes
    use_source_splits: bool = True  # rows with a source split label (medmnist, csv `split`) keep it
    # Medical images (docs/data.md#medical-image-formats): intensity of >8-bit images, volume slicing, mask maps
    intensity: str = "auto"  # auto | none | minmax | percentile:<low>,<high> | window:<center>,<width>
    slice_axis: int = 2  # volumes: the array axis 2-D slices are cut across
    empty_slices: str = "keep"  # volumes: slices without foreground: keep | drop | keep:<fraction>
    mask_values: str = ""  # '<value>=<structure>[+<structure>...],...'; '' = binary or class-index masks
    augment: str = ""  # training-only augmentation: '' or a comma list (parse_augment)
    split_limit: str = ""  # at most this many rows per split at each site: '' or 'train:40,test:20' (parse_split_limit)
    cache_dir: str = ""  # this site's decoded-image cache folder ('' = no disk cache); not part of the run config

    def __post_init__(self) -> None:
        problems = []
        kind, _, arg = self.dataset.partition(":")
        if kind not in SOURCE_KINDS or (kind in ARGLESS_KINDS) == bool(arg):
            problems.append(
                f"dataset {self.dataset!r} is not one of synthetic, medmnist:<flag>, "
                "csv:<manifest>, synthetic-seg, segfolder:<root>, volumes:<root>"
            )
        if self.partition not in PARTITIONS:
            problems.append(f"partition {self.partition!r} is not one of {', '.join(PARTITIONS)}")
        if not self.dirichlet_alpha > 0:
            problems.append(f"dirichlet_alpha must be > 0, got {self.dirichlet_alpha}")
        if self.pathological_k < 1:
            problems.append(f"pathological_k must be >= 1, got {self.pathological_k}")
        if self.qbli_classes < 1 or self.classes_per_task < 1:
            problems.append(
                f"qbli_classes and classes_per_task must be >= 1, got {self.qbli_classes} and {self.classes_per_task}"
            )
        if not (0 <= self.val_fraction < 1 and 0 <= self.test_fraction < 1):
            problems.append("val_fraction and test_fraction must be in [0, 1)")
        elif self.val_fraction + self.test_fraction >= 1:
            problems.append(f"val_fraction + test_fraction must be < 1, got {self.val_fraction} + {self.test_fraction}")
        if self.img_size < 1:
            problems.append(f"img_size must be >= 1, got {self.img_size}")
        for name, parse in (
            ("intensity", parse_intensity),
            ("empty_slices", parse_empty_slices),
            ("augment", parse_augment),
            ("split_limit", parse_split_limit),
        ):
            try:
                parse(getattr(self, name))
            except ValueError as exc:
                problems.append(f"{name} {getattr(self, name)!r}: {exc}")
        try:
            parse_mask_values(self.mask_values)
        except ValueError as exc:
            problems.append(f"mask_values {self.mask_values!r}: {exc}")
        if self.slice_axis not in (0, 1, 2):
            problems.append(f"slice_axis must be 0, 1 or 2, got {self.slice_axis}")
        if self.synthetic_size < 1 or self.synthetic_classes < 2:
            problems.append("synthetic_size must be >= 1 and synthetic_classes >= 2")
        if problems:
            raise DataError("invalid DataSpec: " + "; ".join(problems))

    @property
    def source_kind(self) -> str:
        """'synthetic', 'medmnist', 'csv', 'synthetic-seg' or 'segfolder'."""
        return self.dataset.partition(":")[0]

    @property
    def source_arg(self) -> str:
        """The part after the colon: medmnist flag, csv manifest or segfolder root ('' for synthetic*)."""
        return self.dataset.partition(":")[2]


# ----------------------------------------------------------------------------- option strings
def _numbers(text: str, count: int, what: str) -> tuple[float, ...]:
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != count or not all(math.isfinite(v) for v in values):
        raise ValueError(f"expected {what}")
    return values


def parse_intensity(text: str) -> tuple[str, tuple[float, ...]]:
    """(mode, parameters) of an ``intensity`` setting: how a >8-bit or float image becomes 0..255.

    ``auto``: 8-bit images as they are, others percentile 0.5-99.5 (a DICOM with a VOI LUT or window: that
    window); ``none``: values clipped to 0..255 as they are; ``minmax``: the image's range;
    ``percentile:<low>,<high>``: clip to those percentiles of the image, then scale; ``window:<center>,<width>``:
    a fixed window (DICOM's linear VOI: center - width/2 .. center + width/2), the same for every image.
    """
    mode, _, arg = text.strip().partition(":")
    if mode in ("auto", "none", "minmax") and not arg:
        return mode, ()
    if mode == "percentile":
        low, high = _numbers(arg, 2, "percentile:<low>,<high> with 0 <= low < high <= 100")
        if not 0 <= low < high <= 100:
            raise ValueError("expected percentile:<low>,<high> with 0 <= low < high <= 100")
        return mode, (low, high)
    if mode == "window":
        center, width = _numbers(arg, 2, "window:<center>,<width> with width > 0")
        if not width > 0:
            raise ValueError("expected window:<center>,<width> with width > 0")
        return mode, (center, width)
    raise ValueError("valid forms are auto, none, minmax, percentile:<low>,<high>, window:<center>,<width>")


def parse_empty_slices(text: str) -> float:
    """The share of a volume's slices without foreground that are kept: ``keep`` = 1, ``drop`` = 0,
    ``keep:<fraction>`` = that share (a seeded choice per case)."""
    text = text.strip()
    if text == "keep":
        return 1.0
    if text == "drop":
        return 0.0
    mode, _, arg = text.partition(":")
    if mode == "keep" and arg:
        (fraction,) = _numbers(arg, 1, "keep:<fraction> with the fraction in [0, 1]")
        if 0 <= fraction <= 1:
            return fraction
    raise ValueError("valid forms are keep, drop, keep:<fraction in [0, 1]>")


SPLITS = ("train", "val", "test")  # a site's splits, in this order everywhere


def parse_split_limit(text: str) -> dict[str, int]:
    """The row limits of a ``split-limit`` setting, e.g. ``train:40,val:10,test:20`` (split -> at most that many
    rows at each site; a split not named keeps all its rows). Empty = no limit."""
    out: dict[str, int] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        split, sep, count = (part.strip() for part in item.partition(":"))
        if split not in SPLITS or not sep:
            raise ValueError(f"{item!r} is not <split>:<rows> with the split one of {', '.join(SPLITS)}")
        if split in out:
            raise ValueError(f"{split} is limited twice")
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise ValueError(f"{item!r}: the rows must be a whole number >= 1")
        out[split] = int(count)
    return out


AUGMENTATIONS = {  # name: (needs a value, valid range, what the value means)
    "crop": (True, (0.1, 1.0), "side of a random square crop as a fraction of the image side, resized back"),
    "flip": (False, None, "horizontal flip with probability 0.5"),
    "vflip": (False, None, "vertical flip with probability 0.5"),
    "rotate": (True, (0.0, 180.0), "rotation by a uniform angle in [-value, value] degrees"),
    "jitter": (True, (0.0, 1.0), "brightness and contrast scaled by uniform factors in [1 - value, 1 + value]"),
}


def parse_augment(text: str) -> dict[str, float]:
    """The training augmentations of an ``augment`` setting, e.g. ``crop:0.9,flip,rotate:10,jitter:0.1``
    (name -> value; 1.0 for a flip). Empty = none."""
    out: dict[str, float] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, _, arg = item.partition(":")
        if name not in AUGMENTATIONS:
            raise ValueError(f"unknown augmentation {name!r}; valid: {', '.join(AUGMENTATIONS)}")
        needs_value, bounds, _ = AUGMENTATIONS[name]
        if name in out:
            raise ValueError(f"augmentation {name!r} is given twice")
        if not needs_value:
            if arg:
                raise ValueError(f"augmentation {name!r} takes no value")
            out[name] = 1.0
            continue
        (value,) = _numbers(arg, 1, f"{name}:<value> with the value in [{bounds[0]}, {bounds[1]}]")
        if not bounds[0] <= value <= bounds[1]:
            raise ValueError(f"{name}:<value> needs the value in [{bounds[0]}, {bounds[1]}], got {value}")
        out[name] = value
    return out
