"""SGCA / FedSCA: similarity-guided collaborative aggregation with low-level adapter transmission.

Zhang et al., "FedSCA: Federated Tuning with Similarity-guided Collaborative Aggregation for
Heterogeneous Medical Image Segmentation"; the method as implemented: docs/methods/sgca.md.

Each round, the server turns the adapters the participants sent into one mixing matrix W (a QP per
client over adapter distances) and sends client i its own aggregate ``Θ̂_i = Σ_j W_ij Θ_j``. Only the
lowest ``lat-layers`` adapter modules travel (LAT); higher adapters and the head/decoder stay on the site.

What leaves a site: the lowest ``lat-layers`` adapter modules after local training and the number of
training samples n_i. Higher adapters, the head/decoder and all data stay on the site.

Also here: ``lat``, the paper's LAT baseline (FedAvg over the transmitted adapters only, no cosine term):
the same protocol with W_ij = m_j for every i.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict
from flwr.common.logger import log

from ..contract import (
    ArraySpec,
    FederatedStrategy,
    Reply,
    register_strategy,
    stack_flat,
    to_record,
    unflatten,
    validate_arrays,
)
from ..models import lowest_adapter_names
from ..options import Option, non_negative, one_of
from .shared_subset import SharedSubsetClient


def parse_lat_layers(v: Any) -> int | str:
    """An integer >= 1 (also as a string) or 'all'."""
    if v == "all":
        return "all"
    if isinstance(v, bool):
        raise ValueError("must be an integer >= 1 or 'all'")
    try:
        n = int(v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        raise ValueError("must be an integer >= 1 or 'all'") from None
    if n < 1 or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("must be an integer >= 1 or 'all'")
    return n


METRIC = Option(
    "sgca-metric",
    "l2",
    "sgca: adapter distance (similarities enter as D = -sim)",
    one_of("l2", "l1", "cosine", "inner"),
    "sgca",
)
DISTANCE_SCALE = Option(
    "sgca-distance-scale",
    "row-max",
    "sgca: how distances are made unit-free; row-max = each row divided by its "
    "largest entry, median = the whole matrix divided by the median off-diagonal distance (a site far from everyone "
    "then keeps more of its own adapter)",
    one_of("row-max", "median"),
    "sgca",
)
SOLVER = Option(
    "sgca-solver",
    "cvxpy",
    "sgca: QP solver; closed-form = projection onto the simplex",
    one_of("cvxpy", "closed-form"),
    "sgca",
)
DEVICE = Option(
    "sgca-device",
    "auto",
    "sgca: where the server computes the two N x N x P products (distances, mixing); auto = cuda when the server "
    "has one, else cpu",
    one_of("auto", "cpu", "cuda"),
    "sgca",
)
METRICS, DISTANCE_SCALES, SOLVERS = METRIC.choices, DISTANCE_SCALE.choices, SOLVER.choices
OPTIONS = (
    Option(
        "lat-layers",
        1,
        "sgca/lat: lowest adapter modules that travel (an integer, or 'all')",
        None,
        "sgca",
        parse_lat_layers,
    ),
    Option("sgca-alpha", 0.8, "sgca: weight alpha of the distance term in the aggregation QP", non_negative, "sgca"),
    Option("sgca-beta", 0.01, "sgca: weight beta of the client's -cos(theta, aggregate) term", non_negative, "sgca"),
    METRIC,
    DISTANCE_SCALE,
    SOLVER,
    DEVICE,
)


# ----------------------------------------------------------------------------- aggregation math (server)
def product_flops(n: int, p: int) -> float:
    """Floating-point operations of SGCA's two dense products on N adapters of P parameters: the Gram matrix
    X Xᵀ for the distances and the mixing W Θ, 2·N·N·P each (a multiply and an add per term)."""
    return 2 * 2.0 * n * n * p


def adapter_distances(
    thetas: np.ndarray | torch.Tensor, metric: str = "l2", scale: str = "row-max", device: str | torch.device = "cpu"
) -> np.ndarray:
    """D [N, N] between flattened adapters ``thetas`` [N, P], made unit-free so that α means the same
    whatever the adapter size.

    l2 and l1 are distances; cosine and inner are similarities and enter as ``D = -sim`` (the paper's Eq. 7
    minimises α·Σ_j W_ij d(Θ_i, Θ_j) with a distance, so a similarity enters with a minus sign).
    ``scale``: ``row-max`` divides each row by its largest |entry| (then a site far from everyone mixes
    like one close to everyone); ``median`` divides the whole matrix by the median off-diagonal |entry|,
    one constant, so a site far from everyone sees large distances and keeps more of its own adapter.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown sgca-metric {metric!r}; choose one of {list(METRICS)}")
    if scale not in DISTANCE_SCALES:
        raise ValueError(f"unknown sgca-distance-scale {scale!r}; choose one of {list(DISTANCE_SCALES)}")
    x = torch.as_tensor(thetas, dtype=torch.float32).to(device)
    if metric == "l2":
        # Centering first keeps the Gram-matrix form accurate for adapters that sit close together.
        xc = x - x.mean(dim=0, keepdim=True)
        sq = (xc * xc).sum(dim=1).double()
        d2 = sq[:, None] + sq[None, :] - 2.0 * (xc @ xc.T).double()
        d = d2.clamp_min(0.0).sqrt()
    elif metric == "l1":
        d = torch.cdist(x.double(), x.double(), p=1)
    else:
        if metric == "cosine":
            x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
        d = -(x @ x.T).double()
    d = d.cpu().numpy()
    if metric in ("l2", "l1"):
        np.fill_diagonal(d, 0.0)
    if scale == "row-max":
        denominator = np.abs(d).max(axis=1, keepdims=True)
    else:
        off_diagonal = np.abs(d[~np.eye(len(d), dtype=bool)])
        denominator = np.full((len(d), 1), np.median(off_diagonal) if off_diagonal.size else 0.0)
    return np.divide(d, denominator, out=np.zeros_like(d), where=denominator > 0)


def project_rows_onto_simplex(v: np.ndarray) -> np.ndarray:
    """Euclidean projection of every row of ``v`` onto the probability simplex {w >= 0, Σw = 1}.

    The sort-and-threshold algorithm of Held et al. (1974) / Duchi et al. (2008), vectorised over rows.
    Hand-written: neither numpy nor scipy ships it, and cvxpy is what it replaces.
    """
    v = np.atleast_2d(np.asarray(v, dtype=np.float64))
    n = v.shape[1]
    u = -np.sort(-v, axis=1)
    css = np.cumsum(u, axis=1) - 1.0
    k = np.arange(1, n + 1)
    positive = u - css / k > 0  # true for a prefix of each row
    rho = positive.sum(axis=1) - 1
    theta = css[np.arange(len(v)), rho] / (rho + 1)
    return np.maximum(v - theta[:, None], 0.0)


def sgca_weights_closed_form(m: np.ndarray, d: np.ndarray, alpha: float) -> np.ndarray:
    """W_i = argmin_{w in simplex} Σ_j (w_j − m_j)² + α Σ_j w_j D_ij, for all i at once.

    Completing the square, the objective is ‖w − (m − (α/2) D_i)‖² + const, so each row is the simplex
    projection of ``m − (α/2) D_i``.
    """
    m = np.asarray(m, dtype=np.float64)
    return project_rows_onto_simplex(m[None, :] - 0.5 * alpha * np.asarray(d, dtype=np.float64))


def sgca_weights_cvxpy(m: np.ndarray, d: np.ndarray, alpha: float) -> np.ndarray:
    """The same QP solved row by row with cvxpy (Clarabel, tight tolerances), as the paper does.

    One parametrised problem is compiled once and re-solved for every row. Solver round-off
    (entries of about -1e-12) is clipped and each row renormalised onto the simplex.
    """
    import cvxpy as cp

    m = np.asarray(m, dtype=np.float64)
    n = len(m)
    w = cp.Variable(n)
    d_row = cp.Parameter(n)
    problem = cp.Problem(cp.Minimize(cp.sum_squares(w - m) + alpha * (d_row @ w)), [w >= 0, cp.sum(w) == 1])
    out = np.empty((n, n))
    for i in range(n):
        d_row.value = np.asarray(d[i], dtype=np.float64)
        problem.solve(solver=cp.CLARABEL, tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12)
        if w.value is None:
            raise RuntimeError(f"cvxpy could not solve the SGCA QP of row {i}: status {problem.status}")
        out[i] = w.value
    out = np.maximum(out, 0.0)
    return out / out.sum(axis=1, keepdims=True)


def sgca_weights(m: np.ndarray, d: np.ndarray, alpha: float, solver: str = "cvxpy") -> np.ndarray:
    """Mixing matrix W [N, N], the paper's Eq. 7 row by row; a single participant gives [[1]]."""
    if len(m) == 1:
        return np.ones((1, 1))
    if solver == "closed-form":
        return sgca_weights_closed_form(m, d, alpha)
    if solver == "cvxpy":
        return sgca_weights_cvxpy(m, d, alpha)
    raise ValueError(f"unknown sgca-solver {solver!r}; choose one of {list(SOLVERS)}")


# ----------------------------------------------------------------------------- client half
def cosine_pull(params: Mapping[str, torch.nn.Parameter], aggregate: Mapping[str, torch.Tensor], beta: float):
    """The client's extra loss ``−β·cos(Θ_i, Θ̂_i)`` over the flattened transmitted adapters (the paper's Eq. 9-10)."""
    names = list(aggregate)
    target = torch.cat([aggregate[n].reshape(-1) for n in names])

    def extra_loss(_model, _logits, _labels):
        theta = torch.cat([params[n].reshape(-1) for n in names])
        return -beta * torch.nn.functional.cosine_similarity(theta, target.to(theta.dtype), dim=0, eps=1e-12)

    return extra_loss


class SGCAClient(SharedSubsetClient):
    """Keeps every trainable array in its personal state; trains with Θ̂_i in place of its lowest adapters."""

    def shared_names(self) -> list[str]:
        return lowest_adapter_names(self.rt.model.trainable_names(), self.rt.cfg.lat_layers)

    def shared_description(self) -> str:
        return f"lowest lat-layers={self.rt.cfg.lat_layers} adapter modules"

    def extra_loss(self, shared: Mapping[str, np.ndarray]):
        """SGCA's cosine pull of the trained adapters towards Θ̂_i, weight β (none for LAT)."""
        rt, beta = self.rt, self.pull_weight()
        if beta <= 0:
            return None
        rt.model.to(rt.device)
        anchor = {k: torch.as_tensor(v, device=rt.device) for k, v in shared.items()}
        return cosine_pull(rt.model.trainable_parameters(), anchor, beta)

    def pull_weight(self) -> float:
        """β of the cosine pull (run-config sgca-beta)."""
        return self.rt.cfg.sgca_beta


class LATClient(SGCAClient):
    """SGCA's client without the cosine pull: LAT trains on the plain local loss."""

    def pull_weight(self) -> float:
        return 0.0


# ----------------------------------------------------------------------------- server half
@register_strategy
class SGCA(FederatedStrategy):
    """SGCA (FedSCA, Eq. 7 and 10; docs/methods/sgca.md): per-client aggregates of the lowest adapters from a QP
    over distances.

    Leaves a site: the lowest ``lat-layers`` adapter modules and n_i. Comes back: Θ̂_i, one array set per node.
    """

    name = "sgca"
    contract_case = {"config": {"sgca-solver": "closed-form"}, "why": "the QP's closed form keeps the tests off cvxpy"}
    client_half = SGCAClient
    folds_evaluation = True
    options = OPTIONS
    client_dp = ("site",)  # W and each Θ̂_i are post-processing of the noised Θ_j
    dp_sgd = True  # the cosine pull is a parameter-only term

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        cfg = self.cfg
        self.transmitted = lowest_adapter_names(initial, cfg.lat_layers)
        self.transmitted_spec: OrderedDict[str, tuple[tuple[int, ...], str]] = OrderedDict(
            (k, self.spec[k]) for k in self.transmitted
        )
        self.initial_transmitted = OrderedDict((k, np.array(initial[k])) for k in self.transmitted)
        self.aggregates: dict[str, OrderedDict[str, np.ndarray]] = {}  # client name -> Θ̂_i
        log(
            INFO,
            "[medflower] %s: %d of %d trainable arrays travel (lat-layers=%s): %d parameters",
            self.name,
            len(self.transmitted),
            len(self.spec),
            cfg.lat_layers,
            sum(int(np.prod(s)) for s, _ in self.transmitted_spec.values()),
        )

    # --- hooks of the default round
    def aggregate_for(self, node_id: int) -> OrderedDict[str, np.ndarray]:
        """Θ̂_i of the node's client: its last aggregate, or the shared initial adapters before its first."""
        return self.aggregates.get(self.client_name(node_id), self.initial_transmitted)

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        return RecordDict({"arrays": to_record(self.aggregate_for(node_id)), "config": self.base_config(rnd)})

    evaluate_content = train_content

    def reply_spec(self, node_id: int) -> ArraySpec:
        return self.transmitted_spec

    @property
    def product_device(self) -> torch.device:
        """run-config sgca-device: the server's GPU when it has one (auto), else the CPU."""
        wanted = self.cfg.sgca_device
        return torch.device("cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu")

    def mixing_matrix(self, m: np.ndarray, thetas: torch.Tensor) -> np.ndarray:
        d = adapter_distances(thetas, self.cfg.sgca_metric, self.cfg.sgca_distance_scale, thetas.device)
        # logged beside W: W alone cannot tell the distance term (D) from the size prior (m)
        self.stats.extra.update(sgca_D=np.round(d, 8).tolist())
        return sgca_weights(m, d, self.cfg.sgca_alpha, self.cfg.sgca_solver)

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        """W from the valid replies (rejected ones are not in it), then Θ̂_i = Σ_j W_ij Θ_j per participant."""
        clients = [r.client for r in replies]
        # The two N x N x P products (distances, mixing) run in torch on sgca-device: at N = 1000 ViT-B-sized
        # adapters they are nearly all of the step (docs/methods/sgca.md#which-solver).
        thetas = torch.from_numpy(stack_flat([r.arrays for r in replies], self.transmitted_spec))
        thetas = thetas.to(self.product_device)
        sizes = np.array([r.num_examples for r in replies], dtype=np.float64)
        m = self.shares(
            sizes
        )  # m_j = n_j / Σn, capped at max-client-share (Eq. 7 writes m_i: a typo, the weight is j's)
        w = self.mixing_matrix(m, thetas)
        # torch's matmul: the same float32 product as numpy's, about 1.5x faster on the CPUs measured here
        mixed = (torch.from_numpy(w.astype(np.float32)).to(thetas.device) @ thetas).cpu().numpy()
        for client, row in zip(clients, mixed):
            self.aggregates[client] = unflatten(row, self.transmitted_spec)
        self.stats.extra.update(sgca_clients=clients, sgca_m=np.round(m, 8).tolist(), sgca_W=np.round(w, 8).tolist())

    # --- persistence: one Θ̂ per client
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays = OrderedDict(
            (f"{client}/{name}", value)
            for client, agg in sorted(self.aggregates.items())
            for name, value in agg.items()
        )
        return arrays, {"clients": sorted(self.aggregates)}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.aggregates = {}
        for client in meta.get("clients", []):
            agg = OrderedDict(
                (name, np.array(arrays[f"{client}/{name}"]))
                for name in self.transmitted
                if f"{client}/{name}" in arrays
            )
            if problem := validate_arrays(agg, self.transmitted_spec):
                raise ValueError(f"checkpoint aggregate of {client} does not fit this model: {problem}")
            self.aggregates[client] = agg


@register_strategy
class LAT(SGCA):
    """LAT baseline: FedAvg (W_ij = m_j) over the lowest ``lat-layers`` adapters; no cosine pull.

    Leaves a site: the lowest ``lat-layers`` adapter modules and n_i.
    """

    name = "lat"
    client_half = LATClient
    secagg = True  # Σ_j m_j Θ_j needs only the sum of the sites' weighted updates

    def mixing_matrix(self, m: np.ndarray, thetas: torch.Tensor) -> np.ndarray:
        return np.tile(m, (len(m), 1))

    def aggregate_secure(self, rnd: int, mean_update: Mapping[str, np.ndarray], sites: list[int]) -> None:
        """With secagg: Σ_j m_j Θ_j = Σ_j m_j Θ̂_j + Σ_j m_j (Θ_j − Θ̂_j) over the sites j in the sum, Θ̂_j what the
        server sent j (known to it; sites that skipped rounds hold older aggregates), the second sum SecAgg+'s
        n_k-weighted mean update; m_j = n_j / Σ n from the sizes the sites declared when they joined."""
        sites = [n for n in sites if n in self.nodes]
        if not sites:
            return
        m = np.array([self.nodes[n].num_train for n in sites], dtype=np.float64)
        m /= m.sum()
        sent = [self.aggregate_for(n) for n in sites]
        mixed = OrderedDict(
            (k, np.asarray(sum(w * a[k].astype(np.float64) for w, a in zip(m, sent)) + mean_update[k], dtype=v[1]))
            for k, v in self.transmitted_spec.items()
        )
        for n in sites:
            self.aggregates[self.client_name(n)] = mixed
