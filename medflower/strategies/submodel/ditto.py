"""Ditto (Li et al. 2021, Alg. 1) with the sub-model federation's capacities, on the sub-model protocol
(``protocol.py``): a global-model update on HeteroFL's prefix sub-encoder, merged like HeteroFL, and a personal
sub-model per site pulled towards the received sub-encoder (``DittoClient`` has the update); sites are evaluated on
their personal model.

What leaves a site: its global-model update's sub-encoder arrays, the kept neuron indices, n_k; the personal model
never.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
from torch import nn

from ...contract import register_strategy
from ...models.ffn_slices import extract_subnetwork
from ...options import Option, non_negative
from ..fedavg import proximal_term
from .protocol import CAPACITIES, GLOBAL_PATH, KEPT, SubModelClient, SubModelStrategy, task_module

DITTO_LAMBDA = Option(
    "ditto-lambda",
    0.1,
    "ditto: weight lambda of the personal model's pull (lambda/2)*||v - w_global||^2 towards the received sub-encoder",
    non_negative,
    "fedbkd",
)


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
            [*personal.get_trainable().items(), *((GLOBAL_PATH + k, v) for k, v in task_module(update).items())]
        )
        return metrics, saved


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
