"""SCAFFOLD and FedDyn: client-drift corrections with per-site state, the baselines SiFT compares against
(docs/methods/baselines-fedavg-like.md#scaffold-and-feddyn), over the trainable arrays (adapters + head, or
whatever the model trains).

Both keep a per-site array set in ``PersonalState`` (``context.state``, mirrored to the site's state folder,
so a resumed run or a restarted site gets it back) and a server-side set in the checkpoint. Both use the
papers' uniform means over the participating sites, not size weights.

- SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II). Local steps use g − c_i + c, added as the
  linear loss term ⟨θ, c − c_i⟩ (its gradient is exactly the correction). Then
  c_i⁺ = c_i − c + (x − y)/(K·η_l) over the K local SGD steps. The server does x ← x + η_g·mean(Δy) and
  c ← c + (|S|/N)·mean(Δc). Option II's estimate assumes plain SGD steps, so ``scaffold`` requires
  ``optimizer='sgd'`` and ``momentum=0``.
- FedDyn (Acar et al. 2021, Algorithm 1). Local objective L_i(θ) − ⟨h_i, θ⟩ + (α/2)‖θ − θ^{t−1}‖².
  Then h_i ← h_i − α(θ_i − θ^{t−1}). The server does h ← h − (α/N)·Σ_{i∈S}(θ_i − θ^{t−1}) and
  θ^t = mean(θ_i) − h/α.

With a fully trained backbone (``adapter='full'``) the BatchNorm running statistics travel too. They have no
gradient, so neither correction touches them: SCAFFOLD keeps no control variate for them (x ← x + η_g·mean(Δy)
still moves them), FedDyn keeps no h for them and the server takes their plain mean.

What leaves a site: SCAFFOLD sends its model change Δy (every exchanged array) and control change Δc (the
parameters); FedDyn sends its exchanged arrays. Both also send n_k.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict

from ..contract import (
    ArraySpec,
    ClientHalf,
    FederatedStrategy,
    PersonalState,
    Reply,
    from_record,
    register_strategy,
    to_record,
    weighted_mean,
)
from ..models.arrays import is_running_statistic
from ..options import Option, bad, positive
from .fedavg import proximal_term

CONTROL = "control."  # SCAFFOLD's control variates travel as "control.<name>"
DYN_H = "feddyn-h/"  # FedDyn's server h in the checkpoint


def linear_term(model, direction: Mapping[str, torch.Tensor]):
    """Extra loss ⟨θ, d⟩ over the trainable arrays: its gradient adds d to every step's gradient."""
    params = model.trainable_parameters()

    def extra_loss(_model, _logits, _labels):
        return sum((params[k] * direction[k]).sum() for k in params)

    return extra_loss


def feddyn_term(model, h: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], alpha: float):
    """FedDyn's extra loss −⟨h_i, θ⟩ + (α/2)‖θ − θ^{t−1}‖² (Acar et al. 2021, Algorithm 1): a linear term plus
    FedProx's proximal term with mu = α."""
    linear = linear_term(model, {k: -v for k, v in h.items()})
    proximal = proximal_term(model, anchor, alpha)

    def extra_loss(model_, logits, labels):
        return linear(model_, logits, labels) + proximal(model_, logits, labels)

    return extra_loss


def _tensors(arrays: Mapping[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v, device=device) for k, v in arrays.items()}


def _zeros_like(arrays: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """Zero state for the arrays that have a gradient (running statistics have none)."""
    return OrderedDict((k, np.zeros_like(v)) for k, v in arrays.items() if not is_running_statistic(k))


def _mean(arrays: list[Mapping[str, np.ndarray]]) -> OrderedDict[str, np.ndarray]:
    """The papers' uniform mean over the participating sites."""
    return weighted_mean(arrays, [1.0] * len(arrays))


# ----------------------------------------------------------------------------- SCAFFOLD
class ScaffoldClient(ClientHalf):
    """Local SGD with the control-variate correction; keeps c_i, sends Δy and Δc."""

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        received = from_record(message.content["arrays"])
        x = OrderedDict((k, v) for k, v in received.items() if not k.startswith(CONTROL))
        c = OrderedDict((k[len(CONTROL) :], v) for k, v in received.items() if k.startswith(CONTROL))
        state = PersonalState(rt, key="scaffold-control")
        c_i = state.load(before=rt.round) or _zeros_like(x)
        rt.model.set_trainable(x)
        rt.model.to(rt.device)
        correction = _tensors({k: c[k] - c_i[k] for k in c}, rt.device)
        optimizer = rt.optimizer()
        metrics = rt.train_local(linear_term(rt.model, correction), optimizer=optimizer)
        y = rt.model.get_trainable()
        steps_lr = metrics["train_steps"] * optimizer.lr
        c_new = OrderedDict((k, (c_i[k] - c[k] + (x[k] - y[k]) / steps_lr).astype(np.float32)) for k in c)
        state.save(rt.round, c_new)
        arrays = OrderedDict((k, y[k] - x[k]) for k in x)
        arrays.update((CONTROL + k, c_new[k] - c_i[k]) for k in c)
        metrics["num-examples"] = len(rt.data.train)
        return self.reply(arrays=arrays, metrics=metrics)

    def evaluate(self, message: Message) -> RecordDict:
        """The global model x; a training message's control variates c (evaluate-in-train) are not evaluated."""
        received = from_record(message.content["arrays"])
        self.rt.model.set_trainable(OrderedDict((k, v) for k, v in received.items() if not k.startswith(CONTROL)))
        return self.reply(metrics=self.rt.evaluate_splits())


@register_strategy
class Scaffold(FederatedStrategy):
    """SCAFFOLD (option II): x ← x + η_g·mean(Δy), c ← c + (|S|/N)·mean(Δc).

    Leaves a site: Δy and Δc over the trainable arrays, n_k.
    """

    name = "scaffold"
    contract_case = {
        "config": {"optimizer": "sgd", "momentum": 0.0, "lr": 0.05},
        "why": "SCAFFOLD's control variates assume plain SGD steps (it refuses adaptive optimizers)",
    }
    global_model = True
    client_half = ScaffoldClient
    folds_evaluation = True
    trains_backbone = True
    dp_sgd = True  # c_i is computed from the DP-trained parameters: post-processing
    options = (
        Option(
            "scaffold-global-lr",
            1.0,
            "SCAFFOLD server step size eta_g (needs optimizer='sgd', momentum=0)",
            positive,
            "scaffold",
        ),
    )

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        if cfg.optimizer != "sgd" or cfg.momentum != 0:
            raise bad(
                "optimizer",
                cfg.optimizer,
                "scaffold's control variates (option II) assume plain SGD "
                f"steps: use optimizer='sgd' momentum=0 (momentum is {cfg.momentum})",
            )

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        self.control = _zeros_like(self.global_arrays)

    def reply_spec(self, node_id: int) -> ArraySpec:
        return OrderedDict([*self.spec.items(), *((CONTROL + k, self.spec[k]) for k in self.control)])

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        arrays = OrderedDict(self.global_arrays)
        arrays.update((CONTROL + k, v) for k, v in self.control.items())
        return RecordDict({"arrays": to_record(arrays), "config": self.base_config(rnd)})

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        delta_y = _mean([{k: r.arrays[k] for k in self.spec} for r in replies])
        delta_c = _mean([{k: r.arrays[CONTROL + k] for k in self.control} for r in replies])
        share = len(replies) / max(self.federation_size, 1)
        for k in self.spec:
            self.global_arrays[k] = (self.global_arrays[k] + self.cfg.scaffold_global_lr * delta_y[k]).astype(
                np.float32
            )
        for k in self.control:
            self.control[k] = (self.control[k] + share * delta_c[k]).astype(np.float32)

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        return OrderedDict([*self.global_arrays.items(), *((CONTROL + k, v) for k, v in self.control.items())]), {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if not k.startswith(CONTROL)}, meta)
        self.control = OrderedDict((k, np.array(arrays[CONTROL + k])) for k in self.control)


# ----------------------------------------------------------------------------- FedDyn
class FedDynClient(ClientHalf):
    """Local training with FedDyn's linear and quadratic terms; keeps h_i, sends θ_i."""

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        anchor = from_record(message.content["arrays"])
        alpha = rt.cfg.feddyn_alpha
        state = PersonalState(rt, key="feddyn-h")
        h = state.load(before=rt.round) or _zeros_like(anchor)
        rt.model.set_trainable(anchor)
        rt.model.to(rt.device)
        extra = feddyn_term(rt.model, _tensors(h, rt.device), _tensors(anchor, rt.device), alpha)
        metrics = rt.train_local(extra)
        theta = rt.model.get_trainable()
        state.save(rt.round, OrderedDict((k, (h[k] - alpha * (theta[k] - anchor[k])).astype(np.float32)) for k in h))
        metrics["num-examples"] = len(rt.data.train)
        return self.reply(arrays=theta, metrics=metrics)


@register_strategy
class FedDyn(FederatedStrategy):
    """FedDyn: h ← h − (α/N)·Σ_S(θ_i − θ), θ ← mean_S(θ_i) − h/α.

    Leaves a site: its trainable arrays after local training, n_k.
    """

    name = "feddyn"
    global_model = True
    client_half = FedDynClient
    folds_evaluation = True
    trains_backbone = True
    client_dp = ("site",)  # h and θ are post-processing of the noised θ_i
    dp_sgd = True
    options = (Option("feddyn-alpha", 0.01, "FedDyn regulariser alpha", positive, "feddyn"),)

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        self.h = _zeros_like(self.global_arrays)

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        alpha, total = self.cfg.feddyn_alpha, max(self.federation_size, 1)
        mean = _mean([r.arrays for r in replies])
        self.global_arrays.update((k, mean[k]) for k in self.spec if k not in self.h)  # running statistics
        for k in self.h:
            drift = sum(r.arrays[k].astype(np.float64) - self.global_arrays[k] for r in replies)
            self.h[k] = (self.h[k] - alpha / total * drift).astype(np.float32)
            self.global_arrays[k] = (mean[k] - self.h[k] / alpha).astype(np.float32)

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        return OrderedDict([*self.global_arrays.items(), *((DYN_H + k, v) for k, v in self.h.items())]), {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if not k.startswith(DYN_H)}, meta)
        self.h = OrderedDict((k, np.array(arrays[DYN_H + k])) for k in self.h)
