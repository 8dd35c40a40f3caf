"""The continual protocol's knowledge pool (docs/methods/fedkei.md, "Spec as implemented"): every site's module θ_i^t
after every task, one safetensors file each under the run's ``checkpoint/pool/``, indexed in the strategy's checkpoint.

The pooled modules, as rows of Θ in (task, client) order, are what the server clusters (Eq. 3) and weights
(Eq. 4); ``fedavg-init`` and the pool-mean baselines start a task from their n_i-weighted mean.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from ...records import ArraySpec, stack_flat, validate_arrays
from ...results import safe_name


@dataclass
class PoolEntry:
    task: int
    client: str
    num_examples: float
    file: str  # relative to the pool folder


class KnowledgePool:
    """Every client's module after every task, one safetensors file each (written atomically on arrival)."""

    def __init__(self, directory: Path, spec: ArraySpec):
        self.dir = Path(directory)
        self.spec = spec
        self._items: dict[tuple[int, str], tuple[PoolEntry, OrderedDict[str, np.ndarray]]] = {}

    def __len__(self) -> int:
        return len(self._items)

    @property
    def entries(self) -> list[PoolEntry]:
        """In (task, client) order, whatever order the replies arrived in (k-means++ depends on it)."""
        return [entry for _, (entry, _) in sorted(self._items.items())]

    @property
    def modules(self) -> list[OrderedDict[str, np.ndarray]]:
        return [module for _, (_, module) in sorted(self._items.items())]

    def add(self, task: int, client: str, arrays: Mapping[str, np.ndarray], num_examples: float) -> None:
        file = f"task-{task:03d}/{safe_name(client) or 'client'}.safetensors"
        path = self.dir / file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(
            {k: np.ascontiguousarray(arrays[k]) for k in self.spec},
            str(tmp),
            metadata={"task": str(task), "client": client, "num_examples": str(num_examples)},
        )
        os.replace(tmp, path)
        self._items[(task, client)] = (
            PoolEntry(task, client, float(num_examples), file),
            OrderedDict((k, np.array(arrays[k])) for k in self.spec),
        )

    def index(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.entries]

    def restore(self, index: list[dict[str, Any]]) -> None:
        """Reload the entries of a checkpoint's index; a missing or mismatched file is an error naming it."""
        self._items = {}
        for item in index:
            entry = PoolEntry(**item)
            path = self.dir / entry.file
            if not path.is_file():
                raise FileNotFoundError(f"knowledge pool file {path} listed in the checkpoint is missing")
            arrays = load_file(str(path))
            if problem := validate_arrays(arrays, self.spec):
                raise ValueError(f"knowledge pool file {path} does not fit this model: {problem}")
            self._items[(entry.task, entry.client)] = (entry, OrderedDict((k, arrays[k]) for k in self.spec))

    def matrix(self, spec: ArraySpec) -> np.ndarray:
        """[M, P] float32: the pooled modules' ``spec`` arrays flattened, one row per entry."""
        return stack_flat(self.modules, spec)
