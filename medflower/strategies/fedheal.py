"""FedHEAL (Chen, Huang, Ye, CVPR 2024): fair federated learning under domain skew, as the reference code
(github.com/yuhangchen0/FedHEAL, ``FederatedModel.consistency_mask``, ``get_params_diff_weights``,
``aggregate_nets_parameter``) does it on top of FedAvg. The sites train as in FedAvg; both parts are on the server.

FPHL (parameter-harmonised updates): with the update u_k = θ − θ_k of site k (global minus local) and h_k, the
running fraction of its past rounds in which each element had u_k ≥ 0, the consistency of an element is h_k where
u_k ≥ 0 and 1 − h_k where u_k < 0; the element is kept, m_k = 1, iff its consistency > ``fedheal-threshold`` τ. A
site's first update keeps every element (m_k = 1). Then h_k ← (c_k h_k + [u_k ≥ 0]) / (c_k + 1), c_k the site's
number of updates so far.

FAEL (fair aggregation): d_k = Σ_arrays ||m_k ⊙ u_k||_2 (a sum of per-array norms), and with momentum β
(``fedheal-beta``):

    Δp_k ← (1 − β) Δp_k + β d_k / Σ_j d_j,    p_k ← p_k + Δp_k,    (Δp_k starts at 0, p_k at 1/K),

Σ_j over every site's latest d_j (as the reference), K the sites replying; the round's weights are
w_k = p_k / Σ_{k'} p_{k'} over the replying sites (capped at max-client-share). Elementwise,

    θ ← θ − Σ_k ŵ_k ⊙ m_k ⊙ u_k,    ŵ_k = w_k m_k / Σ_j w_j m_j   (w_k where Σ_j w_j m_j = 0).

The method as implemented, and its decisions: docs/methods/baselines-fedavg-like.md#fedheal.

What leaves a site: the trainable arrays (adapters + head) after local training and n_k, as in FedAvg.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..contract import FederatedStrategy, register_strategy
from ..options import Option, fraction_below_one, unit_interval_open_left
from .fedavg import FedAvgClient

HISTORY = "fedheal-history/"  # prefix of the sites' sign histories h_k in the checkpoint: <prefix><index>/<array>

OPTIONS = (
    Option(
        "fedheal-threshold",
        0.3,
        "fedheal: FPHL threshold tau; an element of a site's update is kept iff the fraction of its past updates "
        "with the same sign is > tau (reference 0.3)",
        fraction_below_one,
        "fedheal",
    ),
    Option(
        "fedheal-beta",
        0.4,
        "fedheal: FAEL momentum beta of the weight increments, dp <- (1-beta) dp + beta d_k / sum_j d_j "
        "(reference 0.4)",
        unit_interval_open_left,
        "fedheal",
    ),
)


def consistency_mask(
    update: Mapping[str, np.ndarray], history: Mapping[str, np.ndarray] | None, count: int, threshold: float
) -> tuple[OrderedDict[str, np.ndarray], OrderedDict[str, np.ndarray]]:
    """FPHL: the mask m_k of update u_k = θ − θ_k and the new sign history. ``history`` None (the site's first update):
    every element kept, h = [u ≥ 0]; else m = [consistency > τ] and h ← (count·h + [u ≥ 0]) / (count + 1)."""
    mask, new_history = OrderedDict(), OrderedDict()
    for k, u in update.items():
        increase = (u >= 0).astype(np.float64)
        if history is None:
            mask[k] = np.ones_like(increase)
            new_history[k] = increase
            continue
        h = history[k]
        consistency = np.where(u >= 0, h, 1.0 - h)
        mask[k] = (consistency > threshold).astype(np.float64)
        new_history[k] = (h * count + increase) / (count + 1)
    return mask, new_history


def update_distance(masked_update: Mapping[str, np.ndarray]) -> float:
    """d_k: the sum over arrays of the L2 norm of the masked update (the reference's ``compute_distance``)."""
    return float(sum(np.linalg.norm(u.reshape(-1)) for u in masked_update.values()))


def masked_aggregate(
    global_arrays: Mapping[str, np.ndarray],
    updates: list[Mapping[str, np.ndarray]],
    masks: list[Mapping[str, np.ndarray]],
    weights: np.ndarray,
) -> OrderedDict[str, np.ndarray]:
    """θ − Σ_k ŵ_k ⊙ m_k ⊙ u_k with ŵ_k = w_k m_k / Σ_j w_j m_j elementwise (w_k where that sum is 0)."""
    out = OrderedDict()
    for name, theta in global_arrays.items():
        adjusted = np.stack([w * m[name] for w, m in zip(weights, masks)])
        total = adjusted.sum(axis=0)
        safe = np.where(total == 0, 1.0, total)
        step = np.zeros(theta.shape, np.float64)
        for i, (w, u, m) in enumerate(zip(weights, updates, masks)):
            share = np.where(total == 0, w, adjusted[i] / safe)
            step += share * (u[name] * m[name])
        out[name] = (theta.astype(np.float64) - step).astype(theta.dtype)
    return out


@register_strategy
class FedHEAL(FederatedStrategy):
    """FedHEAL (Chen, Huang, Ye, CVPR 2024; reference code): FedAvg sites; the server keeps, per site, only the
    elements of its update u_k = θ − θ_k whose sign agrees with its history in more than a fraction τ of its past
    rounds (FPHL, m_k), weighs sites by p_k ← p_k + Δp_k, Δp_k ← (1−β)Δp_k + β d_k/Σ_j d_j, d_k = Σ ||m_k ⊙ u_k||
    (FAEL), and steps θ ← θ − Σ_k ŵ_k ⊙ m_k ⊙ u_k with ŵ_k = w_k m_k / Σ_j w_j m_j, w_k = p_k / Σ p.

    Leaves a site: trainable arrays (adapters + head) after local training and n_k.
    """

    name = "fedheal"
    global_model = True
    client_half = FedAvgClient
    folds_evaluation = True
    trains_backbone = True
    options = OPTIONS

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        self.history: dict[str, OrderedDict[str, np.ndarray]] = {}  # h_k per site name
        self.counts: dict[str, int] = {}  # c_k: updates of site k folded into h_k
        self.weights: dict[str, float] = {}  # p_k (unnormalised, as the reference keeps it)
        self.deltas: dict[str, float] = {}  # Δp_k
        self.distances: dict[str, float] = {}  # d_k of site k's latest update

    def fair_weights(self, sites: list[str], distances: list[float]) -> np.ndarray:
        """FAEL: record the sites' d_k, move Δp_k and p_k, return p_k / Σ p over ``sites``."""
        beta = self.cfg.fedheal_beta
        self.distances.update(zip(sites, distances))
        total = sum(self.distances.values())
        for site in sites:
            share = self.distances[site] / total if total > 0 else 0.0
            self.deltas[site] = (1 - beta) * self.deltas.get(site, 0.0) + beta * share
            self.weights[site] = self.weights.get(site, 1.0 / len(sites)) + self.deltas[site]
        p = np.array([self.weights[s] for s in sites], np.float64)
        return p / p.sum()

    def aggregate_train(self, rnd: int, replies: list[Any]) -> None:
        tau = self.cfg.fedheal_threshold
        sites, updates, masks, distances = [], [], [], []
        for reply in replies:
            site = reply.client
            update = OrderedDict(
                (k, theta.astype(np.float64) - reply.arrays[k].astype(np.float64))
                for k, theta in self.global_arrays.items()
            )
            mask, self.history[site] = consistency_mask(update, self.history.get(site), self.counts.get(site, 0), tau)
            self.counts[site] = self.counts.get(site, 0) + 1
            sites.append(site)
            updates.append(update)
            masks.append(mask)
            distances.append(update_distance(OrderedDict((k, u * mask[k]) for k, u in update.items())))
        weights = self.shares(self.fair_weights(sites, distances))
        kept = [float(np.mean(np.concatenate([m.reshape(-1) for m in mask.values()]))) for mask in masks]
        self.stats.extra["fedheal_kept"] = float(np.mean(kept))
        self.stats.extra["fedheal_weights"] = {site: float(w) for site, w in zip(sites, weights)}
        self.global_arrays = masked_aggregate(self.global_arrays, updates, masks, weights)

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        sites = sorted(self.history)
        arrays = OrderedDict(self.global_arrays)
        for i, site in enumerate(sites):
            arrays.update((f"{HISTORY}{i}/{k}", v) for k, v in self.history[site].items())
        meta = {
            "sites": sites,
            "counts": dict(self.counts),
            "weights": dict(self.weights),
            "deltas": dict(self.deltas),
            "distances": dict(self.distances),
        }
        return arrays, meta

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if not k.startswith(HISTORY)}, meta)
        self.history = {
            site: OrderedDict((k, np.array(arrays[f"{HISTORY}{i}/{k}"], np.float64)) for k in self.global_arrays)
            for i, site in enumerate(meta.get("sites", []))
        }
        self.counts = {k: int(v) for k, v in meta.get("counts", {}).items()}
        self.weights = {k: float(v) for k, v in meta.get("weights", {}).items()}
        self.deltas = {k: float(v) for k, v in meta.get("deltas", {}).items()}
        self.distances = {k: float(v) for k, v in meta.get("distances", {}).items()}
