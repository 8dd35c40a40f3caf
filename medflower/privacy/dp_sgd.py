"""Sample-level differential privacy of a site's local training: DP-SGD (Abadi et al. 2016) with Opacus
(docs/privacy.md#sample-level-dp-sgd).

Each step, Opacus computes every sample's gradient of the task loss, clips it to ``dp-sgd-max-grad-norm`` and adds
N(0, (z·C)²) to their sum, z = ``dp-sgd-noise-multiplier``; batches are Poisson samples of the site's training
split (rate 1 / batches per epoch). The protected unit is one training image of one site, against everyone who sees
anything the site sends. A method's extra loss term that depends only on parameters (FedProx's proximal term, SGCA's
cosine pull, FedDyn's and SCAFFOLD's linear terms) is added to the noised gradient: it touches no sample, so it costs
no privacy. The noise and the batch sampling draw from generators seeded by the operating system, never from the
run's seed, which the server knows.

Per-sample gradients come from Opacus's hooks, so every trainable layer must be one it has a grad sampler for:
Linear (LoRA's A and B, bottleneck adapters, heads, ViT blocks), Conv2d and LayerNorm (decoders, patch embedding)
work; IA3 (peft keeps its scaling vectors as bare parameters) and BatchNorm (batch statistics mix samples; ResNet
and U-Net trained whole) do not, and are refused before round 1. A table a model reads whole for every image (SAM's
mask tokens, ``shared_tables()``) keeps its values under DP-SGD (``keep_shared_tables``).
"""

from __future__ import annotations

import copy
import functools
import secrets
from collections.abc import Iterable

import torch
from torch import nn

from ..options import Option, positive

DP_SGD_OPTIONS: tuple[Option, ...] = (
    Option(
        "dp-sgd",
        False,
        "sample-level DP-SGD of each site's local training (Opacus): per-sample gradients clipped to "
        "dp-sgd-max-grad-norm, Gaussian noise z·C on their sum; docs/privacy.md#sample-level-dp-sgd",
        None,
        "privacy",
    ),
    Option(
        "dp-sgd-noise-multiplier", 1.0, "z of DP-SGD: noise std z·dp-sgd-max-grad-norm per step", positive, "privacy"
    ),
    Option("dp-sgd-max-grad-norm", 1.0, "C of DP-SGD: L2 bound of one sample's gradient", positive, "privacy"),
)


def _secret_generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def _empty_batches_as_the_loader_makes_them(dp_loader, loader) -> None:
    """Give Opacus's empty Poisson batch the shapes and dtypes of ``loader``'s own batches, from the start.

    Opacus (>= 1.6) builds an empty batch from the first batch it collated. When the very first draw is empty it
    falls back to ``torch.zeros`` with the dtypes of the dataset's first item, and a site's items are numpy arrays
    (a cached encoder output is float16 numpy, a mask uint8): ``torch.zeros`` refuses a numpy dtype and the site's
    round failed with a TypeError. One item collated without augmentation (so the training's augmentation draws are
    untouched), cut to zero rows, is the batch Opacus copies instead."""
    collate = dp_loader.collate_fn
    if not hasattr(collate, "first_batch"):
        raise RuntimeError("this Opacus version's loader has no first_batch; medflower's DP-SGD needs opacus>=1.6")
    plain = copy.copy(loader.collate_fn)
    if hasattr(plain, "augmenter"):
        plain.augmenter = None
    collate.first_batch = [part[:0] for part in plain([loader.dataset[0]])]


def keep_shared_tables(model: nn.Module) -> list[str]:
    """Stop the training of ``model``'s shared tables (``shared_tables()``: parameters it reads whole for every
    image, such as SAM's mask tokens, whose gradient no hook can split by image) and return their names. Under
    DP-SGD they keep their pretrained values: training them on the clipped, noised sum would need their per-sample
    gradients, and training them outside it would release an unclipped gradient of the images."""
    names = list(getattr(model, "shared_tables", list)())
    parameters = dict(model.named_parameters())
    for name in names:
        parameters[name].requires_grad_(False)
    return names


def unsupported_layers(model: nn.Module, img_size: int) -> list[str]:
    """What keeps DP-SGD from training ``model`` (empty when nothing does): BatchNorm layers that train, and trainable
    parameters that get no per-sample gradient in one probe step on random images of the run's size (Opacus's
    hooks, or its functorch fallback for layers without a hook), or on their encoder outputs when the model takes
    those (the frozen-encoder mode)."""
    import copy

    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator

    problems = [str(e) for e in ModuleValidator.validate(model, strict=False)]
    if problems:
        return problems
    probe = copy.deepcopy(model)
    keep_shared_tables(probe)
    inputs = torch.randn(2, 3, img_size, img_size)
    if getattr(probe, "encoded_inputs", False):  # frozen-encoder mode: the model takes its encoder's outputs
        with torch.no_grad():
            inputs = probe.encode(inputs)
    wrapped = GradSampleModule(probe)
    try:
        wrapped(inputs).float().sum().backward()
        for name, module in probe.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad and getattr(p, "grad_sample", None) is None:
                    problems.append(f"{name}.{pname} ({type(module).__module__}.{type(module).__name__})")
    finally:
        wrapped._close()
    return problems


class PrivateTraining:
    """DP-SGD for one call of the training loop: the wrapped model, optimizer and Poisson loader, the step, and the
    number of steps taken (for the site's accountant)."""

    def __init__(self, noise_multiplier: float, max_grad_norm: float):
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.steps = 0
        self.sample_rate = 0.0
        self._module = None

    @classmethod
    def from_config(cls, cfg) -> PrivateTraining | None:
        return cls(cfg.dp_sgd_noise_multiplier, cfg.dp_sgd_max_grad_norm) if cfg.dp_sgd else None

    def prepare(self, model: nn.Module) -> None:
        """Before the optimizer and the method's extra term see the trainable parameters: the shared tables stop
        training (``keep_shared_tables``)."""
        keep_shared_tables(model)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader, device: torch.device):
        """(per-sample-gradient model, DP optimizer, Poisson-sampled loader) in place of the three (after
        ``prepare``)."""
        from opacus import GradSampleModule
        from opacus.data_loader import DPDataLoader
        from opacus.optimizers import DPOptimizer

        self.sample_rate = 1.0 / len(loader)
        self._module = GradSampleModule(model)
        dp_optimizer = DPOptimizer(
            optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=loader.batch_size,
            generator=_secret_generator(device),
        )
        dp_loader = DPDataLoader.from_data_loader(loader, generator=_secret_generator(torch.device("cpu")))
        _empty_batches_as_the_loader_makes_them(dp_loader, loader)
        return self._module, dp_optimizer, dp_loader

    def step(self, optimizer, task_loss: torch.Tensor, extra_loss: torch.Tensor | None, params: Iterable[nn.Parameter]):
        """Backward of the task loss (per-sample), clip + noise, then the extra term's plain gradient, then the step."""
        params = list(params)
        optimizer.zero_grad(set_to_none=True)
        task_loss.backward()
        extra = None
        if extra_loss is not None:
            self._module.disable_hooks()  # a parameter-only term: no per-sample gradients to collect
            try:
                extra = torch.autograd.grad(extra_loss, params, allow_unused=True)
            finally:
                self._module.enable_hooks()
        if optimizer.pre_step():  # per-sample clipping, noise, averaging into p.grad
            if extra is not None:
                for p, g in zip(params, extra):
                    if g is not None:
                        p.grad = g if p.grad is None else p.grad + g
            optimizer.original_optimizer.step()
        self.steps += 1

    def noise_step(self, optimizer, extra_loss: torch.Tensor | None, params: Iterable[nn.Parameter]):
        """An empty Poisson batch: the step releases noise alone, as Opacus's does (its sum of clipped per-sample
        gradients is zero), N(0, (z·C)²) / the expected batch size, plus the extra term's plain gradient."""
        params = list(params)
        optimizer.zero_grad(set_to_none=True)
        for p in optimizer.params:
            p.summed_grad = torch.zeros_like(p)
        optimizer.add_noise()  # p.grad = 0 + N(0, (z·C)²)
        if optimizer.loss_reduction == "mean":  # scale_grad's division, without the per-sample count it reads
            for p in optimizer.params:
                p.grad /= optimizer.expected_batch_size
        if extra_loss is not None:
            self._module.disable_hooks()
            try:
                extra = torch.autograd.grad(extra_loss, params, allow_unused=True)
            finally:
                self._module.enable_hooks()
            for p, g in zip(params, extra):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
        optimizer.original_optimizer.step()
        self.steps += 1

    def close(self) -> None:
        """Remove Opacus's hooks from the model (it is reused by the site's next message)."""
        if self._module is not None:
            self._module._close()
            self._module = None


@functools.lru_cache(maxsize=4096)  # pure, and the server asks it per reply and per round
def dp_sgd_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of ``steps`` Poisson-sampled Gaussian steps (Opacus's RDP accountant)."""
    if steps == 0:
        return 0.0
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, steps)]
    return float(accountant.get_epsilon(delta))


def batches_per_epoch(num_train: int, batch_size: int) -> int:
    """Batches of one epoch of a site's training loader, as that loader counts them (``make_loader`` drops a last
    batch of one image): Opacus's Poisson loader takes this many steps per epoch at sample rate 1 / this."""
    from ..data.transforms import make_loader

    return len(make_loader(range(int(num_train)), int(batch_size), shuffle=True, seed=0))


def planned_dp_sgd_epsilon(cfg, num_train: int, rounds: int, batch_size: int | None = None) -> float:
    """The ε a site with ``num_train`` training images spends in ``rounds`` rounds of ``local-epochs`` epochs, or of
    ``local-steps`` steps (every round trained once, the sample rate from its training loader's length)."""
    batches = batches_per_epoch(num_train, batch_size or cfg.batch_size)
    if batches == 0 or rounds <= 0:
        return 0.0
    per_round = cfg.local_steps if cfg.local_steps > 0 else cfg.local_epochs * batches
    return dp_sgd_epsilon(cfg.dp_sgd_noise_multiplier, 1.0 / batches, rounds * per_round, cfg.dp_delta)
