"""FedSA-LoRA (Guo, Zeng, Wang, Fan, Wang and Qu, "Selective Aggregation for Low-Rank Adaptation in Federated
Learning", ICLR 2025): LoRA's A matrices are shared and averaged, its B matrices stay on each site.

With LoRA ΔW = B·A on the adapted layers, every site trains both A and B locally; only the A matrices go to the
server, which takes their FedAvg, A ← Σ_k n_k A_k / Σ_k n_k (capped at ``max-client-share``), and sends it back.
Each site keeps its own B_k in its personal state (``PersonalState``, key ``fedsa``) and trains from
(A, B_k) next round. The task module (the classifier head, or the decoder) stays local too, as in the authors' code
(``personalization.local_param: ['lora_B', 'classifier']``); ``fedsa-share-head=true`` averages it with A instead.
Any other trainable array is shared. The method as implemented and its decisions:
docs/methods/baselines-fedavg-like.md#fedsa.

What leaves a site: the A matrices (with ``fedsa-share-head``, the head too) and n_k. B_k and the head stay.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np

from ..contract import FederatedStrategy, register_strategy
from ..options import Option, bad
from .shared_subset import SharedSubsetClient

LOCAL_LORA = ".lora_B."  # a LoRA B matrix: stays on its site

OPTIONS = (
    Option(
        "fedsa-share-head",
        False,
        "fedsa: also average the head (or decoder) with the LoRA A matrices; false keeps it on each site, as the "
        "authors' code does",
        None,
        "fedsa",
    ),
)


def task_module_of(task: str) -> str:
    """The attribute holding the task module: the classifier's ``head`` or the segmentation model's ``decoder``."""
    return "decoder" if task == "segmentation" else "head"


def shared_names(names: Iterable[str], task_module: str, share_head: bool) -> list[str]:
    """The trainable arrays FedSA sends and averages, in ``names``' order: every array but the LoRA B matrices and,
    unless ``share_head``, the task module's arrays."""
    return [n for n in names if LOCAL_LORA not in n and (share_head or not n.startswith(task_module + "."))]


# ----------------------------------------------------------------------------- client half
class FedSAClient(SharedSubsetClient):
    """Trains (A, B_k, head) from the received A and its own B_k and head; keeps everything, sends A. Its
    evaluation: the received A (the round's average) with its own B_k and head, the model it trains from next."""

    state_key = "fedsa"

    def shared_names(self) -> list[str]:
        rt = self.rt
        return shared_names(rt.model.trainable_names(), rt.model.task_module, rt.cfg.fedsa_share_head)

    def shared_description(self) -> str:
        return "shared FedSA arrays"


# ----------------------------------------------------------------------------- server half
@register_strategy
class FedSA(FederatedStrategy):
    """FedSA-LoRA (Guo et al., ICLR 2025): A ← Σ_k n_k A_k / Σ_k n_k over the LoRA A matrices; each site keeps its B_k
    (and, unless ``fedsa-share-head``, its head or decoder).

    Leaves a site: its LoRA A matrices after local training (with fedsa-share-head, the head too) and n_k; B_k and
    the head stay on it.
    """

    name = "fedsa"
    client_half = FedSAClient
    folds_evaluation = True  # the default round; evaluate is the site's next starting model
    options = OPTIONS

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        if cfg.adapter != "lora":
            raise bad("adapter", cfg.adapter, "fedsa shares LoRA's A matrices and keeps its B matrices: use 'lora'")

    def server_arrays(self, initial: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        names = shared_names(initial, task_module_of(self.cfg.model_task), self.cfg.fedsa_share_head)
        if not any(".lora_A." in n for n in names):
            raise bad("adapter", self.cfg.adapter, "fedsa found no LoRA A matrix among the trainable arrays")
        return OrderedDict((k, initial[k]) for k in names)
