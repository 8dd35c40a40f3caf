"""MaT-FL (Cai, Chen, Liu, Srinivasa, Lee, Kompella and Wang, "Many-Task Federated Learning: A New Problem Setting
and a Simple Baseline", CVPR 2023 Workshops; reference: VITA-Group/MaT-FL, ``dg_utils.py``): each round the server
groups the sites by how their encoders moved and averages within each group, so every site gets its own encoder.

Over the sites k that replied, with encoders θ_k after local training (the reference's ``aggregate``):

    θ̄ = mean_k θ_k,   d_k = θ_k − θ̄,   s_kj = cos(d_k, d_j)        (every encoder array as one vector)
    hard (``matfl-grouping``): agglomerative clustering, average linkage on 1 − s_kj, into ``matfl-groups`` groups;
                               a_kj = 1 if k and j fall in one group, else 0
    soft:                      a_kj = max(s_kj + τ, 0),  τ = ``matfl-threshold``
    θ_k ← Σ_j a_kj w_j θ_j / Σ_j a_kj w_j,   w_j = 1 (``matfl-weights='uniform'``, the reference) or n_j

Only the encoder is grouped and averaged (the reference aggregates its ``backbone`` keys); each site's decoder or head
stays in its personal state.

Capacities: MaT-FL has none. In FedBKD's federation (docs/methods/fedbkd.md) it runs on HeteroFL's prefix
sub-encoders (``fedbkd-capacities``), so its sites train, send and receive what ``heterofl``'s do. With partial slices
each sum above runs over the entries the sites involved hold: θ̄ over each entry's holders, s_kj over the entries k
and j both hold, θ_k's entries over the group members holding them (every entry of k's own prefix has k itself).

What leaves a site: its sub-encoder's arrays (FFN slices narrowed), the kept neuron indices, n_k (as HeteroFL).
What comes to it: its own grouped encoder (full width; the site keeps its prefix), or, before its first reply, the
last round's θ̄ (the initial encoder in round 1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import RecordDict

from ...contract import Reply, register_strategy, to_record
from ...models.ffn_slices import covered_merge, ffn_slice_axes
from ...options import Option, bad, non_negative, one_of, positive
from .protocol import CAPACITIES, KEPT, SubModelClient, SubModelStrategy

PERSONAL = "matfl-personal/"  # each site's grouped encoder in the checkpoint: <prefix><index>/<array>
EPS = 1e-8  # the reference's floor of ‖d_k‖·‖d_j‖

OPTIONS = (
    Option(
        "matfl-groups",
        2,
        "matfl: groups the replying sites are clustered into each round (hard grouping; the reference's "
        "cluster_num, default 2; at most the number of sites)",
        positive,
        "matfl",
    ),
    Option(
        "matfl-grouping",
        "hard",
        "matfl: hard = agglomerative clustering of the sites' encoder deviations (cosine, average linkage), "
        "averaged within each group; soft = weights max(cos + matfl-threshold, 0)",
        one_of("hard", "soft"),
        "matfl",
    ),
    Option(
        "matfl-threshold",
        0.0,
        "matfl: soft grouping's offset tau of the weights max(cos + tau, 0) (the reference's th); 0 with hard",
        non_negative,
        "matfl",
    ),
    Option(
        "matfl-weights",
        "uniform",
        "matfl: weights within a group: uniform (the reference's mean) or examples (n_k)",
        one_of("uniform", "examples"),
        "matfl",
    ),
)


def scatter(
    part: Mapping[str, np.ndarray], kept: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...], ffns: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """A site's array ``name`` at its global indices (float64) and the mask of the entries it holds."""
    value, mask = np.zeros(shape, np.float64), np.zeros(shape, bool)
    sliced = ffn_slice_axes(name, ffns)
    index = (slice(None),) if sliced is None else (slice(None),) * sliced[1] + (np.asarray(kept[sliced[0]]),)
    value[index], mask[index] = part[name], True
    return value, mask


def deviation_cosines(
    soup: Mapping[str, np.ndarray],
    parts: Sequence[Mapping[str, np.ndarray]],
    kept: Sequence[Mapping[str, np.ndarray]],
    ffns: Iterable[str],
) -> np.ndarray:
    """s_kj = cos(θ_k − θ̄, θ_j − θ̄) over the entries both sites hold, all arrays as one vector (the reference's
    ``get_grouping_score``); ‖d_k‖·‖d_j‖ floored at 1e-8 as there, s_kk = 1."""
    ffns = list(ffns)
    count = len(parts)
    inner, squares = np.zeros((count, count)), np.zeros((count, count))
    for name, mean in soup.items():
        held = [scatter(p, k, name, mean.shape, ffns) for p, k in zip(parts, kept)]
        deviation = np.stack([np.where(m, v - mean, 0.0).reshape(-1) for v, m in held])
        mask = np.stack([m.reshape(-1) for _, m in held]).astype(np.float64)
        inner += deviation @ deviation.T  # zero outside each site's entries: the sum runs over both sites' entries
        squares += (deviation**2) @ mask.T  # [k, j]: ‖d_k‖² over the entries j holds too
    cosine = inner / np.maximum(np.sqrt(squares * squares.T), EPS)
    np.fill_diagonal(cosine, 1.0)
    return cosine


def group_affinity(
    cosine: np.ndarray, grouping: str, groups: int, threshold: float
) -> tuple[np.ndarray, list[int] | None]:
    """a_kj and the group labels (hard; None for soft). Hard: sklearn's agglomerative clustering with average
    linkage on the precomputed distance 1 − s_kj into min(groups, K) groups, labels renumbered by first site;
    soft: max(s_kj + τ, 0)."""
    count = len(cosine)
    if grouping == "soft":
        return np.maximum(cosine + threshold, 0.0), None
    if count == 1 or groups == 1:
        labels = np.zeros(count, int)
    else:
        from sklearn.cluster import AgglomerativeClustering

        distance = np.clip(1.0 - cosine, 0.0, 2.0)
        np.fill_diagonal(distance, 0.0)
        clustering = AgglomerativeClustering(n_clusters=min(groups, count), metric="precomputed", linkage="average")
        labels = clustering.fit(distance).labels_
    order = {label: i for i, label in enumerate(dict.fromkeys(labels.tolist()))}
    labels = [order[label] for label in labels.tolist()]
    same = np.equal.outer(labels, labels).astype(np.float64)
    return same, labels


def narrow(full: Mapping[str, np.ndarray], kept: Mapping[str, np.ndarray], ffns: Iterable[str]) -> OrderedDict:
    """The entries of a site's sub-encoder: FFN slices cut to its kept neurons, the other arrays whole."""
    ffns = list(ffns)
    out = OrderedDict()
    for name, value in full.items():
        sliced = ffn_slice_axes(name, ffns)
        out[name] = value if sliced is None else np.take(value, np.asarray(kept[sliced[0]]), axis=sliced[1])
    return out


def grouped_encoders(
    base: Mapping[str, np.ndarray],
    parts: Sequence[Mapping[str, np.ndarray]],
    kept: Sequence[Mapping[str, np.ndarray]],
    affinity: np.ndarray,
    weights: Sequence[float],
    ffns: Iterable[str],
) -> list[OrderedDict]:
    """θ_k ← Σ_j a_kj w_j θ_j / Σ_j a_kj w_j per entry over its holders (``covered_merge``), cut to k's entries."""
    ffns = list(ffns)
    out = []
    for k in range(len(parts)):
        row = affinity[k] * np.asarray(weights, np.float64)
        members = [j for j in range(len(parts)) if row[j] > 0]
        merged = covered_merge(base, [parts[j] for j in members], [kept[j] for j in members], list(row[members]), ffns)
        out.append(narrow(merged, kept[k], ffns))
    return out


class MaTFLClient(SubModelClient):
    """MaT-FL's site: HeteroFL's prefix of the grouped encoder it receives, with its own decoder/head, the task loss
    alone (as the reference's local training)."""

    selection = "prefix"


@register_strategy
class MaTFL(SubModelStrategy):
    """MaT-FL (Cai et al., CVPRW 2023; reference code): each round the sites are grouped by the cosine similarity of
    their encoders' deviations from the round's mean (agglomerative clustering, or soft weights) and each site gets
    the average over its group; on HeteroFL's prefix sub-encoders where sites have capacities.

    Leaves a site: its sub-encoder's arrays, the kept neuron indices, n_k.
    """

    name = "matfl"
    client_half = MaTFLClient
    options = (CAPACITIES, *OPTIONS)

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        if cfg.matfl_grouping == "hard" and cfg.matfl_threshold != 0:
            raise bad("matfl-threshold", cfg.matfl_threshold, "only matfl-grouping='soft' uses it; leave it 0")

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        self.personal: dict[str, OrderedDict[str, np.ndarray]] = {}  # site name -> its grouped sub-encoder + kept

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        own = self.personal.get(self.client_name(node_id))
        return RecordDict({"arrays": to_record(self.encoder_for(own)), "config": self.base_config(rnd)})

    def encoder_for(self, own: Mapping[str, np.ndarray] | None) -> Mapping[str, np.ndarray]:
        """What a site trains from: its grouped sub-encoder written into the last θ̄ (θ̄ alone before its first reply)."""
        if own is None:
            return self.global_arrays
        part = {k: v for k, v in own.items() if not k.startswith(KEPT)}
        kept = {ffn: own[KEPT + ffn] for ffn in self.ffn_width}
        return covered_merge(self.global_arrays, [part], [kept], [1.0], self.ffn_width)

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        valid = self.valid_replies(replies)
        if not valid:
            return
        cfg, ffns = self.cfg, list(self.ffn_width)
        parts = [{k: v for k, v in r.arrays.items() if not k.startswith(KEPT)} for r in valid]
        kept = [{ffn: r.arrays[KEPT + ffn] for ffn in ffns} for r in valid]
        soup = covered_merge(self.global_arrays, parts, kept, [1.0] * len(valid), ffns)
        cosine = deviation_cosines(soup, parts, kept, ffns)
        affinity, labels = group_affinity(cosine, cfg.matfl_grouping, cfg.matfl_groups, cfg.matfl_threshold)
        weights = [r.num_examples if cfg.matfl_weights == "examples" else 1.0 for r in valid]
        encoders = grouped_encoders(soup, parts, kept, affinity, weights, ffns)
        for reply, encoder, held in zip(valid, encoders, kept):
            self.personal[reply.client] = OrderedDict([*encoder.items(), *((KEPT + f, held[f]) for f in ffns)])
        self.global_arrays = soup
        names = [r.client for r in valid]
        shares = affinity * np.asarray(weights)
        shares = shares / shares.sum(axis=1, keepdims=True)
        self.stats.extra["matfl_shares"] = {
            a: {b: round(float(s), 6) for b, s in zip(names, row) if s > 0} for a, row in zip(names, shares)
        }
        self.stats.extra["matfl_cosine"] = {
            a: dict(zip(names, np.round(row, 6).tolist())) for a, row in zip(names, cosine)
        }
        if labels is not None:
            self.stats.extra["matfl_groups"] = dict(zip(names, labels))

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        sites = sorted(self.personal)
        arrays = OrderedDict(self.global_arrays)
        for i, site in enumerate(sites):
            arrays.update((f"{PERSONAL}{i}/{k}", v) for k, v in self.personal[site].items())
        return arrays, {"sites": sites}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if not k.startswith(PERSONAL)}, meta)
        self.personal = {}
        for i, site in enumerate(meta.get("sites", [])):
            prefix = f"{PERSONAL}{i}/"
            own = OrderedDict((k[len(prefix) :], np.array(v)) for k, v in arrays.items() if k.startswith(prefix))
            if not all(KEPT + ffn in own for ffn in self.ffn_width):
                raise ValueError(f"checkpoint lacks the kept neurons of site {site!r}'s grouped encoder")
            self.personal[site] = own
