"""FedProx as a FedKEI baseline (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020), adapted to FedKEI's continual protocol as the FedKEI paper's Table I does.

Task t ≥ 2 starts from the n_i-weighted mean of the knowledge pool (every site's module of every past task, as
``fedkei-variant='fedavg-init'``); task 1, or a task while the pool is empty, from the fresh seeded module. Local
fine-tuning adds FedProx's proximal term (μ/2)·‖θ − θ_start‖² (Eq. 2, μ = ``proximal-mu``) toward the module the task
started from, task 1 included (toward the fresh module). The method as implemented and its decisions:
docs/methods/baselines-continual.md#fedprox-fedprox-init.

``PoolMeanInit`` is the pool-mean start that ``ffa-lora`` and ``per-fedavg`` share (their sites start from the sent
module: ``fedkei.ModuleStartClient``).

What leaves a site: after each task its fine-tuned module θ_i^t (adapter + head) and n_i. What comes to a site: the
pool mean (tasks t ≥ 2). Per task and client 2·|θ| (task 1: |θ|, the upload).
"""

from __future__ import annotations

from flwr.app import Message, RecordDict

from ..contract import register_strategy, weighted_mean
from ..training import ExtraLoss
from .fedavg import PROXIMAL_MU, proximal_term
from .fedkei import OPTIONS as FEDKEI_OPTIONS
from .fedkei import FedKEI, ModuleStartClient


# ----------------------------------------------------------------------------- the pool-mean start, shared
class PoolMeanInit(FedKEI):
    """FedKEI's server with the pool-mean start: nothing for task 1 (or an empty pool), else the n_i-weighted mean
    of every pooled module. Not a strategy itself; the baselines below subclass it."""

    client_half = ModuleStartClient
    uses_variants = False  # its own start: fedkei-variant is refused
    extra_actions = ()  # no bi-level phase

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        arrays = None
        if task > 1 and len(self.pool) > 0:
            arrays = weighted_mean(self.pool.modules, self.shares([e.num_examples for e in self.pool.entries]))
        return self.start_contents(task, nodes, arrays)


# ----------------------------------------------------------------------------- fedprox-init
class FedProxInitClient(ModuleStartClient):
    """Fine-tunes with (μ/2)·‖θ − θ_start‖² added to the task loss; sends the module."""

    def finetune_loss(self, message: Message, train) -> ExtraLoss | None:
        rt = self.rt
        if rt.cfg.proximal_mu == 0:
            return None
        rt.model.to(rt.device)
        anchor = {k: p.detach().clone() for k, p in rt.model.trainable_parameters().items()}  # θ_start, just set
        return proximal_term(rt.model, anchor, rt.cfg.proximal_mu)


@register_strategy
class FedProxInit(PoolMeanInit):
    """FedProx (Li et al., MLSys 2020) in FedKEI's continual protocol: task t starts from the n_i-weighted mean of the
    pool; fine-tuning adds (μ/2)·‖θ − θ_start‖² (``proximal-mu``), in task 1 toward the fresh module.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; with each task's metrics its test size
    and number of positive test images (n_test, n_test_positive).
    """

    name = "fedprox-init"
    client_half = FedProxInitClient
    options = (*FEDKEI_OPTIONS, PROXIMAL_MU)
