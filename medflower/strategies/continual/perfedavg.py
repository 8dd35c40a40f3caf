"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020), first-order variant (Per-FedAvg (FO)), as a FedKEI baseline
adapted to FedKEI's continual protocol as the FedKEI paper's Table I does.

Per-FedAvg's local objective is the MAML one, F_i(w) = f_i(w − α∇f_i(w)) (Eq. 3). Its first-order local step
(Algorithm 1 with the Hessian term dropped), on two separate batches D and D' of the site's task:

    w̃ = w − α·∇f_i(w; D)             (inner step, plain SGD with α = ``perfedavg-alpha``)
    w ← w − β·∇f_i(w̃; D')            (outer step: the run's optimizer at β = ``lr``, fed with ∇f_i(w̃; D'))

Here the task's whole fine-tuning is these steps: ``task-epochs`` passes over the task's training split in chunks of
2·``batch-size`` rows, each split into D and D' (as the PFLlib reimplementation does). The module a site uploads,
and the pool keeps, is its meta-model w; task t ≥ 2 starts from the n_i-weighted mean of the pooled meta-models
(as ``fedkei-variant='fedavg-init'`` starts from the pooled modules). The AUC a site reports after every epoch is of
its personalised model, the meta-model after one inner step on a training batch (Per-FedAvg's personalisation,
Eq. 3); ``auc_meta`` is the meta-model's own final AUC. The method as implemented and its decisions:
docs/methods/baselines-continual.md#per-fedavg-per-fedavg.

A meta-step takes a gradient at w̃ and applies it at w: ``perfedavg_steps`` is that step as ``train_epochs``'s step
hook, which sets the gradient itself and leaves the loop the optimizer step.

What leaves a site: after each task its meta-model w_i^t (adapter + head) and n_i. What comes to a site: the pool mean
(tasks t ≥ 2). Per task and client 2·|θ| (task 1: |θ|).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from ...contract import register_strategy
from ...data import make_loader
from ...options import Option, positive
from ...training import OptimizerSpec, evaluate
from ...training.loops import StepLoss, autocast, train_epochs
from ...training.losses import task_loss
from .protocol import CONTINUAL_OPTIONS, ContinualClient, PoolMeanInit

PERFEDAVG_ALPHA = Option(
    "perfedavg-alpha",
    0.005,
    "per-fedavg: inner (personalisation) SGD step alpha, w - alpha*grad f(w; D); the outer step beta is the run's lr",
    positive,
    "per-fedavg",
)


def perfedavg_steps(
    model: nn.Module,
    params: Mapping[str, nn.Parameter],
    chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    alpha: float,
    optimizer: OptimizerSpec,
    epochs: int = 1,
    after_epoch: Callable[[int], None] | None = None,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
) -> dict[str, float]:
    """Per-FedAvg (FO) local steps on ``params`` (name -> parameter of ``model``): each chunk of rows is split into
    D (first half, rounded up) and D'; w̃ = w − α·∇f(w; D), then the optimizer (step β) steps w on ∇f(w̃; D').
    A chunk of one row is skipped (no D'). ``chunks`` is iterated once per epoch; ``after_epoch(e)`` runs after
    epoch e. Returns the mean loss at w over D, the mean outer loss at w̃ over D', and the number of meta-steps.

    The meta-step is ``train_epochs``'s step hook (the loop's device, precision, finite-loss check and bookkeeping);
    it sets the gradient ∇f(w̃; D') at w itself. No DP-SGD (the method's ``dp_sgd`` stays False): w̃ moves by the
    gradient of the whole of D, so one image of D changes the outer gradient of every row of D', which per-sample
    clipping does not bound."""
    plist = list(params.values())

    def gradient(x: torch.Tensor, y: torch.Tensor, forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with forward():
            loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(loss, plist, allow_unused=True)
        return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(plist, grads)]

    def meta_step(model: nn.Module, batch, opt, forward) -> StepLoss | None:
        x, y = batch
        if len(y) < 2:
            return None
        half = (len(y) + 1) // 2
        at = [p.detach().clone() for p in plist]  # w
        loss_w, g1 = gradient(x[:half], y[:half], forward)
        with torch.no_grad():
            for p, g in zip(plist, g1):
                p.sub_(alpha * g)  # w̃ = w − α∇f(w; D)
        loss_tilde, g2 = gradient(x[half:], y[half:], forward)
        with torch.no_grad():
            for p, v, g in zip(plist, at, g2):
                p.copy_(v)  # back to w, then the outer step on ∇f(w̃; D')
                p.grad = g
        return StepLoss(None, means={"train_loss": (loss_w, half), "meta_loss": (loss_tilde, len(y) - half)})

    return train_epochs(
        model,
        chunks,
        epochs=epochs,
        optimizer=optimizer,
        device=torch.device(device),
        after_epoch=after_epoch,
        param_groups=[{"params": plist}],
        precision=precision,
        step=meta_step,
        losses=("train_loss", "meta_loss"),
    )


def personalise(
    model: nn.Module,
    params: Mapping[str, nn.Parameter],
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    alpha: float,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
) -> list[torch.Tensor]:
    """Per-FedAvg's personalised model (Eq. 3): w ← w − α·∇f(w; batch) in place; returns w to restore it."""
    device = torch.device(device)
    plist = list(params.values())
    saved = [p.detach().clone() for p in plist]
    model.train()
    x, y = batch[0].to(device), batch[1].to(device)
    with autocast(device, precision):
        loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, plist, allow_unused=True)
    with torch.no_grad():
        for p, g in zip(plist, grads):
            if g is not None:
                p.sub_(alpha * g)
    return saved


# ----------------------------------------------------------------------------- client half
class PerFedAvgClient(ContinualClient):
    """Fine-tunes by Per-FedAvg (FO) meta-steps from the task's start; reports the personalised model's AUC after every
    epoch; sends the meta-model."""

    def finetune(self, train, epochs: int, after_epoch, extra_loss, device: torch.device) -> dict:
        rt, cfg = self.rt, self.rt.cfg
        model = rt.model
        params = model.trainable_parameters()
        task = getattr(model, "task", "classification")

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return task_loss(task, logits, y)

        alpha = float(cfg.perfedavg_alpha)
        # personalisation batches: one training batch per evaluation, seeded, never the test split
        adapt = make_loader(train, cfg.batch_size, True, rt.seed(6), **rt.loader_options(True))
        adapt_batches = iter(())

        def next_adapt_batch():
            nonlocal adapt_batches
            try:
                return next(adapt_batches)
            except StopIteration:
                adapt_batches = iter(adapt)
                return next(adapt_batches)

        def evaluate_personalised(epoch: int) -> None:
            saved = personalise(model, params, next_adapt_batch(), loss_fn, alpha, device, cfg.precision)
            try:
                after_epoch(epoch)  # the curve: AUC of the personalised model
            finally:
                with torch.no_grad():
                    for p, v in zip(params.values(), saved):
                        p.copy_(v)  # back to the meta-model

        metrics = perfedavg_steps(
            model,
            params,
            make_loader(train, 2 * cfg.batch_size, True, rt.seed(1), **rt.loader_options(True)),
            loss_fn,
            alpha=alpha,
            optimizer=rt.optimizer(),
            epochs=epochs,
            after_epoch=evaluate_personalised,
            device=device,
            precision=cfg.precision,
        )
        test = make_loader(self.task_split("test"), cfg.batch_size, False, 0, **rt.loader_options(False))
        metrics["auc_meta"] = float(evaluate(model, test, device, precision=cfg.precision)["auc"])
        return metrics


# ----------------------------------------------------------------------------- server half
@register_strategy
class PerFedAvg(PoolMeanInit):
    """Per-FedAvg (FO) (Fallah et al., NeurIPS 2020) in FedKEI's continual protocol: a task's fine-tuning is
    Per-FedAvg's meta-steps w ← w − β∇f(w − α∇f(w; D); D') from the n_i-weighted mean of the pooled meta-models;
    the reported AUC is the personalised model's, w − α∇f(w; batch).

    Leaves a site: its meta-model w_i^t after every task (adapter + head) and n_i; with each task's metrics its test
    size and number of positive test images (n_test, n_test_positive).
    """

    name = "per-fedavg"
    client_half = PerFedAvgClient
    options = (*CONTINUAL_OPTIONS, PERFEDAVG_ALPHA)
