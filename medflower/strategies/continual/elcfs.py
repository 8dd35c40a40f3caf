"""ELCFS (Liu, Chen, Qin, Dou and Heng, "FedDG: Federated Domain Generalization on Medical Image Segmentation via
Episodic Learning in Continuous Frequency Space", CVPR 2021) as a FedKEI baseline, adapted to FedKEI's continual
protocol as the FedKEI paper's Table I does (docs/methods/baselines-continual.md#elcfs-elcfs).

Task t ≥ 2 starts from the n_i-weighted mean of the knowledge pool (``protocol.PoolMeanInit``, as
``fedavg-init``). Before a task's fine-tuning the sites share amplitude spectra (the paper's distribution bank):
each site sends the amplitude spectra of its task-t training images, the server relays to every site the other
sites' ones. Fine-tuning is ELCFS's episodic step per batch (the authors' ``train_ELCFS.py``):

    θ' = θ − β·clip(∇_θ L(θ; x))                                         (meta-train on the raw batch x)
    x̃ = F⁻¹[((1 − λ)·A(x) + λ·A_n)·M + A(x)·(1 − M), P(x)]               (continuous frequency interpolation)
    θ ← the run's optimizer on ∇_θ [L(θ; x) + L(θ'; x̃)]                   (meta-test at θ', both losses weight 1)

A, P: amplitude and phase of the 2-D FFT (per channel); A_n: the amplitude of an image of another site (a site drawn
uniformly, then one of its images); M: the central (2b+1)² low-frequency window, b = ⌊min(H, W)·L⌋; λ ~ U(0, 1) per
image; x̃ clipped to the pixel range. β = ``elcfs-inner-lr``, first order by default as the authors' code (their
inner gradient is taken without a graph), ``elcfs-order='second'`` back-propagates through it. The paper's
boundary-oriented contrastive loss needs segmentation masks and is left out: FedKEI's tasks are classifications.

Only the window of an amplitude enters x̃, so a site sends the window (``amplitude_window``): the same x̃ as the full
spectrum, (2b+1)²·3 values per image instead of H·W·3. A site with no other site's amplitudes trains plainly.

What leaves a site: after each task its fine-tuned module θ_i^t (adapter + head) and n_i; before each task the
number of its task-t training images and the low-frequency amplitude windows of (up to ``elcfs-bank-size`` of) them.
What comes to a site: the pool mean (tasks t ≥ 2) and the other sites' amplitude windows.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...contract import from_record, register_strategy, to_record
from ...data import make_loader
from ...data.transforms import IMAGENET_MEAN, IMAGENET_STD
from ...options import Option, non_negative, one_of
from ...training import OptimizerSpec
from ...training.loops import StepLoss, train_epochs
from ...training.losses import task_loss
from .protocol import CONTINUAL_OPTIONS, ContinualClient, PoolMeanInit

RECORD = "elcfs"  # the fine-tuning message's record of the other sites' amplitude windows (site/<j>)
AMPLITUDES = "amplitudes"  # the amplitude reply's array: [images, channels, 2b+1, 2b+1]
SEND = "elcfs-send"  # the amplitude message's config: how many windows to send (absent: report the count only)
CHANNELS = 3  # the model's input channels (a grayscale image is repeated, ``data.transforms.normalise``)
INNER_CLIP = 100.0  # the authors' clip_value: the inner gradient is clipped to ±100 elementwise


def window_ratio(v: float) -> str | None:
    return None if 0 <= v < 0.5 else "must lie in [0, 0.5) (the window must fit inside the spectrum)"


WINDOW = Option(
    "elcfs-window",
    0.003,
    "elcfs: low-frequency window ratio L: amplitudes are interpolated in the central (2b+1)^2 frequencies, "
    "b = floor(L * img-size) (the authors' 0.003; b = 0, the DC term only, below 334 px)",
    window_ratio,
    "elcfs",
)
INNER_LR = Option(
    "elcfs-inner-lr", 0.001, "elcfs: inner (meta-train) step beta, theta' = theta - beta*grad", non_negative, "elcfs"
)
ORDER = Option(
    "elcfs-order",
    "first",
    "elcfs: meta-gradient through the inner step: first = the authors' (inner gradient as a constant), second = "
    "with its Hessian term",
    one_of("first", "second"),
    "elcfs",
)
BANK_SIZE = Option(
    "elcfs-bank-size",
    0,
    "elcfs: most amplitude spectra a site sends per task, drawn from its task's training images (0: all of them)",
    non_negative,
    "elcfs",
)


# ----------------------------------------------------------------------------- the frequency space
def window_bounds(height: int, width: int, ratio: float) -> tuple[int, int, int, int]:
    """Rows h1:h2 and columns w1:w2 of the low-frequency window in the centred (fftshift) spectrum: (2b+1)² around
    (⌊H/2⌋, ⌊W/2⌋), b = ⌊min(H, W)·L⌋, as the authors' ``low_freq_mutate_np``."""
    b = math.floor(min(height, width) * ratio)
    ch, cw = height // 2, width // 2
    return ch - b, ch + b + 1, cw - b, cw + b + 1


def window_width(size: int, ratio: float) -> int:
    h1, h2, _, _ = window_bounds(size, size, ratio)
    return h2 - h1


def amplitude_window(images: torch.Tensor, ratio: float) -> torch.Tensor:
    """The low-frequency window of the amplitude spectra |F(x)| of images [B, C, H, W]: [B, C, 2b+1, 2b+1]
    (orthonormal FFT; the full spectrum's other entries never enter the interpolation)."""
    amp = torch.fft.fftshift(torch.fft.fft2(images.float(), norm="ortho").abs(), dim=(-2, -1))
    h1, h2, w1, w2 = window_bounds(images.shape[-2], images.shape[-1], ratio)
    return amp[..., h1:h2, w1:w2]


def frequency_interpolate(images: torch.Tensor, target: torch.Tensor, lam: torch.Tensor, ratio: float) -> torch.Tensor:
    """ELCFS's continuous frequency space interpolation: the images [B, C, H, W] with their amplitude in the window
    replaced by (1 − λ)·A(x) + λ·A_n (``target`` [B, C, 2b+1, 2b+1], the other site's window; ``lam`` [B]) and
    their phase kept; the real part of the inverse FFT, not clipped."""
    spectrum = torch.fft.fft2(images.float(), norm="ortho")
    amp = torch.fft.fftshift(spectrum.abs(), dim=(-2, -1))
    h1, h2, w1, w2 = window_bounds(images.shape[-2], images.shape[-1], ratio)
    lam = lam.to(amp).view(-1, 1, 1, 1)
    amp[..., h1:h2, w1:w2] = (1 - lam) * amp[..., h1:h2, w1:w2] + lam * target.to(amp)
    amp = torch.fft.ifftshift(amp, dim=(-2, -1))
    return torch.fft.ifft2(torch.polar(amp, spectrum.angle()), norm="ortho").real


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return mean, std


def to_pixels(x: torch.Tensor) -> torch.Tensor:
    """A loader's ImageNet-normalised batch back to pixels in [0, 1] (the images the spectra are of)."""
    mean, std = _stats(x)
    return x * std + mean


def from_pixels(pixels: torch.Tensor) -> torch.Tensor:
    mean, std = _stats(pixels)
    return (pixels - mean) / std


class FrequencyMix:
    """x -> x̃ for a normalised batch: per image a site drawn uniformly among ``banks`` (one window array per other
    site), one of its windows uniformly, λ ~ U(0, 1); interpolated in pixel space, clipped to [0, 1] (the authors
    clip to 0..255), normalised again. Seeded by ``generator``."""

    def __init__(self, banks: list[torch.Tensor], ratio: float, generator: torch.Generator):
        self.banks, self.ratio, self.generator = banks, ratio, generator

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, g = len(x), self.generator
        sites = torch.randint(len(self.banks), (n,), generator=g)
        target = torch.stack(
            [self.banks[s][torch.randint(len(self.banks[s]), (1,), generator=g).item()] for s in sites.tolist()]
        )
        lam = torch.rand(n, generator=g)
        with torch.no_grad():
            pixels = frequency_interpolate(to_pixels(x.float()), target.to(x.device), lam.to(x.device), self.ratio)
        return from_pixels(pixels.clamp(0.0, 1.0)).to(x.dtype)


# ----------------------------------------------------------------------------- the episodic step
def episodic_steps(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    transform: Callable[[torch.Tensor], torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    inner_lr: float,
    optimizer: OptimizerSpec,
    second_order: bool = False,
    epochs: int = 1,
    after_epoch: Callable[[int], None] | None = None,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
) -> dict[str, float]:
    """ELCFS's local training over the model's parameters that require grad: per batch (x, y), the inner loss
    L(θ; x), θ' = θ − β·clip(∇L(θ; x), ±100), the outer loss L(θ'; transform(x)) at θ' (``functional_call``), and
    one optimizer step on ∇_θ [L(θ; x) + L(θ'; x̃)]. First order (the authors'): the inner gradient enters θ' as a
    constant; ``second_order``: differentiated through. ``batches`` is iterated once per epoch. Returns the mean
    inner and outer losses and the number of steps.

    The episodic step is ``train_epochs``'s step hook: it returns L(θ; x) + L(θ'; x̃), which the loop checks,
    backpropagates and steps on (its device, precision and bookkeeping). No DP-SGD (the method's ``dp_sgd`` stays
    False): θ' moves by the whole batch's gradient, so one image changes the outer loss of every row, which
    per-sample clipping does not bound."""
    params = OrderedDict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    plist = list(params.values())

    def kernels():  # second order differentiates twice: torch's fused attention kernels cannot, its math one can
        return sdpa_kernel(SDPBackend.MATH) if second_order else contextlib.nullcontext()

    def episodic_step(model: nn.Module, batch, opt, forward) -> StepLoss:
        x, y = batch
        x_tilde = transform(x)
        with forward(), kernels():
            inner = loss_fn(model(x), y)  # meta-train: L(θ; x)
        grads = torch.autograd.grad(inner, plist, create_graph=second_order, retain_graph=True, allow_unused=True)
        fast = {
            name: p if g is None else p - inner_lr * g.clamp(-INNER_CLIP, INNER_CLIP)
            for (name, p), g in zip(params.items(), grads)
        }
        with forward(), kernels():
            outer = loss_fn(functional_call(model, fast, (x_tilde,)), y)  # meta-test: L(θ'; x̃)
        return StepLoss(inner + outer, means={"train_loss": (inner, len(y)), "outer_loss": (outer, len(y))})

    return train_epochs(
        model,
        batches,
        epochs=epochs,
        optimizer=optimizer,
        device=torch.device(device),
        after_epoch=after_epoch,
        precision=precision,
        step=episodic_step,
        losses=("train_loss", "outer_loss"),
    )


# ----------------------------------------------------------------------------- client half
def amplitude_problem(value: np.ndarray, width: int) -> str | None:
    """Why ``value`` cannot be a bank of amplitude windows [n ≥ 1, 3, width, width] (finite, ≥ 0), or None."""
    if value.ndim != 4 or value.shape[0] < 1 or value.shape[1:] != (CHANNELS, width, width):
        return f"amplitude windows of shape {value.shape}, expected (n >= 1, {CHANNELS}, {width}, {width})"
    if not np.isfinite(value).all():
        return "amplitude windows with NaN/Inf values"
    if (value < 0).any():
        return "amplitude windows with negative values; an amplitude |F(x)| is >= 0"
    return None


class ELCFSClient(ContinualClient):
    """Sends its amplitude windows on request; fine-tunes by ELCFS's episodic step with the other sites' windows
    (plainly without any); sends the module."""

    def elcfs_amplitudes(self, message: Message) -> RecordDict:
        """The number of this task's training images; with ``elcfs-send`` = m, the amplitude windows of m of them
        (a seeded draw without replacement; all when m is their number)."""
        rt = self.rt
        train = self.task_split("train")
        config = message.content["config"]
        metrics = {"num-examples": len(train)}
        if SEND not in config:
            return self.reply(metrics=metrics)
        count = int(config[SEND])
        if not 1 <= count <= len(train):
            raise ValueError(f"asked for {count} amplitude spectra; this task has {len(train)} training images")
        loader = make_loader(train, rt.cfg.batch_size, False, 0, **rt.loader_options(False))
        ratio = float(rt.cfg.elcfs_window)
        with torch.no_grad():
            windows = torch.cat([amplitude_window(to_pixels(x.float()), ratio) for x, _ in loader])
        keep = np.arange(len(train))
        if count < len(train):
            keep = np.sort(np.random.default_rng(rt.seed(8)).choice(len(train), size=count, replace=False))
        arrays = OrderedDict([(AMPLITUDES, windows[torch.as_tensor(keep)].numpy().astype(np.float32))])
        return self.reply(arrays=arrays, metrics={**metrics, "elcfs_sent": count})

    def banks(self, message: Message) -> list[torch.Tensor]:
        """The other sites' amplitude windows the fine-tuning message carries (checked), one tensor per site."""
        record = message.content.array_records.get(RECORD)
        if record is None:
            return []
        width = window_width(int(self.rt.cfg.img_size), float(self.rt.cfg.elcfs_window))
        banks = []
        for name, value in from_record(record).items():
            if problem := amplitude_problem(value, width):
                raise ValueError(f"received {name}: {problem}")
            banks.append(torch.as_tensor(value))
        return banks

    def train(self, message: Message) -> RecordDict:
        self.other_banks = self.banks(message)
        return super().train(message)

    def finetune(self, train, epochs: int, after_epoch, extra_loss, device: torch.device) -> dict:
        rt, cfg = self.rt, self.rt.cfg
        if not self.other_banks:  # one site, or no other site's amplitudes arrived: plain fine-tuning
            return {**super().finetune(train, epochs, after_epoch, extra_loss, device), "elcfs_sites": 0}
        model = rt.model
        task = getattr(model, "task", "classification")

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return task_loss(task, logits, y)  # ELCFS adds no term of its own (``finetune_loss`` is None here)

        transform = FrequencyMix(self.other_banks, float(cfg.elcfs_window), torch.Generator().manual_seed(rt.seed(7)))
        metrics = episodic_steps(
            model,
            make_loader(train, cfg.batch_size, True, rt.seed(1), **rt.loader_options(True)),
            transform,
            loss_fn,
            inner_lr=float(cfg.elcfs_inner_lr),
            optimizer=rt.optimizer(),
            second_order=cfg.elcfs_order == "second",
            epochs=epochs,
            after_epoch=after_epoch,
            device=device,
            precision=cfg.precision,
        )
        return {**metrics, "elcfs_sites": len(self.other_banks), "elcfs_bank": sum(len(b) for b in self.other_banks)}


# ----------------------------------------------------------------------------- server half
@register_strategy
class ELCFS(PoolMeanInit):
    """ELCFS (Liu et al., CVPR 2021) in FedKEI's continual protocol: task t starts from the n_i-weighted mean of the
    pool; before it the sites' low-frequency amplitude windows are gathered and relayed; fine-tuning is the episodic
    step L(θ; x) + L(θ − β∇L(θ; x); x̃) with x̃ the image with another site's amplitude interpolated in.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; before every task the number of its
    task-t training images and their amplitude windows (up to ``elcfs-bank-size``); with each task's metrics its
    test size and number of positive test images (n_test, n_test_positive).
    """

    name = "elcfs"
    client_half = ELCFSClient
    options = (*CONTINUAL_OPTIONS, WINDOW, INNER_LR, ORDER, BANK_SIZE)
    extra_actions = (("train", "elcfs_amplitudes"),)
    reads_pixels = True  # the amplitude spectra are of the images
    contract_case: ClassVar[dict[str, Any]] = {
        **PoolMeanInit.contract_case,
        "no_arrays_down": (),
        "why": "walks fedkei's tasks; task 1's fine-tuning messages carry the other sites' amplitude windows",
    }

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """The pool-mean start, and to every node the other sites' amplitude windows."""
        contents = super().task_contents(grid, task, nodes)
        banks = self.amplitude_phase(grid, task, nodes) if len(nodes) > 1 else {}
        for node, content in contents.items():
            others = [bank for source, bank in banks.items() if source != node]
            if others:
                content[RECORD] = to_record(OrderedDict((f"site/{j}", bank) for j, bank in enumerate(others)))
        self.stats.extra["elcfs_banks"] = {self.client_name(n): int(len(b)) for n, b in banks.items()}
        return contents

    def amplitude_phase(self, grid, task: int, nodes: list[int]) -> dict[int, np.ndarray]:
        """Each node's task-t image count, then its amplitude windows (min(count, ``elcfs-bank-size``) of them);
        the windows that pass the checks, by node, in node order. A node whose windows fail is dropped and logged."""
        action = "train.elcfs_amplitudes"
        ask = {n: RecordDict({"config": self.base_config(task)}) for n in nodes}
        counts = {}
        for reply in self.counted_exchange(grid, action, ask, task, None, "amplitude_counts"):
            if "num-examples" not in reply.metrics:
                self.reject(task, action, reply.client, "an amplitude count reply must declare num-examples")
            elif reply.num_examples > 0:
                counts[reply.node_id] = int(reply.num_examples)
        cap = int(self.cfg.elcfs_bank_size)
        send = {n: min(c, cap) if cap else c for n, c in counts.items()}
        width = window_width(int(self.cfg.img_size), float(self.cfg.elcfs_window))
        contents = {n: RecordDict({"config": self.base_config(task, **{SEND: m})}) for n, m in send.items()}

        def expect(node: int):
            return OrderedDict([(AMPLITUDES, ((send[node], CHANNELS, width, width), "float32"))])

        banks = {}
        for reply in self.counted_exchange(grid, action, contents, task, expect, "amplitudes"):
            if problem := amplitude_problem(reply.arrays[AMPLITUDES], width):
                self.reject(task, action, reply.client, problem)
                continue
            banks[reply.node_id] = reply.arrays[AMPLITUDES]
        if len(banks) < len(nodes):
            log(WARNING, "[medflower] task %d: amplitude windows of %d of %d sites", task, len(banks), len(nodes))
        return {n: banks[n] for n in nodes if n in banks}
