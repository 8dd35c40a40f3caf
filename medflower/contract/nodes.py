"""Nodes: who is in the federation, in which order, and which of them a round asks to train.

``NodesMixin`` is the part of ``FederatedStrategy`` (server.py) that keeps ``nodes`` (node id -> ``NodeInfo``): it
waits for run-config min-nodes, asks each new node who it is (refusing one that claims another node's site or
partition), orders them by partition and draws each round's seeded sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
from flwr.app import RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..records import derive_seed


@dataclass
class NodeInfo:
    node_id: int
    partition_id: int
    client: str
    num_train: int
    extra: dict[str, float] = field(default_factory=dict)  # the rest of its query reply (e.g. pfedmxf's n-frequency)


class NodesMixin:
    """The federation's members: ``wait_for_nodes``, ``refresh_nodes`` (query the nodes not seen before),
    ``client_name``, ``ordered_nodes`` and ``sample_nodes`` (a method may draw its own sample).

    Reads from the rest of ``FederatedStrategy``: ``cfg`` and ``nodes`` (server.py's ``__init__``), ``exchange``,
    ``base_config`` and ``reject`` (messaging.py).
    """

    def client_name(self, node_id: int) -> str:
        info = self.nodes.get(node_id)
        return info.client if info else f"node-{node_id}"

    def refresh_nodes(self, grid: Grid, rnd: int) -> None:
        """Ask nodes not seen before who they are (partition id, site name, training size); refuse a node that
        claims the site name or partition id of another node. A node's first answer includes starting its site
        worker (imports) and reading its data, so the wait is node-wait-timeout when that is longer than
        round-timeout."""
        current = set(grid.get_node_ids())
        for gone in set(self.nodes) - current:
            log(WARNING, "[medflower] %s left the federation", self.nodes.pop(gone).client)
        unknown = sorted(current - set(self.nodes))
        if not unknown:
            return
        contents = {n: RecordDict({"config": self.base_config(rnd)}) for n in unknown}
        wait = max(self.cfg.round_timeout, self.cfg.node_wait_timeout)
        for reply in self.exchange(grid, "query", contents, rnd, timeout=wait):
            info = NodeInfo(
                reply.node_id, reply.partition_id, reply.client_claim, int(reply.metrics["num-train"]), reply.metrics
            )
            holder = next(
                (n for n in self.nodes.values() if n.client == info.client or n.partition_id == info.partition_id),
                None,
            )
            if holder is not None:
                self.reject(
                    rnd,
                    "query",
                    f"node-{reply.node_id}",
                    f"claims site {info.client!r}, partition {info.partition_id}, already held by node "
                    f"{holder.node_id} ({holder.client!r}, partition {holder.partition_id}); refused",
                )
                continue
            self.nodes[reply.node_id] = info
            log(
                INFO,
                "[medflower] %s joined (partition %d, %d training samples)",
                info.client,
                info.partition_id,
                info.num_train,
            )

    def ordered_nodes(self) -> list[int]:
        """Known nodes sorted by partition id (stable across runs, unlike node ids)."""
        return [n.node_id for n in sorted(self.nodes.values(), key=lambda n: (n.partition_id, n.client))]

    def sample_nodes(self, rnd: int) -> list[int]:
        """Seeded sample of ``fraction-train`` of the known nodes (by partition order)."""
        ordered = self.ordered_nodes()
        k = max(1, int(round(self.cfg.fraction_train * len(ordered))))
        if k >= len(ordered):
            return ordered
        rng = np.random.default_rng(derive_seed(self.cfg.seed, rnd, 17))
        return [ordered[i] for i in sorted(rng.choice(len(ordered), size=k, replace=False))]

    def wait_for_nodes(self, grid: Grid) -> None:
        deadline = time.monotonic() + self.cfg.node_wait_timeout
        while len(list(grid.get_node_ids())) < self.cfg.min_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(list(grid.get_node_ids()))} nodes connected after "
                    f"{self.cfg.node_wait_timeout:.0f}s; run-config 'min-nodes' = {self.cfg.min_nodes}"
                )
            time.sleep(1.0)
