"""The contract every strategy keeps, in a package that imports no method (docs/adding-a-method.md), by concern
(Flower keeps its strategy base, helpers and result types apart too):

- ``registry.py``: ``@register_strategy`` and the name -> class table (filled when ``medflower.strategies``, the
  methods, is imported);
- ``server.py``: ``FederatedStrategy``, a method's facts, its hooks and the round loop, built from one mixin per
  concern of the server loop:
  - ``nodes.py``: who is in the federation (``NodeInfo``), in which order, each round's sample;
  - ``messaging.py``: sending, waiting, checking and rejecting replies, byte counts (``Reply``, ``RoundStats``);
  - ``persistence.py``: the checkpoint after each round, resume, a failed round's rollback;
  - ``secure.py``: SecAgg+ rounds (run-config secagg);
  - ``evaluation.py``: evaluation records, pooled metrics, evaluate-in-train, cross-site evaluation;
- ``client.py``: ``ClientRuntime`` and ``ClientHalf``, one message on one site;
- ``replies.py``: the one checking step every reply goes through (records, identity, metrics, arrays, bytes);
- ``checkpoint.py``: the server's checkpoint store and each site's personal state;
- ``site_registry.py``: the operator's registry binding site names to node ids.

Below it: ``medflower/records.py`` (arrays <-> ArrayRecords, array specs, the shared array maths) and
``medflower/settings.py`` (the run config as a value). This module re-exports what a method module builds on, so
it imports its building blocks from one place.
"""

from ..records import (
    ArraySpec,
    derive_seed,
    from_record,
    record_bytes,
    spec_of,
    stack_flat,
    to_record,
    unflatten,
    validate_arrays,
    weighted_mean,
)
from .checkpoint import Checkpointer, PersonalState, resolve_checkpoint_dir
from .client import ClientHalf, ClientRuntime
from .messaging import Reply, RoundStats
from .nodes import NodeInfo
from .registry import STRATEGIES, register_strategy
from .replies import RejectedReply, count_check
from .server import FederatedStrategy

__all__ = [
    "STRATEGIES",
    "ArraySpec",
    "Checkpointer",
    "ClientHalf",
    "ClientRuntime",
    "FederatedStrategy",
    "NodeInfo",
    "RejectedReply",
    "PersonalState",
    "Reply",
    "RoundStats",
    "count_check",
    "derive_seed",
    "from_record",
    "record_bytes",
    "register_strategy",
    "resolve_checkpoint_dir",
    "spec_of",
    "stack_flat",
    "to_record",
    "unflatten",
    "validate_arrays",
    "weighted_mean",
]
