"""What data a run uses (`DataSpec`), the error the data layer raises and its row lists."""

from __future__ import annotations

from dataclasses import dataclass

SOURCE_KINDS = ("synthetic", "medmnist", "csv", "synthetic-seg", "segfolder")
ARGLESS_KINDS = ("synthetic", "synthetic-seg")  # kinds written without ":<argument>"
SEGMENTATION_KINDS = ("synthetic-seg", "segfolder")
PARTITIONS = ("natural", "iid", "dirichlet", "pathological", "qbli")
LABEL_PARTITIONS = ("dirichlet", "pathological", "qbli")  # skew by class label: classification sources only
SITELESS_KINDS = ("medmnist",)  # a MedMNIST file has no site per row, so no natural partition
MAX_LISTED_ROWS = 10


def supported_partitions(kind: str) -> tuple[str, ...]:
    """The partitions a source kind can make. Segmentation sources have no class label to skew by; a csv
    manifest supports 'natural' only with a site column, which only reading it tells."""
    return tuple(p for p in PARTITIONS if not (kind in SEGMENTATION_KINDS and p in LABEL_PARTITIONS)
                 and not (kind in SITELESS_KINDS and p == "natural"))


def unsupported_partition(dataset: str, partition: str) -> str | None:
    """Why ``dataset``'s source kind cannot make ``partition`` (one sentence naming the valid ones), or None.
    The config check and the sites' partitioning both raise with it."""
    kind = dataset.partition(":")[0]
    valid = supported_partitions(kind)
    if partition in valid:
        return None
    why = ("is a segmentation source (no class label to skew by)" if kind in SEGMENTATION_KINDS
           else "has no site per row, which partition 'natural' needs")
    return f"dataset {dataset!r} {why}; valid choices are {', '.join(valid)}"


class DataError(ValueError):
    """Data that is missing or malformed; the message names the file and the problem."""


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

    def __post_init__(self) -> None:
        problems = []
        kind, _, arg = self.dataset.partition(":")
        if kind not in SOURCE_KINDS or (kind in ARGLESS_KINDS) == bool(arg):
            problems.append(f"dataset {self.dataset!r} is not one of synthetic, medmnist:<flag>, "
                            "csv:<manifest>, synthetic-seg, segfolder:<root>")
        if self.partition not in PARTITIONS:
            problems.append(f"partition {self.partition!r} is not one of {', '.join(PARTITIONS)}")
        if not self.dirichlet_alpha > 0:
            problems.append(f"dirichlet_alpha must be > 0, got {self.dirichlet_alpha}")
        if self.pathological_k < 1:
            problems.append(f"pathological_k must be >= 1, got {self.pathological_k}")
        if self.qbli_classes < 1 or self.classes_per_task < 1:
            problems.append(f"qbli_classes and classes_per_task must be >= 1, got {self.qbli_classes} and "
                            f"{self.classes_per_task}")
        if not (0 <= self.val_fraction < 1 and 0 <= self.test_fraction < 1):
            problems.append("val_fraction and test_fraction must be in [0, 1)")
        elif self.val_fraction + self.test_fraction >= 1:
            problems.append("val_fraction + test_fraction must be < 1, "
                            f"got {self.val_fraction} + {self.test_fraction}")
        if self.img_size < 1:
            problems.append(f"img_size must be >= 1, got {self.img_size}")
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
