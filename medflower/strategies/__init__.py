"""Strategy registry: run-config ``strategy`` name -> server half (which names its client half)."""

from __future__ import annotations

from .base import ClientHalf, FederatedStrategy
from .drift import FedDyn, Scaffold
from .fedavg import FedAvg, FedProx, Local
from .fedbkd import Ditto, FedBKD, FedDrop, FedRolex, HeteroFL, SubModelFedProx, SubModelLocal
from .fedkei import FedKEI
from .pfedmxf import FedAvgLoRA, FedStack, PFedMxF
from .sgca import LAT, SGCA
from .sift import SiFT

STRATEGIES: dict[str, type[FederatedStrategy]] = {
    s.name: s for s in (FedAvg, FedProx, Scaffold, FedDyn, Local, SGCA, LAT, FedKEI, PFedMxF, FedAvgLoRA, FedStack, SiFT,
                             FedBKD, HeteroFL, FedRolex, FedDrop, SubModelFedProx, SubModelLocal, Ditto)}

__all__ = ["STRATEGIES", "ClientHalf", "FederatedStrategy"]
