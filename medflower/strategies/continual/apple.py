"""APPLE (Luo and Wu, "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated Learning", IJCAI 2022)
in FedKEI's continual protocol (docs/methods/baselines-continual.md#apple-apple).

A site's personalised model is Σ_j p_ij θ_j over the clients' core models θ_j, with p_i its directed-relationship
vector, learnt on its own data with a proximal term λ(r)·‖p_i − p_0‖² whose weight decays (the paper's loss scheduler;
the authors' code ``ljaiverson/pFL-APPLE``: ``utils/losses.py``, ``train_APPLE.py``). Here the core models are the
previous task's modules: before task t ≥ 2 a site downloads the N modules θ_j^{t−1} of the latest pooled task, learns
p_i from p_0 = n_j / Σ n on its training split of task t (``learn_relationships``), starts from θ̃ = Σ_j p_ij θ_j and
fine-tunes as FedKEI's sites do. Task 1 (no pool) starts fresh, as in FedKEI.

What leaves a site: its module θ_i^t (adapter + head) after every task and n_i, as FedKEI's; p_i goes with the task's
metrics. What comes to a site: the N modules of the latest pooled task and p_0. Per task and site (N+1)·|θ|.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict

from ...contract import register_strategy, stack_flat, to_record, unflatten
from ...data import DataError, make_loader
from ...options import Option, non_negative, one_of, positive
from .bilevel import LossFn
from .protocol import CONTINUAL_OPTIONS, ContinualClient, ContinualStrategy, latest_modules

P0 = "apple-p0"  # the config entry of a task's message that carries p_0
MOMENTUM = 0.9  # the authors' SGD momentum for p (train_APPLE.py), not a run-config key
EPSILON = 1e-3  # the exponential scheduler's end value λ = μ·ε (utils/losses.py)
SCHEDULES = ("exponential", "cosine")


def _fraction(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


APPLE_OPTIONS = (
    Option("apple-lr", 0.001, "apple: SGD (momentum 0.9) step on p (the authors' lr_coef 0.001)", positive, "apple"),
    Option(
        "apple-epochs",
        1,
        "apple: epochs of the task's training split that p is learnt on before fine-tuning",
        positive,
        "apple",
    ),
    Option(
        "apple-mu", 0.1, "apple: weight mu of the proximal term on p (0: none; the authors' 0.1)", non_negative, "apple"
    ),
    Option(
        "apple-schedule",
        "exponential",
        "apple: decay of the proximal weight lambda over the p steps (the authors' loss scheduler)",
        one_of(*SCHEDULES),
        "apple",
    ),
    Option(
        "apple-reg-fraction",
        0.1,
        "apple: fraction of the p steps with the proximal term, 0 after (the authors' 0.1 of the rounds)",
        _fraction,
        "apple",
    ),
)


def reg_weight(step: int, steps: int, mu: float, fraction: float, schedule: str) -> float:
    """λ at p step ``step`` of ``steps`` (0-based): the authors' ``get_reg_coef`` with the task's p steps as its rounds.
    Over the first ⌈fraction·steps⌉ steps λ decays from μ (exponential: μ·ε^(s/S'), ε = 0.001; cosine:
    μ·(1 + cos(π s/S'))/2), then it is 0."""
    if mu == 0:
        return 0.0
    dynamic = math.ceil(fraction * steps)
    if step >= dynamic:
        return 0.0
    if schedule == "cosine":
        return float((math.cos(math.pi * step / dynamic) + 1) / 2 * mu)
    return float(EPSILON ** (step / dynamic) * mu)


@dataclass
class Relationships:
    """The result of ``learn_relationships``."""

    p: torch.Tensor
    mean_loss: float  # task loss (without the proximal term), mean over the steps
    steps: int


def learn_relationships(
    loss_fn: LossFn,
    modules: Sequence[torch.Tensor],
    batches: Iterable,
    p0: torch.Tensor,
    lr: float,
    steps: int,
    mu: float,
    fraction: float,
    schedule: str = "exponential",
) -> Relationships:
    """APPLE's update of the directed-relationship vector on one site, the core models frozen: from p = p_0, per batch
    one SGD step (momentum 0.9, torch.optim.SGD) on L(θ̃(p)) + λ(s)·‖p − p_0‖², θ̃(p) = Σ_j p_j θ_j per part
    (``modules``: one [N, P] tensor per part, the same p for every part, as the authors' one p per client model).
    ``steps`` is the length of ``batches`` (λ's schedule needs it up front)."""
    p = p0.detach().clone().requires_grad_(True)
    optimizer = torch.optim.SGD([p], lr=lr, momentum=MOMENTUM)
    frozen = [m.detach() for m in modules]
    total, done = 0.0, 0
    for batch in batches:
        task_loss = loss_fn([p @ m for m in frozen], batch)
        loss = task_loss + reg_weight(done, steps, mu, fraction, schedule) * ((p - p0) ** 2).sum()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"APPLE's p loss became {loss.item()} at step {done}; lower apple-lr")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += task_loss.item()
        done += 1
    if done == 0:
        raise DataError("APPLE's p learning got no training batch")
    return Relationships(p.detach(), total / done, done)


class AppleClient(ContinualClient):
    """A site's task: learn p over the received modules, start from Σ_j p_j θ_j, fine-tune, upload its module."""

    def initialise(self, message: Message, loss_fn, parts: OrderedDict, device: torch.device, train) -> dict[str, Any]:
        rt = self.rt
        rt.model.set_trainable(rt.initial_arrays)
        if "arrays" not in message.content.array_records:
            return {}  # task 1 or an empty pool: a fresh module, as FedKEI's
        modules = self.stacked_modules(message, parts, device)
        p0 = torch.tensor(list(message.content["config"][P0]), dtype=modules[0].dtype, device=device)
        if p0.shape != (modules[0].shape[0],) or any(m.shape[0] != len(p0) for m in modules):
            raise ValueError(f"received {len(p0)} weights p_0 for {[m.shape[0] for m in modules]} modules")
        cfg = rt.cfg
        started = time.monotonic()
        loader = make_loader(train, cfg.batch_size, True, rt.seed(4), **rt.loader_options(True))
        batches = ((x.to(device), y.to(device)) for _ in range(cfg.apple_epochs) for x, y in loader)
        torch.manual_seed(rt.seed(3))
        result = learn_relationships(
            loss_fn,
            modules,
            batches,
            p0,
            cfg.apple_lr,
            cfg.apple_epochs * len(loader),
            cfg.apple_mu,
            cfg.apple_reg_fraction,
            cfg.apple_schedule,
        )
        start = OrderedDict()
        for module, spec in zip(modules, parts.values()):
            start.update(unflatten((result.p @ module).cpu().numpy(), spec))
        rt.model.set_trainable(start)
        return {
            "apple_p": result.p.cpu().tolist(),
            "apple_p0": p0.cpu().tolist(),
            "apple_loss": result.mean_loss,
            "apple_steps": result.steps,
            "apple_s": time.monotonic() - started,
        }


@register_strategy
class Apple(ContinualStrategy):
    """APPLE (Luo and Wu, IJCAI 2022) in FedKEI's protocol: each site learns its weights p_i over the previous task's
    modules of all sites on the new task's data and starts from Σ_j p_ij θ_j^{t−1}.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; with each task's metrics its p_i, its
    test size and number of positive test images (n_test, n_test_positive), as FedKEI's sites.
    """

    name = "apple"
    client_half = AppleClient
    options = (*CONTINUAL_OPTIONS, *APPLE_OPTIONS)

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """The latest pooled task's N modules, stacked per part ([N, P]), and p_0 = n_j / Σ n (the authors'
        ``init_pss``); nothing for task 1 or an empty pool."""
        entries, modules = latest_modules(self.pool, task)
        contents = {}
        if entries:
            arrays = OrderedDict((p, stack_flat(modules, spec)) for p, spec in self.parts.items())
            sizes = np.array([e.num_examples for e in entries], dtype=np.float64)
            p0 = [float(v) for v in sizes / sizes.sum()]
            self.stats.extra.update(apple_task=entries[0].task, apple_clients=[e.client for e in entries], apple_p0=p0)
        for node in nodes:
            if entries:
                content = RecordDict({"config": self.base_config(task, **{P0: p0}), "arrays": to_record(arrays)})
            else:
                content = RecordDict({"config": self.base_config(task)})
            contents[node] = content
        return contents
