"""FLwF (Usmanova, Portet, Lalanda and Vega, "A distillation-based approach integrating continual learning and
federated learning for pervasive services", IJCAI 2021 workshop) in FedKEI's continual protocol
(docs/methods/baselines-continual.md#flwf-flwf).

Learning without Forgetting (Li and Hoiem, TPAMI 2017) on each site of a federation, the previous task's model as the
teacher: every task is a fresh binary problem, so the previous task's head is LwF's old-task head θ_o. For task t ≥ 2
the server sends the n_i-weighted mean of task t−1's pooled modules θ^{t−1}; the site starts from it, keeps a frozen
copy as the teacher and a trainable copy of its head as the auxiliary old-task head, and fine-tunes on
CE(new head) + λ·T²·KL(teacher ‖ auxiliary head on the current features). The distillation loss and ``Distiller`` are
``training/regularisers.py``'s, shared with ``lwf-lora`` (``strategies/incremental/lwf_lora.py``).

What leaves a site: its module θ_i^t (adapter + head) and n_i, as FedKEI's; the auxiliary head stays. What comes to a
site: θ^{t−1} (nothing for task 1). Per task and site 2·|θ|.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Message
from torch import nn
from torch.func import functional_call

from ...contract import from_record, register_strategy, weighted_mean
from ...data import make_loader
from ...training import ExtraLoss, train_epochs
from ...training.regularisers import LWF_OPTIONS, Distiller, plus
from .protocol import CONTINUAL_OPTIONS, ContinualClient, ContinualStrategy, latest_modules


class ModuleDistiller(Distiller):
    """flwf: the teacher is the model with the previous task's module θ^{t−1} (``torch.func.functional_call``, the
    live parameters untouched); the student's old-task logits are the auxiliary head on the current features."""

    def __init__(self, model: nn.Module, teacher: Mapping[str, torch.Tensor], temperature: float, weight: float):
        super().__init__(model, temperature, weight)
        self.aux_head = copy.deepcopy(model.head)  # LwF's θ_o: trained by the distillation term only
        self.frozen = dict(teacher)  # raw parameter path -> value; not registered, so never trained

    def teacher(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.trained, self.frozen, (x,))

    def student(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, features = self.trained.forward_with_features(x)
        return logits, self.aux_head(features)


class FLwFClient(ContinualClient):
    """Starts task t from θ^{t−1} and fine-tunes it with LwF's distillation from θ^{t−1} through an auxiliary copy
    of its head; uploads the module θ_i^t as FedKEI's sites do."""

    teacher: OrderedDict[str, np.ndarray] | None = None

    def initialise(self, message: Message, loss_fn, parts, device: torch.device, train) -> dict:
        """A fresh module for task 1 (nothing sent), else the sent θ^{t−1}, which is also the teacher."""
        super().initialise(message, loss_fn, parts, device, train)
        sent = "arrays" in message.content.array_records
        self.teacher = from_record(message.content["arrays"]) if sent else None
        return {"lwf_teacher": int(self.teacher is not None)}

    def finetune(self, train, epochs: int, after_epoch, extra_loss: ExtraLoss | None, device: torch.device) -> dict:
        if self.teacher is None:  # task 1: nothing to keep, plain fine-tuning
            return super().finetune(train, epochs, after_epoch, extra_loss, device)
        rt = self.rt
        paths = rt.model.parameter_paths()
        teacher = {paths[k]: torch.as_tensor(v, device=device) for k, v in self.teacher.items() if k in paths}
        distiller = ModuleDistiller(rt.model.to(device), teacher, rt.cfg.lwf_temperature, rt.cfg.lwf_lambda)
        metrics = train_epochs(
            distiller,
            make_loader(train, rt.cfg.batch_size, True, rt.seed(1), **rt.loader_options(True)),
            epochs=epochs,
            optimizer=rt.optimizer(),
            device=device,
            extra_loss=plus(extra_loss, distiller.loss),
            after_epoch=after_epoch,
            precision=rt.cfg.precision,
        )
        return {**metrics, **distiller.metrics()}


@register_strategy
class FLwF(ContinualStrategy):
    """FLwF (Usmanova et al. 2021; LwF, Li and Hoiem, TPAMI 2017) in FedKEI's protocol: task t starts from the mean
    of task t−1's modules and distils their old-task logits while it trains.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; with each task's metrics its test
    size and number of positive test images (n_test, n_test_positive), as FedKEI's sites.
    """

    name = "flwf"
    client_half = FLwFClient
    options = (*CONTINUAL_OPTIONS, *LWF_OPTIONS)

    def start_module(self, task: int) -> Mapping[str, np.ndarray] | None:
        """θ^{t−1}: the n_i-weighted mean of the latest pooled task's modules (task t−1 unless no site finished it);
        nothing for task 1 or an empty pool."""
        entries, modules = latest_modules(self.pool, task)
        if not entries:
            return None
        self.stats.extra["teacher_task"] = entries[0].task
        return weighted_mean(modules, self.shares([e.num_examples for e in entries]))
