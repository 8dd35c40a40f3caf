"""FedAvg, FedProx and local training: the baselines every method is compared against.

What leaves a site: ``fedavg``/``fedprox`` send the trainable arrays (adapters + head) after
local training and the number of training samples; ``local`` sends only metrics (its model
never leaves the site). Every strategy sends evaluation metrics on the site's own splits.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Message, RecordDict

from ..contract import ArraySpec, ClientHalf, FederatedStrategy, PersonalState, from_record, register_strategy
from ..options import Option, non_negative

PROXIMAL_MU = Option(
    "proximal-mu", 0.01, "FedProx proximal weight mu (fedprox, submodel-fedprox)", non_negative, "fedprox"
)


def proximal_term(model, anchor: Mapping[str, torch.Tensor], mu: float):
    """FedProx (Li et al. 2020, Eq. 2): (mu/2)·||w − w_global||² over the trainable parameters that ``anchor``
    holds (a site's own decoder, say, is left out by leaving it out of the anchor)."""
    params = {k: p for k, p in model.trainable_parameters().items() if k in anchor}

    def extra_loss(_model, _logits, _labels):
        return 0.5 * mu * sum(((params[k] - anchor[k]) ** 2).sum() for k in params)

    return extra_loss


class FedAvgClient(ClientHalf):
    """Train the received global adapters + head locally, send them back."""

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        global_arrays = from_record(message.content["arrays"])
        rt.model.set_trainable(global_arrays)
        metrics = rt.train_local(self.extra_loss(global_arrays))
        metrics["num-examples"] = len(rt.data.train)
        return self.reply(arrays=rt.model.get_trainable(), metrics=metrics)

    def extra_loss(self, global_arrays: Mapping[str, np.ndarray]):
        """A term added to the local loss (none for FedAvg)."""
        return None


class FedProxClient(FedAvgClient):
    """FedAvg's client with the proximal term (mu/2)·||θ − θ_global||², mu = run-config proximal-mu."""

    def extra_loss(self, global_arrays: Mapping[str, np.ndarray]):
        rt = self.rt
        if rt.cfg.proximal_mu == 0:
            return None
        anchor = {k: torch.as_tensor(v, device=rt.device) for k, v in global_arrays.items()}
        rt.model.to(rt.device)
        return proximal_term(rt.model, anchor, rt.cfg.proximal_mu)


@register_strategy
class FedAvg(FederatedStrategy):
    """FedAvg (McMahan et al. 2017): θ ← Σ_k n_k θ_k / Σ_k n_k over the trainable arrays.

    Leaves a site: trainable arrays (adapters + head) and n_k.
    """

    name = "fedavg"
    client_half = FedAvgClient
    folds_evaluation = True
    global_model = True
    trains_backbone = True
    client_dp = ("site", "server")
    dp_sgd = True
    secagg = True


@register_strategy
class FedProx(FedAvg):
    """FedProx: FedAvg aggregation; clients add (mu/2)·||θ − θ_global||² (run-config proximal-mu).

    Leaves a site: trainable arrays (adapters + head) and n_k.
    """

    name = "fedprox"
    client_half = FedProxClient
    options = (PROXIMAL_MU,)


class LocalClient(ClientHalf):
    """Each site trains its own adapters + head; they stay in its personal state."""

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        personal = PersonalState(rt).load(before=rt.round)
        rt.model.set_trainable(personal if personal is not None else rt.initial_arrays)
        metrics = rt.train_local()
        PersonalState(rt).save(rt.round, rt.model.get_trainable())
        metrics["num-examples"] = len(rt.data.train)
        return self.reply(metrics=metrics)

    def evaluate(self, message: Message) -> RecordDict:
        rt = self.rt
        personal = PersonalState(rt).load(before=rt.round + 1)
        rt.model.set_trainable(personal if personal is not None else rt.initial_arrays)
        return self.reply(metrics=rt.evaluate_splits())


@register_strategy
class Local(FederatedStrategy):
    """Local training only, no aggregation: the lower bound of collaboration.

    Leaves a site: metrics only. Nothing is sent down but the round's config; a site starts
    from the same seeded initial arrays as every other strategy.
    """

    name = "local"
    contract_case = {
        "arrays_up": False,
        "no_arrays_down": "all",
        "why": "its training reply carries metrics only (the model stays on the site); nothing is sent down",
    }
    client_half = LocalClient
    folds_evaluation = True
    trains_backbone = True
    dp_sgd = True

    def reply_spec(self, node_id: int) -> ArraySpec | None:
        return {}

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        return RecordDict({"config": self.base_config(rnd)})

    evaluate_content = train_content

    def state(self):
        return {}, {}

    def aggregate_train(self, rnd, replies) -> None:
        """Nothing to aggregate: each site keeps its own model."""
