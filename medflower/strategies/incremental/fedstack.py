"""FedStack / FLoRA in the federated class-incremental protocol (docs/methods/pfedmxf.md): the sites' LoRA stacked
on the rank axis, p_k-scaled B_k and A_k, so B A = Σ p_k B_k A_k exactly (Eqs. 7-8), merged every round; a fresh
LoRA every round.

FedAvg-LoRA's site and message (``fedavg_lora.py``); the stacking is ``lora_merge.py``'s.

What leaves a site each round: its LoRA A and B on q and k, the head, and n_k. What comes to a site: the merged ΔW
of q and k, the fresh LoRA and the head.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ...contract import Reply, register_strategy
from .fedavg_lora import FedAvgLoRA
from .lora_merge import lora_product, stack_lora


@register_strategy
class FedStack(FedAvgLoRA):
    """FedStack / FLoRA: stacked p_k B_k and A_k (Eq. 7) give Σ p_k B_k A_k exactly (Eq. 8), merged every round,
    then a fresh LoRA. Here the server ships the merged ΔW of q and k instead of the stacks, so a site that
    missed rounds needs no replay.

    Leaves a site: its LoRA A and B on q and k, the head and n_k.
    """

    name = "fedstack"
    contract_case: ClassVar[dict[str, Any]] = {
        **FedAvgLoRA.contract_case,
        "stop_after": 2,
        "why": "stops at the end of task 1; round 3 has no fault",
    }

    def aggregate_updates(self, rnd: int, task: int, replies: list[Reply]) -> None:
        weights = list(self.shares([r.num_examples for r in replies]))
        for name in self.modules:
            a, b = stack_lora(
                [r.arrays[f"{name}.lora_A"] for r in replies], [r.arrays[f"{name}.lora_B"] for r in replies], weights
            )
            self.merged[name] = self.merged[name] + lora_product(a, b, self.scale)
        self.stats.extra["stacked_rank"] = sum(r.arrays[self.lora_names[0]].shape[1] for r in replies)
        self.fresh_lora(1000 + rnd)

    def end_task(self, task: int) -> None:
        """Nothing left to merge: every round already merged its update."""
