"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei and Zhang, "Personalized Cross-Silo Federated Learning on Non-IID Data",
AAAI 2021) in FedKEI's continual protocol (docs/methods/baselines-continual.md#fedamp-fedamp).

Attentive message passing: the server gives each site i a personalised cloud model u_i = Σ_j ξ_ij θ_j with
ξ_ij = α·A'(‖θ_i − θ_j‖²) for j ≠ i, A(x) = 1 − exp(−x/σ), so A'(x) = exp(−x/σ)/σ, and the self-weight
ξ_ii = 1 − Σ_{j≠i} ξ_ij (``attention_weights``: the paper's message-passing step, as PFLlib's ``serveramp.py``
computes it). The site then trains with the proximal term (λ/2α)·‖θ − u_i‖². Here the θ_j are the
modules of the latest pooled task (task t − 1) and θ_i is site i's own: before task t ≥ 2 the server sends u_i, the
site starts from it and fine-tunes as FedKEI's sites do, with the proximal term. A site with no module in that task
(absent from it) gets the plain mean of its modules. Task 1 (no pool) starts fresh without the term, as in FedKEI.

What leaves a site: its module θ_i^t (adapter + head) after every task and n_i, as FedKEI's. What comes to a site:
u_i and the step α_k (``fedamp-alpha``, by default σ/(M − 1), which keeps every ξ_ii ≥ 0). Per task and site 2·|θ|.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Message, RecordDict

from ...contract import from_record, register_strategy, stack_flat, to_record, unflatten
from ...options import Option, bad, non_negative, positive
from ...training import ExtraLoss
from ..fedavg import proximal_term
from .protocol import CONTINUAL_OPTIONS, ContinualClient, ContinualStrategy, latest_modules

FEDAMP_OPTIONS = (
    Option(
        "fedamp-alpha",
        0.0,
        "fedamp: step alpha of the message passing, xi_ij = alpha * A'(||theta_i - theta_j||^2), and of the proximal "
        "weight lambda/(2 alpha); 0 = sigma/(M - 1) per task, the largest step whose self-weights are >= 0 for any "
        "distances (M: the modules attended over)",
        non_negative,
        "fedamp",
    ),
    Option("fedamp-sigma", 1.0, "fedamp: scale sigma of A(x) = 1 - exp(-x/sigma) (PFLlib's 1.0)", positive, "fedamp"),
    Option(
        "fedamp-lambda",
        1.0,
        "fedamp: lambda of the proximal term (lambda/(2 alpha))*||theta - u_i||^2 (0: none; PFLlib's 1.0)",
        non_negative,
        "fedamp",
    ),
)


ALPHA = "fedamp-alpha-k"  # the config entry of a task's message that carries the step α the server used


def message_step(alpha: float, sigma: float, modules: int) -> float:
    """α_k of a task: ``fedamp-alpha``, or with 0 σ/(M − 1), which keeps ξ_ii = 1 − α Σ_{j≠i} A'_ij ≥ 0 whatever the
    distances (A' ≤ 1/σ); σ when there is a single module (it attends only to itself)."""
    return alpha if alpha > 0 else sigma / max(modules - 1, 1)


def alpha_problem(alpha: float, sigma: float, sites: int) -> str | None:
    """Why ``fedamp-alpha`` can make a site's self-weight ξ_ii = 1 − α Σ_{j≠i} A'_ij negative among ``sites`` modules
    (α (M − 1)/σ > 1: it does when their modules are close), or None; checked before the first task."""
    if alpha > 0 and sites > 1 and alpha * (sites - 1) > sigma:
        return (
            f"with fedamp-sigma = {sigma:g} and {sites} sites the valid range is 0 (sigma/(M - 1) per task) or "
            f"(0, {sigma / (sites - 1):g}] (alpha * (M - 1) / sigma <= 1): a larger step makes a site's self-weight "
            "xi_ii = 1 - alpha * sum_j A'_ij negative when the sites' modules are close; lower fedamp-alpha or raise "
            "fedamp-sigma"
        )
    return None


def attention_weights(modules: np.ndarray, i: int, alpha: float, sigma: float) -> np.ndarray:
    """ξ_i· over the rows of ``modules`` [M, P] for site i (its own row): ξ_ij = α·exp(−‖θ_i − θ_j‖²/σ)/σ for j ≠ i,
    ξ_ii = 1 − Σ_{j≠i} ξ_ij. A negative ξ_ii (α too large for the distances) is refused."""
    w = modules.astype(np.float64)
    distances = ((w - w[i]) ** 2).sum(axis=1)
    xi = alpha * np.exp(-distances / sigma) / sigma
    xi[i] = 0.0
    xi[i] = 1.0 - xi.sum()
    if xi[i] < 0:
        raise ValueError(
            f"fedamp: the self-weight xi_ii = 1 - sum_j xi_ij is {xi[i]:.3f} < 0 over {len(w)} modules (squared "
            f"distances {np.round(np.delete(distances, i), 4).tolist()}); lower fedamp-alpha or raise fedamp-sigma "
            f"(alpha * (M - 1) / sigma <= 1 always keeps it >= 0; fedamp-alpha = 0 takes that step)"
        )
    return xi


class FedAMPClient(ContinualClient):
    """A site's task: start from the received cloud model u_i, fine-tune with (λ/2α)·‖θ − u_i‖², upload θ_i^t."""

    def finetune_loss(self, message: Message, train) -> ExtraLoss | None:
        """(λ/2α)·‖θ − u_i‖² over the module (FedAMP's local objective); none without u_i (task 1) or with λ = 0."""
        rt = self.rt
        if "arrays" not in message.content.array_records or rt.cfg.fedamp_lambda == 0:
            return None
        alpha = float(message.content["config"][ALPHA])  # the server's α_k (fedamp-alpha, or σ/(M − 1) with 0)
        if not alpha > 0:
            raise ValueError(f"received the message-passing step {ALPHA} = {alpha}; it must be > 0")
        anchor = {k: torch.as_tensor(v, device=rt.device) for k, v in from_record(message.content["arrays"]).items()}
        rt.model.to(rt.device)
        return proximal_term(rt.model, anchor, rt.cfg.fedamp_lambda / alpha)  # (μ/2)‖·‖², μ = λ/α


@register_strategy
class FedAMP(ContinualStrategy):
    """FedAMP (Huang et al., AAAI 2021) in FedKEI's protocol: each site starts task t from its personalised cloud
    model u_i, the attention-weighted sum of the previous task's modules, and fine-tunes close to it.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; with each task's metrics its test size
    and number of positive test images (n_test, n_test_positive), as FedKEI's sites.
    """

    name = "fedamp"
    client_half = FedAMPClient
    options = (*CONTINUAL_OPTIONS, *FEDAMP_OPTIONS)

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        super().check_config(cfg, check_paths)
        if why := alpha_problem(cfg.fedamp_alpha, cfg.fedamp_sigma, cfg.min_nodes):
            raise bad("fedamp-alpha", cfg.fedamp_alpha, why)

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """u_i per node over the latest pooled task's modules: attention-weighted around the site's own module, the
        plain mean for a site without one there; nothing for task 1 or an empty pool."""
        if why := alpha_problem(self.cfg.fedamp_alpha, self.cfg.fedamp_sigma, len(self.ordered_nodes())):
            raise bad("fedamp-alpha", self.cfg.fedamp_alpha, why)  # before any site trains, not at task 2
        entries, modules = latest_modules(self.pool, task)
        contents, weights = {}, {}
        if entries:
            matrix = stack_flat(modules, self.spec)
            row = {e.client: j for j, e in enumerate(entries)}
            alpha = message_step(self.cfg.fedamp_alpha, self.cfg.fedamp_sigma, len(entries))
            self.stats.extra.update(
                fedamp_task=entries[0].task, fedamp_clients=[e.client for e in entries], fedamp_alpha=alpha
            )
        for node in nodes:
            content = RecordDict({"config": self.base_config(task, **({ALPHA: alpha} if entries else {}))})
            if entries:
                client = self.client_name(node)
                if client in row:
                    xi = attention_weights(matrix, row[client], alpha, self.cfg.fedamp_sigma)
                else:
                    xi = np.full(len(entries), 1.0 / len(entries))  # absent from the last task: the plain mean
                weights[client] = [float(v) for v in xi]
                u = (xi @ matrix.astype(np.float64)).astype(np.float32)
                content["arrays"] = to_record(unflatten(u, self.spec))
            contents[node] = content
        if weights:
            self.stats.extra["fedamp_weights"] = weights
        return contents
