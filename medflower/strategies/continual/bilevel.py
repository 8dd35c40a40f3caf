"""FedKEI's bi-level maths (docs/methods/fedkei.md, "Spec as implemented", "Decisions where the paper is vague").

A module θ = (adapter ω, head φ) is two flat parameter vectors (``split_parts``, ``part_width``), clustered and
weighted separately. Server: k-means++ membership B of the pooled modules (``kmeans_membership``; variant A: one
row per client, ``group_membership``), β_c = B_c / Σ_j B_cj (Eq. 3, ``normalised``), θ_c(β) = Σ_j β_cj θ_j
(Eq. 4, ``cluster_modules``) and one outer step on β (Eqs. 8-9, ``beta_step``). Site: the inner loop on α over
one epoch from α = 1/K, θ̃(α) = Σ_c α_c θ_c (Eqs. 5-6, ``inner_loop``), the outer loss's gradient at α_i^t
(``outer_gradient``, Eq. 7) and ∇_{θ_c} L for every cluster module (Eq. 9's client factor, ``cluster_gradients``:
exact, first-order or variant C's direct form), on the model with its module replaced by the flat vectors
(``module_loss``; the continual protocol's sites use it and ``split_parts`` for every method). FedKEI's use of
them is in ``fedkei.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...data import DataError
from ...models import adapter_module
from ...records import ArraySpec

PARTS = ("adapter", "head")  # clustered, weighted and sent separately (the paper's two parameter spaces)
GRAD_MODES = ("exact", "first-order", "direct")  # direct = variant C (no back-propagation through the inner loop)


def part_width(spec: ArraySpec) -> int:
    """Parameters of a part: the length of its flattened vector."""
    return sum(int(np.prod(shape)) for shape, _ in spec.values())


def split_parts(spec: ArraySpec) -> OrderedDict[str, ArraySpec]:
    """The module's array spec split into its adapter arrays (backbone) and head arrays (the rest)."""
    parts: OrderedDict[str, OrderedDict[str, tuple[tuple[int, ...], str]]] = OrderedDict(
        (p, OrderedDict()) for p in PARTS
    )
    for name, shape_dtype in spec.items():
        parts["adapter" if adapter_module(name) is not None else "head"][name] = shape_dtype
    if not parts["adapter"] or not parts["head"]:
        raise ValueError("fedkei needs a model with adapter arrays and head arrays (adapter='none'?)")
    return parts


# ----------------------------------------------------------------------------- server side
def kmeans_membership(points: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Binary membership B [K, M] of k-means++ (scikit-learn) on the M pooled modules, K = min(k, M).

    Clusters that end up empty (possible with duplicate modules) are dropped, so every row has a member.
    """
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    m = len(points)
    k = min(k, m)
    if k == 1:
        return np.ones((1, m))
    with warnings.catch_warnings():  # "fewer distinct clusters than n_clusters" when modules coincide
        warnings.simplefilter("ignore", ConvergenceWarning)
        labels = (
            KMeans(n_clusters=k, init="k-means++", n_init=1, random_state=seed).fit(points.astype(np.float64)).labels_
        )
    members = np.zeros((k, m))
    members[labels, np.arange(m)] = 1.0
    return members[members.sum(axis=1) > 0]


def group_membership(groups: Sequence[str]) -> np.ndarray:
    """Membership [G, M] of one row per distinct group (variant A: a client's own past modules)."""
    names = sorted(set(groups))
    return np.array([[1.0 if g == name else 0.0 for g in groups] for name in names])


def normalised(members: np.ndarray) -> np.ndarray:
    """β_c = B_c / Σ_j B_cj (Eq. 3, and β's initial value before Eq. 4)."""
    return members / members.sum(axis=1, keepdims=True)


def cluster_modules(beta: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """θ_c(β_c) = Σ_j β_cj θ_j for every cluster (Eq. 4): [K, M] @ [M, P] -> [K, P] float32."""
    return (beta.astype(np.float64) @ pool.astype(np.float64)).astype(np.float32)


def beta_step(beta: np.ndarray, pool: np.ndarray, cluster_grads: Iterable[np.ndarray], eta2: float) -> np.ndarray:
    """One outer step (Eqs. 8-9): β_c <- β_c − η2 Σ_i Θᵀ ∇_{θ_c} L_i, Θ = [θ_1 .. θ_M] as columns.

    ``cluster_grads`` holds each client's [K, P] gradients w.r.t. the cluster modules.
    """
    total = np.zeros((beta.shape[0], pool.shape[1]))
    for grads in cluster_grads:
        total += grads.astype(np.float64)
    return beta - eta2 * (total @ pool.astype(np.float64).T)


# ----------------------------------------------------------------------------- site side
# loss_fn(thetas, batch): the task loss of the model with module parts ``thetas`` (flat tensors, PARTS order).
LossFn = Callable[[Sequence[torch.Tensor], Any], torch.Tensor]


@dataclass
class InnerLoop:
    """The result of the inner loop on α (Eq. 6, one step per batch of one epoch)."""

    alphas: list[torch.Tensor]  # α_i^t per part; with create_graph a function of the cluster modules
    step_grads: list[torch.Tensor]  # Σ_s ∇_θ̃ L at each step's α (what the first-order form needs)
    mean_loss: float
    steps: int


def inner_loop(
    loss_fn: LossFn, clusters: Sequence[torch.Tensor], batches: Iterable[Any], eta1: float, create_graph: bool = False
) -> InnerLoop:
    """α <- α − η1 ∇_α L(θ̃(α)) over ``batches`` from α = 1/K, θ̃(α) = Σ_c α_c θ_c (Eqs. 5-6).

    With ``create_graph`` the steps stay differentiable w.r.t. ``clusters`` (which must require grad).

    Not a ``train_epochs`` step hook: it steps α, not the model's parameters (their values come in through
    ``loss_fn``), by plain α − η1·g, which torch's optimizers compute as a fused multiply-add (other last bits); with
    ``create_graph`` every α is a node of the unrolled graph Eq. 9 differentiates, which an optimizer's in-place step
    would cut; and the loss is float32 throughout, where the loop's ``precision='auto'`` would be bf16 on CUDA.
    """
    alphas = [
        torch.full((c.shape[0],), 1.0 / c.shape[0], dtype=c.dtype, device=c.device, requires_grad=True)
        for c in clusters
    ]
    step_grads = [torch.zeros(c.shape[1], dtype=c.dtype, device=c.device) for c in clusters]
    total, steps = 0.0, 0
    for batch in batches:
        if create_graph:
            thetas = [a @ c for a, c in zip(alphas, clusters)]
            loss = loss_fn(thetas, batch)
            grads = torch.autograd.grad(loss, alphas, create_graph=True)
        else:
            # ∇_α L = Θ_K ∇_θ̃ L: one backward to θ̃, which also gives the first-order form's step gradients
            thetas = [(a.detach() @ c.detach()).requires_grad_(True) for a, c in zip(alphas, clusters)]
            loss = loss_fn(thetas, batch)
            theta_grads = torch.autograd.grad(loss, thetas)
            grads = [c.detach() @ g for c, g in zip(clusters, theta_grads)]
            step_grads = [s + g for s, g in zip(step_grads, theta_grads)]
        alphas = [a - eta1 * g for a, g in zip(alphas, grads)]
        if not create_graph:
            alphas = [a.detach() for a in alphas]
        if not np.isfinite(loss.item()):
            raise FloatingPointError(f"inner-loop loss became {loss.item()} at step {steps}; lower fedkei-eta1")
        total += loss.item()
        steps += 1
    if steps == 0:
        raise DataError("the inner loop got no training batch")
    return InnerLoop(alphas, step_grads, total / steps, steps)


def outer_gradient(
    loss_fn: LossFn, thetas: Sequence[torch.Tensor], batches: Iterable[tuple[Any, int]]
) -> tuple[list[torch.Tensor], float]:
    """∇_θ̃ of the mean loss over ``batches`` (pairs of batch and its size) at module parts ``thetas``."""
    leaves = [t.detach().requires_grad_(True) for t in thetas]
    acc = [torch.zeros_like(t) for t in leaves]
    total, count = 0.0, 0
    for batch, size in batches:
        loss = loss_fn(leaves, batch)
        grads = torch.autograd.grad(loss * size, leaves)
        acc = [a + g for a, g in zip(acc, grads)]
        total += loss.item() * size
        count += size
    if count == 0:
        raise DataError("the outer loss got no training batch")
    return [a / count for a in acc], total / count


def cluster_gradients(
    loss_fn: LossFn,
    clusters: Sequence[torch.Tensor],
    inner_batches: Iterable[Any],
    outer_batches: Iterable[tuple[Any, int]],
    eta1: float,
    mode: str = "exact",
) -> tuple[list[torch.Tensor], InnerLoop, float]:
    """∇_{θ_c} L(θ̃(α_i^t)) for every cluster module (Eq. 9's client factor), per part [K, P].

    With g = ∇_θ̃ L_outer at θ̃(α_i^t) and u_k = θ_kᵀ g (= ∂L/∂α_k):
    - ``exact``: α_i^t,c·g + (∂α_i^t/∂θ_c)ᵀ u by autograd through the unrolled inner loop (Hessian terms
      kept);
    - ``first-order``: α_i^t,c·g − η1·u_c·Σ_s g_s, the paper's (α'_c I − η1 θ_c gᵀ)ᵀ g' for one step;
    - ``direct`` (variant C): α_i^t,c·g, α_i^t held fixed.
    """
    if mode not in GRAD_MODES:
        raise ValueError(f"gradient mode {mode!r}: valid choices are {', '.join(GRAD_MODES)}")
    exact = mode == "exact"
    leaves = [c.detach().clone().requires_grad_(exact) for c in clusters]
    # Fused attention kernels have no double backward; the math kernel does (and is what they compute).
    with sdpa_kernel(SDPBackend.MATH) if exact else contextlib.nullcontext():
        inner = inner_loop(loss_fn, leaves, inner_batches, eta1, create_graph=exact)
        alphas = [a.detach() for a in inner.alphas]
        g, outer_loss = outer_gradient(loss_fn, [a @ c.detach() for a, c in zip(alphas, leaves)], outer_batches)
        u = [c.detach() @ gp for c, gp in zip(leaves, g)]
        grads = [torch.outer(a, gp) for a, gp in zip(alphas, g)]
        if exact:
            through = torch.autograd.grad(inner.alphas, leaves, grad_outputs=u, allow_unused=True)
            grads = [d + (t if t is not None else 0.0) for d, t in zip(grads, through)]
    if mode == "first-order":
        grads = [d - eta1 * torch.outer(up, s) for d, up, s in zip(grads, u, inner.step_grads)]
    return [x.detach() for x in grads], inner, outer_loss


def module_loss(model: torch.nn.Module, parts: Mapping[str, ArraySpec], raw_names: Mapping[str, str]) -> LossFn:
    """The model's cross-entropy with its module replaced by flat part vectors (torch.func.functional_call)."""
    layout = [
        [(raw_names[name], shape, int(np.prod(shape))) for name, (shape, _) in spec.items()] for spec in parts.values()
    ]

    def loss(thetas: Sequence[torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        params: dict[str, torch.Tensor] = {}
        for part, theta in zip(layout, thetas):
            offset = 0
            for raw, shape, size in part:
                params[raw] = theta[offset : offset + size].view(shape)
                offset += size
        x, y = batch
        return torch.nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    return loss
