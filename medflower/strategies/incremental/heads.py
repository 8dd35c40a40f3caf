"""The class-incremental classifier's maths (docs/methods/pfedmxf.md, "Classifier"), shared by pfedmxf and its
LoRA baselines.

One linear head over every class; task t owns rows (t−1)C … tC−1. ``aac`` trains task t's block with a softmax
over that task's classes (Eq. 16, ``logit_mask`` and ``MaskedLogits``) and predicts with the prototype router
(Eqs. 17-18, ``aac_log_probs``; μ_t from ``task_prototypes``, set by ``set_block_mean`` to ``mean_feature`` with
``aac-prototype='feature-mean'``); ``unified`` trains and predicts with one softmax over every seen class (Eq. 15).
``frozen_rows`` keeps the rows outside a step's softmax bit-identical, weight decay included. The heads are
averaged by n_k (Eq. 19) on the server, in ``protocol.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def task_prototypes(weight: torch.Tensor, classes_per_task: int, tasks: int) -> torch.Tensor:
    """μ_t = mean of task t's class weight vectors (rows of the head), [tasks, d]."""
    return weight[: tasks * classes_per_task].reshape(tasks, classes_per_task, -1).mean(dim=1)


def aac_log_probs(
    features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, classes_per_task: int, tasks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(y|x) over the seen classes (Eq. 18) and the router's log p(t|x) (Eq. 17), both normalised.

    log p(y|x) = log softmax_{y in task t}(φ_t(f)) + log r_t(x), r_t ∝ exp(−‖f − μ_t‖²/2).
    """
    logits = features @ weight[: tasks * classes_per_task].T + bias[: tasks * classes_per_task]
    within = torch.log_softmax(logits.reshape(len(features), tasks, classes_per_task), dim=2)
    distances = torch.cdist(features, task_prototypes(weight, classes_per_task, tasks)) ** 2
    router = torch.log_softmax(-distances / 2, dim=1)
    return (within + router[:, :, None]).reshape(len(features), -1), router


def logit_mask(classifier: str, classes_per_task: int, task: int, width: int) -> torch.Tensor:
    """Classes a training step's softmax runs over: task t's block (aac, Eq. 16) or every seen class (unified)."""
    mask = torch.zeros(width, dtype=torch.bool)
    mask[(task - 1) * classes_per_task if classifier == "aac" else 0 : task * classes_per_task] = True
    return mask


def set_block_mean(weight: torch.Tensor, classes_per_task: int, task: int, prototype: torch.Tensor) -> None:
    """Shift task t's head rows so that their mean, μ_t, is ``prototype`` (in place).

    Adding one vector to every row of a block adds the same logit to each of the task's classes, so the
    within-task softmax (Eq. 16) is unchanged; only the router (Eq. 17) sees the new μ_t.
    """
    rows = slice((task - 1) * classes_per_task, task * classes_per_task)
    weight[rows] += prototype - weight[rows].mean(dim=0)


@contextlib.contextmanager
def frozen_rows(head: torch.nn.Linear, rows: torch.Tensor) -> Iterator[None]:
    """Keep the head rows (and biases) of the classes outside a training step's softmax bit-identical.

    Those rows (past and future tasks' classes with ``aac``, future ones with ``unified``) get no gradient
    from the masked cross-entropy, but weight decay still moves them: AdamW's decoupled term shrinks them by
    lr·wd per step, Adam's and SGD's L2 term adds wd·w to their zero gradient. Nothing they hold enters the
    loss, so putting them back after local training is the same as never stepping them.
    """
    with torch.no_grad():
        at = rows.to(head.weight.device)
        weight, bias = head.weight[at].clone(), head.bias[at].clone()
    try:
        yield
    finally:
        with torch.no_grad():  # train_epochs may have moved the model
            at = rows.to(head.weight.device)
            head.weight[at] = weight.to(head.weight.device)
            head.bias[at] = bias.to(head.bias.device)


@torch.no_grad()
def mean_feature(model, loader, device: torch.device) -> torch.Tensor:
    """The mean pooled backbone feature over a loader."""
    model.eval()
    total, count = None, 0
    for x, _ in loader:
        features = model.features(x.to(device)).float().sum(dim=0)
        total = features if total is None else total + features
        count += len(x)
    return total / count


class MaskedLogits(torch.nn.Module):
    """The model's logits with the classes outside ``mask`` at −inf (their softmax weight is zero)."""

    def __init__(self, model: torch.nn.Module, mask: torch.Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("mask", mask, persistent=False)
        self.task = "classification"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).float().masked_fill(~self.mask, float("-inf"))
