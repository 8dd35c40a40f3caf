"""The sub-model family: FedBKD (docs/methods/fedbkd.md) and its baselines with the same capacities (HeteroFL,
FedRolex, FedDrop, submodel-fedprox, submodel-local, Ditto), on one server half and one client template.

Every site trains a sub-encoder of the server's ViT: each transformer block's FFN keeps ⌈β_k·d_ffn⌉ of its
hidden neurons (``models/ffn_slices.py``), the rest of the encoder stays whole. β_k is the site's capacity:
node-config ``capacity``, else ``fedbkd-capacities`` by partition id, else 1. A site is a segmentation or a
classification client (its data decides: ``site-datasets`` or its own data folder); only the encoder is
shared, each site's decoder or head stays in its personal state.

Which neurons (``SubModelClient.selection``):
- ``fedbkd``: adaptive sub-model extraction (ASE). The site runs the received global encoder over its training
  data and keeps the top-ψ neurons of each FFN, ψ = mean² + variance of the GELU activation (Eqs. 2-3).
- ``heterofl``: the first k (a static prefix); ``fedrolex``: k consecutive neurons starting at (round − 1) mod
  d_ffn (a window rolling by one per round); ``feddrop``: k drawn at random per site and round (seeded).

Training: ``local-epochs`` on the sub-encoder + the site's decoder/head (``SubModelClient.local_loss``).
``fedbkd`` adds λ·(1 − CKA(f_k, f_g)) (feature consistency, FCO; Eq. 4 as a similarity, so 1 − CKA is the
loss; λ = ``fedbkd-lambda``), f_g the frozen global encoder's pooled features on the same batch.

Merge: slices go back to their global indices; each entry is Σ_k w_k θ_k / Σ_{k covering it} w_k, entries no
site covers keep their value. ``fedbkd``: w_k ∝ μ_k, the trace (or top eigenvalue, ``fedbkd-eigen``) of the
covariance of the site's encoder features after training (Eqs. 6-7); the baselines: w_k ∝ n_k (HeteroFL's
averaging over the clients that hold each entry). With β = 1 everywhere the merge is weighted FedAvg.

Capacity baselines beside those: ``submodel-fedprox`` (prefix + a proximal term), ``submodel-local`` (no
merge; the Δm reference) and ``ditto`` (prefix + a personal sub-model per site, Li et al. 2021).

Ablations (``fedbkd-variant``, the paper's Table 2): ``ase-only`` (top-ψ sub-models, no CKA, n_k weights),
``fco-only`` (prefix sub-models, CKA and eigenvalue weights).

Messages carry what the server decides each round (the round, this round's arrays, ``num-classes`` =
``model-classes`` = 0: each site builds its decoder/head for its own classes); the methods' static settings
(``fedbkd-*``, ``proximal-mu``, ``ditto-lambda``) come from the run config on the site. Each server class
names its client class, whose hooks decide the behaviour.

What leaves a site: its sub-encoder's arrays (FFN slices narrowed), the kept neuron indices per FFN, n_k and
μ_k (FedBKD); never its decoder or head, never its data or features.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from torch import nn

from ..contract import (
    ArraySpec,
    ClientHalf,
    FederatedStrategy,
    PersonalState,
    Reply,
    from_record,
    register_strategy,
    to_record,
)
from ..models.ffn_slices import (
    covered_merge,
    extract_subnetwork,
    feature_spread,
    ffn_modules,
    ffn_saliency,
    ffn_slice_axes,
    kept_count,
    linear_cka,
    select_neurons,
)
from ..options import Option, non_negative, one_of
from .fedavg import PROXIMAL_MU, proximal_term

ENCODER = "backbone."  # the shared part: every encoder array; decoders and heads stay on the sites
KEPT = "kept/"  # kept neuron indices travel as "kept/<ffn module name>" int64 arrays
GLOBAL_PATH = "global-path/"  # Ditto: the decoder/head its global-model update trains, saved beside the personal model


def parse_capacities(v: Any) -> str:
    """'' or comma-separated capacities in (0, 1], one per partition id."""
    text = str(v).strip()
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"entry {part!r} is not a number") from None
        if not 0 < value <= 1:
            raise ValueError(f"entry {part!r} must be in (0, 1] (the share of FFN neurons a site keeps)")
    return text


CAPACITIES = Option(
    "fedbkd-capacities",
    "",
    "fedbkd and its sub-model baselines: share of FFN neurons each site "
    "keeps, by partition id, e.g. '0.5,0.25,0.125'; empty = 1 (a node-config capacity wins)",
    None,
    "fedbkd",
    parse_capacities,
)
FEDBKD_OPTIONS = (
    Option(
        "fedbkd-lambda",
        1.0,
        "fedbkd: weight of the alignment loss lambda*(1 - CKA(sub-encoder, global encoder))",
        non_negative,
        "fedbkd",
    ),
    Option(
        "fedbkd-eigen",
        "trace",
        "fedbkd: mu_k of the merge weights, from the covariance of the site's features; "
        "none = weigh by n_k (a diagnostic, not the paper's)",
        one_of("trace", "top", "none"),
        "fedbkd",
    ),
    Option(
        "fedbkd-variant",
        "full",
        "fedbkd: full, ase-only (saliency sub-models, no CKA, n_k weights), fco-only "
        "(prefix sub-models with CKA and eigenvalue weights)",
        one_of("full", "ase-only", "fco-only"),
        "fedbkd",
    ),
)
DITTO_LAMBDA = Option(
    "ditto-lambda",
    0.1,
    "ditto: weight lambda of the personal model's pull (lambda/2)*||v - w_global||^2 towards the received sub-encoder",
    non_negative,
    "fedbkd",
)


def capacity_of(runtime) -> float:
    """β_k: node-config ``capacity``, else ``fedbkd-capacities`` by partition id, else 1."""
    node = runtime.context.node_config
    if node.get("capacity") is not None:
        return float(node["capacity"])
    listed = [float(p) for p in runtime.cfg.fedbkd_capacities.split(",") if p.strip()]
    if not listed:
        return 1.0
    if runtime.partition_id >= len(listed):
        raise ValueError(
            f"run-config 'fedbkd-capacities' lists {len(listed)} capacities but this site is partition "
            f"{runtime.partition_id}; give one per partition id or set node-config capacity"
        )
    return listed[runtime.partition_id]


def weighs_by_spread(cfg) -> bool:
    """FedBKD's w_k ∝ μ_k (Eq. 7), unless ``ase-only`` or ``fedbkd-eigen='none'`` (the diagnostic) weigh by n_k.

    Both halves ask it: the site computes μ_k only when the server weighs by it.
    """
    return cfg.fedbkd_variant != "ase-only" and cfg.fedbkd_eigen != "none"


class FeatureAligned(nn.Module):
    """The sub-model's forward that also keeps CKA(f_k, f_g) of the batch against the frozen global model.

    The global model is held outside the module tree, so the optimizer never sees its parameters.
    """

    def __init__(self, sub: nn.Module, reference: nn.Module):
        super().__init__()
        self.sub = sub
        self.task = sub.task
        self._reference = (reference,)
        self.alignment = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, features = self.sub.forward_with_features(x)
        with torch.no_grad():
            reference = self._reference[0].features(x)
        self.alignment = linear_cka(features, reference)
        return logits


ExtraLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class SubModelClient(ClientHalf):
    """Extract this round's sub-encoder, train it with the local decoder/head, send its slices back.

    ``train`` is a template; a strategy's client class overrides the hooks: ``selection`` (which neurons),
    ``local_loss`` (the term beside the task loss), ``start`` (where the sub-model comes from), ``fit`` (what the
    site trains and keeps), ``task_state`` (which saved decoder/head the shared model's update uses),
    ``computes_spread`` (μ_k) and ``sends_update`` (False: metrics only).
    """

    selection: ClassVar[str] = "prefix"  # select_neurons' kind: prefix, rolling, random or saliency
    task_state: ClassVar[str] = ""  # prefix of the saved decoder/head that the received encoder is trained with
    computes_spread: ClassVar[bool] = False  # μ_k (Eqs. 6-7) for the server's merge weights
    sends_update: ClassVar[bool] = True  # False: the site's model never leaves it

    def query(self, message: Message) -> RecordDict:
        content = super().query(message)
        content["metrics"]["capacity"] = capacity_of(self.rt)
        return content

    def personal(self) -> PersonalState:
        return PersonalState(self.rt, key="submodel")

    # ------------------------------------------------------------------ the template
    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        model = rt.model.to(rt.device)
        model.set_trainable(rt.initial_arrays)  # the task module's seeded init, unless the site has its own
        previous = self.personal().load(before=rt.round)
        capacity = capacity_of(rt)
        sub, kept = self.start(message, model, previous, capacity)
        metrics, saved = self.fit(sub, model, kept, previous)
        kept_arrays = OrderedDict((KEPT + name, idx) for name, idx in kept.items())
        self.personal().save(rt.round, OrderedDict([*saved.items(), *kept_arrays.items()]))
        metrics.update({"num-examples": len(rt.data.train), "capacity": capacity})
        if self.computes_spread:  # FedBKD's merge weight; the baselines weigh by n_k
            metrics["feature-spread"] = self.spread(sub, rt.cfg.fedbkd_eigen)
        if not self.sends_update:
            return self.reply(metrics=metrics)
        encoder = OrderedDict((k, v) for k, v in sub.get_trainable().items() if k.startswith(ENCODER))
        return self.reply(arrays=OrderedDict([*encoder.items(), *kept_arrays.items()]), metrics=metrics)

    # ------------------------------------------------------------------ hooks
    def start(
        self, message: Message, model: nn.Module, previous: dict[str, np.ndarray] | None, capacity: float
    ) -> tuple[nn.Module, OrderedDict[str, np.ndarray]]:
        """This round's sub-model: the received encoder with the site's own decoder/head, cut to the kept neurons."""
        if "arrays" in message.content.array_records:
            model.set_trainable(from_record(message.content["arrays"]), strict=False)
        if previous is not None:  # the site's decoder/head (Ditto: the one its global-model update trains)
            model.set_trainable(_task_module(previous, self.task_state), strict=False)
        kept = self.kept_neurons(model, capacity)
        return extract_subnetwork(model, kept), kept

    def kept_neurons(self, model: nn.Module, capacity: float) -> OrderedDict[str, np.ndarray]:
        """This round's kept neurons per FFN, by ``selection`` (saliency: ψ of Eqs. 2-3 on the training split)."""
        rt = self.rt
        selection = self.selection
        modules = ffn_modules(model)
        saliency = None
        if selection == "saliency":
            images = (x.to(rt.device) for x, _ in rt.loader("train"))
            saliency = ffn_saliency(model, images, forward=model.features)
        return OrderedDict(
            (
                name,
                select_neurons(
                    m.fc1.out_features,
                    capacity,
                    selection,
                    saliency=None if saliency is None else saliency[name],
                    round_index=rt.round - 1,
                    seed=rt.seed(7 + i),
                ),
            )
            for i, (name, m) in enumerate(modules.items())
        )

    def local_loss(self, sub: nn.Module, model: nn.Module) -> tuple[nn.Module, ExtraLoss | None]:
        """The module local training runs (``sub`` or a wrapper of it) and the term added to its task loss.

        ``model`` is the received global model, frozen. None: the task loss alone.
        """
        return sub, None

    def fit(
        self, sub: nn.Module, model: nn.Module, kept: Mapping[str, np.ndarray], previous: dict[str, np.ndarray] | None
    ) -> tuple[dict[str, float], Mapping[str, np.ndarray]]:
        """Local training of ``sub``: its metrics and the arrays the site keeps (the trained sub-model)."""
        trained, extra_loss = self.local_loss(sub, model)
        metrics = self.rt.train_local(extra_loss, model=trained)
        return metrics, sub.get_trainable()

    # ------------------------------------------------------------------ helpers
    def restore(self, saved: dict[str, np.ndarray]) -> tuple[nn.Module, OrderedDict[str, np.ndarray]]:
        """The site's sub-model as it left its last training (sub-encoder and decoder/head), and its kept neurons."""
        kept = OrderedDict((k[len(KEPT) :], v) for k, v in saved.items() if k.startswith(KEPT))
        sub = extract_subnetwork(self.rt.model, kept)
        sub.set_trainable({k: v for k, v in saved.items() if not k.startswith((KEPT, GLOBAL_PATH))})
        return sub, kept

    def received(self, sub: nn.Module) -> dict[str, torch.Tensor]:
        """The global sub-encoder as it arrived (before training): FedProx's and Ditto's anchor."""
        return {
            k: torch.as_tensor(v, device=self.rt.device)
            for k, v in sub.get_trainable().items()
            if k.startswith(ENCODER)
        }

    @torch.no_grad()
    def spread(self, sub: nn.Module, kind: str) -> float:
        """μ_k (Eqs. 6-7): the covariance trace or top eigenvalue of the trained sub-encoder's pooled features."""
        sub.eval()
        features = [sub.features(x.to(self.rt.device)).float().cpu().numpy() for x, _ in self.rt.loader("train")]
        return feature_spread(np.concatenate(features), kind)

    def evaluate(self, message: Message) -> RecordDict:
        """The site's own model after its last training: its sub-encoder and decoder/head."""
        rt = self.rt
        saved = self.personal().load(before=rt.round + 1)
        if saved is None:
            return self.reply(metrics={})
        return self.reply(metrics=rt.evaluate_splits(model=self.restore(saved)[0]))


class FedBKDClient(SubModelClient):
    """FedBKD's site: top-ψ neurons (ASE, Eqs. 2-3), λ·(1 − CKA(f_k, f_g)) beside the task loss (FCO, Eqs. 4-5),
    μ_k for the merge (Eqs. 6-7); ``fedbkd-variant`` ablates: ``ase-only`` (no CKA, no μ_k), ``fco-only`` (prefix)."""

    @property
    def selection(self) -> str:  # type: ignore[override]
        return "prefix" if self.rt.cfg.fedbkd_variant == "fco-only" else "saliency"

    @property
    def alignment_weight(self) -> float:
        """λ of the alignment loss: ``fedbkd-lambda``, 0 for ``ase-only``."""
        return 0.0 if self.rt.cfg.fedbkd_variant == "ase-only" else self.rt.cfg.fedbkd_lambda

    @property
    def computes_spread(self) -> bool:  # type: ignore[override]
        return weighs_by_spread(self.rt.cfg)

    def local_loss(self, sub: nn.Module, model: nn.Module) -> tuple[nn.Module, ExtraLoss | None]:
        weight = self.alignment_weight
        if weight == 0:
            return sub, None
        aligned = FeatureAligned(sub, model.eval())
        return aligned, lambda *_: weight * (1.0 - aligned.alignment)


class HeteroFLClient(SubModelClient):
    """HeteroFL's site: the first k neurons of each FFN, the task loss alone."""

    selection = "prefix"


class FedRolexClient(SubModelClient):
    """FedRolex's site: k consecutive neurons from (round − 1) mod d_ffn."""

    selection = "rolling"


class FedDropClient(SubModelClient):
    """FedDrop's site: k random neurons per site and round (seeded)."""

    selection = "random"


class SubModelFedProxClient(SubModelClient):
    """FedProx's site with a capacity: the prefix sub-encoder, plus (μ/2)·‖θ − θ_received‖² on the sub-encoder
    only (Li et al. 2020, Eq. 2; μ = ``proximal-mu``): the decoder/head never leaves the site."""

    selection = "prefix"

    def local_loss(self, sub: nn.Module, model: nn.Module) -> tuple[nn.Module, ExtraLoss | None]:
        mu = self.rt.cfg.proximal_mu
        if mu == 0:
            return sub, None
        return sub, proximal_term(sub, self.received(sub), mu)


class SubModelLocalClient(SubModelClient):
    """Local training with a capacity: round 1 cuts the prefix sub-encoder of the seeded initial encoder, later
    rounds continue the site's own sub-model; only metrics leave the site."""

    selection = "prefix"
    sends_update = False

    def start(
        self, message: Message, model: nn.Module, previous: dict[str, np.ndarray] | None, capacity: float
    ) -> tuple[nn.Module, OrderedDict[str, np.ndarray]]:
        if previous is not None:  # the site's own model goes on
            return self.restore(previous)
        return super().start(message, model, previous, capacity)


class DittoClient(SubModelClient):
    """Ditto's site (Li et al. 2021, Alg. 1): the global-model update on the prefix sub-encoder with its own
    decoder/head (saved under ``global-path/``), then the personal sub-model
    v_k ← v_k − η(∇F_k(v_k) + λ(v_k − w^t)), w^t the received sub-encoder, λ = ``ditto-lambda`` (λ = 0: purely
    local, still a personal model)."""

    selection = "prefix"
    task_state = GLOBAL_PATH

    def fit(
        self, sub: nn.Module, model: nn.Module, kept: Mapping[str, np.ndarray], previous: dict[str, np.ndarray] | None
    ) -> tuple[dict[str, float], Mapping[str, np.ndarray]]:
        rt = self.rt
        received = self.received(sub)
        # the personal model: its own last one, or (first round, new capacity) the received one
        same = previous is not None and all(np.array_equal(previous.get(KEPT + n), i) for n, i in kept.items())
        personal = self.restore(previous)[0] if same else extract_subnetwork(model, kept)
        update_metrics, update = super().fit(sub, model, kept, previous)
        metrics = {
            **{f"global-path-{k}": v for k, v in update_metrics.items()},
            **rt.train_local(proximal_term(personal, received, rt.cfg.ditto_lambda), model=personal),
        }
        saved = OrderedDict(
            [*personal.get_trainable().items(), *((GLOBAL_PATH + k, v) for k, v in _task_module(update).items())]
        )
        return metrics, saved


def _task_module(saved: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """The decoder/head arrays saved under ``prefix`` (not the encoder, not the kept indices)."""
    return {
        k[len(prefix) :]: v
        for k, v in saved.items()
        if k.startswith(prefix) and not k[len(prefix) :].startswith((ENCODER, KEPT, GLOBAL_PATH))
    }


class SubModelStrategy(FederatedStrategy):
    """Server half shared by FedBKD and the width-scaling baselines: per-site shapes, the covered merge.

    Each registered subclass names its client class (``client_half``), which decides the sites' behaviour.
    """

    options = (CAPACITIES,)
    adapter = "full"  # width-reduced whole encoders
    trains_backbone = True
    mixed_tasks = True  # only the encoder is shared: each site's decoder or head fits its own task

    def server_arrays(self, initial: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The encoder: decoders and heads stay on the sites."""
        return OrderedDict((k, v) for k, v in initial.items() if k.startswith(ENCODER))

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        self.ffn_width = self._ffn_widths()

    def _ffn_widths(self) -> dict[str, int]:
        """FFN module name -> d_ffn, from the encoder's fc1 weights."""
        return {k[: -len(".fc1.weight")]: v[0][0] for k, v in self.spec.items() if k.endswith(".fc1.weight")}

    # ------------------------------------------------------------------ what the sites are told
    def base_config(self, rnd: int, **extra: Any) -> ConfigRecord:
        # Sites hold different tasks and datasets: each builds its decoder/head for its own classes.
        config = super().base_config(rnd, **extra)
        config["num-classes"], config["model-classes"] = 0, 0
        return config

    def evaluate_content(self, rnd: int, node_id: int) -> RecordDict:
        return RecordDict({"config": self.base_config(rnd)})

    # ------------------------------------------------------------------ replies
    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        """β_k (a query's ``capacity``) lies in (0, 1] and stays what the site declared; μ_k (``feature-spread``,
        a weight of the merge) is >= 0."""
        if problem := super().check_reply_values(phase, reply):
            return problem
        metrics = reply.metrics
        if "capacity" in metrics and not 0.0 < metrics["capacity"] <= 1.0:
            return f"capacity must lie in (0, 1], got {metrics['capacity']}"
        if phase != "query" and "capacity" in metrics and metrics["capacity"] != self.capacity(reply.node_id):
            return f"capacity {metrics['capacity']} differs from the {self.capacity(reply.node_id)} declared at joining"
        if metrics.get("feature-spread", 0.0) < 0:
            return f"feature-spread must be >= 0, got {metrics['feature-spread']}"
        return None

    def capacity(self, node_id: int) -> float:
        return float(self.nodes[node_id].extra.get("capacity", 1.0)) if node_id in self.nodes else 1.0

    def reply_spec(self, node_id: int) -> ArraySpec:
        """The encoder with each FFN narrowed to ⌈β_k·d_ffn⌉ neurons, plus the kept indices."""
        capacity = self.capacity(node_id)
        spec: OrderedDict[str, tuple[tuple[int, ...], str]] = OrderedDict()
        for name, (shape, dtype) in self.spec.items():
            if (sliced := ffn_slice_axes(name, self.ffn_width)) is not None:
                ffn, axis = sliced
                narrow = kept_count(self.ffn_width[ffn], capacity)
                shape = tuple(narrow if i == axis else n for i, n in enumerate(shape))
            spec[name] = (shape, dtype)
        for ffn, width in self.ffn_width.items():
            spec[KEPT + ffn] = ((kept_count(width, capacity),), "int64")
        return spec

    def merge_weight(self, reply: Reply) -> float:
        return reply.num_examples

    def valid_replies(self, replies: list[Reply]) -> list[Reply]:
        """The replies whose kept indices are distinct, sorted neurons in range; the others are rejected."""
        valid = []
        for reply in replies:
            bad = [ffn for ffn, width in self.ffn_width.items() if not _valid_indices(reply.arrays[KEPT + ffn], width)]
            if bad:
                self.stats.rejected.append(
                    f"{reply.client}: kept indices of {bad[0]} are not distinct, sorted neurons in range"
                )
                continue
            valid.append(reply)
        return valid

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        valid = self.valid_replies(replies)
        if not valid:
            return
        parts = [{k: v for k, v in r.arrays.items() if not k.startswith(KEPT)} for r in valid]
        kept = [{ffn: r.arrays[KEPT + ffn] for ffn in self.ffn_width} for r in valid]
        weights = list(self.shares([self.merge_weight(r) for r in valid]))
        self.global_arrays = covered_merge(self.global_arrays, parts, kept, weights, self.ffn_width)
        self.stats.extra["merge_weights"] = {r.client: round(w / sum(weights), 6) for r, w in zip(valid, weights)}


def _valid_indices(index: np.ndarray, width: int) -> bool:
    return bool(index.size) and bool((np.diff(index) > 0).all()) and int(index[0]) >= 0 and int(index[-1]) < width


@register_strategy
class FedBKD(SubModelStrategy):
    """FedBKD: top-ψ sub-encoders, CKA alignment to the global encoder, eigenvalue-weighted covered merge.

    Leaves a site: its sub-encoder's arrays, the kept neuron indices, n_k and μ_k.
    """

    name = "fedbkd"
    client_half = FedBKDClient
    options = (CAPACITIES, *FEDBKD_OPTIONS)

    @property
    def weighs_by_spread(self) -> bool:
        """w_k ∝ μ_k (Eq. 7), unless ``ase-only`` or ``fedbkd-eigen='none'`` (the diagnostic) weigh by n_k."""
        return weighs_by_spread(self.cfg)

    def merge_weight(self, reply: Reply) -> float:
        if not self.weighs_by_spread:
            return reply.num_examples
        return max(float(reply.metrics.get("feature-spread", 0.0)), 1e-12)


@register_strategy
class HeteroFL(SubModelStrategy):
    """HeteroFL (Diao et al. 2021): static prefix sub-models, entries averaged over the sites holding them.

    Leaves a site: its sub-encoder's arrays, the kept neuron indices, n_k.
    """

    name = "heterofl"
    client_half = HeteroFLClient


@register_strategy
class FedRolex(SubModelStrategy):
    """FedRolex (Alam et al. 2022): a window of neurons rolling by one per round.

    Leaves a site: its sub-encoder's arrays, the kept neuron indices, n_k.
    """

    name = "fedrolex"
    client_half = FedRolexClient


@register_strategy
class FedDrop(SubModelStrategy):
    """FedDrop (federated dropout, Caldas et al. 2018): a random subset of neurons per site and round.

    Leaves a site: its sub-encoder's arrays, the kept neuron indices, n_k.
    """

    name = "feddrop"
    client_half = FedDropClient


@register_strategy
class SubModelFedProx(SubModelStrategy):
    """FedProx with the same capacities: HeteroFL's prefix sub-encoders and covered merge, plus
    (mu/2)·‖θ − θ_received‖² over the sub-encoder in local training (``proximal-mu``).

    Leaves a site: its sub-encoder's arrays, the kept neuron indices, n_k.
    """

    name = "submodel-fedprox"
    client_half = SubModelFedProxClient
    options = (CAPACITIES, PROXIMAL_MU)


@register_strategy
class SubModelLocal(SubModelStrategy):
    """Local training with the same capacities: each site trains its prefix sub-encoder of the seeded initial
    encoder and its decoder/head alone; nothing is merged (the Δm reference of FedBKD's Table 1).

    Leaves a site: metrics only.
    """

    name = "submodel-local"
    client_half = SubModelLocalClient

    def reply_spec(self, node_id: int) -> ArraySpec:
        return {}

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        # Round 1 needs the seeded initial encoder to cut the site's sub-encoder from; later rounds need nothing.
        return RecordDict(
            {"config": self.base_config(rnd)}
            if rnd > 1
            else {"arrays": to_record(self.global_arrays), "config": self.base_config(rnd)}
        )

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        """Nothing to merge: each site keeps its own model."""


@register_strategy
class Ditto(SubModelStrategy):
    """Ditto (Li et al. 2021) with the same capacities: each site updates HeteroFL's prefix sub-encoder of the
    global one with a decoder/head of its own (merged like HeteroFL), and also trains a personal sub-model
    pulled towards the received sub-encoder by (λ/2)·‖v − w‖² (``ditto-lambda``); sites are evaluated on it.

    Leaves a site: its global-model update's sub-encoder arrays, the kept neuron indices, n_k; the personal
    model never.
    """

    name = "ditto"
    client_half = DittoClient
    options = (CAPACITIES, DITTO_LAMBDA)
