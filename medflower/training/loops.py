"""Local training and evaluation loops shared by every method."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..privacy.dp_sgd import PrivateTraining
from .losses import one_hot_masks, task_loss
from .metrics import CONFUSION, SegmentationScores, classification_metrics, confusion_counts, segmentation_scores

# A method's extra loss term: (model, logits, labels) -> scalar tensor (e.g. FedProx's proximal term).
ExtraLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

# ``train_epochs(step=...)``'s hook ``forward()``: the loop's precision (``autocast``) for forward passes and losses.
Forward = Callable[[], contextlib.AbstractContextManager]


@dataclass
class StepLoss:
    """What one local step hands back to ``train_epochs``.

    ``loss`` (+ ``extra``) is what the loop backpropagates before it steps the optimizer; ``loss`` None: the step has
    set every ``p.grad`` itself and the loop only steps. ``extra`` is a term of the parameters alone (FedProx's
    proximal term): DP-SGD adds its plain gradient to the noised one. ``means`` maps a name of ``train_epochs(losses)``
    to (a mean loss, the rows it is a mean over); None: ``train_loss``, loss + extra over the batch's rows.
    """

    loss: torch.Tensor | None
    extra: torch.Tensor | None = None
    means: Mapping[str, tuple[torch.Tensor | float, int]] | None = None

    def __post_init__(self):
        if self.loss is None and (self.extra is not None or self.means is None):
            raise ValueError("a step that sets its own gradients reports its losses in means, and no extra term")


# One local step: (model, (x, y) on the device, optimizer, forward) -> StepLoss, or None to skip the batch (no step).
# ``forward()`` is entered around forward passes and losses only, never around a backward.
Step = Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.optim.Optimizer, Forward], StepLoss | None]


def task_step(model: nn.Module, extra_loss: ExtraLoss | None = None) -> Step:
    """``train_epochs``'s own step: the model's task loss (cross-entropy, or BCE + Dice for segmentation) plus
    ``extra_loss(model, logits, y)``, backpropagated by the loop. The hook's model may be DP-SGD's wrapper of
    ``model``; ``extra_loss`` gets ``model`` itself."""
    task = getattr(model, "task", "classification")

    def step(net: nn.Module, batch, opt, forward: Forward) -> StepLoss:
        x, y = batch
        with forward():
            logits = net(x)
            loss = task_loss(task, logits, y)
            extra = extra_loss(model, logits, y) if extra_loss is not None else None
        return StepLoss(loss, extra)

    return step


class DeviceError(RuntimeError):
    """The run or the node asks for a device this site does not have. The message names devices only, so a site
    sends it to the server as it is (medflower/site_app.py)."""

    shareable = True


def available_devices() -> list[str]:
    """The devices torch sees here: cpu, cuda:0.. (after CUDA_VISIBLE_DEVICES), mps."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        names.append("mps")
    return names


def pick_device(name: str = "auto") -> torch.device:
    """auto = cuda, then mps, then cpu; else the named device (``cuda``, ``cuda:1``, ``mps``, ``cpu``), which must
    exist here (DeviceError naming the devices this site has)."""
    name = str(name).strip().lower()
    have = available_devices()
    if name == "auto":
        return torch.device("cuda" if "cuda:0" in have else "mps" if "mps" in have else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    known = device is not None and (
        device.type == "cpu"
        or (device.type == "mps" and "mps" in have)
        or (device.type == "cuda" and f"cuda:{device.index or 0}" in have)
    )
    if not known:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        note = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise DeviceError(f"device {name!r} does not exist here; this site has {', '.join(have)}{note}")
    return device


PRECISIONS = ("auto", "fp32", "bf16")


def autocast(device: torch.device, precision: str = "auto"):
    """Mixed precision for forward passes and losses: bf16 autocast on CUDA with ``auto``, on any device with
    ``bf16`` (the CPU too, slower there but equal within bf16's rounding); float32 (no autocast) with ``fp32``
    and with ``auto`` off CUDA."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class OptimizerSpec:
    name: str = "adamw"
    lr: float = 3e-3
    momentum: float = 0.9
    weight_decay: float = 0.0

    def build(self, params: Iterable[nn.Parameter] | Iterable[dict]) -> torch.optim.Optimizer:
        """The optimizer over ``params``: parameters, or torch param groups (dicts with their own ``lr``)."""
        params = list(params)
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if self.name == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)


def _scalar(value: torch.Tensor | float) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def train_epochs(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    epochs: int,
    optimizer: OptimizerSpec,
    device: torch.device,
    extra_loss: ExtraLoss | None = None,
    after_epoch: Callable[[int], None] | None = None,
    param_groups: list[dict] | None = None,
    private: PrivateTraining | None = None,
    precision: str = "auto",
    step: Step | None = None,
    losses: tuple[str, ...] = ("train_loss",),
    max_steps: int = 0,
) -> dict[str, float]:
    """Train the parameters that require grad on the model's task loss (cross-entropy, or BCE + Dice for
    segmentation) plus ``extra_loss``, or by ``step``; returns the mean losses and the number of steps.

    Per batch the loop moves (x, y) to ``device``, calls the step, checks that every loss it returns is finite
    (FloatingPointError before the optimizer steps), backpropagates its ``loss`` (+ ``extra``) unless the step set the
    gradients itself, steps the optimizer, and adds each of the step's ``means`` to ``losses``'s row-weighted means.
    The optimizer's gradients are cleared at the end.

    ``step(model, (x, y), optimizer, forward) -> StepLoss | None`` (default ``task_step(model, extra_loss)``): one
    local step (Per-FedAvg's meta-step, FedSpeed's, ELCFS's episodic one); ``forward()`` is ``autocast`` at
    ``precision``, to enter around forward passes and losses; None skips the batch. ``losses`` names the means the
    step reports, in the order they are returned, before ``train_steps``.
    ``after_epoch(e)`` runs after epoch e (1-based) with the optimizer state kept across epochs
    (a per-epoch evaluation, for example); it must leave the model's trainable parameters as they are.
    ``param_groups`` (torch's dicts, e.g. a learning rate per group) replaces "every parameter that requires grad".
    ``private`` (run-config dp-sgd): DP-SGD steps on Poisson-sampled batches (medflower/privacy/dp_sgd.py), with the
    task step only: per-sample clipping bounds one image's effect on a step only when the step is the gradient of a
    sum of per-sample losses at the current parameters (plus a parameter-only term), which a hook does not promise.
    ``precision`` (run-config precision): ``autocast``'s mode for the forward pass and the losses.
    ``max_steps`` (run-config local-steps) > 0: exactly that many steps instead of ``epochs`` passes, drawing batches
    from the loader and starting a new pass (a new shuffle) when it runs out; ``after_epoch`` runs after each whole
    pass. A loader that yields no batch stops it.
    """
    if private is not None and step is not None:
        raise ValueError("DP-SGD trains by the task step only; a custom step's gradient is not a per-sample sum")
    step = step or task_step(model, extra_loss)
    model.to(device)
    if private is not None:
        private.prepare(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer.build(param_groups or params)
    net = model
    if private is not None:
        net, opt, loader = private.attach(model, opt, loader, device)

    def forward() -> contextlib.AbstractContextManager:
        return autocast(device, precision)

    sums, rows, steps = dict.fromkeys(losses, 0.0), dict.fromkeys(losses, 0), 0
    passes = epochs if max_steps <= 0 else max_steps  # with max_steps, at least one step per pass or it stops
    try:
        for epoch in range(1, passes + 1):
            model.train()  # after_epoch may have evaluated in eval mode
            at_start, partial = steps, False
            for x, y in loader:
                if 0 < max_steps <= steps:
                    partial = True  # stopped inside a pass: no after_epoch for it
                    break
                if private is not None and len(y) == 0:  # an empty Poisson batch: a noise-only step, as Opacus's
                    extra = None
                    if extra_loss is not None:  # a parameter-only term (the only kind DP-SGD allows)
                        y = y.to(device)
                        extra = extra_loss(model, torch.zeros((0,), device=device), y)
                        if extra is not None and not math.isfinite(extra.item()):
                            raise FloatingPointError(f"training loss became {extra.item()} at step {steps}; lower lr")
                    private.noise_step(opt, extra, params)
                    steps += 1
                    continue
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                out = step(net, (x, y), opt, forward)
                if out is None:
                    continue
                whole = out.loss if out.extra is None else out.loss + out.extra
                means = {"train_loss": (whole, len(y))} if out.means is None else out.means
                if unknown := set(means) - set(sums):
                    raise ValueError(f"the step reports {sorted(unknown)}; train_epochs(losses=) has {list(losses)}")
                values = {name: _scalar(value) for name, (value, _) in means.items()}
                for value in ([] if whole is None else [whole.item()]) + list(values.values()):
                    if not math.isfinite(value):
                        raise FloatingPointError(f"training loss became {value} at step {steps}; lower lr")
                if private is not None:
                    private.step(opt, out.loss, out.extra, params)
                elif whole is not None:
                    opt.zero_grad(set_to_none=True)
                    whole.backward()
                    opt.step()
                else:  # the step has set the gradients
                    opt.step()
                for name, (_, n) in means.items():
                    sums[name] += values[name] * n
                    rows[name] += n
                steps += 1
            if partial:
                break
            if after_epoch is not None:
                after_epoch(epoch)
            if 0 < max_steps <= steps or (max_steps > 0 and steps == at_start):
                break
        opt.zero_grad(set_to_none=True)
    finally:
        if private is not None:
            private.close()
    return {**{name: sums[name] / max(rows[name], 1) for name in losses}, "train_steps": float(steps)}


@torch.no_grad()
def predict(
    model: nn.Module, loader: torch.utils.data.DataLoader, device: torch.device, precision: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """Labels and softmax probabilities over a loader."""
    model.to(device).eval()
    ys, ps = [], []
    for x, y in loader:
        with autocast(device, precision):
            logits = model(x.to(device))
        ps.append(torch.softmax(logits.float(), dim=1).cpu().numpy())
        ys.append(y.numpy())
    return np.concatenate(ys), np.concatenate(ps)


def evaluate(
    model: nn.Module,
    loader: torch.utils.data.DataLoader,
    device: torch.device,
    class_names: list[str] | None = None,
    confusion: bool = False,
    empty_masks: str = "skip",
    precision: str = "auto",
) -> dict[str, Any]:
    """Classification: loss, accuracy, balanced accuracy, AUC and n, plus with ``confusion`` the flattened C×C
    counts ``confusion`` (for the server's pooled metrics). Segmentation (``evaluate_segmentation``, scoring an
    image without a structure by run-config ``empty_masks``): loss, Dice, IoU, HD95, empty_fp, hd95_missed, n."""
    if getattr(model, "task", "classification") == "segmentation":
        return evaluate_segmentation(model, loader, device, class_names, empty_masks, precision)
    y, probs = predict(model, loader, device, precision)
    eps = 1e-12
    loss = float(-np.mean(np.log(probs[np.arange(len(y)), y] + eps)))
    out: dict[str, Any] = {"loss": loss, **classification_metrics(y, probs), "n": float(len(y))}
    if confusion:
        out[CONFUSION] = confusion_counts(y, probs.argmax(axis=1), probs.shape[1])
    return out


@torch.no_grad()
def evaluate_segmentation(
    model: nn.Module,
    loader: torch.utils.data.DataLoader,
    device: torch.device,
    class_names: list[str] | None = None,
    empty_masks: str = "skip",
    precision: str = "auto",
) -> dict[str, float]:
    """Per-image hard masks (sigmoid > 0.5) scored per structure by MONAI (``metrics.segmentation_scores``): Dice,
    IoU and HD95 (pixels at the evaluated size) averaged over images per structure ('dice_<structure>', ... when
    there are several) and over structures ('dice', 'iou', 'hd95'); ``empty_fp`` and ``hd95_missed``; mean loss
    and ``n`` images. ``empty_masks`` ('skip' | 'one') scores a structure an image's ground truth lacks
    (docs/data.md#segmentation-metrics). A mean with nothing to average is left out, never NaN."""
    model.to(device).eval()
    scores: list[SegmentationScores] = []
    loss_sum, n = 0.0, 0
    for x, y in loader:
        y = y.to(device)
        with autocast(device, precision):
            logits = model(x.to(device))
        logits = logits.float()
        loss_sum += task_loss("segmentation", logits, y).item() * len(y)
        n += len(y)
        target = one_hot_masks(y, logits.shape[1]).bool()
        scores.append(segmentation_scores((logits > 0).cpu().numpy(), target.cpu().numpy(), empty_masks))
    if n == 0:
        return {"n": 0.0}
    return {"loss": loss_sum / n, **SegmentationScores.concat(scores).metrics(class_names), "n": float(n)}
