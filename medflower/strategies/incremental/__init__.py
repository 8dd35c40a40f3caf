"""The class-incremental family: pFedMxF (docs/methods/pfedmxf.md) and its baselines on a stream of tasks of new
classes, one module each on the protocol they share (docs/methods/baselines-incremental.md).

- ``protocol.py``: the protocol itself: tasks x rounds, the site's masked training and evaluation over the seen
  classes (``IncrementalClient``; ``LoRAClient`` for the LoRA baselines), the server's round, head averaging and task
  ends (``IncrementalStrategy``), its run-config keys (``INCREMENTAL_OPTIONS``) and what the contract tests run it
  on; ``heads.py``: the classifier; ``report.py``: the per-task accuracy;
- ``pfedmxf.py``: pFedMxF (``pfedmxf``); its maths in ``spectral.py``;
- the LoRA baselines: ``fedavg_lora.py`` (``fedavg-lora``, the base of the others), ``fedstack.py`` (``fedstack``),
  with ``lora_merge.py``; ``inflora.py`` (``inflora``); ``lwf_lora.py`` (``lwf-lora``) and ``fedcurv_lora.py``
  (``fedcurv-lora``), with the regularisers of ``training/regularisers.py``, shared with their continual twins.

Each module registers its strategies when ``medflower.strategies`` imports it; this package imports nothing.
"""
