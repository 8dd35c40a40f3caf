"""EWC with a federated Fisher on FedAvg-LoRA in the federated class-incremental protocol
(docs/methods/baselines-incremental.md#ewc-fedcurv-lora): the EWC row of pFedMxF's table.

Kirkpatrick et al., "Overcoming catastrophic forgetting in neural networks" (PNAS 2017, Eq. 3): one LoRA on q/k for
the whole run, A and B and the head averaged by n_k every round (FedAvg-LoRA without the merge at task end); after
each task's last round every site computes the Fisher of the global end-of-task module on its data of that task, the
server averages them by n_k (the Fisher of the federation's task data), and the sites then train with
λ Σ_{s<t} (θ − θ*_s)ᵀ diag(F_s) (θ − θ*_s) over the past tasks' end-of-task modules θ*_s. The Fisher and the
quadratic are ``training/regularisers.py``'s, shared with FedKEI's ``fedcurv``.

What leaves a site: its LoRA A and B, the head and n_k each round; after a task's last round its Fisher over them.
What comes to a site: the LoRA and head; from task 2 on, u, v and c of the past tasks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Message, RecordDict

from ...contract import Reply, from_record, register_strategy, to_record, weighted_mean
from ...data import make_loader
from ...models.qk_delta import qk_modules
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
from .fedavg_lora import FedAvgLoRA
from .heads import logit_mask
from .protocol import HEAD, INCREMENTAL_OPTIONS, LoRAClient

RECORD = "fedcurv"  # the message record that carries the penalty (u/<name>, v/<name>, c); the checkpoint's prefix


class FedCurvLoRAClient(LoRAClient):
    """One LoRA for the whole run (the merged ΔW stays zero); training adds λ times the received past tasks'
    quadratic; ``fedcurv_fisher`` computes the Fisher of the received module on this site's rows of the task."""

    def load(self, arrays: Mapping[str, np.ndarray], training: bool) -> None:
        model = self.rt.model.to(self.rt.device)
        with torch.no_grad():
            for module in qk_modules(model).values():
                module.merged.zero_()
        model.set_trainable(arrays)

    def train(self, message: Message) -> RecordDict:
        record = message.content.array_records.get(RECORD)
        self.quadratic = Quadratic.from_arrays(from_record(record)) if record is not None else None
        return super().train(message)

    def training_objective(self, model: torch.nn.Module, train) -> tuple[torch.nn.Module, ExtraLoss | None]:
        if self.quadratic is None:
            return model, None
        return model, self.quadratic.penalty(self.rt.model.trainable_parameters(), float(self.rt.cfg.fedcurv_lambda))

    def fedcurv_fisher(self, message: Message) -> RecordDict:
        """The Fisher of the received end-of-task module on this site's training rows of the task, with the task's
        training softmax (``classifier``'s logit mask)."""
        rt, cfg = self.rt, self.rt.cfg
        self.load(from_record(message.content["arrays"]), training=False)
        train = self.split("train", seen=False)
        mask = logit_mask(cfg.classifier, cfg.classes_per_task, self.task, rt.model.head.out_features)
        loader = make_loader(train, cfg.batch_size, False, 0, **rt.loader_options(False))
        fisher = diagonal_fisher(rt.model, loader, rt.device, mask)
        return self.reply(arrays=fisher_arrays(fisher), metrics={"num-examples": len(train), "task": self.task})


@register_strategy
class FedCurvLoRA(FedAvgLoRA):
    """EWC with a federated Fisher on FedAvg-LoRA (q/k): one LoRA kept across tasks; after each task the n_k-weighted
    mean of the sites' Fishers of the global module on the task's data, and λ Σ_{s<t} (θ − θ*_s)ᵀ diag(F_s)(θ − θ*_s)
    in every later round's local loss.

    Leaves a site: its LoRA A and B on q and k, the head and n_k every round; after a task's last round its diagonal
    Fisher of the global LoRA and head on its rows of that task, and n_k.
    """

    name = "fedcurv-lora"
    client_half = FedCurvLoRAClient
    options = (*INCREMENTAL_OPTIONS, FEDCURV_LAMBDA)
    extra_actions = (("train", "fedcurv_fisher"),)
    contract_case: ClassVar[dict[str, Any]] = {
        **FedAvgLoRA.contract_case,
        "stop_after": 2,
        "why": "stops after task 1's Fisher phase: the resumed run sends its penalty",
    }

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        self.quadratic: Quadratic | None = None  # the past tasks' penalty (u, v, c), summed task after task
        self.fisher_tasks: list[int] = []

    def model_arrays(self, task: int) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, self.global_arrays[k]) for k in self.lora_names)  # no merged ΔW: it stays zero

    def contents(self, nodes: list[int], rnd: int, training: bool) -> dict[int, RecordDict]:
        out = super().contents(nodes, rnd, training)
        if training and self.quadratic is not None:
            for content in out.values():
                content[RECORD] = to_record(self.quadratic.arrays())
        return out

    def end_task(self, task: int) -> None:
        """Nothing to merge: the LoRA carries on into the next task (the penalty needs its parameters)."""

    def run_round(self, grid, rnd: int) -> None:
        super().run_round(grid, rnd)
        if self.is_task_end(rnd):
            self.fisher_phase(grid, rnd)

    def fisher_phase(self, grid, rnd: int) -> None:
        """Every site's Fisher of the end-of-task module θ*_t on its task-t rows; their n_k-weighted mean F_t adds
        (θ − θ*_t)ᵀ diag(F_t)(θ − θ*_t) to the penalty."""
        task = self.task_of(rnd)
        expect = OrderedDict((FISHER + k, s) for k, s in self.spec.items())
        replies = self.exchange(
            grid, "train.fedcurv_fisher", self.contents(self.ordered_nodes(), rnd, False), rnd, expect=expect
        )
        learned = [r for r in replies if r.num_examples > 0]
        if not learned:
            return
        fisher = weighted_mean(
            [OrderedDict((k, r.arrays[FISHER + k]) for k in self.spec) for r in learned],
            self.shares([r.num_examples for r in learned]),
        )
        theta = OrderedDict((k, self.global_arrays[k]) for k in self.spec)
        added = Quadratic.of([(theta, fisher)])
        self.quadratic = added if self.quadratic is None else self.quadratic.plus(added)
        self.fisher_tasks.append(task)
        self.stats.extra.update(
            fisher_sites=[r.client for r in learned],
            fisher_mean={"lora": part_mean(fisher, self.lora_names), "head": part_mean(fisher, HEAD)},
        )

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        return super().check_reply_values(phase, reply) or fisher_problem(reply.arrays)

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        arrays = OrderedDict(arrays)
        if self.quadratic is not None:
            arrays.update((f"{RECORD}/{k}", v) for k, v in self.quadratic_state().items())
        return arrays, {**meta, "fisher_tasks": list(self.fisher_tasks)}

    def quadratic_state(self) -> OrderedDict[str, np.ndarray]:
        """u and v in float64 (the sums keep accumulating over tasks), c."""
        out = OrderedDict((f"u/{k}", np.asarray(u, np.float64)) for k, u in self.quadratic.u.items())
        out.update((f"v/{k}", np.asarray(v, np.float64)) for k, v in self.quadratic.v.items())
        out["c"] = np.array([self.quadratic.c], np.float64)
        return out

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        prefix = f"{RECORD}/"
        super().load_state({k: v for k, v in arrays.items() if not k.startswith(prefix)}, meta)
        self.fisher_tasks = [int(t) for t in meta.get("fisher_tasks", [])]
        saved = {k[len(prefix) :]: np.array(v) for k, v in arrays.items() if k.startswith(prefix)}
        self.quadratic = Quadratic.from_arrays(saved) if saved else None
