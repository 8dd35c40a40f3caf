"""Splitting the pool over clients (flwr-datasets partitioners) and each client's rows into splits.

Every process computes the full partitioning itself from the spec, so all clients agree
without talking to each other; the result is cached per (source, partitioning, seed).

A source with ``groups`` (the patient, case or video sequence of each row) is partitioned and split by group:
no group spans two partitions or two of train/val/test (docs/data.md#splits-without-leakage). Partitioners
see one row per group carrying its majority label, and the partition of a group is that of all its rows.
Without groups every partition and split is row by row, exactly as before groups existed.
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
    return _partition_cached(
        source_key(spec), spec.partition, spec.dirichlet_alpha, spec.pathological_k, spec.seed, num_partitions, qbli
    )


def check_partition_supported(spec: DataSpec) -> None:
    """Refuse a partition the source cannot make, before any split: the one check the sites and the
    ServerApp's check before round 1 share (a csv manifest is read to see whether it has a site column)."""
    if why := unsupported_partition(spec.dataset, spec.partition):
        raise DataError(f"partition {spec.partition!r}: {why}")
    if spec.partition == "natural" and open_source_by_key(source_key(spec)).sites(1) is None:
        raise DataError(
            f"dataset {spec.dataset!r}: partition 'natural' needs a site per row (a csv manifest "
            f"with a site column, a segfolder, or a synthetic source); this source has none"
        )


@lru_cache(maxsize=16)
def _partition_cached(
    key: tuple,
    partition: str,
    alpha: float,
    k: int,
    seed: int,
    num_partitions: int,
    qbli: tuple[int, str, int] | None = None,
) -> Partitioning:
    import datasets  # heavy imports, deferred so that importing the package stays fast

    datasets.disable_progress_bars()  # one bar per partitioner call would flood the sites' logs

    source = open_source_by_key(key)
    if num_partitions > len(source):
        raise DataError(f"{source.name}: cannot split {len(source)} rows into {num_partitions} partitions")
    sites = source.sites(num_partitions)
    parts_per_site = _check_natural_sites(source, sites, num_partitions) if partition == "natural" else 1
    grouping = source_grouping(source)
    labels = source.labels
    if grouping is not None:  # partition groups, one table row per group (rows keep their group's partition)
        if partition == "natural":
            _check_group_sites(source, grouping, sites)
        if num_partitions > len(grouping.names):
            raise DataError(
                f"{source.name}: cannot split {len(grouping.names)} group(s) (patients, cases or "
                f"videos; a group never spans two partitions) into {num_partitions} partitions"
            )
        labels = grouping.labels(source.labels)
        if sites is not None:
            sites = sites[grouping.first_rows]
    table = datasets.Dataset.from_dict(
        {
            "index": np.arange(len(labels)),
            "label": labels,
            "site": sites if sites is not None else np.full(len(labels), ""),
        }
    )
    if partition != "natural":
        # Partitioners hand out rows of a class in table order; shuffling first keeps a
        # partition from being, e.g., all of a source's official train rows and none of its test rows.
        table = table.shuffle(seed=seed).flatten_indices()
    try:
        if partition == "qbli":
            rows = _qbli_rows(table, task_groups(source.class_names, qbli[1], qbli[2]), qbli[0], num_partitions, seed)
        elif partition == "dirichlet":
            partitioner = _dirichlet(table, num_partitions, alpha, seed)
        else:
            partitioner = _partitioner(partition, num_partitions, k, seed)
            partitioner.dataset = table
        if partition != "qbli":
            rows = tuple(_rows_of(partitioner, p) for p in range(num_partitions // parts_per_site))
    except ValueError as exc:
        raise DataError(
            f"{source.name}: cannot make a {partition!r} partitioning into {num_partitions} partitions: {exc}"
        ) from exc
    if partition == "natural":
        site_names = tuple(partitioner.partition_id_to_natural_id[p] for p in range(len(rows)))
        if parts_per_site > 1:  # cut per site before groups expand to rows: a group stays in one part
            rows, site_names = _split_sites(rows, site_names, parts_per_site, seed)
    elif source.styled_by_partition:  # each partition renders in its own site style
        site_names = tuple(source.site_name(p, num_partitions) for p in range(num_partitions))
    else:
        site_names = (None,) * num_partitions
    if grouping is not None:
        rows = tuple(grouping.rows_of(chosen) for chosen in rows)
    return Partitioning(rows=rows, sites=site_names)


def _partitioner(partition: str, num_partitions: int, k: int, seed: int) -> Partitioner:
    from flwr_datasets.partitioner import IidPartitioner, NaturalIdPartitioner, PathologicalPartitioner

    if partition == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if partition == "pathological":
        # first-deterministic: partition p surely holds class p % num_classes, so no class
        # goes unused when there are at least as many partitions as classes
        return PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=k,
            seed=seed,
            class_assignment_mode="first-deterministic",
        )
    return NaturalIdPartitioner(partition_by="site")


def task_groups(class_names: list[str], task_classes: str, classes_per_task: int) -> list[list[int]]:
    """Consecutive groups of ``classes_per_task`` classes of the task order; classes outside it form a last group."""
    from .tasks import parse_task_classes

    order = parse_task_classes(task_classes, class_names)
    groups = [order[i : i + classes_per_task] for i in range(0, len(order), classes_per_task)]
    rest = [c for c in range(len(class_names)) if c not in order]
    return groups + ([rest] if rest else [])


def _qbli_rows(
    table: datasets.Dataset, groups: list[list[int]], k: int, num_partitions: int, seed: int
) -> tuple[np.ndarray, ...]:
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
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=min(k, len(group)),
            class_assignment_mode="first-deterministic",
            seed=seed + g,
        )
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


def _sampled_dirichlet(
    table: datasets.Dataset, num_partitions: int, alpha: float, seed: int, min_size: int
) -> Partitioner:
    from flwr_datasets.partitioner import DirichletPartitioner

    partitioner = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=alpha,
        seed=seed,
        min_partition_size=min_size,
        self_balancing=False,
    )
    partitioner.dataset = table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per failed resampling attempt
        partitioner.load_partition(0)  # samples the whole assignment
    return partitioner


def _rows_of(partitioner: Partitioner, partition_id: int) -> np.ndarray:
    rows = np.sort(np.asarray(partitioner.load_partition(partition_id)["index"], dtype=np.int64))
    rows.setflags(write=False)
    return rows


def _split_sites(
    rows: tuple[np.ndarray, ...], names: tuple[str, ...], parts: int, seed: int
) -> tuple[tuple[np.ndarray, ...], tuple[str, ...]]:
    """Each natural site's rows (or groups) cut at random into ``parts`` near-equal partitions named
    ``<site>-1`` .. ``<site>-<parts>``, in site order: alike sites made from one source."""
    out_rows, out_names = [], []
    for site, (site_rows, name) in enumerate(zip(rows, names)):
        shuffled = np.random.default_rng([seed, site]).permutation(site_rows)
        for j, part in enumerate(np.array_split(shuffled, parts)):
            part = np.sort(part)
            part.setflags(write=False)
            out_rows.append(part)
            out_names.append(f"{name}-{j + 1}")
    return tuple(out_rows), tuple(out_names)


def _check_natural_sites(source: Source, sites: np.ndarray | None, num_partitions: int) -> int:
    """Partitions per natural site: num_partitions must be the number of sites or a multiple of it."""
    if sites is None:
        raise DataError(
            f"{source.name}: partition 'natural' needs a site per row (a csv manifest "
            f"with a site column, a segfolder, or a synthetic source); this source has none"
        )
    blank = np.flatnonzero(sites == "")
    if blank.size:
        raise DataError(
            f"{source.name}: partition 'natural' needs a site in every row; "
            f"{blank.size} row(s) have none: " + list_rows([source.row_name(r) for r in blank])
        )
    found = sorted(set(sites.tolist()))
    if num_partitions % len(found):
        raise DataError(
            f"{source.name}: partition 'natural' needs num_partitions equal to the number "
            f"of sites or a multiple of it (each site cut into equal parts), but "
            f"num_partitions={num_partitions} and {len(found)} site(s) were found: {list_rows(found)}"
        )
    return num_partitions // len(found)


def split_client_rows(
    labels: np.ndarray,
    source_splits: np.ndarray | None,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    groups: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Positions (into ``labels``) of train/val/test; rows with a source split keep it.

    Rows without one are split seeded and stratified by label where sklearn can
    (unstratified when a class is too small). With ``groups`` (one name per row) whole groups are held out
    instead (``_hold_out_groups``), so no group spans two splits; a group's rows without a source split follow
    the split its other rows carry, and a group whose rows carry two source splits is a DataError.
    """
    if groups is not None:
        return _split_groups(labels, source_splits, val_fraction, test_fraction, seed, groups)
    positions = np.arange(len(labels))
    if source_splits is None:
        source_splits = np.full(len(labels), "")
    free = positions[source_splits == ""]
    rest, test = _hold_out(free, labels, test_fraction, seed)
    train, val = _hold_out(rest, labels, val_fraction / (1 - test_fraction), seed)
    drawn = {"train": train, "val": val, "test": test}
    return {split: np.sort(np.concatenate([positions[source_splits == split], drawn[split]])) for split in SPLITS}


def _hold_out(positions: np.ndarray, labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) with ceil(fraction * n) held out, leaving at least one row kept."""
    num_held = min(math.ceil(fraction * len(positions)), len(positions) - 1)
    if num_held <= 0:
        return positions, positions[:0]
    return _draw(positions, labels, num_held, seed)


def _draw(positions: np.ndarray, labels: np.ndarray, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the rest, ``count`` drawn): seeded, stratified by ``labels`` where sklearn can, else unstratified."""
    try:
        return tuple(train_test_split(positions, test_size=count, random_state=seed, stratify=labels[positions]))
    except ValueError:  # a class with fewer than 2 rows, or fewer drawn rows than classes
        return tuple(train_test_split(positions, test_size=count, random_state=seed))


def limit_split(positions: np.ndarray, labels: np.ndarray, limit: int, seed: int) -> np.ndarray:
    """At most ``limit`` of ``positions`` (one split of one site), a seeded, stratified subset in their order: it
    never mixes splits, so the groups of ``split_client_rows`` stay apart."""
    if len(positions) <= limit:
        return positions
    return np.sort(_draw(positions, labels, limit, seed)[1])


# ----------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class Grouping:
    """The groups of some rows: sorted group names, the group (index into ``names``) of each row, and the first
    row of each group."""

    names: np.ndarray
    of_row: np.ndarray
    first_rows: np.ndarray

    @classmethod
    def of(cls, groups: np.ndarray) -> Grouping:
        names, first_rows, of_row = np.unique(np.asarray(groups, dtype=str), return_index=True, return_inverse=True)
        return cls(names, of_row.reshape(-1).astype(np.int64), first_rows.astype(np.int64))

    @property
    def sizes(self) -> np.ndarray:
        """Rows per group."""
        return np.bincount(self.of_row, minlength=len(self.names))

    def labels(self, labels: np.ndarray) -> np.ndarray:
        """The majority label of each group's rows (the smallest label on a tie)."""
        pairs, counts = np.unique(
            np.stack([self.of_row, np.asarray(labels, dtype=np.int64)]), axis=1, return_counts=True
        )
        order = np.lexsort((pairs[1], -counts, pairs[0]))  # by group, then most rows, then smallest label
        group = pairs[0][order]
        first = np.r_[True, group[1:] != group[:-1]]
        return pairs[1][order][first]

    def rows_of(self, chosen: np.ndarray) -> np.ndarray:
        """Sorted rows of the groups ``chosen`` (indices into ``names``), read-only."""
        rows = np.flatnonzero(np.isin(self.of_row, chosen)).astype(np.int64)
        rows.setflags(write=False)
        return rows


def source_grouping(source: Source, rows: np.ndarray | None = None) -> Grouping | None:
    """The groups of ``source``'s ``rows`` (all rows by default), or None when it has none; a row without a
    group (empty name) is a DataError naming the rows."""
    if source.groups is None:
        return None
    rows = np.arange(len(source)) if rows is None else np.asarray(rows)
    groups = np.asarray(source.groups, dtype=str)[rows]
    blank = np.flatnonzero(groups == "")
    if blank.size:
        raise DataError(
            f"{source.name}: group column missing for some rows: the source names the patient, case "
            f"or video of its rows, but {blank.size} row(s) have none: "
            + list_rows([source.row_name(r) for r in rows[blank]])
            + "; give every row its group"
        )
    return Grouping.of(groups)


def _check_group_sites(source: Source, grouping: Grouping, sites: np.ndarray) -> None:
    """Refuse a natural partitioning where a group's rows lie in two sites (its rows would sit in two partitions)."""
    pairs = np.unique(np.stack([grouping.of_row, np.unique(sites, return_inverse=True)[1].reshape(-1)]), axis=1)
    spanning = np.unique(pairs[0][np.r_[pairs[0][1:] == pairs[0][:-1], False]])
    if spanning.size:
        described = [
            f"{str(grouping.names[g])!r} in sites " + ", ".join(sorted(set(sites[grouping.of_row == g].tolist())))
            for g in spanning
        ]
        raise DataError(
            f"{source.name}: partition 'natural': {spanning.size} group(s) have rows in two or more "
            f"sites, so the group would span partitions: "
            + list_rows(described, 5)
            + "; a patient, case or video belongs to one site (fix the site or group column)"
        )


def _split_groups(
    labels: np.ndarray,
    source_splits: np.ndarray | None,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    groups: np.ndarray,
) -> dict[str, np.ndarray]:
    """``split_client_rows`` by group: source splits per group, then held-out groups for test and val."""
    groups = np.asarray(groups, dtype=str)
    if (groups == "").any():
        raise DataError(
            f"group column missing for some rows: {(groups == '').sum()} of {len(groups)} row(s) have no group"
        )
    grouping = Grouping.of(groups)
    group_splits = np.full(len(grouping.names), "", dtype=object)
    if source_splits is not None:
        for g, split in sorted(set(zip(grouping.of_row.tolist(), np.asarray(source_splits, dtype=str).tolist()))):
            if not split:
                continue
            if group_splits[g] and group_splits[g] != split:
                found = sorted(set(np.asarray(source_splits, dtype=str)[grouping.of_row == g].tolist()) - {""})
                raise DataError(
                    f"group {str(grouping.names[g])!r} has rows in source splits {', '.join(found)}; a "
                    f"patient, case or video must lie in one split (fix the split column, or use "
                    f"use_source_splits=False to split by group)"
                )
            group_splits[g] = split
    if len(grouping.names) == 1:
        raise DataError(
            f"all {len(groups)} row(s) belong to one group ({str(grouping.names[0])!r}: one patient, "
            f"case or video), which cannot be split into train and test without leakage; a site needs "
            f"rows of at least 2 groups (3 for a val split): use fewer partitions or finer groups"
        )
    group_labels, sizes = grouping.labels(labels), grouping.sizes
    free = np.flatnonzero(group_splits == "")
    seed &= 2**64 - 1  # numpy seeds are non-negative
    rest, test = _hold_out_groups(free, group_labels, sizes, test_fraction, [seed, 0])
    train, val = _hold_out_groups(rest, group_labels, sizes, val_fraction / (1 - test_fraction), [seed, 1])
    for split, drawn in (("train", train), ("val", val), ("test", test)):
        group_splits[drawn] = split
    row_splits = group_splits[grouping.of_row]
    return {split: np.flatnonzero(row_splits == split).astype(np.int64) for split in SPLITS}


def _hold_out_groups(
    chosen: np.ndarray, labels: np.ndarray, sizes: np.ndarray, fraction: float, seed: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) groups of ``chosen``, holding out about ``fraction`` of their rows, stratified by the
    groups' labels, leaving at least one group kept.

    A seeded greedy pass in the spirit of sklearn's StratifiedGroupKFold: in random order, a group is held out
    when that brings its label's held-out rows closer to ``fraction`` of that label's rows. If no group was
    taken although ceil(fraction * rows) >= 1 (every group too large), the one closest to that many rows is.
    """
    if fraction <= 0 or chosen.size < 2:
        return chosen, chosen[:0]
    order = chosen[np.random.default_rng(seed).permutation(chosen.size)]
    target = {c: fraction * sizes[chosen[labels[chosen] == c]].sum() for c in np.unique(labels[chosen])}
    held_rows = dict.fromkeys(target, 0)
    held = []
    for g in order:
        c = labels[g]
        if abs(held_rows[c] + sizes[g] - target[c]) < abs(held_rows[c] - target[c]):
            held.append(g)
            held_rows[c] += sizes[g]
    if not held:
        wanted = math.ceil(fraction * sizes[chosen].sum())
        held = [order[np.argmin(np.abs(sizes[order] - wanted))]]
    if len(held) == chosen.size:  # keep one group
        held = held[:-1]
    held = np.sort(np.asarray(held, dtype=np.int64))
    return np.setdiff1d(chosen, held), held
