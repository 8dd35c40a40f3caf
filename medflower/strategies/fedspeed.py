"""FedSpeed (Sun, Shen, Huang, Ding and Tao, "FedSpeed: Larger Local Interval, Less Communication Round, and Higher
Generalization Accuracy", ICLR 2023, Algorithm 1), over the trainable arrays (adapters + head, or the whole backbone).

Round t, site i, from the global x^t (x_{i,0} = x^t), K local steps k = 0..K-1 on minibatches ε:

    g1 = ∇f_i(x_k; ε),   y_k = x_k + ρ·g1/‖g1‖,   g2 = ∇f_i(y_k; ε)             (gradient perturbation, lines 7-9)
    g̃_k = (1 − α)·g1 + α·g2                                                     (quasi-gradient, line 10)
    x_{k+1} = x_k − η·(g̃_k − ĝ_i^{t−1} + (x_k − x^t)/λ)                         (prox-corrected step, line 11)

then ĝ_i^t = ĝ_i^{t−1} − (x_K − x^t)/λ (line 13) and the site uploads x̂_i = x_K − λ·ĝ_i^t (line 14). The server
takes their plain mean over the participating sites, x^{t+1} = (1/|S|)·Σ_{i∈S} x̂_i (Algorithm 1's server step; no size
weights). ĝ_i (zero before a site's first round) stays on the site, in its ``PersonalState`` (key ``fedspeed``), so a
resumed run or a restarted site gets it back. ‖g1‖ is the norm over every trainable array together (the reference's).

FedSpeed needs two gradients at two points per step and a correction on the gradient itself: ``fedspeed_steps`` is
that step as the step hook of ``train_epochs`` (medflower/training/loops.py), which sets the corrected gradient and
leaves the loop the optimizer step: the run's optimizer fed with the corrected gradient. With ``optimizer='sgd'
momentum=0 weight-decay=0`` (SiFT's recipe) it is exactly line 11. BatchNorm running statistics (``adapter='full'``)
have no gradient: no ĝ, no perturbation, x̂ = x_K for them, and the perturbed pass leaves them as the unperturbed pass
set them. The method as implemented and its decisions: docs/methods/baselines-fedavg-like.md#fedspeed.

What leaves a site: x̂_i over the trainable arrays, and n_k. ĝ_i and x_K stay on the site.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
from flwr.app import Message, RecordDict
from torch import nn

from .. import profiling
from ..contract import (
    ClientHalf,
    FederatedStrategy,
    PersonalState,
    Reply,
    from_record,
    register_strategy,
    weighted_mean,
)
from ..models.arrays import is_running_statistic
from ..options import Option, positive
from ..training import OptimizerSpec
from ..training.loops import StepLoss, train_epochs
from ..training.losses import task_loss


def _unit_interval(v: float) -> str | None:
    return None if 0 <= v <= 1 else "must be in [0, 1]"


def _non_negative(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0 (0: no perturbation)"


OPTIONS = (
    Option(
        "fedspeed-lambda",
        10.0,
        "fedspeed: prox coefficient lambda; the local step adds (x - x^t)/lambda - g_hat_i (reference 1/lambda = 0.1)",
        positive,
        "fedspeed",
    ),
    Option(
        "fedspeed-rho",
        0.1,
        "fedspeed: radius rho of the gradient perturbation y = x + rho*g/||g|| (reference 0.1; 0 turns it off)",
        _non_negative,
        "fedspeed",
    ),
    Option(
        "fedspeed-alpha",
        0.9,
        "fedspeed: weight alpha of the perturbed gradient in (1 - alpha)*g(x) + alpha*g(y), in [0, 1]",
        _unit_interval,
        "fedspeed",
    ),
)


def fedspeed_steps(
    model: nn.Module,
    params: Mapping[str, nn.Parameter],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    optimizer: OptimizerSpec,
    anchor: Mapping[str, torch.Tensor],
    g_hat: Mapping[str, torch.Tensor],
    lam: float,
    rho: float,
    alpha: float,
    epochs: int = 1,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
) -> dict[str, float]:
    """FedSpeed's local steps (Algorithm 1, lines 6-12) on ``params`` (name -> parameter of ``model``): each batch,
    the quasi-gradient g̃ = (1 − α)·g(x) + α·g(x + ρ·g(x)/‖g(x)‖), then the optimizer steps on
    g̃ − ĝ + (x − anchor)/λ. ``anchor`` is x^t and ``g_hat`` ĝ_i^{t−1}, both by name over ``params``. ``batches`` is
    iterated once per epoch. Returns the mean loss at the unperturbed points and the number of steps.

    The step (lines 7-11) is ``train_epochs``'s step hook (the loop's device, precision, finite-loss check and
    bookkeeping); it sets the corrected gradient itself. No DP-SGD (the method's ``dp_sgd`` stays False): the
    perturbation ρ·g/‖g‖ is the whole batch's gradient, so one image moves the point y_k where every row's g2 is
    taken, which per-sample clipping does not bound."""
    names = list(params)
    plist = [params[k] for k in names]

    def gradients(x, y, opt, forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
        opt.zero_grad(set_to_none=True)
        with forward():
            loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in plist]

    def speed_step(model: nn.Module, batch, opt, forward) -> StepLoss:
        x, y = batch
        loss, g1 = gradients(x, y, opt, forward)  # g1 = ∇f_i(x_k; ε) (line 7)
        quasi = g1
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in g1)))
        if rho > 0 and alpha > 0 and norm > 0:
            at = [p.detach().clone() for p in plist]
            buffers = [(b, b.detach().clone()) for b in model.buffers()]  # running statistics: the x_k pass's
            with torch.no_grad():
                for p, g in zip(plist, g1):
                    p.add_(g, alpha=rho / norm)  # y_k = x_k + ρ·g1/‖g1‖ (line 8)
            _, g2 = gradients(x, y, opt, forward)  # g2 = ∇f_i(y_k; ε) (line 9)
            with torch.no_grad():
                for p, v in zip(plist, at):
                    p.copy_(v)
                for b, v in buffers:
                    b.copy_(v)
            quasi = [(1 - alpha) * a + alpha * b for a, b in zip(g1, g2)]  # g̃_k (line 10)
        with torch.no_grad():
            for k, p, g in zip(names, plist, quasi):
                p.grad = g + (p.detach() - anchor[k]) / lam - g_hat[k]  # line 11's direction; the loop steps
        return StepLoss(None, means={"train_loss": (loss, len(y))})

    return train_epochs(
        model,
        batches,
        epochs=epochs,
        optimizer=optimizer,
        device=torch.device(device),
        param_groups=[{"params": plist}],
        precision=precision,
        step=speed_step,
    )


def dual_and_upload(
    x_k: Mapping[str, np.ndarray], anchor: Mapping[str, np.ndarray], g_hat: Mapping[str, np.ndarray], lam: float
) -> tuple[OrderedDict[str, np.ndarray], OrderedDict[str, np.ndarray]]:
    """Lines 13-14: ĝ_i^t = ĝ_i^{t−1} − (x_K − x^t)/λ over the arrays of ``g_hat``, and the upload x̂_i = x_K − λ·ĝ_i^t
    over every array of ``x_k`` (x_K itself for the running statistics, which have no ĝ)."""
    new = OrderedDict(
        (k, (g_hat[k].astype(np.float64) - (x_k[k].astype(np.float64) - anchor[k]) / lam).astype(np.float32))
        for k in g_hat
    )
    upload = OrderedDict(
        (k, (v.astype(np.float64) - lam * new[k]).astype(np.float32) if k in new else np.array(v, np.float32))
        for k, v in x_k.items()
    )
    return new, upload


def _zeros(arrays: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """ĝ before a site's first round: zero for every array with a gradient (running statistics have none)."""
    return OrderedDict(
        (k, np.zeros_like(v, dtype=np.float32)) for k, v in arrays.items() if not is_running_statistic(k)
    )


# ----------------------------------------------------------------------------- client half
class FedSpeedClient(ClientHalf):
    """FedSpeed's K local steps from x^t, then ĝ_i and x̂_i; keeps ĝ_i, sends x̂_i."""

    def personal(self) -> PersonalState:
        return PersonalState(self.rt, key="fedspeed")

    def train(self, message: Message) -> RecordDict:
        rt, cfg = self.rt, self.rt.cfg
        anchor = from_record(message.content["arrays"])
        state = self.personal()
        g_hat = state.load(before=rt.round) or _zeros(anchor)
        model = rt.model
        model.set_trainable(anchor)
        model.to(rt.device)
        params = model.trainable_parameters()
        tensors = {k: torch.as_tensor(v, device=rt.device) for k, v in anchor.items() if k in params}
        g_tensors = {k: torch.as_tensor(g_hat[k], device=rt.device) for k in params}
        task = getattr(model, "task", "classification")
        torch.manual_seed(rt.seed(2))  # as rt.train_local: the same seed purpose for local training
        with profiling.phase("train"):
            metrics = fedspeed_steps(
                model,
                params,
                rt.loader("train", shuffle=True),
                lambda logits, y: task_loss(task, logits, y),
                optimizer=rt.optimizer(),
                anchor=tensors,
                g_hat=g_tensors,
                lam=cfg.fedspeed_lambda,
                rho=cfg.fedspeed_rho,
                alpha=cfg.fedspeed_alpha,
                epochs=cfg.local_epochs,
                device=rt.device,
                precision=cfg.precision,
            )
        new_g, upload = dual_and_upload(model.get_trainable(), anchor, g_hat, cfg.fedspeed_lambda)
        state.save(rt.round, new_g)
        flat = np.concatenate([v.reshape(-1) for v in new_g.values()]) if new_g else np.zeros(1)
        metrics["fedspeed_g_hat_norm"] = float(np.linalg.norm(flat))
        metrics["num-examples"] = len(rt.data.train)
        return self.reply(arrays=upload, metrics=metrics)


# ----------------------------------------------------------------------------- server half
@register_strategy
class FedSpeed(FederatedStrategy):
    """FedSpeed (Sun et al., ICLR 2023, Algorithm 1): local steps x ← x − η(g̃ − ĝ_i + (x − x^t)/λ) on the quasi-gradient
    g̃ = (1 − α)·g(x) + α·g(x + ρ·g/‖g‖); then ĝ_i ← ĝ_i − (x_K − x^t)/λ and x̂_i = x_K − λ·ĝ_i; the server takes
    x^{t+1} = mean_S(x̂_i), unweighted.

    Leaves a site: x̂_i over the trainable arrays (adapters + head, or the whole backbone with its BatchNorm
    statistics), n_k; ĝ_i stays on it.
    """

    local_steps = False  # its sites train by their own loop (local-epochs / task-epochs)

    name = "fedspeed"
    global_model = True
    client_half = FedSpeedClient
    folds_evaluation = True  # the default round: train, aggregate, evaluate the global arrays
    trains_backbone = True
    options = OPTIONS

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        mean = weighted_mean([r.arrays for r in replies], [1.0] * len(replies))  # the paper's 1/|S|
        self.global_arrays.update((k, mean[k].astype(np.float32)) for k in self.spec)
