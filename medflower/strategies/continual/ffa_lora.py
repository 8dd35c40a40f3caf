"""FFA-LoRA (Sun, Li, Li and Ding, "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024) as a FedKEI
baseline, adapted to FedKEI's continual protocol as the FedKEI paper's Table I does.

LoRA's update ΔW = B·A: FFA-LoRA freezes every A at its random initialisation and trains only B (zero-initialised)
and the head. A is the seeded initial A, the same on every site and for every task, and never changes, so it never
travels: a site sends B and the head only (|θ| in the FedKEI paper's cost table counts just those), and the pool
holds B's and heads. Task t ≥ 2 starts from the n_i-weighted mean of the pooled B's and heads with the fixed A;
because A is shared, mean(B_i)·A = mean(B_i·A): the mean of the pooled adapters' updates, exactly (FFA-LoRA's point).
Task 1, or a task while the pool is empty, starts from the fresh seeded module (B = 0). The method as implemented
and its decisions: docs/methods/baselines-continual.md#ffa-lora-ffa-lora.

What leaves a site: after each task its LoRA B matrices and head and n_i; A never leaves. What comes to a site: the
pool mean of B's and heads (tasks t ≥ 2).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from flwr.app import Message

from ...contract import from_record, register_strategy
from ...options import bad
from .protocol import CONTINUAL_OPTIONS, ContinualClient, PoolMeanInit

FROZEN_LORA = ".lora_A."  # a LoRA A matrix: frozen at its seeded initialisation, never sent


def trained_names(names: Iterable[str]) -> list[str]:
    """The arrays FFA-LoRA trains and sends, in ``names``' order: all trainable arrays but the LoRA A matrices."""
    return [n for n in names if FROZEN_LORA not in n]


class FFALoRAClient(ContinualClient):
    """Fine-tunes B and the head with every A frozen at its seeded value; sends B and the head."""

    def initialise(self, message: Message, loss_fn, parts: OrderedDict, device: torch.device, train) -> dict:
        """Every A (and, in task 1, B = 0 and the head) from the seeded initial arrays; then the sent B's and head."""
        rt = self.rt
        rt.model.set_trainable(rt.initial_arrays)
        if "arrays" in message.content.array_records:
            sent = from_record(message.content["arrays"])
            names = trained_names(rt.initial_arrays)
            if list(sent) != names:
                raise ValueError(f"received {len(sent)} arrays; ffa-lora starts from {len(names)} (B's and head)")
            rt.model.set_trainable(sent, strict=False)
        return {}

    def finetune(self, train, epochs: int, after_epoch, extra_loss, device: torch.device) -> dict:
        params = self.rt.model.trainable_parameters()
        frozen = [p for name, p in params.items() if name not in trained_names(params)]
        for p in frozen:  # no gradient, no optimizer state, no update: A stays bit for bit
            p.requires_grad_(False)
        try:
            return super().finetune(train, epochs, after_epoch, extra_loss, device)
        finally:
            for p in frozen:  # the model object is cached and shared with other code
                p.requires_grad_(True)

    def upload(self, message: Message, train) -> OrderedDict[str, np.ndarray]:
        arrays = self.rt.model.get_trainable()
        return OrderedDict((k, arrays[k]) for k in trained_names(arrays))


@register_strategy
class FFALoRA(PoolMeanInit):
    """FFA-LoRA (Sun et al., ICLR 2024) in FedKEI's continual protocol: LoRA's A frozen at its seeded initialisation on
    every site; B and the head fine-tune; task t starts from the n_i-weighted mean of the pooled B's and heads.

    Leaves a site: its LoRA B matrices and head after every task and n_i (A never leaves); with each task's metrics
    its test size and number of positive test images (n_test, n_test_positive).
    """

    name = "ffa-lora"
    client_half = FFALoRAClient
    options = CONTINUAL_OPTIONS

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        super().check_config(cfg, check_paths)
        if cfg.adapter != "lora":
            raise bad("adapter", cfg.adapter, "ffa-lora freezes LoRA's A matrices and trains its B: use 'lora'")

    def server_arrays(self, initial: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """B and the head: what a site sends, what the pool holds and what a task starts from."""
        if not any(FROZEN_LORA in n for n in initial):
            raise bad("adapter", self.cfg.adapter, "ffa-lora found no LoRA A matrix among the trainable arrays")
        return OrderedDict((k, initial[k]) for k in trained_names(initial))
