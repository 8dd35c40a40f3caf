"""The continual task family: FedKEI (docs/methods/fedkei.md) and its baselines on a stream of binary tasks, one module
each on the protocol they share (docs/methods/baselines-continual.md).

- ``protocol.py``: the protocol itself: tasks, the site's initialise / fine-tune / upload (``ContinualClient`` and its
  hooks), the server that walks the tasks and pools the modules (``ContinualStrategy``), its run-config keys
  (``task-epochs``, ``fedkei-site-classes``), the pieces several methods share (``PoolMeanInit``,
  ``latest_modules``) and what the contract tests run it on;
- ``knowledge_pool.py``: the pool of every finished module; ``report.py``: the per-task tables and curves;
- ``fedkei.py``: FedKEI (``fedkei``): its variants, the bi-level phase and its keys; its maths in ``bilevel.py``;
- one module per baseline: ``apple.py``, ``fedamp.py``, ``fedga.py``, ``elcfs.py``, ``fedprox_init.py``,
  ``ffa_lora.py``, ``perfedavg.py``, ``flwf.py``, ``fedcurv.py`` (the last two with the regularisers of
  ``training/regularisers.py``, shared with their class-incremental twins).

Each module registers its strategies when ``medflower.strategies`` imports it; this package imports nothing.
"""
