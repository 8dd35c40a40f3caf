"""FedGA (Zhang, Xu, Yao, Zhang, Tian and Wang, "Federated Domain Generalization with Generalization Adjustment",
CVPR 2023) in FedKEI's continual protocol (docs/methods/baselines-continual.md#fedga-fedga).

FedGA aggregates with weights a_i that the server adjusts round after round by each site's generalization gap
G_i = L_i(θ̄) − L_i(θ_i), the loss of the aggregate minus that of the site's own model on the site's validation split:
a_i ← a_i + (d_r / 3)·G_i / max_j |G_j|, clipped to [0, 1] and renormalised, the step d_r decaying linearly over the
rounds (``ga_update``; the authors' code ``MediaBrain-SJTU/FedDG-GA``, ``utils/weight_adjust.py``:
``refine_weight_dict_by_GA``, ``weight_clip``, and the decay of ``algorithms/*/train_pacs_GA.py``).

Here the aggregated models are the previous task's modules: before task t ≥ 2 the server runs ``fedga-rounds`` rounds
of gap feedback on the modules θ_i^{t−1} of the latest pooled task, from a = n_i shares; round r sends θ̄(a^r) =
Σ_i a_i θ_i^{t−1} and each site that holds one of those modules answers G_i on its validation split of that task, its
own module's loss measured once when it finished the task and kept in its personal state (key ``fedga``). Task t
starts from θ̄(a^{R+1}); task 1 (or an empty pool) starts fresh, as FedKEI's.

What leaves a site: its module θ_i^t (adapter + head) after every task and n_i, as ``fedkei-variant='fedavg-init'``;
one scalar G_i per gap round. What comes to a site: θ̄(a^r) each gap round and the start θ̄(a^{R+1}). Per task t ≥ 2
and site (R + 2)·|θ|.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common.logger import log

from ...contract import PersonalState, from_record, register_strategy, to_record, weighted_mean
from ...data import DataError, make_loader
from ...data.tasks import binary_task
from ...options import Option, bad, positive
from ...training import evaluate
from .protocol import CONTINUAL_OPTIONS, ContinualClient, ContinualStrategy, latest_modules

GAP = "fedga_gap"  # the metric a gap reply carries
SOURCE = "fedga-task"  # the config entry of a gap message: the task whose modules are aggregated
STATE = "fedga"  # the site's personal-state key: its own module's validation loss per finished task
ACTION = "train.fedga_gap"
SCALE = 1.0 / 3.0  # the authors' fixed 1/3 on the step (refine_weight_dict_by_GA; 1/K for their K = 3 sites)

FEDGA_OPTIONS = (
    Option(
        "fedga-rounds",
        10,
        "fedga: rounds R of generalization-gap feedback before each task t >= 2 (each sends the aggregate of task "
        "t-1's modules to their sites and gets one gap back)",
        positive,
        "fedga",
    ),
    Option(
        "fedga-step",
        0.2,
        "fedga: step d of the weight update, decaying linearly to d/R over the rounds (the authors' step_size 0.2)",
        positive,
        "fedga",
    ),
)


# ----------------------------------------------------------------------------- the maths
def step_size(step: float, rnd: int, rounds: int) -> float:
    """d_r of gap round ``rnd`` (1-based) of ``rounds``: d·(1 − (r − 1)/R), from d down to d/R (the authors'
    ``step_size − (i − 1)·step_size/comm`` for their rounds i = 1..comm)."""
    return step * (1.0 - (rnd - 1) / rounds)


def ga_update(weights: np.ndarray, gaps: Mapping[int, float], step: float) -> np.ndarray:
    """FedGA's generalization adjustment of the aggregation weights (``refine_weight_dict_by_GA`` with
    ``fair_metric='loss'``): for the sites i with a gap, a_i += (d_r/3)·G_i / max_j |G_j| (not centred, as the
    authors' code), then every a_i is clipped to [0, 1] and the weights renormalised (``weight_clip``). Sites
    without a gap keep their a_i before the clip. No gap, or every gap 0, leaves the weights as they are."""
    new = np.asarray(weights, dtype=np.float64).copy()
    if not gaps:
        return new
    largest = max(abs(g) for g in gaps.values())
    if largest == 0:
        return new
    for i, gap in gaps.items():
        new[i] += SCALE * step * gap / largest
    new = np.clip(new, 0.0, 1.0)
    total = new.sum()
    return new / total if total > 0 else np.asarray(weights, dtype=np.float64).copy()


# ----------------------------------------------------------------------------- client half
class FedGAClient(ContinualClient):
    """Starts from the sent module (fresh without one), fine-tunes as FedKEI's sites, keeps its module's loss on the
    task's validation split; ``fedga_gap`` answers G_i of a received aggregate."""

    def personal(self) -> PersonalState:
        return PersonalState(self.rt, key=STATE)

    def validation_loss(self, task: int) -> float:
        """The task loss (cross-entropy) of the model's module on this site's validation split of ``task``."""
        rt = self.rt
        data = binary_task(rt.data.val, self.class_order(), task)
        if len(data) == 0:
            raise DataError(f"{rt.client}: task {task} has no validation rows on this site; FedGA's gap needs some")
        loader = make_loader(data, rt.cfg.batch_size, False, 0, **rt.loader_options(False))
        return float(evaluate(rt.model, loader, rt.device, precision=rt.cfg.precision)["loss"])

    def train(self, message: Message) -> RecordDict:
        content = super().train(message)
        task = self.task
        if len(binary_task(self.rt.data.val, self.class_order(), task)):  # else a later gap request fails here
            own = self.validation_loss(task)  # the model still holds the uploaded module θ_i^t
            self.personal().save(task, {"loss": np.array([own]), "task": np.array([task], dtype=np.int64)})
        return content

    def fedga_gap(self, message: Message) -> RecordDict:
        """G_i = L_i(θ̄) − L_i(θ_i) on the validation split of the task whose modules the server aggregates."""
        rt = self.rt
        source = int(message.content["config"][SOURCE])
        saved = self.personal().load(before=source + 1)
        if saved is None or int(saved["task"][0]) != source:
            raise DataError(f"{rt.client}: no validation loss of its own module of task {source} is kept here")
        rt.model.to(rt.device)
        rt.model.set_trainable(from_record(message.content["arrays"]))
        return self.reply(metrics={GAP: self.validation_loss(source) - float(saved["loss"][0])})


# ----------------------------------------------------------------------------- server half
@register_strategy
class FedGA(ContinualStrategy):
    """FedGA (Zhang et al., CVPR 2023) in FedKEI's protocol: task t ≥ 2 starts from Σ_i a_i θ_i^{t−1}, the weights a
    tuned by ``fedga-rounds`` rounds of generalization-gap feedback from the sites.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; one scalar gap G_i per gap round;
    with each task's metrics its test size and number of positive test images (n_test, n_test_positive), as
    FedKEI's sites.
    """

    name = "fedga"
    client_half = FedGAClient
    options = (*CONTINUAL_OPTIONS, *FEDGA_OPTIONS)
    extra_actions = (("train", "fedga_gap"),)

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        super().check_config(cfg, check_paths)
        if cfg.val_fraction == 0:
            raise bad(
                "val-fraction",
                cfg.val_fraction,
                "fedga measures each site's generalization gap on its validation split; give it one (> 0)",
            )

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        self.ga_weights: dict[str, Any] = {}  # the latest gap phase: its task, clients and final weights a^{R+1}

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        return arrays, {**meta, "fedga": self.ga_weights}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state(arrays, meta)
        self.ga_weights = dict(meta.get("fedga", {}))

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """Nothing for task 1 or an empty pool (a fresh start); else the gap phase on the latest pooled task's
        modules and their weighted mean θ̄(a^{R+1}) to start from."""
        entries, modules = latest_modules(self.pool, task)
        if not entries:
            return self.start_contents(task, nodes, None)
        clients = [e.client for e in entries]
        weights = self.shares([e.num_examples for e in entries])
        weights = self.gap_phase(grid, task, nodes, entries[0].task, clients, modules, np.asarray(weights))
        return self.start_contents(task, nodes, weighted_mean(modules, weights))

    def gap_phase(
        self,
        grid,
        task: int,
        nodes: list[int],
        source: int,
        clients: Sequence[str],
        modules: Sequence[Mapping[str, np.ndarray]],
        weights: np.ndarray,
    ) -> np.ndarray:
        """``fedga-rounds`` rounds: θ̄(a^r) to every sampled node that holds a module of task ``source``, their gaps
        back, a^{r+1} = ``ga_update``. Returns a^{R+1}; logs the gaps and weights in the task's server record."""
        rounds, step = int(self.cfg.fedga_rounds), float(self.cfg.fedga_step)
        index = {c: i for i, c in enumerate(clients)}
        holders = [n for n in nodes if self.client_name(n) in index]
        history: dict[str, Any] = {"task": source, "clients": list(clients), "weights": [weights.tolist()], "gaps": []}
        bytes_before = self.stats.bytes_down, self.stats.bytes_up
        for rnd in range(1, rounds + 1):
            mean = weighted_mean(modules, weights)
            config = self.base_config(task, **{SOURCE: source, "fedga-round": rnd})
            contents = {n: RecordDict({"config": config, "arrays": to_record(mean)}) for n in holders}
            gaps = {}
            for reply in self.exchange(grid, ACTION, contents, task, expect=None):
                gap = reply.metrics.get(GAP)
                if not isinstance(gap, (int, float)) or isinstance(gap, bool) or not math.isfinite(gap):
                    self.reject(task, ACTION, reply.client, f"a gap reply must carry a finite {GAP}, got {gap!r}")
                    continue
                gaps[index[reply.client]] = float(gap)
            started = time.monotonic()
            weights = ga_update(weights, gaps, step_size(step, rnd, rounds))
            self.stats.aggregation_s += time.monotonic() - started
            history["gaps"].append({clients[i]: g for i, g in sorted(gaps.items())})
            history["weights"].append(weights.tolist())
        if holders and not any(history["gaps"]):
            log(WARNING, "[medflower] task %d: no FedGA gap arrived; the start keeps the n_i weights", task)
        self.stats.extra.setdefault("bytes", {})["fedga_gap"] = {
            "down": self.stats.bytes_down - bytes_before[0],
            "up": self.stats.bytes_up - bytes_before[1],
            "nodes": len(holders),
            "rounds": rounds,
        }
        self.stats.extra["fedga"] = history
        self.ga_weights = {"task": task, "source": source, "clients": list(clients), "weights": weights.tolist()}
        return weights
