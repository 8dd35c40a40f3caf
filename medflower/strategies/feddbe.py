"""FedDBE: Domain Bias Eliminator (Zhang et al., "Eliminating Domain Bias for Federated Learning in Representation
Space", NeurIPS 2023; reference: TsingZ0/FedDBE, clientdbe.py / serverdbe.py), the FedAvg instance of DBE.

The model is a feature extractor f (backbone + adapters) and a task module (head or decoder). Each site i keeps a
Personalized Representation Bias Memory (PRBM) b_i, a trainable vector added to the representation the task module
receives:

    z_i = f(x) + b_i,          ŷ = head(z_i)

and adds Mean Regularisation (MR) to its task loss, pulling the running mean of its *global* representation f(x)
(without b_i) towards the global mean z̄^g:

    z̄_i ← (1 − μ)·sg(z̄_i) + μ·mean_batch f(x)          (reset to 0 at the start of each round's training)
    L_i = task_loss(head(f(x) + b_i), y) + κ·mean_d ½ (z̄_i − z̄^g)_d²

with μ = ``feddbe-momentum`` and κ = ``feddbe-kappa`` (sg: stop-gradient: only this batch's mean carries a gradient).
b_i is trained by its own plain SGD at the run's ``lr`` (one step per batch, with the model's optimizer step). The
server is FedAvg over the trainable arrays (θ ← Σ_k n_k θ_k / Σ_k n_k) and computes once, from the first round that
brings replies, z̄^g = Σ_k n_k z̄_k / Σ_k n_k; it is fixed afterwards. Until a site has z̄^g (its first round: the
reference's "initialization period") it trains plain FedAvg, no b_i, no MR, and sends its running mean z̄_k.

Segmentation (a faithful analogue, not in the paper): the decoder's input is a feature map [B, D, h, w]; b_i is a
per-channel bias [D] added at every position and the MR mean is over the batch and the positions.

The method as implemented, and its decisions: docs/methods/baselines-fedavg-like.md#feddbe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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
from ..options import Option, bad, non_negative, unit_interval_open_left

MEAN = "feddbe/mean"  # a site's running mean z̄_k of f(x), in its reply while the server has no z̄^g
GLOBAL_MEAN = "feddbe/global-mean"  # z̄^g, sent with the global arrays once the server has it (and checkpointed)
PRBM = "prbm"  # b_i in the site's personal state (key "feddbe")

OPTIONS = (
    Option(
        "feddbe-kappa",
        1.0,
        "feddbe: weight kappa of the mean regularisation kappa*mean_d 0.5*(zbar_i - zbar^g)^2 (the reference's "
        "kl_weight; its argparse default 0 turns MR off)",
        non_negative,
        "feddbe",
    ),
    Option(
        "feddbe-momentum",
        0.1,
        "feddbe: momentum mu of the running mean zbar_i <- (1-mu)*zbar_i + mu*batch mean of f(x) (reference 0.1)",
        unit_interval_open_left,
        "feddbe",
    ),
)


# ----------------------------------------------------------------------------- the representation
def representation_dim(arrays: Mapping[str, np.ndarray]) -> int | None:
    """D of the task module's input, from its first layer's weight: a linear head ``head.weight`` [C, D], the light
    decoder's ``decoder.proj.weight`` [W, D, 1, 1] or SAM's mask decoder's tokens ``decoder.sam.mask_tokens.weight``
    [T, D] (LiteMedSAM: D = 256 channels of the image embedding, b_i added at every position); None for other task
    modules."""
    head = arrays.get("head.weight")
    if head is not None and head.ndim == 2:
        return int(head.shape[1])
    proj = arrays.get("decoder.proj.weight")
    if proj is not None and proj.ndim == 4:
        return int(proj.shape[1])
    tokens = arrays.get("decoder.sam.mask_tokens.weight")
    if tokens is not None and tokens.ndim == 2:
        return int(tokens.shape[1])
    return None


def shift(z: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """z + b: a vector [B, D] plus b, or a feature map [B, D, h, w] plus b at every position."""
    if z.ndim == 2:
        return z + bias
    if z.ndim == 4:
        return z + bias[None, :, None, None]
    raise ValueError(f"feddbe: the task module's input has shape {tuple(z.shape)}, not [B, D] or [B, D, h, w]")


def batch_mean(z: torch.Tensor) -> torch.Tensor:
    """The mean representation of a batch: over the samples (and the positions of a feature map)."""
    return z.mean(dim=0) if z.ndim == 2 else z.mean(dim=(0, 2, 3))


def mean_regulariser(
    running: torch.Tensor, batch: torch.Tensor, global_mean: torch.Tensor, kappa: float, momentum: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(κ·mean_d ½(z̄_i − z̄^g)², z̄_i) with z̄_i = (1 − μ)·running + μ·batch; ``running`` carries no gradient."""
    new = (1 - momentum) * running.detach() + momentum * batch
    return kappa * (0.5 * (new - global_mean) ** 2).mean(), new


class DomainBiasEliminator:
    """A forward pre-hook on the task module (``attached``) that adds b_i to its input and records f(x), and the MR
    term as ``train_local``'s extra loss.

    ``global_mean`` None: the initialization period (no b_i, no MR; the running mean is still kept). ``train``
    False: evaluation, b_i added and nothing recorded. b_i's SGD step (lr ``lr``) on the gradient of the previous
    backward is applied just before the next forward (the reference steps it right after the backward: the same
    sequence); ``flush`` applies the last one."""

    def __init__(
        self,
        bias: np.ndarray,
        global_mean: np.ndarray | None,
        device: torch.device | str = "cpu",
        kappa: float = 1.0,
        momentum: float = 0.1,
        lr: float = 0.0,
        train: bool = True,
    ):
        self.device = torch.device(device)
        self.learn = train and global_mean is not None
        self.bias = torch.tensor(np.asarray(bias, dtype=np.float32), device=self.device, requires_grad=self.learn)
        self.global_mean = None if global_mean is None else torch.as_tensor(global_mean, device=self.device).float()
        self.kappa, self.momentum, self.lr, self.train = kappa, momentum, lr, train
        self.running = torch.zeros_like(self.bias, requires_grad=False)
        self.batches = 0
        self._last: torch.Tensor | None = None

    @torch.no_grad()
    def flush(self) -> None:
        """Apply b_i's pending SGD step."""
        if self.bias.grad is not None:
            self.bias.sub_(self.lr * self.bias.grad)
            self.bias.grad = None

    def hook(self, _module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        z = args[0]
        if self.train:
            self._last = z
        if self.global_mean is None and self.train:
            return None  # the initialization period: head(f(x))
        if self.learn:
            self.flush()
            bias = self.bias
        else:
            bias = self.bias.detach()
        return (shift(z, bias.to(z.dtype) if z.dtype != torch.float32 else bias), *args[1:])

    def extra_loss(self, _model: torch.nn.Module, _logits: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor | None:
        """The MR term of this batch (None in the initialization period), updating the running mean."""
        z, self._last = self._last, None
        if z is None:
            raise RuntimeError("feddbe: the task module saw no input in this step")
        self.batches += 1
        batch = batch_mean(z.float())
        if self.global_mean is None:
            self.running = ((1 - self.momentum) * self.running + self.momentum * batch).detach()
            return None
        loss, running = mean_regulariser(self.running, batch, self.global_mean, self.kappa, self.momentum)
        self.running = running.detach()
        return loss

    @contextmanager
    def attached(self, model: torch.nn.Module) -> Iterator[DomainBiasEliminator]:
        handle = getattr(model, model.task_module).register_forward_pre_hook(self.hook)
        try:
            yield self
        finally:
            handle.remove()
            self.flush()

    def bias_array(self) -> np.ndarray:
        return self.bias.detach().cpu().numpy().astype(np.float32)

    def running_array(self) -> np.ndarray:
        return self.running.detach().cpu().numpy().astype(np.float32)


def split_received(received: Mapping[str, np.ndarray]) -> tuple[OrderedDict[str, np.ndarray], np.ndarray | None]:
    """(the model's arrays, z̄^g or None) of a message's arrays."""
    arrays = OrderedDict((k, v) for k, v in received.items() if k != GLOBAL_MEAN)
    return arrays, received.get(GLOBAL_MEAN)


# ----------------------------------------------------------------------------- client half
class FedDBEClient(ClientHalf):
    """FedAvg's local training with b_i on the representation and MR towards z̄^g; b_i stays in the site's state."""

    def personal(self) -> PersonalState:
        return PersonalState(self.rt, key="feddbe")

    def bias(self, before: int, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """b_i saved before round ``before`` (zeros before its first training)."""
        saved = self.personal().load(before=before)
        if saved is not None:
            return np.array(saved[PRBM])
        dim = representation_dim(arrays)
        if dim is None:
            raise ValueError(
                "feddbe: the task module is neither a linear head, the light decoder nor SAM's mask decoder"
            )
        return np.zeros(dim, np.float32)

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        arrays, global_mean = split_received(from_record(message.content["arrays"]))
        rt.model.set_trainable(arrays)
        rt.model.to(rt.device)
        cfg = rt.cfg
        dbe = DomainBiasEliminator(
            self.bias(rt.round, arrays), global_mean, rt.device, cfg.feddbe_kappa, cfg.feddbe_momentum, cfg.lr
        )
        with dbe.attached(rt.model):
            metrics = rt.train_local(dbe.extra_loss)
        self.personal().save(rt.round, {PRBM: dbe.bias_array()})
        out = rt.model.get_trainable()
        if global_mean is None:
            out[MEAN] = dbe.running_array()
        metrics["num-examples"] = len(rt.data.train)
        metrics["feddbe_prbm_norm"] = float(np.linalg.norm(dbe.bias_array()))
        return self.reply(arrays=out, metrics=metrics)

    def evaluate(self, message: Message) -> RecordDict:
        """The received global arrays with this site's b_i after the round (the reference evaluates the global model
        it sends plus each client's PRBM)."""
        rt = self.rt
        arrays, _ = split_received(from_record(message.content["arrays"]))
        rt.model.set_trainable(arrays)
        rt.model.to(rt.device)
        dbe = DomainBiasEliminator(self.bias(rt.round + 1, arrays), None, rt.device, train=False)
        with dbe.attached(rt.model):
            return self.reply(metrics=rt.evaluate_splits())


# ----------------------------------------------------------------------------- server half
@register_strategy
class FedDBE(FederatedStrategy):
    """FedDBE (Zhang et al., NeurIPS 2023): FedAvg on the server (θ ← Σ_k n_k θ_k / Σ_k n_k); each site trains
    head(f(x) + b_i) with its own PRBM b_i and adds MR κ·mean_d ½(z̄_i − z̄^g)² on the running mean z̄_i of f(x);
    z̄^g = Σ_k n_k z̄_k / Σ_k n_k from the first round's replies, fixed afterwards.

    Leaves a site: trainable arrays (adapters + head) after local training and n_k; in its first round (until the
    server has z̄^g) also its running mean representation z̄_k. b_i stays on it.
    """

    name = "feddbe"
    client_half = FedDBEClient
    folds_evaluation = True  # its evaluate is the received global arrays plus its own b_i
    options = OPTIONS

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        dim = representation_dim(initial)
        if dim is None:
            raise bad(
                "strategy",
                "feddbe",
                "needs a task module whose input is the representation: a linear head (head='linear'), the light "
                "decoder of a ViT/Swin/SAM segmenter or LiteMedSAM's mask decoder (not a U-Net)",
            )
        self.dim = dim
        self.global_mean: np.ndarray | None = None

    def reply_spec(self, node_id: int) -> ArraySpec:
        if self.global_mean is not None:
            return self.spec
        return OrderedDict([*self.spec.items(), (MEAN, ((self.dim,), "float32"))])

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        arrays = OrderedDict(self.global_arrays)
        if self.global_mean is not None:
            arrays[GLOBAL_MEAN] = self.global_mean
        return RecordDict({"arrays": to_record(arrays), "config": self.base_config(rnd)})

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        shares = self.shares([r.num_examples for r in replies])
        if self.global_mean is None:
            self.global_mean = weighted_mean([{MEAN: r.arrays[MEAN]} for r in replies], shares)[MEAN]
        self.global_arrays = weighted_mean([{k: r.arrays[k] for k in self.spec} for r in replies], shares)

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays = OrderedDict(self.global_arrays)
        if self.global_mean is not None:
            arrays[GLOBAL_MEAN] = self.global_mean
        return arrays, {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if k != GLOBAL_MEAN}, meta)
        self.global_mean = np.array(arrays[GLOBAL_MEAN]) if GLOBAL_MEAN in arrays else None
