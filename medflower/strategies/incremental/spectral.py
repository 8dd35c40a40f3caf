"""pFedMxF's spectral maths (docs/methods/pfedmxf.md, "Spec as implemented"): frequency allocation and the merge.

Allocation: a seeded permutation of the coordinates of every adapted q/k shape, with one representative per
conjugate class {(u,v), (−u,−v)} by default, so blocks of distinct classes give exactly orthogonal updates
(Eqs. 10-11; "Deviations from the paper"). Every (task, site) gets a block of it (``FrequencyAllocator``), and
``plan_capacity`` checks a whole run's blocks against the smallest shape before round 1 ("Capacity is checked
before round 1").

Merge: the server scatters every site's coefficients into one union spectrum (Eq. 13, ``union_spectrum``: a
coordinate held by one site keeps its value, a shared one gets the n_k-weighted mean);
``frequency-sharing='shared'`` averages one block per task over a round's replies (``shared_block_mean``, "The
shared-frequency ablation"); a site turns received coefficients into a dense spectrum (``dense_spectrum``) for
``models/qk_delta.py``'s Re(IDFT2).

Which arrays travel, and pFedMxF's server and client halves, are in ``pfedmxf.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


# ----------------------------------------------------------------------------- frequency allocation
def conjugate(flat: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Flat index of (−u mod M, −v mod N) for flat indices of (u, v) in an M x N spectrum."""
    rows, cols = shape
    u, v = np.divmod(np.asarray(flat, dtype=np.int64), cols)
    return ((-u) % rows) * cols + (-v) % cols


def coordinate_order(shape: tuple[int, int], seed: int, conjugate_aware: bool) -> np.ndarray:
    """The seeded permutation that blocks are cut from.

    ``conjugate_aware``: one representative (the smaller flat index) per class {(u,v), (−u,−v)}. With the
    real part kept, Re(IDFT2) of a coefficient at (u,v) and at its conjugate is the same cosine, so blocks
    of distinct classes give exactly orthogonal ΔW; without it (the paper) two sites can share a basis.
    """
    flat = np.arange(shape[0] * shape[1], dtype=np.int64)
    if conjugate_aware:
        flat = flat[flat <= conjugate(flat, shape)]
    rng = np.random.default_rng([seed, shape[0], shape[1], 4004])
    return rng.permutation(flat)


def usable_coordinates(shape: tuple[int, int], conjugate_aware: bool) -> int:
    """How many coordinates of an M x N spectrum the allocator can hand out (``len(coordinate_order(...))``).

    ``conjugate_aware``: one per class {(u,v), (−u,−v)}, i.e. (M·N + s) / 2 with s the self-conjugate
    coordinates (u in {0, M/2} and v in {0, N/2}: 4 when M and N are even); else all M·N.
    """
    rows, cols = shape
    if not conjugate_aware:
        return rows * cols
    self_conjugate = (2 - rows % 2) * (2 - cols % 2)
    return (rows * cols + self_conjugate) // 2


def largest_n_frequency(capacity: int, sites: int, tasks: int, shared: bool) -> int:
    """The largest n-frequency, the same for every site, whose plan fits in ``capacity`` positions."""
    return capacity // (tasks * (1 if shared else max(sites, 1)))


@dataclass
class CapacityPlan:
    """A run's use of the allocator's positions against the tightest adapted shape's usable coordinates."""

    shape: tuple[int, int]
    capacity: int
    need: int
    per_task: int
    tasks: int
    budgets: list[int]
    shared: bool
    largest: int

    @property
    def fits(self) -> bool:
        return self.need <= self.capacity


def plan_capacity(
    shapes: Sequence[tuple[int, int]], budgets: Sequence[int], tasks: int, conjugate_aware: bool, shared: bool
) -> CapacityPlan:
    """The positions a whole run takes from every shape's permutation, as ``FrequencyAllocator`` hands them out.

    A block is the same positions of every shape's permutation, so the smallest shape bounds the run. Per task,
    disjoint blocks take Σ_k n_k positions and ``shared`` blocks (one per task, every site from its start)
    max_k n_k; every listed site is counted in every task (the worst case when ``fraction-train`` < 1).
    """
    shape = min(set(shapes), key=lambda s: (usable_coordinates(s, conjugate_aware), s))
    capacity = usable_coordinates(shape, conjugate_aware)
    per_task = max(budgets, default=0) if shared else sum(budgets)
    return CapacityPlan(
        shape,
        capacity,
        tasks * per_task,
        per_task,
        tasks,
        [int(b) for b in budgets],
        shared,
        largest_n_frequency(capacity, len(budgets), tasks, shared),
    )


@dataclass
class SiteBlock:
    """A site's coefficients in one task (module name -> [2, n]) and the weight n_k of its last reply
    (0 until it reports)."""

    coefficients: OrderedDict[str, np.ndarray]
    weight: float = 0.0


@dataclass
class Allocation:
    """Coordinates ``order[start : start + n]`` of every adapted shape, for one site in one task."""

    task: int
    client: str
    partition_id: int
    start: int
    n: int


class FrequencyAllocator:
    """Disjoint blocks of coordinates per (task, site) in lexicographic order (``shared``: one per task).

    One permutation per adapted matrix shape; a block is the same positions of every shape's permutation.
    The allocation table is the strategy's checkpoint (``table()`` / ``restore()``).
    """

    def __init__(self, shapes: Sequence[tuple[int, int]], seed: int, conjugate_aware: bool, shared: bool = False):
        self.orders = {shape: coordinate_order(shape, seed, conjugate_aware) for shape in sorted(set(shapes))}
        self.capacity = min(len(order) for order in self.orders.values())
        self.shared = shared
        self.allocations: list[Allocation] = []

    def get(self, task: int, client: str) -> Allocation | None:
        return next((a for a in self.allocations if a.task == task and a.client == client), None)

    def allocate(self, task: int, client: str, partition_id: int, n: int) -> Allocation:
        """The site's block for the task (made on first request; ValueError when the coordinates run out)."""
        if (found := self.get(task, client)) is not None:
            return found
        if self.shared:  # every site of a task starts at the task's block; they overlap on min(n) coordinates
            same_task = [a for a in self.allocations if a.task == task]
            start = same_task[0].start if same_task else self._end()
        else:
            start = self._end()
        if start + n > self.capacity:
            raise ValueError(
                f"frequency allocator: {client} in task {task} needs {n} coordinates from position "
                f"{start}, but a {min(self.orders)} matrix has {self.capacity} "
                f"{'conjugate classes' if self._halved else 'coordinates'}; lower n-frequency"
            )
        allocation = Allocation(task, client, partition_id, start, n)
        self.allocations.append(allocation)
        return allocation

    @property
    def _halved(self) -> bool:
        shape = min(self.orders)
        return self.capacity < shape[0] * shape[1]

    def _end(self) -> int:
        return max((a.start + a.n for a in self.allocations), default=0)

    def coords(self, allocation: Allocation, shape: tuple[int, int]) -> np.ndarray:
        return self.orders[shape][allocation.start : allocation.start + allocation.n]

    def table(self) -> list[dict[str, Any]]:
        return [asdict(a) for a in self.allocations]

    def restore(self, table: list[dict[str, Any]]) -> None:
        self.allocations = [Allocation(**row) for row in table]


# ----------------------------------------------------------------------------- merge
def union_spectrum(
    coords: Sequence[np.ndarray], values: Sequence[np.ndarray], weights: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """Scatter every site's coefficients into one sparse spectrum (Eq. 13): sorted coordinates [U] and values
    [R, U] (R rows per site: q and k, of one or many matrices). A coordinate held by one site keeps its
    value; one held by several gets their weighted mean."""
    flat = np.concatenate(coords)
    unique, inverse = np.unique(flat, return_inverse=True)
    w = np.concatenate([np.full(len(c), float(wk)) for c, wk in zip(coords, weights)])
    total = np.zeros((values[0].shape[0], len(unique)))
    np.add.at(total.T, inverse, (np.concatenate(values, axis=1) * w).T)
    mass = np.zeros(len(unique))
    np.add.at(mass, inverse, w)
    return unique, (total / np.where(mass > 0, mass, 1.0)).astype(np.float32)


def shared_block_mean(previous: np.ndarray, values: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``frequency-sharing='shared'``: Eq. 13 over this round's replies only. Position j of a task's block
    ([2, L], every site's block starts at position 0 of it) gets the weighted mean of the replies that hold it
    (``values[k]`` [2, n_k], n_k <= L); a position no reply holds keeps ``previous``. A site that was not
    sampled or did not answer adds no stale coefficients."""
    total = np.zeros(previous.shape, np.float64)
    mass = np.zeros(previous.shape[1], np.float64)
    for value, weight in zip(values, weights):
        total[:, : value.shape[1]] += float(weight) * value.astype(np.float64)
        mass[: value.shape[1]] += float(weight)
    return np.where(mass > 0, total / np.where(mass > 0, mass, 1.0), previous).astype(np.float32)


def dense_spectrum(coords: np.ndarray, values: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """[2, M, N] float32 with ``values`` at flat ``coords`` and zero elsewhere."""
    dense = np.zeros((2, shape[0] * shape[1]), dtype=np.float32)
    dense[:, coords] = values
    return dense.reshape(2, *shape)
