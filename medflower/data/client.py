"""One client's data: its partition of the pool, split into train/val/test."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset

from .cache import cache_key, decoded
from .partition import limit_split, partition_rows, source_grouping, split_client_rows
from .sources import Source, open_source
from .spec import DataError, DataSpec, parse_split_limit


@dataclass
class ClientData:
    """Datasets of one partition.

    Items are (uint8 HxWx3 / HxW numpy image, int label) for classification and (image, uint8
    HxW mask of class indices 0..num_classes, 0 = background) for segmentation, where
    ``num_classes`` / ``class_names`` count the foreground classes only. ``train`` carries the
    run's ``augment`` setting as an attribute, which shuffled (training) loaders apply.
    """

    train: Dataset
    val: Dataset
    test: Dataset
    num_classes: int
    class_names: list[str]
    partition_id: int
    site: str | None  # natural site name when known
    task: str = "classification"  # or "segmentation"


def load_client_data(spec: DataSpec, partition_id: int, num_partitions: int) -> ClientData:
    """Data of partition ``partition_id`` out of ``num_partitions`` (deterministic from ``spec``)."""
    if not 0 <= partition_id < num_partitions:
        raise DataError(f"partition_id {partition_id} is out of range for {num_partitions} partitions")
    source = open_source(spec)
    partitioning = partition_rows(spec, num_partitions)
    return split_rows(
        source, spec, partitioning.rows[partition_id], partition_id, num_partitions, partitioning.sites[partition_id]
    )


def split_rows(
    source: Source, spec: DataSpec, rows: np.ndarray, partition_id: int, num_partitions: int, site: str | None
) -> ClientData:
    """``source``'s ``rows`` (one partition) split into train/val/test, seeded per partition.

    A source with groups is split by group, so no patient, case or video spans two splits
    (docs/data.md#splits-without-leakage); ``split-limit`` then keeps a seeded, stratified subset of a split. Only
    the train split carries ``spec.augment`` (as ``augment``), which a shuffled loader applies
    (docs/data.md#augmentation).
    """
    source_splits = source.splits[rows] if spec.use_source_splits and source.splits is not None else None
    grouping = source_grouping(source, rows)  # refuses rows without a group, naming them
    groups = None if grouping is None else np.asarray(source.groups)[rows]
    try:
        positions = split_client_rows(
            source.labels[rows],
            source_splits,
            spec.val_fraction,
            spec.test_fraction,
            seed=spec.seed + partition_id,
            groups=groups,
        )
    except DataError as exc:
        raise DataError(f"{source.name}: partition {partition_id} of {num_partitions}: {exc}") from exc
    for split, limit in parse_split_limit(spec.split_limit).items():  # a budget: docs/data.md#a-budget-of-rows
        positions[split] = limit_split(positions[split], source.labels[rows], limit, seed=spec.seed + partition_id)
    sizes = ", ".join(f"{split} {len(p)}" for split, p in positions.items())
    for split, remedy in (("test", "a larger test_fraction"), ("train", "a less skewed partitioning")):
        if len(positions[split]) == 0:
            remedies = ["fewer partitions", remedy]
            if source_splits is not None:
                remedies.append("use_source_splits=False")
            raise DataError(
                f"{source.name}: partition {partition_id} of {num_partitions} has an empty {split} split "
                f"({len(rows)} rows: {sizes}); try {', '.join(remedies[:-1])} or {remedies[-1]}"
            )
    client_rows = source.dataset(rows, partition_id, spec)
    key = cache_key(client_rows, spec)
    if key is not None:  # files read lazily: decode them once, keep them on the site's disk (cache_dir)
        client_rows = decoded(client_rows, spec.cache_dir, key)
    train = client_rows.take(positions["train"])
    train.augment = spec.augment
    return ClientData(
        train=train,
        val=client_rows.take(positions["val"]),
        test=client_rows.take(positions["test"]),
        num_classes=source.num_classes,
        class_names=list(source.class_names),
        partition_id=partition_id,
        site=site,
        task=source.task,
    )
