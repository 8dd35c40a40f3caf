"""The sub-model family: FedBKD (docs/methods/fedbkd.md) and the baselines on its federation of sites with different
capacities and tasks, one module each on the protocol they share.

- ``protocol.py``: the protocol itself: capacities (``fedbkd-capacities``), the client template that cuts, trains
  and sends a sub-encoder (``SubModelClient`` and its hooks), the server half that checks the narrowed replies and
  merges each entry over the sites holding it (``SubModelStrategy``), and what the contract tests run it on;
- ``fedbkd.py``: FedBKD (``fedbkd``): top-ψ sub-encoders, CKA alignment, eigenvalue-weighted merge;
- ``capacity_baselines.py``: HeteroFL, FedRolex, FedDrop, FedProx and local training with the same capacities
  (``heterofl``, ``fedrolex``, ``feddrop``, ``submodel-fedprox``, ``submodel-local``);
- ``ditto.py``: Ditto with the same capacities (``ditto``);
- ``matfl.py``, ``fedhca2.py``: the federated multi-task baselines MaT-FL (``matfl``) and FedHCA² (``fedhca2``) on
  HeteroFL's prefix sub-encoders (docs/methods/baselines-submodel.md).

Each module registers its strategies when ``medflower.strategies`` imports it; this package imports nothing.
"""
