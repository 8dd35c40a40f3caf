"""Splitting the pool over clients (flwr-datasets partitioners) and each client's rows into splits.

Every process computes the full partitioning itself from the spec, so all clients agree
without talking to each other; the result is cached per (source, partitioning, seed).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
from sklearn.model_selection import train_test_split

from .sources import SPLITS, Source, open_source_by_key, source_key
from .spec import DataError, DataSpec, list_rows, unsupported_partition

if TYPE_CHECKING:
    import datasets
    from flwr_datasets.partitioner import Partitioner

DIRICHLET_MIN_PARTITION_SIZE = 10  # lowered for small pools, dropped if flwr-datasets cannot meet it


@dataclass(frozen=True)
class Partitioning:
    """Sorted pool rows of each partition and the natural site name of each (None if not natural)."""

    rows: tuple[np.ndarray, ...]
    sites: tuple[str | None, ...]


def partition_rows(spec: DataSpec, num_partitions: int) -> Partitioning:
    """The partitioning of ``spec``'s pool into ``num_partitions`` parts (cached, deterministic)."""
    if num_partitions < 1:
        raise DataError(f"num_partitions must be >= 1, got {num_partitions}")
    check_partition_supported(spec)
    qbli = (spec.qbli_classes, spec.task_classes, spec.classes_per_task) if spec.partition == "qbli" else None
    return _partition_cached(source_key(spec), spec.partition, spec.dirichlet_alpha,
                             spec.pathological_k, spec.seed, num_partitions, qbli)


def check_partition_supported(spec: DataSpec) -> None:
    """Refuse a partition the source cannot make, before any split: the one check the sites and the
    ServerApp's check before round 1 share (a csv manifest is read to see whether it has a site column)."""
    if why := unsupported_partition(spec.dataset, spec.partition):
        raise DataError(f"partition {spec.partition!r}: {why}")
    if spec.partition == "natural" and open_source_by_key(source_key(spec)).sites(1) is None:
        raise DataError(f"dataset {spec.dataset!r}: partition 'natural' needs a site per row (a csv manifest "
                        f"with a site column, a segfolder, or a synthetic source); this source has none")


@lru_cache(maxsize=16)
def _partition_cached(key: tuple, partition: str, alpha: float, k: int, seed: int,
                      num_partitions: int, qbli: tuple[int, str, int] | None = None) -> Partitioning:
    import datasets  # heavy imports, deferred so that importing the package stays fast

    datasets.disable_progress_bars()  # one bar per partitioner call would flood the sites' logs

    source = open_source_by_key(key)
    if num_partitions > len(source):
        raise DataError(f"{source.name}: cannot split {len(source)} rows into {num_partitions} partitions")
    sites = source.sites(num_partitions)
    if partition == "natural":
        _check_natural_sites(source, sites, num_partitions)
    table = datasets.Dataset.from_dict({
        "index": np.arange(len(source)),
        "label": source.labels,
        "site": sites if sites is not None else np.full(len(source), ""),
    })
    if partition != "natural":
        # Partitioners hand out rows of a class in table order; shuffling first keeps a
        # partition from being, e.g., all of a source's official train rows and none of its test rows.
        table = table.shuffle(seed=seed).flatten_indices()
    try:
        if partition == "qbli":
            rows = _qbli_rows(table, task_groups(source.class_names, qbli[1], qbli[2]), qbli[0],
                              num_partitions, seed)
        elif partition == "dirichlet":
            partitioner = _dirichlet(table, num_partitions, alpha, seed)
        else:
            partitioner = _partitioner(partition, num_partitions, k, seed)
            partitioner.dataset = table
        if partition != "qbli":
            rows = tuple(_rows_of(partitioner, p) for p in range(num_partitions))
    except ValueError as exc:
        raise DataError(f"{source.name}: cannot make a {partition!r} partitioning into "
                        f"{num_partitions} partitions: {exc}") from exc
    if partition == "natural":
        site_names = tuple(partitioner.partition_id_to_natural_id[p] for p in range(num_partitions))
    elif source.styled_by_partition:  # each partition renders in its own site style
        site_names = tuple(source.site_name(p, num_partitions) for p in range(num_partitions))
    else:
        site_names = (None,) * num_partitions
    return Partitioning(rows=rows, sites=site_names)


def _partitioner(partition: str, num_partitions: int, k: int, seed: int) -> Partitioner:
    from flwr_datasets.partitioner import IidPartitioner, NaturalIdPartitioner, PathologicalPartitioner

    if partition == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if partition == "pathological":
        # first-deterministic: partition p surely holds class p % num_classes, so no class
        # goes unused when there are at least as many partitions as classes
        return PathologicalPartitioner(num_partitions=num_partitions, partition_by="label",
                                       num_classes_per_partition=k, seed=seed,
                                       class_assignment_mode="first-deterministic")
    return NaturalIdPartitioner(partition_by="site")


def task_groups(class_names: list[str], task_classes: str, classes_per_task: int) -> list[list[int]]:
    """Consecutive groups of ``classes_per_task`` classes of the task order; classes outside it form a last group."""
    from .tasks import parse_task_classes

    order = parse_task_classes(task_classes, class_names)
    groups = [order[i:i + classes_per_task] for i in range(0, len(order), classes_per_task)]
    rest = [c for c in range(len(class_names)) if c not in order]
    return groups + ([rest] if rest else [])


def _qbli_rows(table: datasets.Dataset, groups: list[list[int]], k: int, num_partitions: int,
               seed: int) -> tuple[np.ndarray, ...]:
    """Quantity-based label imbalance per task (NIID-bench's #C=k within each group of classes).

    For every group, flwr-datasets' PathologicalPartitioner gives each partition ``k`` of the group's classes
    and splits each class's rows evenly over the partitions holding it ("first-deterministic": every class
    has a holder when there are as many partitions as classes in a group). The partition ids are rotated
    by the group index, so the same site does not always get the first class of every task.
    """
    from flwr_datasets.partitioner import PathologicalPartitioner

    labels = np.asarray(table["label"])
    parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for g, group in enumerate(groups):
        positions = np.flatnonzero(np.isin(labels, group))
        if positions.size == 0:
            continue
        partitioner = PathologicalPartitioner(
            num_partitions=num_partitions, partition_by="label", num_classes_per_partition=min(k, len(group)),
            class_assignment_mode="first-deterministic", seed=seed + g)
        partitioner.dataset = table.select(positions)
        for p in range(num_partitions):
            parts[(p + g) % num_partitions].append(_rows_of(partitioner, p))
    rows = []
    for chunks in parts:
        joined = np.sort(np.concatenate(chunks)) if chunks else np.zeros(0, dtype=np.int64)
        joined.setflags(write=False)
        rows.append(joined)
    return tuple(rows)


def _dirichlet(table: datasets.Dataset, num_partitions: int, alpha: float, seed: int) -> Partitioner:
    """Dirichlet label skew; asks for a small minimum partition size, drops it if unreachable."""
    min_size = min(DIRICHLET_MIN_PARTITION_SIZE, table.num_rows // (2 * num_partitions))
    try:
        return _sampled_dirichlet(table, num_partitions, alpha, seed, min_size)
    except ValueError:  # flwr-datasets gives up after 10 resampling attempts
        if min_size == 0:
            raise
        return _sampled_dirichlet(table, num_partitions, alpha, seed, 0)


def _sampled_dirichlet(table: datasets.Dataset, num_partitions: int, alpha: float, seed: int,
                       min_size: int) -> Partitioner:
    from flwr_datasets.partitioner import DirichletPartitioner

    partitioner = DirichletPartitioner(
        num_partitions=num_partitions, partition_by="label", alpha=alpha, seed=seed,
        min_partition_size=min_size, self_balancing=False)
    partitioner.dataset = table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per failed resampling attempt
        partitioner.load_partition(0)  # samples the whole assignment
    return partitioner


def _rows_of(partitioner: Partitioner, partition_id: int) -> np.ndarray:
    rows = np.sort(np.asarray(partitioner.load_partition(partition_id)["index"], dtype=np.int64))
    rows.setflags(write=False)
    return rows


def _check_natural_sites(source: Source, sites: np.ndarray | None, num_partitions: int) -> None:
    if sites is None:
        raise DataError(f"{source.name}: partition 'natural' needs a site per row (a csv manifest "
                        f"with a site column, a segfolder, or a synthetic source); this source has none")
    blank = np.flatnonzero(sites == "")
    if blank.size:
        raise DataError(f"{source.name}: partition 'natural' needs a site in every row; "
                        f"{blank.size} row(s) have none: " + list_rows([source.row_name(r) for r in blank]))
    found = sorted(set(sites.tolist()))
    if len(found) != num_partitions:
        raise DataError(f"{source.name}: partition 'natural' needs num_partitions equal to the number "
                        f"of sites, but num_partitions={num_partitions} and {len(found)} site(s) were "
                        f"found: {list_rows(found)}")


def split_client_rows(labels: np.ndarray, source_splits: np.ndarray | None, val_fraction: float,
                      test_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Positions (into ``labels``) of train/val/test; rows with a source split keep it.

    Rows without one are split seeded and stratified by label where sklearn can
    (unstratified when a class is too small).
    """
    positions = np.arange(len(labels))
    if source_splits is None:
        source_splits = np.full(len(labels), "")
    free = positions[source_splits == ""]
    rest, test = _hold_out(free, labels, test_fraction, seed)
    train, val = _hold_out(rest, labels, val_fraction / (1 - test_fraction), seed)
    drawn = {"train": train, "val": val, "test": test}
    return {split: np.sort(np.concatenate([positions[source_splits == split], drawn[split]]))
            for split in SPLITS}


def _hold_out(positions: np.ndarray, labels: np.ndarray, fraction: float,
              seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) with ceil(fraction * n) held out, leaving at least one row kept."""
    num_held = min(math.ceil(fraction * len(positions)), len(positions) - 1)
    if num_held <= 0:
        return positions, positions[:0]
    try:
        return tuple(train_test_split(positions, test_size=num_held, random_state=seed,
                                      stratify=labels[positions]))
    except ValueError:  # a class with fewer than 2 rows, or fewer held-out rows than classes
        return tuple(train_test_split(positions, test_size=num_held, random_state=seed))
