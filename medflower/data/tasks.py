"""Continual task streams from any classification source: FedKEI's binary tasks (docs/methods/fedkei.md) and
pFedMxF's class-incremental tasks (docs/methods/pfedmxf.md, at the end of this module).

A class order ``c_0, c_1, ..., c_T`` defines T tasks: task t (1-based) is binary, positive =
the new class ``c_t``, negative = the classes seen before, ``{c_0, ..., c_{t-1}}`` (task 1 is
``c_1`` vs ``c_0``). Every task has a two-output head, so heads of different tasks can be pooled.
``task-order`` gives each client its order: ``sync`` (the given order), ``reversed``, or
``shuffled`` (a seeded, different permutation per client).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch.utils.data import Dataset

from .spec import DataError

TASK_ORDERS = ("sync", "reversed", "shuffled")
_SHUFFLE_TAG = 4242  # keeps the order's random stream apart from the others


def parse_task_classes(text: str, class_names: Sequence[str]) -> list[int]:
    """Class indices of a comma-separated list of class names or indices; '' = the dataset's order.

    Raises DataError naming the unknown entry and the valid names, or a repeated class.
    """
    names = list(class_names)
    if not text.strip():
        return list(range(len(names)))
    order: list[int] = []
    for raw in (part.strip() for part in text.split(",")):
        if raw in names:
            index = names.index(raw)
        elif raw.isdigit() and int(raw) < len(names):
            index = int(raw)
        else:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise DataError(
                f"task-classes: {raw!r} is neither a class name nor an index < {len(names)} (classes: {shown})"
            )
        if index in order:
            raise DataError(f"task-classes: class {names[index]!r} appears twice")
        order.append(index)
    if len(order) < 2:
        raise DataError(f"task-classes needs at least two classes (one task), got {text!r}")
    return order


def count_tasks(order: Sequence[int], requested: int) -> int:
    """Tasks in a run: ``requested``, or every class after the first when 0; DataError if too many."""
    available = len(order) - 1
    if requested == 0:
        return available
    if requested > available:
        raise DataError(
            f"num-tasks = {requested} needs {requested + 1} classes in the task order, but it has {len(order)}"
        )
    return requested


def client_class_order(order: Sequence[int], task_order: str, seed: int, partition_id: int) -> list[int]:
    """This client's class order: the given one, reversed, or a seeded per-client permutation."""
    if task_order == "sync":
        return list(order)
    if task_order == "reversed":
        return list(order)[::-1]
    if task_order == "shuffled":
        rng = np.random.default_rng([_SHUFFLE_TAG, seed, partition_id])
        return [int(c) for c in rng.permutation(list(order))]
    raise DataError(f"task-order {task_order!r}: valid choices are {', '.join(TASK_ORDERS)}")


def parse_site_task_classes(text: str) -> dict[str, str]:
    """Per-site class orders, ``<site>=<c_0>,<c_1>,...;<site>=...`` (a site = its partition id or its name) ->
    {site: order text}. ValueError names a malformed or repeated entry."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        site, eq, order = (part.strip() for part in entry.partition("="))
        if not eq or not site or not order:
            raise ValueError(f"{entry!r} is not <site>=<class>,<class>,... (site = partition id or site name)")
        if site in out:
            raise ValueError(f"site {site!r} is listed twice")
        out[site] = order
    return out


def site_class_order(run_order: Sequence[int], own: str, class_names: Sequence[str], where: str) -> list[int]:
    """A site's own class order ``own`` (a node-config ``task-classes`` or its ``fedkei-site-classes`` entry):
    the same number of classes as the run's order, so that task t exists on every site. A site that lacks a
    class of the run's order names another in its place (FedKEI's Derm7pt takes VASC for AK)."""
    try:
        order = parse_task_classes(own, class_names)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from exc
    if len(order) != len(run_order):
        names = list(class_names)
        raise DataError(
            f"{where} lists {len(order)} classes but the run's task order has {len(run_order)} "
            f"({', '.join(names[c] for c in run_order)}); a site replaces a class it lacks by another, "
            "it does not drop it"
        )
    return order


def task_classes(order: Sequence[int], task: int) -> tuple[int, list[int]]:
    """(new class c_t, previously seen classes) of 1-based task ``task``."""
    if not 1 <= task < len(order):
        raise DataError(f"task {task} is outside 1..{len(order) - 1} for a class order of {len(order)}")
    return int(order[task]), [int(c) for c in order[:task]]


class TaskDataset(Dataset):
    """The rows of ``dataset`` that belong to a binary task, labelled 1 (new class) or 0 (seen classes)."""

    task = "classification"

    def __init__(self, dataset: Dataset, positions: np.ndarray, labels: np.ndarray) -> None:
        self.dataset = dataset
        self.positions = np.asarray(positions, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.img_size = getattr(dataset, "img_size", None)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image, _ = self.dataset[int(self.positions[i])]
        return image, int(self.labels[i])

    def take(self, positions: np.ndarray) -> TaskDataset:
        return TaskDataset(self.dataset, self.positions[positions], self.labels[positions])


def binary_task(dataset: Dataset, order: Sequence[int], task: int) -> TaskDataset:
    """Task ``task`` of a client's split: rows of c_0..c_t, label 1 for c_t and 0 for the rest."""
    new, seen = task_classes(order, task)
    labels = np.asarray(dataset.labels)
    positions = np.flatnonzero(np.isin(labels, [*seen, new]))
    return TaskDataset(dataset, positions, (labels[positions] == new).astype(np.int64))


# ----------------------------------------------------------------------------- class-incremental (pFedMxF)
def count_incremental_tasks(order: Sequence[int], classes_per_task: int, requested: int) -> int:
    """Tasks of ``classes_per_task`` classes in a run: ``requested``, or every full group when 0."""
    available = len(order) // classes_per_task
    if available == 0:
        raise DataError(
            f"classes-per-task = {classes_per_task} is more than the {len(order)} classes of the task order"
        )
    if requested == 0:
        return available
    if requested > available:
        raise DataError(
            f"num-tasks = {requested} with classes-per-task = {classes_per_task} needs "
            f"{requested * classes_per_task} classes in the task order, but it has {len(order)}"
        )
    return requested


def incremental_task(
    dataset: Dataset, order: Sequence[int], classes_per_task: int, task: int, seen: bool = False
) -> TaskDataset:
    """Rows of task ``task`` (1-based: classes ``order[(t-1)C : tC]``), or with ``seen`` of every task up to it.

    Labels are positions in the class order (0 .. tC-1), so task t's classes are labels [(t-1)C, tC):
    one label space for the unified head and a contiguous block per task for AAC's heads.
    """
    first = 0 if seen else (task - 1) * classes_per_task
    classes = [int(c) for c in order[first : task * classes_per_task]]
    position = {c: first + i for i, c in enumerate(classes)}
    labels = np.asarray(dataset.labels)
    rows = np.flatnonzero(np.isin(labels, classes))
    return TaskDataset(dataset, rows, np.array([position[int(c)] for c in labels[rows]], dtype=np.int64))
