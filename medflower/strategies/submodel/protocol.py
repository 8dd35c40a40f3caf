"""The sub-model protocol that every strategy of the family runs on: per-site capacities, sub-encoders cut from the
server's ViT, the covered merge; a method is a client class (its hooks) and a server class naming it.

Every site trains a sub-encoder of the server's ViT: each transformer block's FFN keeps ⌈β_k·d_ffn⌉ of its
hidden neurons (``models/ffn_slices.py``), the rest of the encoder stays whole. β_k is the site's capacity:
node-config ``capacity``, else ``fedbkd-capacities`` by partition id, else 1 (``capacity_of``). A site is a
segmentation or a classification client (its data decides: ``site-datasets`` or its own data folder); only the
encoder is shared, each site's decoder or head stays in its personal state.

Client template (``SubModelClient.train``), with the hooks a method overrides:
- ``start``: this round's sub-model, the received encoder with the site's own decoder/head (saved under
  ``task_state``), cut to the kept neurons;
- ``selection``: which neurons (``select_neurons``' kind: prefix, rolling, random or saliency);
- ``local_loss``: the term local training (``local-epochs``) adds to the task loss; ``fit``: what the site trains
  and keeps;
- ``computes_spread``: μ_k of the trained sub-encoder's features for the server's merge weights;
  ``sends_update``: False sends metrics only.

Server half (``SubModelStrategy``): the encoder only (``server_arrays``); each reply checked against the site's
narrowed shapes and kept indices (``reply_spec``, ``valid_replies``) and its capacity (``check_reply_values``); the
merge puts slices back at their global indices, each entry Σ_k w_k θ_k / Σ_{k covering it} w_k, entries no site
covers keep their value; w_k = n_k unless a method's ``merge_weight`` says otherwise. With β = 1 everywhere the
merge is weighted FedAvg.

Messages carry what the server decides each round (the round, this round's arrays, ``num-classes`` =
``model-classes`` = 0: each site builds its decoder/head for its own classes); the methods' static settings come
from the run config on the site.

What leaves a site: its sub-encoder's arrays (FFN slices narrowed), the kept neuron indices per FFN, n_k and
whatever its method adds to the metrics; never its decoder or head, never its data or features.

The registry-wide contract tests run the family on conftest's mixed federation (``contract_case``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from torch import nn

from ...contract import ArraySpec, ClientHalf, FederatedStrategy, PersonalState, Reply, from_record
from ...models.ffn_slices import (
    covered_merge,
    extract_subnetwork,
    feature_spread,
    ffn_modules,
    ffn_saliency,
    ffn_slice_axes,
    kept_count,
    select_neurons,
)
from ...options import Option
from ...training import ExtraLoss

ENCODER = "backbone."  # the shared part: every encoder array; decoders and heads stay on the sites
KEPT = "kept/"  # kept neuron indices travel as "kept/<ffn module name>" int64 arrays
GLOBAL_PATH = "global-path/"  # a personal-state prefix: the decoder/head a global-model update trains (Ditto)


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

# The mixed federation of the registry-wide contract tests (tests/conftest.py MIXED_TASKS): three capacities, two
# segmentation sites and one classification site.
CONTRACT_SITES = {
    "dataset": "synthetic-seg",
    "site-datasets": "synthetic-seg,synthetic-seg,synthetic",
    "fedbkd-capacities": "0.5,0.125,0.25",
    "synthetic-size": 160,
}


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
            model.set_trainable(task_module(previous, self.task_state), strict=False)
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


def task_module(saved: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """The decoder/head arrays of a site's personal state saved under ``prefix`` (not the encoder, not the kept
    indices, not another prefix's decoder/head)."""
    return {
        k[len(prefix) :]: v
        for k, v in saved.items()
        if k.startswith(prefix) and not k[len(prefix) :].startswith((ENCODER, KEPT, GLOBAL_PATH))
    }


class SubModelStrategy(FederatedStrategy):
    """Server half of the family (FedBKD and every baseline on its federation): per-site shapes, the covered merge.

    Each registered subclass names its client class (``client_half``), which decides the sites' behaviour; one that
    merges differently overrides ``merge_weight`` (FedBKD) or ``aggregate_train`` (MaT-FL, FedHCA², submodel-local).
    """

    options = (CAPACITIES,)
    adapter = "full"  # width-reduced whole encoders
    trains_backbone = True
    mixed_tasks = True  # only the encoder is shared: each site's decoder or head fits its own task
    contract_case: ClassVar[dict[str, Any]] = {
        "config": CONTRACT_SITES,
        "why": "sites of three capacities holding both tasks, so reply shapes and kept indices differ per site and "
        "only the encoder travels",
    }

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
