"""FedCurv (Shoham et al., "Overcoming Forgetting in Federated Learning on Non-IID Data", NeurIPS 2019 workshop on FL)
in FedKEI's continual protocol (docs/methods/baselines-continual.md#fedcurv-fedcurv); a baseline of FedKEI's Tables
I-IV.

Task t ≥ 2 starts from the pool's n_i-weighted mean (as ``fedkei-variant='fedavg-init'``) and fine-tunes with
λ Σ_{j≠i} (θ − θ_j)ᵀ diag(F_j) (θ − θ_j) over the other sites' newest modules θ_j and their diagonal Fishers F_j.
The Fisher and the quadratic are ``training/regularisers.py``'s, shared with EWC (``fedcurv-lora``,
``strategies/incremental/fedcurv_lora.py``).

What leaves a site after each task: its module θ_i^t, its Fisher F_i^t and n_i. What comes to a site: the initial
module and either u, v, c over the others (``fedcurv-downlink='sums'``: FedCurv's) or every other site's θ_j and F_j
(``'modules'``: FedKEI's Table IV count, (2N+2)·|θ|; (2N+1)·|θ| here, the start and N − 1 others' pairs down).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict

from ...contract import ArraySpec, Reply, from_record, register_strategy, to_record
from ...data import make_loader
from ...options import Option, one_of
from ...training import ExtraLoss
from ...training.regularisers import (
    FEDCURV_LAMBDA,
    FISHER,
    Quadratic,
    diagonal_fisher,
    fisher_arrays,
    fisher_problem,
    part_mean,
)
from .bilevel import split_parts
from .protocol import CONTINUAL_OPTIONS, ContinualClient, ContinualStrategy

RECORD = "fedcurv"  # the message record that carries the penalty (u/<name>, v/<name>, c; or theta/<j>/, fisher/<j>/)
DOWNLINK = Option(
    "fedcurv-downlink",
    "sums",
    "fedcurv: what a site gets for its penalty: sums = FedCurv's u, v (and c) over the other sites (5|theta| per "
    "site and task with the start and the upload); modules = each other site's module and Fisher ((2N+1)|theta|)",
    one_of("sums", "modules"),
    "fedcurv",
)


class FedCurvClient(ContinualClient):
    """Starts from the sent module (fresh without one), fine-tunes with λ times the received quadratic, uploads the
    module and its Fisher on the task's training split."""

    def finetune_loss(self, message: Message, train) -> ExtraLoss | None:
        self.quadratic = None
        if RECORD not in message.content.array_records:
            return None
        self.quadratic = Quadratic.from_arrays(from_record(message.content[RECORD]))
        return self.quadratic.penalty(self.rt.model.trainable_parameters(), float(self.rt.cfg.fedcurv_lambda))

    def upload(self, message: Message, train) -> OrderedDict[str, np.ndarray]:
        rt = self.rt
        arrays = rt.model.get_trainable()
        loader = make_loader(train, rt.cfg.batch_size, False, 0, **rt.loader_options(False))
        arrays.update(fisher_arrays(diagonal_fisher(rt.model, loader, rt.device)))
        if self.quadratic is not None:
            self.penalty = float(rt.cfg.fedcurv_lambda) * self.quadratic.value(rt.model.get_trainable())
        return arrays

    def train(self, message: Message) -> RecordDict:
        self.penalty = None
        content = super().train(message)
        if self.penalty is not None:
            content["metrics"]["fedcurv_penalty"] = self.penalty  # λ times the quadratic at the fine-tuned module
        return content


@register_strategy
class FedCurv(ContinualStrategy):
    """FedCurv in FedKEI's continual protocol: the n_i-weighted mean of the pool as task t's start, and
    λ Σ_{j≠i} (θ − θ_j)ᵀ diag(F_j) (θ − θ_j) over the other sites' newest modules and Fishers while fine-tuning.

    Leaves a site: its module θ_i^t (adapter + head) and its diagonal Fisher F_i^t after every task, n_i; with each
    task's metrics its test size and positives (n_test, n_test_positive).
    """

    name = "fedcurv"
    client_half = FedCurvClient
    options = (*CONTINUAL_OPTIONS, FEDCURV_LAMBDA, DOWNLINK)

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        self.fishers: dict[str, tuple[int, OrderedDict[str, np.ndarray]]] = {}  # site -> (task, its newest Fisher)

    def anchors(self) -> dict[str, tuple[OrderedDict[str, np.ndarray], OrderedDict[str, np.ndarray]]]:
        """Per site with a Fisher: (θ_j, F_j), its module of the task the Fisher is of (the newest it finished)."""
        modules = {(e.task, e.client): m for e, m in zip(self.pool.entries, self.pool.modules)}
        return {c: (modules[(t, c)], f) for c, (t, f) in sorted(self.fishers.items()) if (t, c) in modules}

    def penalty_record(self, others: list[tuple[Mapping, Mapping]]) -> OrderedDict[str, np.ndarray] | None:
        if not others:
            return None
        if self.cfg.fedcurv_downlink == "sums":
            return Quadratic.of(others).arrays()
        arrays: OrderedDict[str, np.ndarray] = OrderedDict()
        for j, (theta, fisher) in enumerate(others):
            arrays.update((f"theta/{j}/{k}", v) for k, v in theta.items())
            arrays.update((f"fisher/{j}/{k}", v) for k, v in fisher.items())
        return arrays

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """Task 1 (or an empty pool): nothing, the sites start fresh. Else the pool's n_i-weighted mean to start from,
        and the penalty over every other site that has a Fisher."""
        init = None
        if task > 1 and len(self.pool):
            init = self.pool_mean()
        anchors = self.anchors()
        contents = {}
        for node in nodes:
            content = RecordDict({"config": self.base_config(task)})
            if init is not None:
                content["arrays"] = to_record(init)
            penalty = self.penalty_record([a for c, a in anchors.items() if c != self.client_name(node)])
            if penalty is not None:
                content[RECORD] = to_record(penalty)
            contents[node] = content
        self.stats.extra["fedcurv_anchors"] = sorted(anchors)
        return contents

    def finetune_spec(self) -> ArraySpec:
        return OrderedDict([*self.spec.items(), *((FISHER + k, s) for k, s in self.spec.items())])

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        return super().check_reply_values(phase, reply) or fisher_problem(reply.arrays)

    def finetuned(self, task: int, reply: Reply) -> None:
        """The module joins the pool; the site's Fisher replaces its previous one (the penalty's anchor)."""
        super().finetuned(task, reply)
        fisher = OrderedDict((k, np.array(reply.arrays[FISHER + k])) for k in self.spec)
        self.fishers[reply.client] = (task, fisher)
        means = self.stats.extra.setdefault("fisher_mean", {})
        means[reply.client] = {p: part_mean(fisher, spec) for p, spec in split_parts(self.spec).items()}

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        arrays = OrderedDict(arrays)
        for client, (_, fisher) in sorted(self.fishers.items()):
            arrays.update((f"{FISHER}{client}/{k}", v) for k, v in fisher.items())
        return arrays, {**meta, "fisher_tasks": {c: t for c, (t, _) in sorted(self.fishers.items())}}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state(arrays, meta)
        self.fishers = {
            client: (int(task), OrderedDict((k, np.array(arrays[f"{FISHER}{client}/{k}"])) for k in self.spec))
            for client, task in meta.get("fisher_tasks", {}).items()
        }
