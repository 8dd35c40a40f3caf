"""What every strategy shares, by concern (Flower keeps its strategy base, helpers and result types apart too):

- ``records.py``: arrays <-> ArrayRecords, array specs, the shared array maths (weighted means, capped shares);
- ``replies.py``: the one checking step every reply goes through (records, identity, metrics, arrays, bytes);
- ``site_registry.py``: the operator's registry binding site names to node ids;
- ``checkpoint.py``: the server's checkpoint store and each site's personal state;
- ``server.py``: ``FederatedStrategy``, the server loop (nodes, messages, rounds, checkpoints, byte counts);
- ``client.py``: ``ClientRuntime`` and ``ClientHalf``, one message on one site;
- ``registry.py``: ``@register_strategy`` and the name -> class table.

This module re-exports them, so a method module can import its building blocks from one place.
"""

from .checkpoint import Checkpointer, PersonalState, resolve_checkpoint_dir
from .client import ClientHalf, ClientRuntime
from .records import (
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
from .registry import STRATEGIES, register_strategy
from .replies import RejectedReply, count_check
from .server import FederatedStrategy, NodeInfo, Reply, RoundStats

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
