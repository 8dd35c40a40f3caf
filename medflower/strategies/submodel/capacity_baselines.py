"""The capacity baselines of FedBKD's Table 1 on the sub-model protocol (``protocol.py``): HeteroFL, FedRolex,
FedDrop, submodel-fedprox and submodel-local, each a choice of neurons and of what the site trains.

| strategy | kept neurons of each FFN | local training | merge |
|---|---|---|---|
| ``heterofl`` | the first k (a static prefix) | task loss | covered, w_k ∝ n_k |
| ``fedrolex`` | k consecutive from (round − 1) mod d_ffn (rolling by one per round) | task loss | covered, n_k |
| ``feddrop`` | k at random per site and round (seeded) | task loss | covered, n_k |
| ``submodel-fedprox`` | the prefix | + (μ/2)·‖θ − θ_received‖² on the sub-encoder (``proximal-mu``) | covered, n_k |
| ``submodel-local`` | the prefix of the seeded initial encoder | the site's own model, round after round | none |

w_k ∝ n_k is HeteroFL's averaging over the clients that hold each entry. What leaves a site: its sub-encoder's
arrays and kept indices and n_k (``submodel-local``: metrics only).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from flwr.app import Message, RecordDict
from torch import nn

from ...contract import ArraySpec, Reply, register_strategy, to_record
from ...training import ExtraLoss
from ..fedavg import PROXIMAL_MU, proximal_term
from .protocol import CAPACITIES, SubModelClient, SubModelStrategy


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
    contract_case = {
        **SubModelStrategy.contract_case,
        "arrays_up": False,
        "no_arrays_down": {"after": 1},
        "why": "its training reply carries metrics only (each site's model stays on it); round 1 sends the seeded "
        "encoder to cut the sub-encoder from, later rounds send no arrays",
    }

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
