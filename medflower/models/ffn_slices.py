"""Sub-encoders made of FFN neuron slices (FedBKD, docs/methods/fedbkd.md, and its width-scaling baselines).

Every transformer block's feed-forward network is ``W2 · gelu(W1 x + b1) + b2`` (the paper's Eq. 1; timm's
``Mlp`` with ``fc1``/``act``/``fc2``). A sub-encoder keeps a subset of each block's d_ffn hidden neurons:
rows of W1 and b1, columns of W2 (b2, attention and the model width stay whole, a decision where the paper is
vague, docs/methods/fedbkd.md).
Which neurons: the top-ψ ones (FedBKD's adaptive extraction, ψ = mean² + variance of the GELU activations,
Eqs. 2-3), a prefix (HeteroFL), a rolling window (FedRolex) or a seeded random subset (FedDrop).

timm builds no narrower variant of a trained model, so the surgery is here: the kept slices are copied into
new, narrower ``nn.Linear`` modules of a deep copy, which then runs as an ordinary timm encoder.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import nn

from .errors import ModelError

SELECTIONS = ("saliency", "prefix", "rolling", "random")


def ffn_modules(model: nn.Module) -> OrderedDict[str, nn.Module]:
    """Name -> module of every FFN with ``fc1``/``act``/``fc2`` (timm ``Mlp``), in forward order."""
    found = OrderedDict(
        (name, m)
        for name, m in model.named_modules()
        if all(isinstance(getattr(m, a, None), nn.Module) for a in ("fc1", "act", "fc2"))
        and isinstance(m.fc1, nn.Linear)
        and isinstance(m.fc2, nn.Linear)
    )
    if not found:
        raise ModelError(
            f"{type(model).__name__} has no transformer FFN (fc1/act/fc2) to slice; FedBKD's "
            "sub-models need a ViT or Swin backbone"
        )
    return found


@torch.no_grad()
def ffn_saliency(model: nn.Module, batches: Iterable[torch.Tensor], forward=None) -> OrderedDict[str, np.ndarray]:
    """ψ(m) = α(m)² + γ(m) per FFN hidden neuron (FedBKD Eqs. 2-3): mean and variance of gelu(W1 x + b1)_m
    over every token of every sample the model sees. ``forward`` (default ``model``) runs one batch.

    Sums are kept in float64, so the result does not depend on how the data is batched.
    """
    modules = ffn_modules(model)
    sums: dict[str, list] = {name: [0, 0, 0] for name in modules}  # count, Σa, Σa²

    def hook(name):
        def record(_module, _inputs, output):
            a = output.detach().double().reshape(-1, output.shape[-1])
            entry = sums[name]
            entry[0] += a.shape[0]
            entry[1] = entry[1] + a.sum(0)
            entry[2] = entry[2] + (a * a).sum(0)

        return record

    handles = [m.act.register_forward_hook(hook(name)) for name, m in modules.items()]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():  # statistics only: no graph to keep
            for x in batches:
                (forward or model)(x)
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, (n, s1, s2) in sums.items():
        if n == 0:
            raise ModelError("saliency needs at least one sample")
        mean = s1 / n
        variance = (s2 / n - mean * mean).clamp_min(0.0)
        out[name] = (mean * mean + variance).numpy()
    return out


def kept_count(width: int, capacity: float) -> int:
    """⌈β·d_ffn⌉ neurons, at least one."""
    if not 0 < capacity <= 1:
        raise ModelError(f"capacity {capacity} must be in (0, 1]")
    return max(1, math.ceil(capacity * width - 1e-9))


def select_neurons(
    width: int,
    capacity: float,
    selection: str,
    *,
    saliency: np.ndarray | None = None,
    round_index: int = 0,
    seed: int = 0,
) -> np.ndarray:
    """Sorted int64 indices of the kept neurons of one FFN of ``width`` hidden neurons.

    saliency: the top-ψ ones (ties by index); prefix: the first k (HeteroFL); rolling: k consecutive starting at
    ``round_index`` mod width, wrapping (FedRolex); random: k drawn with ``seed`` (FedDrop).
    """
    k = kept_count(width, capacity)
    if selection == "saliency":
        if saliency is None or saliency.shape != (width,):
            raise ModelError(f"saliency selection needs ψ of shape ({width},)")
        chosen = np.argsort(-saliency, kind="stable")[:k]
    elif selection == "prefix":
        chosen = np.arange(k)
    elif selection == "rolling":
        chosen = (round_index + np.arange(k)) % width
    elif selection == "random":
        chosen = np.random.default_rng(seed).choice(width, size=k, replace=False)
    else:
        raise ModelError(f"unknown neuron selection {selection!r}; choose one of {list(SELECTIONS)}")
    return np.sort(chosen).astype(np.int64)


def _narrow(linear: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    weight = linear.weight.detach()
    bias = linear.bias.detach() if linear.bias is not None else None
    if rows is not None:
        weight, bias = weight[rows], (bias[rows] if bias is not None else None)
    if cols is not None:
        weight = weight[:, cols]
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


def extract_subnetwork(model: nn.Module, kept: Mapping[str, np.ndarray]) -> nn.Module:
    """A deep copy of ``model`` whose FFN ``name`` keeps only the neurons ``kept[name]``: W1/b1 rows, W2 columns.

    Its forward pass equals the original with every other FFN neuron's output set to zero (tested). FFNs not in
    ``kept`` stay whole.
    """
    sub = copy.deepcopy(model)
    modules = ffn_modules(sub)
    unknown = set(kept) - set(modules)
    if unknown:
        raise ModelError(f"no FFN named {sorted(unknown)[:3]} in the model")
    for name, idx in kept.items():
        mlp = modules[name]
        index = torch.as_tensor(np.asarray(idx, dtype=np.int64), device=mlp.fc1.weight.device)
        if index.numel() == 0 or int(index.max()) >= mlp.fc1.out_features or int(index.min()) < 0:
            raise ModelError(f"FFN {name}: kept indices must be in [0, {mlp.fc1.out_features})")
        mlp.fc1 = _narrow(mlp.fc1, rows=index)
        mlp.fc2 = _narrow(mlp.fc2, cols=index)
    return sub


def ffn_slice_axes(name: str, ffn_names: Iterable[str]) -> tuple[str, int] | None:
    """(FFN name, sliced axis) for a parameter that a sub-encoder slices, else None:
    ``<ffn>.fc1.weight``/``.fc1.bias`` along axis 0 (rows), ``<ffn>.fc2.weight`` along axis 1 (columns)."""
    for ffn in ffn_names:
        if name in (f"{ffn}.fc1.weight", f"{ffn}.fc1.bias"):
            return ffn, 0
        if name == f"{ffn}.fc2.weight":
            return ffn, 1
    return None


def covered_merge(
    global_arrays: Mapping[str, np.ndarray],
    parts: list[Mapping[str, np.ndarray]],
    kept: list[Mapping[str, np.ndarray]],
    weights: list[float],
    ffn_names: Iterable[str],
) -> OrderedDict[str, np.ndarray]:
    """FedBKD's merge: scatter each client's slices back to global indices; every entry becomes
    Σ_k w_k θ_k / Σ_{k covering it} w_k over the clients that cover it, uncovered entries keep their value.

    ``parts[k]`` holds client k's arrays (FFN ones narrowed to ``kept[k][ffn]``), ``weights[k]`` its w_k.
    Arrays that no sub-encoder slices are covered by every client: their merge is the weighted mean. With every
    client keeping every neuron this is weighted FedAvg (tested).
    """
    ffn_names = list(ffn_names)
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, current in global_arrays.items():
        total = np.zeros(current.shape, dtype=np.float64)
        cover = np.zeros(current.shape, dtype=np.float64)
        sliced = ffn_slice_axes(name, ffn_names)
        for part, kept_k, w in zip(parts, kept, weights):
            if name not in part:
                continue
            value = part[name].astype(np.float64)
            if sliced is None:
                total += w * value
                cover += w
                continue
            ffn, axis = sliced
            index = (slice(None),) * axis + (np.asarray(kept_k[ffn]),)
            total[index] += w * value
            cover[index] += w
        merged = np.where(cover > 0, total / np.where(cover > 0, cover, 1.0), current)
        out[name] = merged.astype(current.dtype)
    return out


def linear_cka(f_k: torch.Tensor, f_g: torch.Tensor) -> torch.Tensor:
    """Linear CKA (FedBKD Eq. 4 on centred features): ‖f_gᵀ f_k‖²_F / (‖f_kᵀ f_k‖_F ‖f_gᵀ f_g‖_F), features
    ``[N, D]`` centred over the batch. 1 for identical features, invariant to isotropic scaling, in [0, 1]."""
    f_k = f_k.float() - f_k.float().mean(0, keepdim=True)
    f_g = f_g.float() - f_g.float().mean(0, keepdim=True)
    cross = (f_g.T @ f_k).pow(2).sum()
    norm = torch.linalg.matrix_norm(f_k.T @ f_k) * torch.linalg.matrix_norm(f_g.T @ f_g)
    return cross / norm.clamp_min(1e-12)


def feature_spread(features: np.ndarray, kind: str = "trace") -> float:
    """μ_k of FedBKD Eqs. 6-7 from a client's features ``[N, D]``: the covariance's trace (sum of its
    eigenvalues, the default) or its top eigenvalue."""
    x = np.asarray(features, dtype=np.float64)
    x = x - x.mean(0, keepdims=True)
    cov = x.T @ x / max(len(x), 1)
    if kind == "trace":
        return float(np.trace(cov))
    if kind == "top":
        return float(np.linalg.eigvalsh(cov)[-1])
    raise ModelError(f"unknown eigenvalue weight {kind!r}; choose trace or top")
