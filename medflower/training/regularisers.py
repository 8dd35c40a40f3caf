"""The regularisers that baselines of both continual protocols add to a site's task loss: LwF's distillation and
the diagonal-Fisher quadratic of FedCurv and EWC, with their run-config keys.

- Distillation (Li and Hoiem, "Learning without Forgetting", TPAMI 2017): the outputs of the old task's head on the
  new task's images are kept close to those a teacher (the previous model) gives on the same images, by
  T²·KL(teacher ‖ student) with temperature T (``distillation_loss``); ``Distiller`` wraps the trained module so
  that one forward pass yields its logits and the (student, teacher) pair. Used by ``flwf``
  (``strategies/continual/flwf.py``) and ``lwf-lora`` (``strategies/incremental/lwf_lora.py``).
- Fisher penalties: a site's empirical diagonal Fisher F = (1/n) Σ_i (∇_θ log p(y_i | x_i))² over its module θ
  (``diagonal_fisher``), and a sum of diagonal quadratics

      Σ_j (θ − θ_j)ᵀ diag(F_j) (θ − θ_j) = θᵀ diag(u) θ − 2 θᵀ v + c,
      u = Σ_j F_j,  v = Σ_j F_j ⊙ θ_j,  c = Σ_j θ_jᵀ diag(F_j) θ_j

  (``Quadratic``). FedCurv (Shoham et al., "Overcoming Forgetting in Federated Learning on Non-IID Data", NeurIPS
  2019 workshop on FL) sums it over the other sites, with its u_t and v_t (``fedcurv``,
  ``strategies/continual/fedcurv.py``); EWC (Kirkpatrick et al., "Overcoming catastrophic forgetting in neural
  networks", PNAS 2017, Eq. 3) over the past tasks (``fedcurv-lora``, ``strategies/incremental/fedcurv_lora.py``).
  The local loss adds λ times it.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from ..options import Option, non_negative, positive
from .loops import ExtraLoss

FISHER = "fisher/"  # prefix of a Fisher's arrays in a reply and in the server's checkpoint
PER_SAMPLE_ELEMENTS = 1 << 24  # per-row gradients held at once (rows x parameters): vmap's chunk size follows

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
FEDCURV_LAMBDA = Option(
    "fedcurv-lambda",
    1.0,
    "fedcurv, fedcurv-lora: weight lambda of the Fisher penalty lambda * sum_j (theta - theta_j)' diag(F_j) "
    "(theta - theta_j) (0: none)",
    non_negative,
    "fedcurv",
)


# ----------------------------------------------------------------------------- distillation (LwF)
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


# ----------------------------------------------------------------------------- diagonal-Fisher penalties
def diagonal_fisher(
    model: torch.nn.Module, batches: Iterable, device: torch.device, mask: torch.Tensor | None = None
) -> OrderedDict[str, np.ndarray]:
    """The empirical diagonal Fisher of ``model``'s trainable arrays, F = (1/n) Σ_i (∇_θ −log p(y_i | x_i))², over
    the rows of ``batches`` (x, y); the model in eval mode, float32. ``mask``: the softmax runs over these classes only
    (a class-incremental task's). An exchanged array that is no parameter (a BatchNorm statistic) gets F = 0.

    Per-row gradients by torch.func (vmap of grad): the square of a batch's mean gradient, as some FedCurv code
    takes, is not the Fisher."""
    model = model.to(device)
    was_training = model.training
    model.eval()
    paths = model.parameter_paths()
    params = {paths[k]: p.detach() for k, p in model.trainable_parameters().items()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (x.unsqueeze(0),)).float()
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0))

    size = sum(p.numel() for p in params.values())
    per_row = vmap(grad(loss), in_dims=(None, 0, 0), chunk_size=max(1, PER_SAMPLE_ELEMENTS // max(size, 1)))
    total = {path: torch.zeros_like(p, dtype=torch.float64) for path, p in params.items()}
    rows = 0
    if mask is not None:
        mask = mask.to(device)
    try:
        with warnings.catch_warnings():  # torch's fallback for attention under vmap is correct, only slower
            warnings.filterwarnings("ignore", message="There is a performance drop")
            for x, y in batches:
                grads = per_row(params, x.to(device), y.to(device))
                for path, g in grads.items():
                    total[path] += (g.double() ** 2).sum(dim=0)
                rows += len(y)
    finally:
        model.train(was_training)
    fisher = OrderedDict((name, np.zeros(shape, np.float32)) for name, (shape, _) in model.trainable_spec().items())
    for name, path in paths.items():
        fisher[name] = (total[path] / max(rows, 1)).cpu().numpy().astype(np.float32)
    return fisher


@dataclass(frozen=True)
class Quadratic:
    """Σ_j (θ − θ_j)ᵀ diag(F_j) (θ − θ_j) as θᵀ diag(u) θ − 2 θᵀ v + c per array name: FedCurv's u_t = Σ_j F_j and
    v_t = Σ_j F_j ⊙ θ_j, and the constant c = Σ_j θ_jᵀ diag(F_j) θ_j, which sets the value but not the gradient."""

    u: Mapping[str, np.ndarray]
    v: Mapping[str, np.ndarray]
    c: float

    @classmethod
    def of(cls, anchors: Iterable[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]]) -> Quadratic | None:
        """The sum over (θ_j, F_j) pairs, in float64; None for no pair (no penalty)."""
        u: dict[str, np.ndarray] = {}
        v: dict[str, np.ndarray] = {}
        c = 0.0
        for theta, fisher in anchors:
            for name, f in fisher.items():
                f, t = f.astype(np.float64), theta[name].astype(np.float64)
                u[name] = u.get(name, 0.0) + f
                v[name] = v.get(name, 0.0) + f * t
                c += float((f * t * t).sum())
        return cls(OrderedDict(u), OrderedDict(v), c) if u else None

    def plus(self, other: Quadratic | None) -> Quadratic:
        """The sum of two quadratics (EWC's penalty of one more task)."""
        if other is None:
            return self
        return Quadratic(
            OrderedDict((k, self.u[k] + other.u[k]) for k in self.u),
            OrderedDict((k, self.v[k] + other.v[k]) for k in self.v),
            self.c + other.c,
        )

    def value(self, theta: Mapping[str, np.ndarray]) -> float:
        total = self.c
        for name, u in self.u.items():
            t = theta[name].astype(np.float64)
            total += float((u * t * t).sum() - 2 * (self.v[name] * t).sum())
        return total

    def arrays(self) -> OrderedDict[str, np.ndarray]:
        """What travels: u and v in float32, c as one float64."""
        out = OrderedDict((f"u/{k}", np.asarray(u, np.float32)) for k, u in self.u.items())
        out.update((f"v/{k}", np.asarray(v, np.float32)) for k, v in self.v.items())
        out["c"] = np.array([self.c], np.float64)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Quadratic:
        """Read ``arrays()``, or every other site's module and Fisher (``theta/<j>/<name>``, ``fisher/<j>/<name>``)."""
        if "c" in arrays:
            u = OrderedDict((k[2:], a) for k, a in arrays.items() if k.startswith("u/"))
            v = OrderedDict((k[2:], a) for k, a in arrays.items() if k.startswith("v/"))
            if set(u) != set(v):
                raise ValueError("the penalty's u and v name different arrays")
            return cls(u, v, float(arrays["c"][0]))
        sites = sorted({k.split("/")[1] for k in arrays if k.startswith("theta/")}, key=int)
        anchors = []
        for j in sites:
            theta = OrderedDict((k[len(f"theta/{j}/") :], a) for k, a in arrays.items() if k.startswith(f"theta/{j}/"))
            fisher = OrderedDict((k, arrays[f"fisher/{j}/{k}"]) for k in theta)
            anchors.append((theta, fisher))
        quadratic = cls.of(anchors)
        if quadratic is None:
            raise ValueError("the penalty record holds neither u, v, c nor any site's module")
        return quadratic

    def penalty(self, params: Mapping[str, torch.Tensor], lam: float) -> ExtraLoss:
        """λ (θᵀ diag(u) θ − 2 θᵀ v + c) over ``params`` as a training loss term, gradient 2λ(u ⊙ θ − v). Computed as
        λ (Σ u (θ − m)² + r) with m = v / u where u > 0 and r = c − Σ v² / u, the same value without float32's
        cancellation between θᵀ diag(u) θ and c."""
        device = next(iter(params.values())).device
        terms, rest = [], self.c
        for name, p in params.items():
            u, v = np.asarray(self.u[name], np.float64), np.asarray(self.v[name], np.float64)
            held = u > 0
            m = np.divide(v, u, out=np.zeros_like(v), where=held)
            rest -= float((v[held] ** 2 / u[held]).sum())
            terms.append((p, torch.as_tensor(u, dtype=torch.float32, device=device), torch.as_tensor(m, device=device)))

        def extra(model, logits, labels) -> torch.Tensor:
            total = sum((u * (p.float() - m.float()) ** 2).sum() for p, u, m in terms)
            return lam * (total + rest)

        return extra


def fisher_arrays(fisher: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    return OrderedDict((FISHER + k, v) for k, v in fisher.items())


def part_mean(fisher: Mapping[str, np.ndarray], names: Iterable[str]) -> float:
    """The mean Fisher over the arrays ``names`` (a part: the adapter, the head), for the server's records."""
    return float(np.mean(np.concatenate([fisher[k].reshape(-1) for k in names])))


def fisher_problem(arrays: Mapping[str, np.ndarray]) -> str | None:
    """A Fisher is a mean of squares: why ``arrays``' Fisher part cannot be one, or None."""
    for name, value in arrays.items():
        if name.startswith(FISHER) and (value < 0).any():
            return f"{name} has negative values; a Fisher's diagonal is >= 0"
    return None
