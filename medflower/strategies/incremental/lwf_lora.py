"""LwF on FedAvg-LoRA in the federated class-incremental protocol (docs/methods/baselines-incremental.md#lwf-lwf-lora).

Li and Hoiem, "Learning without Forgetting" (TPAMI 2017): while the new task trains, the outputs of the old classes'
head rows on the new task's images are kept close to those the previous model gave on the same images, by a
distillation loss with temperature T (their T = 2; ``training/regularisers.py``, shared with FedKEI's ``flwf``).
``lwf-lora`` is FedAvg-LoRA plus that term over the classes of the finished tasks. The teacher is the end of task
t−1's global model: the backbone with the received merged ΔW (it does not change during a task) without the current
LoRA, and the head rows of the old classes as they were when task t−1 ended, which the server sends with every
training message of task t.

What leaves a site: LoRA A and B, the head and n_k (as ``fedavg-lora``). What comes to a site: fedavg-lora's message
plus those old head rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Message, RecordDict
from torch import nn
from torch.func import functional_call

from ...contract import register_strategy
from ...models.qk_delta import qk_modules
from ...training import ExtraLoss
from ...training.regularisers import LWF_OPTIONS, Distiller
from .fedavg_lora import FedAvgLoRA
from .protocol import HEAD, INCREMENTAL_OPTIONS, LoRAClient

OLD_HEAD = "lwf."  # prefix of the old head rows in a lwf-lora training message


class Features(nn.Module):
    """The model's pooled features as its forward pass (what ``functional_call`` calls)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.features(x)


class OldClassDistiller(Distiller):
    """lwf-lora: the teacher is the backbone with the merged ΔW and no current LoRA (every B = 0 through
    ``functional_call``) under the old head rows the server sent; the student's old-class logits are the current
    head's rows of those classes on the current features, detached where the classifier keeps the rows frozen (aac:
    ``frozen_rows`` restores them after training anyway)."""

    def __init__(self, masked: nn.Module, old_head: Mapping[str, torch.Tensor], blocks: int, temperature, weight):
        super().__init__(masked, temperature, weight, blocks)
        model = masked.model
        self.features = Features(model)
        self.no_lora = {
            f"model.{name}.lora_B": torch.zeros_like(module.lora_B) for name, module in qk_modules(model).items()
        }
        self.old_weight, self.old_bias = old_head["head.weight"], old_head["head.bias"]
        self.rows_train = bool(masked.mask[: len(self.old_bias)].all())  # unified: the old rows are in the softmax

    def teacher(self, x: torch.Tensor) -> torch.Tensor:
        features = functional_call(self.features, self.no_lora, (x,)).float()
        return nn.functional.linear(features, self.old_weight, self.old_bias)

    def student(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        masked = self.trained
        model = masked.model
        features = model.features(x)
        logits = model.head(features)
        k = len(self.old_bias)
        weight, bias = model.head.weight[:k], model.head.bias[:k]
        if not self.rows_train:
            weight, bias = weight.detach(), bias.detach()
        old = nn.functional.linear(features, weight, bias)
        return logits.float().masked_fill(~masked.mask, float("-inf")), old  # MaskedLogits' output


class LwFLoRAClient(LoRAClient):
    """FedAvg-LoRA's site with LwF's distillation of the old classes from the end of task t−1's global model."""

    old_head: dict[str, np.ndarray] | None = None
    distiller: OldClassDistiller | None = None

    def load(self, arrays: Mapping[str, np.ndarray], training: bool) -> None:
        self.old_head = {k[len(OLD_HEAD) :]: v for k, v in arrays.items() if k.startswith(OLD_HEAD)} or None
        super().load({k: v for k, v in arrays.items() if not k.startswith(OLD_HEAD)}, training)

    def training_objective(self, model: nn.Module, train) -> tuple[nn.Module, ExtraLoss | None]:
        if self.old_head is None:  # task 1: no old class
            return model, None
        rt, cfg = self.rt, self.rt.cfg
        device = rt.device
        old = {k: torch.as_tensor(v, device=device) for k, v in self.old_head.items()}
        expected = (self.task - 1) * cfg.classes_per_task
        if old["head.weight"].shape[0] != expected or old["head.bias"].shape[0] != expected:
            raise ValueError(
                f"received old head rows for {old['head.bias'].shape[0]} classes; task {self.task} has "
                f"{expected} old classes"
            )
        blocks = self.task - 1 if cfg.classifier == "aac" else 1  # aac: one softmax per old task (LwF's old heads)
        self.distiller = OldClassDistiller(model.to(device), old, blocks, cfg.lwf_temperature, cfg.lwf_lambda)
        return self.distiller, self.distiller.loss

    def train(self, message: Message) -> RecordDict:
        content = super().train(message)
        if self.distiller is not None and self.distiller.steps:
            content["metrics"].update(self.distiller.metrics())
        return content


@register_strategy
class LwFLoRA(FedAvgLoRA):
    """LwF (Li and Hoiem, TPAMI 2017) on FedAvg-LoRA: local training adds λ·T²·KL over the old classes between the
    end of task t−1's global model and the current model, on the current task's images.

    Leaves a site: its LoRA A and B on q and k, the head and n_k.
    """

    name = "lwf-lora"
    client_half = LwFLoRAClient
    options = (*INCREMENTAL_OPTIONS, *LWF_OPTIONS)
    contract_case: ClassVar[dict[str, Any]] = {
        **FedAvgLoRA.contract_case,
        "why": "stops inside task 2, where the old head rows carry over",
    }

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        self.old_head: OrderedDict[str, np.ndarray] = OrderedDict()  # the head rows of tasks < t, as task t−1 ended

    def end_task(self, task: int) -> None:
        super().end_task(task)
        k = task * self.cfg.classes_per_task
        self.old_head = OrderedDict((name, self.global_arrays[name][:k].copy()) for name in HEAD)

    def node_arrays(self, node_id: int, task: int) -> OrderedDict[str, np.ndarray]:
        """The teacher's head: the old classes' rows at the end of task t−1 (none in task 1)."""
        if task == 1 or not self.old_head:
            return OrderedDict()
        return OrderedDict((OLD_HEAD + name, value) for name, value in self.old_head.items())

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        arrays = OrderedDict(arrays)
        arrays.update((f"lwf/{name}", value) for name, value in self.old_head.items())
        return arrays, meta

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if not k.startswith("lwf/")}, meta)
        self.old_head = OrderedDict((name, np.array(arrays[f"lwf/{name}"])) for name in HEAD if f"lwf/{name}" in arrays)
        for name, value in self.old_head.items():
            if value.shape[1:] != self.spec[name][0][1:]:
                raise ValueError(
                    f"checkpoint's old {name} rows have shape {value.shape}; this model's is {self.spec[name][0]}"
                )
