"""FedHCA²: Hetero-Client Federated Multi-Task Learning (Lu, Huang, Yang, Sirejiding, Ding and Lu, CVPR 2024), on the
sub-model federation of FedBKD (docs/methods/fedbkd.md): sites of different capacities, segmentation and
classification sites together.

The server keeps each site's personalised model: its sub-encoder (the first ⌈β_k·d_ffn⌉ neurons of every FFN, as
HeteroFL: FedHCA² itself is not capacity-aware) and, for a segmentation site, its decoder body (the decoder without
its output layer; the paper's decoder, whose task head stays local). Each round a site trains what it received with
its own output layer or classification head, and returns the trained arrays. With Δ_i the site's update of round t:

- Hyper Conflict-Averse Aggregation (encoders): the updates are treated as gradients of a multi-objective problem and
  combined as CAGrad does (Liu et al., NeurIPS 2021): w* = argmin_{w ∈ simplex} wᵀG b + c‖g₀‖√(wᵀGw) with G the Gram
  matrix of the updates, b = 1/N and g₀ the mean update; d* = (g₀ + c‖g₀‖/‖g_w‖ · g_w)/(1 + c²). Site i's encoder
  becomes θ_i + Δ_i + α_i·d* (each sub-encoder's update is zero-padded to the full encoder; the site takes its slice).
- Hyper Cross-Attention Aggregation (decoders of one shape): per array of each layer l,
  φ_i ← φ_i + Δφ_i + β_i^l · softmax(Δφ_i ΔΦᵀ/√D) ΔΦ, ΔΦ the stacked updates of the decoders in the group.
- Hyper Aggregation Weights: α_i and β_i^l, clamped to [0, 1] where used, learnt on the server by SGD from the
  sites' next updates: ∂L/∂α_i = −⟨Δ_i^{t+1}, ∂θ_i^t/∂α_i⟩ = −⟨Δ_i^{t+1}, d*^t⟩ (the same for β with the attention
  output), as the authors' code backpropagates the personalised parameters with the difference it sees next round.

What leaves a site: its trained sub-encoder and, when it received one, its trained decoder body; n_k, β_k and whether
it segments. Never its output layer or classification head, nor its data. What comes to it: its personalised
sub-encoder and decoder body (training and evaluation messages).
Decisions: docs/methods/baselines-submodel.md#fedhca2-fedhca2.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Message, RecordDict
from scipy.optimize import minimize

from ...contract import ArraySpec, PersonalState, Reply, from_record, register_strategy, spec_of, to_record
from ...models.ffn_slices import extract_subnetwork, ffn_slice_axes, kept_count, select_neurons
from ...options import Option, bad, non_negative, one_of, positive
from .protocol import CAPACITIES, ENCODER, SubModelClient, SubModelStrategy, capacity_of

SITE = "site"  # server state: "site<i>/<part>/<array>" for the i-th site of the meta's "sites"
PARTS = ("encoder", "decoder", "encoder-direction", "decoder-direction")
MOMENTUM, WEIGHT_DECAY = 0.9, 1e-4  # the authors' SGD of the hyper weights (their configs' Hyperweight block)

OPTIONS = (
    Option(
        "fedhca2-ca-c",
        0.4,
        "fedhca2: radius c of the conflict-averse encoder update, ||d - g0|| <= c||g0|| (authors' default 0.4; "
        "0 = the mean update)",
        non_negative,
        "fedhca2",
    ),
    Option(
        "fedhca2-alpha-init",
        0.1,
        "fedhca2: initial hyper aggregation weight alpha of each site's encoder (authors' default 0.1)",
        non_negative,
        "fedhca2",
    ),
    Option(
        "fedhca2-beta-init",
        0.1,
        "fedhca2: initial layer-wise hyper weight beta of each decoder's cross-attention (authors' default 0.1)",
        non_negative,
        "fedhca2",
    ),
    Option(
        "fedhca2-hyper-lr",
        0.01,
        "fedhca2: SGD learning rate of the hyper weights on the server (momentum 0.9, weight decay 1e-4, as the "
        "authors)",
        positive,
        "fedhca2",
    ),
    Option(
        "fedhca2-decoders",
        "cross-attention",
        "fedhca2: cross-attention = Hyper Cross-Attention Aggregation of the segmentation decoders (without their "
        "output layers); local = decoders stay on the sites",
        one_of("cross-attention", "local"),
        "fedhca2",
    ),
)


# ----------------------------------------------------------------------------- the aggregations
def conflict_averse_weights(gram: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray]:
    """CAGrad's dual on the Gram matrix G of N updates (Hyper Conflict-Averse Aggregation): w* minimises
    wᵀG b + c‖g₀‖√(wᵀGw) over the simplex, b = 1/N. Returns (w*, γ) with d* = Σ_i γ_i Δ_i =
    (g₀ + c‖g₀‖/‖g_w‖ · g_w)/(1 + c²), the rescaling of the authors' code.

    Solved with scipy's SLSQP from b, as the authors do; G is scaled by its largest entry first (w* is invariant
    to it, and the solver's tolerances then mean the same for any size of update)."""
    gram = np.asarray(gram, dtype=np.float64)
    n = len(gram)
    b = np.full(n, 1.0 / n)
    scale = float(np.abs(gram).max()) if n else 0.0
    if n == 0 or scale == 0.0 or c == 0.0:
        return b.copy(), b / (1.0 + c * c)
    a = gram / scale
    k = c * math.sqrt(max(float(b @ a @ b), 0.0))  # c‖g₀‖

    def objective(w: np.ndarray) -> float:
        return float(w @ a @ b + k * math.sqrt(max(float(w @ a @ w), 0.0) + 1e-12))

    def jacobian(w: np.ndarray) -> np.ndarray:
        return a @ b + k * (a @ w) / math.sqrt(max(float(w @ a @ w), 0.0) + 1e-12)

    result = minimize(
        objective,
        b,
        jac=jacobian,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * n,
        constraints={"type": "eq", "fun": lambda w: 1.0 - w.sum(), "jac": lambda w: -np.ones_like(w)},
        options={"ftol": 1e-12, "maxiter": 500},
    )
    w = np.clip(result.x, 0.0, None)
    w = w / w.sum() if w.sum() > 0 else b.copy()
    norm_w = math.sqrt(max(float(w @ a @ w), 0.0))
    lam = k / (norm_w + 1e-12)
    return w, (b + lam * w) / (1.0 + c * c)


def gram_matrix(updates: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
    """G_ij = ⟨Δ_i, Δ_j⟩ over every array (float64), one array at a time rather than one flattened copy."""
    n = len(updates)
    gram = np.zeros((n, n))
    for name in updates[0] if n else ():
        stacked = np.stack([np.asarray(u[name], dtype=np.float64).reshape(-1) for u in updates])
        gram += stacked @ stacked.T
    return gram


def cross_attention(updates: np.ndarray) -> np.ndarray:
    """softmax(Δ_i ΔΦᵀ/√D) ΔΦ for every row i of the stacked updates ``[K, D]`` (the authors' CrossAttention, one
    query per decoder): torch's scaled dot-product attention is exactly this."""
    x = torch.as_tensor(np.asarray(updates, dtype=np.float64))[None]
    return F.scaled_dot_product_attention(x, x, x)[0].numpy()


def decoder_body(names: Sequence[str]) -> list[str]:
    """The decoder arrays the paper aggregates: the task module's arrays (everything outside the encoder) except
    those of its last layer, the output layer whose width is the site's number of classes (FedHCA²'s task head)."""
    task = [n for n in names if not n.startswith(ENCODER)]
    if not task:
        return []
    head = task[-1].rsplit(".", 1)[0]
    return [n for n in task if n.rsplit(".", 1)[0] != head]


def layer_of(name: str) -> str:
    """The layer an array belongs to (its module path): β is layer-wise, shared by a layer's weight and bias."""
    return name.rsplit(".", 1)[0]


# ----------------------------------------------------------------------------- client half
class FedHCA2Client(SubModelClient):
    """Trains the personalised sub-encoder (and decoder body) it receives with its own output layer or head; sends
    back what it received, trained. Its output layer or head stays in its personal state (key ``fedhca2``)."""

    def query(self, message: Message) -> RecordDict:
        content = super().query(message)
        content["metrics"]["segments"] = float(getattr(self.rt.data, "task", "classification") == "segmentation")
        return content

    def personal(self) -> PersonalState:
        return PersonalState(self.rt, key="fedhca2")

    def build(self, message: Message, before: int) -> tuple[Any, OrderedDict[str, np.ndarray], bool]:
        """The site's model with its own task module (saved before round ``before``) and the received arrays: the
        prefix sub-encoder at its capacity. Returns (sub-model, received arrays, whether the site has trained)."""
        rt = self.rt
        model = rt.model.to(rt.device)
        model.set_trainable(rt.initial_arrays)  # the task module's seeded init, unless the site has its own
        own = self.personal().load(before=before)
        if own is not None:
            model.set_trainable(own, strict=False)
        received = from_record(message.content["arrays"]) if "arrays" in message.content.array_records else {}
        model.set_trainable({k: v for k, v in received.items() if not k.startswith(ENCODER)}, strict=False)
        capacity = capacity_of(rt)
        widths = {
            k[: -len(".fc1.weight")]: p.shape[0]
            for k, p in model.trainable_parameters().items()
            if k.endswith(".fc1.weight")
        }
        kept = OrderedDict()
        for name, value in received.items():
            if name.endswith(".fc1.weight"):
                ffn = name[: -len(".fc1.weight")]
                if value.shape[0] != kept_count(widths[ffn], capacity):
                    raise ValueError(
                        f"received {value.shape[0]} neurons of {ffn}; capacity {capacity} keeps "
                        f"{kept_count(widths[ffn], capacity)}"
                    )
                kept[ffn] = select_neurons(widths[ffn], capacity, "prefix")
        sub = extract_subnetwork(model, kept)
        sub.set_trainable({k: v for k, v in received.items() if k.startswith(ENCODER)}, strict=False)
        return sub, received, own is not None

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        sub, received, _ = self.build(message, before=rt.round)
        metrics = rt.train_local(model=sub)
        trained = sub.get_trainable()
        self.personal().save(rt.round, OrderedDict((k, v) for k, v in trained.items() if not k.startswith(ENCODER)))
        metrics.update({"num-examples": len(rt.data.train), "capacity": capacity_of(rt)})
        return self.reply(arrays=OrderedDict((k, trained[k]) for k in received), metrics=metrics)

    def evaluate(self, message: Message) -> RecordDict:
        """The personalised model after the round's aggregation, with the site's own output layer or head."""
        rt = self.rt
        if "arrays" not in message.content.array_records:
            return self.reply(metrics={})
        sub, _, trained = self.build(message, before=rt.round + 1)
        if not trained:
            return self.reply(metrics={})
        return self.reply(metrics=rt.evaluate_splits(model=sub))


# ----------------------------------------------------------------------------- server half
@dataclass
class SiteModel:
    """What the server keeps of one site: its personalised arrays, its hyper weights (raw, before the clamp) with
    their SGD momentum, and ∂θ/∂α, ∂φ/∂β of its last aggregation (d*'s slice, the attention outputs)."""

    encoder: OrderedDict[str, np.ndarray]
    decoder: OrderedDict[str, np.ndarray]
    alpha: float
    beta: dict[str, float]
    momentum: dict[str, float] = field(default_factory=dict)  # "alpha" or a layer -> SGD momentum buffer
    encoder_direction: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict)
    decoder_direction: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict)

    def arrays(self, part: str) -> OrderedDict[str, np.ndarray]:
        return getattr(self, part.replace("-", "_"))


@register_strategy
class FedHCA2(SubModelStrategy):
    """FedHCA² (Lu et al., CVPR 2024) with the sub-model federation's capacities: personalised prefix sub-encoders
    merged by Hyper Conflict-Averse Aggregation (CAGrad's direction d*, θ_i += Δ_i + α_i d*), segmentation decoder
    bodies by Hyper Cross-Attention Aggregation (φ_i += Δφ_i + β_i^l·attention), α and β learnt on the server.

    Leaves a site: its trained sub-encoder and (segmentation, fedhca2-decoders='cross-attention') decoder body, n_k,
    its capacity and whether it segments; never its output layer or head.
    """

    name = "fedhca2"
    client_half = FedHCA2Client
    options = (CAPACITIES, *OPTIONS)

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        from ...data.spec import SEGMENTATION_KINDS

        segments = [d for d in cfg.site_dataset_list if d.split(":", 1)[0] in SEGMENTATION_KINDS]
        if cfg.fedhca2_decoders == "cross-attention" and segments and cfg.model_task != "segmentation":
            raise bad(
                "fedhca2-decoders",
                cfg.fedhca2_decoders,
                f"the server's decoder bodies come from run-config dataset, which classifies ({cfg.dataset!r}), but "
                f"site-datasets has segmentation sites ({segments[0]!r}): set dataset to a segmentation source or "
                "fedhca2-decoders='local'",
            )

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        body = decoder_body(list(initial)) if self.cfg.fedhca2_decoders == "cross-attention" else []
        self.initial_decoder = OrderedDict((k, np.array(initial[k])) for k in body)
        self.sites: dict[str, SiteModel] = {}

    # ------------------------------------------------------------------ per-site models
    def site_model(self, node_id: int) -> SiteModel:
        """The site's personalised model; a new site starts from the global encoder's prefix at its capacity and,
        when it segments, the run's seeded decoder body."""
        info = self.nodes[node_id]
        if info.client not in self.sites:
            capacity = self.capacity(node_id)
            encoder = OrderedDict((k, self.slice(k, v, capacity)) for k, v in self.global_arrays.items())
            segments = bool(info.extra.get("segments", 0.0))
            decoder = OrderedDict((k, v.copy()) for k, v in self.initial_decoder.items()) if segments else OrderedDict()
            beta = {layer_of(k): self.cfg.fedhca2_beta_init for k in decoder}
            self.sites[info.client] = SiteModel(encoder, decoder, self.cfg.fedhca2_alpha_init, beta)
        return self.sites[info.client]

    def slice(self, name: str, value: np.ndarray, capacity: float) -> np.ndarray:
        """The prefix of a full encoder array a site of ``capacity`` holds."""
        if (sliced := ffn_slice_axes(name, self.ffn_width)) is None:
            return np.array(value)
        ffn, axis = sliced
        return np.array(np.take(value, np.arange(kept_count(self.ffn_width[ffn], capacity)), axis=axis))

    def pad(self, name: str, value: np.ndarray) -> np.ndarray:
        """A sub-encoder array in the full encoder's shape, zeros where the site holds no neuron."""
        if (sliced := ffn_slice_axes(name, self.ffn_width)) is None:
            return np.asarray(value, dtype=np.float64)
        full = np.zeros(self.spec[name][0])
        index = [slice(None)] * full.ndim
        index[sliced[1]] = slice(0, value.shape[sliced[1]])
        full[tuple(index)] = value
        return full

    # ------------------------------------------------------------------ messages
    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        site = self.site_model(node_id)
        return RecordDict(
            {
                "arrays": to_record(OrderedDict([*site.encoder.items(), *site.decoder.items()])),
                "config": self.base_config(rnd),
            }
        )

    def evaluate_content(self, rnd: int, node_id: int) -> RecordDict:
        client = self.client_name(node_id)
        if client not in self.sites:  # never asked to train: nothing personalised to evaluate
            return RecordDict({"config": self.base_config(rnd)})
        site = self.sites[client]
        arrays = OrderedDict([*site.encoder.items(), *site.decoder.items()])
        return RecordDict({"arrays": to_record(arrays), "config": self.base_config(rnd)})

    def reply_spec(self, node_id: int) -> ArraySpec:
        """What the site received: its sub-encoder's shapes and its decoder body's."""
        site = self.site_model(node_id)
        return OrderedDict([*spec_of(site.encoder).items(), *spec_of(site.decoder).items()])

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        if problem := super().check_reply_values(phase, reply):
            return problem
        if phase == "query" and reply.metrics.get("segments", 0.0) not in (0.0, 1.0):
            return f"segments must be 0 or 1, got {reply.metrics['segments']}"
        return None

    # ------------------------------------------------------------------ aggregation
    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        sites = [self.sites[r.client] for r in replies]
        enc = [
            OrderedDict((k, r.arrays[k].astype(np.float64) - s.encoder[k]) for k in s.encoder)
            for r, s in zip(replies, sites)
        ]
        dec = [
            OrderedDict((k, r.arrays[k].astype(np.float64) - s.decoder[k]) for k in s.decoder)
            for r, s in zip(replies, sites)
        ]
        self.update_hyper_weights(sites, enc, dec)
        # Hyper Conflict-Averse Aggregation of the encoders, in the full encoder's coordinates
        padded = [OrderedDict((k, self.pad(k, v)) for k, v in u.items()) for u in enc]
        w, gamma = conflict_averse_weights(gram_matrix(padded), self.cfg.fedhca2_ca_c)
        direction = OrderedDict((k, sum(g * p[k] for g, p in zip(gamma, padded))) for k in self.global_arrays)
        for site, update in zip(sites, enc):
            alpha = min(max(site.alpha, 0.0), 1.0)
            site.encoder_direction = OrderedDict(  # the prefix of d* the site holds
                (k, direction[k][tuple(slice(0, n) for n in v.shape)].astype(v.dtype)) for k, v in site.encoder.items()
            )
            site.encoder = OrderedDict(
                (k, (v + update[k] + alpha * site.encoder_direction[k]).astype(v.dtype))
                for k, v in site.encoder.items()
            )
        # Hyper Cross-Attention Aggregation of the decoder bodies, among decoders of the same arrays and shapes
        groups: dict[tuple, list[int]] = {}
        for i, site in enumerate(sites):
            if site.decoder:
                groups.setdefault(tuple((k, v.shape) for k, v in site.decoder.items()), []).append(i)
        for members in groups.values():
            for name in sites[members[0]].decoder:
                stacked = np.stack([dec[i][name].reshape(-1) for i in members])
                attended = cross_attention(stacked)
                for row, i in enumerate(members):
                    site = sites[i]
                    beta = min(max(site.beta[layer_of(name)], 0.0), 1.0)
                    site.decoder_direction[name] = (
                        attended[row].reshape(dec[i][name].shape).astype(site.decoder[name].dtype)
                    )
                    new = site.decoder[name] + dec[i][name] + beta * site.decoder_direction[name]
                    site.decoder[name] = new.astype(site.decoder[name].dtype)
        self.stats.extra["ca_weights"] = {r.client: round(float(x), 6) for r, x in zip(replies, w)}
        self.stats.extra["alpha"] = {r.client: round(min(max(s.alpha, 0.0), 1.0), 6) for r, s in zip(replies, sites)}
        self.stats.extra["beta_mean"] = {
            r.client: round(float(np.mean([min(max(b, 0.0), 1.0) for b in s.beta.values()])), 6)
            for r, s in zip(replies, sites)
            if s.beta
        }

    def update_hyper_weights(
        self, sites: list[SiteModel], enc: list[Mapping[str, np.ndarray]], dec: list[Mapping[str, np.ndarray]]
    ) -> None:
        """One SGD step (torch's, momentum 0.9, weight decay 1e-4) of α_i and β_i^l of the sites whose personalised
        model came from an earlier aggregation: the gradient of ⟨θ_i^t(α), θ_i^t − θ_i'⟩ is −⟨Δ_i, ∂θ_i^t/∂α_i⟩,
        zero where the clamp to [0, 1] is flat (what the authors' backward through the clamped weights gives)."""
        params, momenta, targets = [], [], []
        for site, update, dec_update in zip(sites, enc, dec):
            if site.encoder_direction:
                grads = {"alpha": -sum(float(np.vdot(update[k], site.encoder_direction[k])) for k in update)}
                for name, attended in site.decoder_direction.items():
                    layer = layer_of(name)
                    grads[layer] = grads.get(layer, 0.0) - float(np.vdot(dec_update[name], attended))
                for key, grad in grads.items():
                    value = site.alpha if key == "alpha" else site.beta[key]
                    param = torch.tensor(value, dtype=torch.float64, requires_grad=True)
                    param.grad = torch.tensor(grad if 0.0 <= value <= 1.0 else 0.0, dtype=torch.float64)
                    params.append(param)
                    momenta.append(site.momentum.get(key))
                    targets.append((site, key))
        if not params:
            return
        optimizer = torch.optim.SGD(params, lr=self.cfg.fedhca2_hyper_lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        for param, buffer in zip(params, momenta):
            if buffer is not None:
                optimizer.state[param]["momentum_buffer"] = torch.tensor(buffer, dtype=torch.float64)
        optimizer.step()
        for param, (site, key) in zip(params, targets):
            site.momentum[key] = float(optimizer.state[param]["momentum_buffer"])
            if key == "alpha":
                site.alpha = float(param.detach())
            else:
                site.beta[key] = float(param.detach())

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        names = sorted(self.sites)
        arrays = OrderedDict(self.global_arrays)
        for i, client in enumerate(names):
            for part in PARTS:
                arrays.update((f"{SITE}{i}/{part}/{k}", v) for k, v in self.sites[client].arrays(part).items())
        meta = {
            "sites": names,
            "hyper": {
                c: {
                    "alpha": s.alpha,
                    "beta": s.beta,
                    "momentum": s.momentum,
                    "order": {p: list(s.arrays(p)) for p in PARTS},
                }
                for c, s in self.sites.items()
            },
        }
        return arrays, meta

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state(OrderedDict((k, v) for k, v in arrays.items() if k in self.spec), meta)
        self.sites = {}
        for i, client in enumerate(meta.get("sites", [])):
            hyper = meta["hyper"][client]
            parts = {
                p: OrderedDict((k, np.array(arrays[f"{SITE}{i}/{p}/{k}"])) for k in hyper["order"][p]) for p in PARTS
            }
            self.sites[client] = SiteModel(
                parts["encoder"],
                parts["decoder"],
                float(hyper["alpha"]),
                {k: float(v) for k, v in hyper["beta"].items()},
                {k: float(v) for k, v in hyper["momentum"].items()},
                parts["encoder-direction"],
                parts["decoder-direction"],
            )
