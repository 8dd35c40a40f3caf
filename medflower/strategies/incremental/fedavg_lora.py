"""FedAvg-LoRA in the federated class-incremental protocol (docs/methods/pfedmxf.md): LoRA on q and k, A and B
averaged separately (Eq. 5, with the interference of Eq. 6), merged into the frozen weights at the end of each task,
then a fresh LoRA.

Its server is the base of the other LoRA baselines (``fedstack``, ``inflora``, ``lwf-lora``, ``fedcurv-lora``); its
site is the protocol's ``LoRAClient``; the merge is ``lora_merge.py``'s.

What leaves a site each round: its LoRA A and B on q and k, the head, and n_k. What comes to a site: the merged ΔW
of q and k, the current LoRA and the head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from ...contract import Reply, derive_seed, register_strategy, weighted_mean
from ...models.qk_delta import LoRAQK
from .lora_merge import lora_product
from .protocol import HEAD, IncrementalStrategy, LoRAClient


@register_strategy
class FedAvgLoRA(IncrementalStrategy):
    """FedAvg-LoRA: A and B averaged separately (Eq. 5); B̄Ā merged at the end of each task, then a fresh LoRA.

    Leaves a site: its LoRA A and B on q and k, the head and n_k.
    """

    name = "fedavg-lora"
    client_half = LoRAClient
    adapter = "lora-qk"  # LoRA on the q and k slices only
    contract_case: ClassVar[dict[str, Any]] = {
        **IncrementalStrategy.contract_case,
        "why": "stops inside task 2, where the averaged LoRA carries over",
    }

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        cfg = self.cfg
        self.lora_names = [k for k in self.spec if k not in HEAD]
        self.scale = cfg.lora_alpha / cfg.lora_rank
        self.merged = OrderedDict((name, np.zeros((2, *shape), np.float32)) for name, shape in self.modules.items())

    def fresh_lora(self, salt: int) -> None:
        """A seeded fresh LoRA (A as peft initialises it, B = 0), identical for every site."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.cfg.seed, salt, 77))
            for name, (rows, cols) in self.modules.items():
                module = LoRAQK(cols, rows, self.cfg.lora_rank, self.cfg.lora_alpha)
                self.global_arrays[f"{name}.lora_A"] = module.lora_A.detach().numpy().copy()
                self.global_arrays[f"{name}.lora_B"] = module.lora_B.detach().numpy().copy()

    def model_arrays(self, task: int) -> OrderedDict[str, np.ndarray]:
        arrays = OrderedDict((f"{name}.merged", value) for name, value in self.merged.items())
        arrays.update((k, self.global_arrays[k]) for k in self.lora_names)
        return arrays

    def aggregate_updates(self, rnd: int, task: int, replies: list[Reply]) -> None:
        self.global_arrays.update(
            weighted_mean(
                [{k: r.arrays[k] for k in self.lora_names} for r in replies],
                self.shares([r.num_examples for r in replies]),
            )
        )

    def end_task(self, task: int) -> None:
        """Merge B̄Ā into the frozen weights, then start the next task from a fresh LoRA."""
        for name in self.modules:
            self.merged[name] = self.merged[name] + lora_product(
                self.global_arrays[f"{name}.lora_A"], self.global_arrays[f"{name}.lora_B"], self.scale
            )
        self.fresh_lora(task)

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays = OrderedDict(self.global_arrays)
        arrays.update((f"merged/{name}", value) for name, value in self.merged.items())
        return arrays, {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if not k.startswith("merged/")}, meta)
        self.merged = OrderedDict((name, np.array(arrays[f"merged/{name}"])) for name in self.modules)
