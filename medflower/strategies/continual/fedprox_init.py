"""FedProx as a FedKEI baseline (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020), adapted to FedKEI's continual protocol as the FedKEI paper's Table I does.

Task t ≥ 2 starts from the n_i-weighted mean of the knowledge pool (every site's module of every past task, as
``fedkei-variant='fedavg-init'``; ``protocol.PoolMeanInit``); task 1, or a task while the pool is empty, from the
fresh seeded module. Local fine-tuning adds FedProx's proximal term (μ/2)·‖θ − θ_start‖² (Eq. 2, μ = ``proximal-mu``)
toward the module the task started from, task 1 included (toward the fresh module). The method as implemented and
its decisions: docs/methods/baselines-continual.md#fedprox-fedprox-init.

The whole method is the term: the protocol (``protocol.py``) walks the tasks, starts every site from the pool mean,
fine-tunes, pools the modules and reports; the client half adds the term, the server half states the facts.

What leaves a site: after each task its fine-tuned module θ_i^t (adapter + head) and n_i. What comes to a site: the
pool mean (tasks t ≥ 2). Per task and client 2·|θ| (task 1: |θ|, the upload).
"""

from __future__ import annotations

from flwr.app import Message

from ...contract import register_strategy
from ...training import ExtraLoss
from ..fedavg import PROXIMAL_MU, proximal_term
from .protocol import CONTINUAL_OPTIONS, ContinualClient, PoolMeanInit


class FedProxInitClient(ContinualClient):
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
    options = (*CONTINUAL_OPTIONS, PROXIMAL_MU)
