"""Learning without Forgetting in the two continual protocols (FedKEI's: docs/methods/baselines-continual.md#flwf-flwf;
pFedMxF's: docs/methods/baselines-incremental.md#lwf-lwf-lora).

Li and Hoiem, "Learning without Forgetting" (TPAMI 2017): while the new task trains, the outputs of the old task's
head on the new task's images are kept close to those the previous model gave on the same images, by a
distillation loss with temperature T (their T = 2; ``distillation_loss``). Usmanova, Portet, Lalanda and Vega,
"A distillation-based approach integrating continual learning and federated learning for pervasive services"
(IJCAI 2021 workshop, FLwF): LwF on each site of a federation, the previous task's model as the teacher.

- ``flwf`` (FedKEI protocol, docs/methods/fedkei.md): every task is a fresh binary problem, so the previous task's
  head is LwF's old-task head θ_o. For task t ≥ 2 the server sends the n_i-weighted mean of task t−1's pooled
  modules θ^{t−1}; the site starts from it, keeps a frozen copy as the teacher and a trainable copy of its head as
  the auxiliary old-task head, and fine-tunes on CE(new head) + λ·T²·KL(teacher ‖ auxiliary head on the current
  features). Leaves a site: its module θ_i^t (adapter + head) and n_i, as FedKEI's; the auxiliary head stays.
  Comes to a site: θ^{t−1} (nothing for task 1). Per task and site 2·|θ|.
- ``lwf-lora`` (class-incremental protocol, docs/methods/pfedmxf.md): FedAvg-LoRA plus LwF's term over the classes
  of the finished tasks. The teacher is the end of task t−1's global model: the backbone with the received merged
  ΔW (it does not change during a task) without the current LoRA, and the head rows of the old classes as they
  were when task t−1 ended, which the server sends with every training message of task t. Leaves a site: LoRA A
  and B, the head and n_k (as ``fedavg-lora``). Comes to a site: fedavg-lora's message plus those old head rows.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from torch import nn
from torch.func import functional_call

from ..contract import from_record, register_strategy, weighted_mean
from ..data import make_loader
from ..models.qk_delta import qk_modules
from ..options import Option, non_negative, positive
from ..training import ExtraLoss, train_epochs
from .fedkei import OPTIONS as FEDKEI_OPTIONS
from .fedkei import FedKEI, FedKEIClient
from .pfedmxf import HEAD, INCREMENTAL_OPTIONS, FedAvgLoRA, LoRAClient

LWF_OPTIONS = (
    Option(
        "lwf-temperature",
        2.0,
        "flwf, lwf-lora: distillation temperature T (Li and Hoiem's 2)",
        positive,
        "lwf",
    ),
    Option(
        "lwf-lambda",
        1.0,
        "flwf, lwf-lora: weight λ of the distillation term λ·T²·KL(teacher ‖ student) (0: the plain baseline)",
        non_negative,
        "lwf",
    ),
)
OLD_HEAD = "lwf."  # prefix of the old head rows in a lwf-lora training message


def distillation_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, blocks: int = 1
) -> torch.Tensor:
    """T²·KL(softmax(teacher/T) ‖ softmax(student/T)), summed over ``blocks`` equal softmax groups of the logits
    (one per old task, LwF's sum over old heads), mean over the batch. LwF's L_old (Li and Hoiem, Eq. 2) is the
    cross-entropy with the teacher's soft targets, which has the same gradient; T² (Hinton et al. 2015) keeps that
    gradient, (T/n)·(softmax(student/T) − softmax(teacher/T)), on the scale of the task loss's whatever T."""
    n = student.shape[0]
    s = torch.log_softmax(student.float().reshape(n, blocks, -1) / temperature, dim=-1)
    t = torch.log_softmax(teacher.float().reshape(n, blocks, -1) / temperature, dim=-1)
    return temperature**2 * nn.functional.kl_div(s, t, reduction="batchmean", log_target=True)


class Distiller(nn.Module):
    """Wraps the trained module so that one forward pass yields its logits and stores the (student, teacher) pair
    of old-task logits of the same batch for ``loss``; the teacher runs first, in eval mode, without gradient."""

    task = "classification"

    def __init__(self, trained: nn.Module, temperature: float, weight: float, blocks: int = 1):
        super().__init__()
        self.trained = trained
        self.temperature, self.weight, self.blocks = temperature, weight, blocks
        self.pair: tuple[torch.Tensor, torch.Tensor] | None = None
        self.total, self.steps = 0.0, 0  # the unweighted distillation term, summed over the steps (a metric)

    def teacher(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def student(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the trained module's logits, its old-task logits)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        network = self.trained
        training = network.training
        network.eval()  # LwF records the old model's responses in inference mode
        with torch.no_grad():
            target = self.teacher(x)
        network.train(training)
        logits, old = self.student(x)
        self.pair = (old, target)
        return logits

    def loss(self, model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """λ·``distillation_loss`` of the batch the last forward pass saw (an ``ExtraLoss``)."""
        old, target = self.pair
        value = distillation_loss(old, target, self.temperature, self.blocks)
        self.total += float(value.detach())
        self.steps += 1
        return self.weight * value

    def metrics(self) -> dict[str, float]:
        """``lwf_distill``: the mean unweighted distillation term over the training steps."""
        return {"lwf_distill": self.total / max(self.steps, 1)}


def plus(first: ExtraLoss | None, second: ExtraLoss) -> ExtraLoss:
    if first is None:
        return second
    return lambda model, logits, labels: first(model, logits, labels) + second(model, logits, labels)


# ----------------------------------------------------------------------------- FedKEI protocol: flwf
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


class FLwFClient(FedKEIClient):
    """Starts task t from θ^{t−1} and fine-tunes it with LwF's distillation from θ^{t−1} through an auxiliary copy
    of its head; uploads the module θ_i^t as FedKEI's sites do."""

    teacher: OrderedDict[str, np.ndarray] | None = None

    def initialise(self, message: Message, loss_fn, parts, device: torch.device, train) -> dict:
        """A fresh module for task 1 (nothing sent), else the sent θ^{t−1}, which is also the teacher."""
        rt = self.rt
        rt.model.set_trainable(rt.initial_arrays)
        self.teacher = None
        if "arrays" in message.content.array_records:
            self.teacher = from_record(message.content["arrays"])
            rt.model.set_trainable(self.teacher)
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
class FLwF(FedKEI):
    """FLwF (Usmanova et al. 2021; LwF, Li and Hoiem, TPAMI 2017) in FedKEI's protocol: task t starts from the mean
    of task t−1's modules and distils their old-task logits while it trains.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; with each task's metrics its test
    size and number of positive test images (n_test, n_test_positive), as FedKEI's sites.
    """

    name = "flwf"
    client_half = FLwFClient
    uses_variants = False  # its own start: fedkei-variant is refused
    options = (*(o for o in FEDKEI_OPTIONS if o.key in ("task-epochs", "fedkei-site-classes")), *LWF_OPTIONS)
    extra_actions = ()

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """θ^{t−1}: the n_i-weighted mean of the latest pooled task's modules (task t−1 unless no site finished it);
        nothing for task 1 or an empty pool."""
        arrays = None
        if task > 1 and len(self.pool):
            latest = max(e.task for e in self.pool.entries)
            chosen = [(e, m) for e, m in zip(self.pool.entries, self.pool.modules) if e.task == latest]
            arrays = weighted_mean([m for _, m in chosen], self.shares([e.num_examples for e, _ in chosen]))
            self.stats.extra["teacher_task"] = latest
        return self.start_contents(task, nodes, arrays)


# ----------------------------------------------------------------------------- class-incremental protocol: lwf-lora
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
