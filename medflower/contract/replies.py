"""The one checking step every reply goes through: every phase (query, train, evaluate, custom actions) of every
strategy, before anything in it is used.

A site is untrusted: its reply may be malformed by a bug, a careless configuration or an attacker. ``check_reply``
accepts only the records the protocol defines (``arrays``, ``metrics``, ``info``, ``evaluation``), checks the
array names, dtypes, shapes and byte sizes from the metadata *before* anything is decoded, then the decoded values
(finite, within ``reply-value-limit``), every metric and evaluation metric (a finite number or a bounded list of
them, not named like a record's own field) and the site's identity fields. Anything else raises
``RejectedReply`` with the reason; the server logs it, counts the node as rejected for the round and goes on
(``FederatedStrategy.exchange``). The meaning of particular values (counts, budgets, capacities) is checked by the
strategy's ``check_reply`` hook right after this.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..records import ArraySpec, validate_arrays
from ..results import RESERVED_FIELDS

# "evaluation": the previous round's evaluation metrics in a training reply (run-config evaluate-in-train)
RECORDS = {"arrays": ArrayRecord, "metrics": MetricRecord, "info": ConfigRecord, "evaluation": MetricRecord}
INFO_KEYS = frozenset({"partition-id", "client"})
MAX_METRICS = 256  # metric names per reply (a site sends a few dozen at most)
MAX_NAME = 64  # characters of a metric name
MAX_LIST = 1 << 20  # values of a list metric (a 1000-class confusion matrix has 1e6)
MAX_CLIENT = 128  # characters of a site name
MAX_PARTITION = 2**31  # partition ids are non-negative 31-bit integers (they seed the site's generators)
NPY_HEADER = 4096  # bytes an array's npy header may add to its values (numpy writes 128 for these shapes)


class RejectedReply(ValueError):
    """A reply that must not be used; the message says why (it goes to the server's log and metrics.jsonl)."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_number(value: Any) -> bool:
    return _number(value) and math.isfinite(value)


def _check_records(content: RecordDict) -> None:
    """Only the three records of the protocol, each of its type."""
    for name, record in content.items():
        expected = RECORDS.get(name)
        if expected is None:
            raise RejectedReply(f"unexpected record {name[:MAX_NAME]!r}")
        if not isinstance(record, expected):
            raise RejectedReply(f"record {name!r} is a {type(record).__name__}, expected {expected.__name__}")


def check_info(content: RecordDict) -> dict[str, Any]:
    """The site's identity: exactly ``partition-id`` (a non-negative integer) and ``client`` (a printable name)."""
    if "info" not in content:
        raise RejectedReply("no 'info' record (partition-id and client)")
    info = dict(content["info"])
    if set(info) != INFO_KEYS:
        raise RejectedReply(
            f"info must hold exactly {sorted(INFO_KEYS)}, got {sorted(str(k)[:MAX_NAME] for k in info)}"
        )
    pid, client = info["partition-id"], info["client"]
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < MAX_PARTITION:
        raise RejectedReply(f"info partition-id must be an integer in [0, 2**31), got {str(pid)[:40]!r}")
    if not isinstance(client, str) or not 0 < len(client) <= MAX_CLIENT or not client.isprintable():
        raise RejectedReply(f"info client must be a printable name of 1 to {MAX_CLIENT} characters")
    return info


def check_metrics(content: RecordDict) -> dict[str, Any]:
    """Finite numbers or bounded lists of them, under names that do not overwrite a record's own fields."""
    return check_metric_values(dict(content["metrics"]) if "metrics" in content else {})


def check_evaluation(content: RecordDict) -> dict[str, Any]:
    """The evaluation metrics a training reply carries under run-config evaluate-in-train, checked like metrics."""
    return check_metric_values(dict(content["evaluation"])) if "evaluation" in content else {}


def check_metric_values(metrics: dict[str, Any]) -> dict[str, Any]:
    """``check_metrics`` on metrics that arrived outside a medflower reply (SecAgg+'s FitRes)."""
    if len(metrics) > MAX_METRICS:
        raise RejectedReply(f"{len(metrics)} metrics, at most {MAX_METRICS}")
    for name, value in metrics.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise RejectedReply(f"metric name {str(name)[:MAX_NAME]!r} is not 1 to {MAX_NAME} characters")
        if isinstance(value, list):
            if len(value) > MAX_LIST:
                raise RejectedReply(f"metric {name} lists {len(value)} values, at most {MAX_LIST}")
            if not all(_finite_number(v) for v in value):
                raise RejectedReply(f"metric {name} has a value that is not a finite number")
        elif not _finite_number(value):
            raise RejectedReply(f"metric {name} is not a finite number")
    clash = sorted(set(metrics) & RESERVED_FIELDS)
    if clash:
        raise RejectedReply(f"metric names {clash} are reserved for the record's own fields")
    return metrics


def check_arrays(content: RecordDict, expected: ArraySpec | None, value_limit: float) -> OrderedDict[str, np.ndarray]:
    """The arrays of ``expected`` and nothing else: metadata and byte sizes first, then the decoded values.

    ``expected`` None or empty: the reply may carry no arrays. The byte limit of each array is what its expected
    shape and dtype take plus an npy header, so an oversized or padded payload is refused before it is decoded.
    """
    record = content.get("arrays")
    names = list(record) if record is not None else []
    spec = dict(expected or {})
    if not spec:
        if names:
            shown = [str(k)[:MAX_NAME] for k in names[:3]]
            raise RejectedReply(f"wrong array names ({len(names)} arrays where none are expected, unexpected {shown})")
        return OrderedDict()
    missing = [k for k in spec if k not in names]
    unexpected = [k for k in names if k not in spec]
    if missing or unexpected:
        more = "..." if len(missing) > 3 else ""
        raise RejectedReply(
            f"wrong array names (missing {missing[:3]}{more}, unexpected {[str(k)[:MAX_NAME] for k in unexpected[:3]]})"
        )
    for name, (shape, dtype) in spec.items():
        array = record[name]
        if array.stype != "numpy.ndarray":
            raise RejectedReply(f"array {name} is serialized as {str(array.stype)[:40]!r}, not numpy.ndarray")
        if str(array.dtype) != dtype:
            raise RejectedReply(f"array {name} has dtype {str(array.dtype)[:20]}, expected {dtype}")
        if tuple(array.shape) != tuple(shape):
            raise RejectedReply(f"array {name} has shape {tuple(array.shape)[:8]}, expected {tuple(shape)}")
        limit = np.dtype(dtype).itemsize * math.prod(shape) + NPY_HEADER
        if len(array.data) > limit:
            raise RejectedReply(f"array {name} carries {len(array.data)} bytes, at most {limit} expected")
    arrays: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, (shape, dtype) in spec.items():
        try:
            value = record[name].numpy()  # numpy's npy reader, pickles refused
        except (TypeError, ValueError, EOFError, OSError) as err:
            raise RejectedReply(f"array {name} is not a valid npy payload ({type(err).__name__})") from None
        if problem := validate_arrays({name: value}, {name: (shape, dtype)}):  # the payload may belie its metadata
            raise RejectedReply(problem)
        if value.size and float(np.abs(value).max()) > value_limit:
            raise RejectedReply(f"array {name} has values beyond ±{value_limit:g} (run-config reply-value-limit)")
        arrays[name] = value
    return arrays


def check_reply(
    content: RecordDict, expected: ArraySpec | None, value_limit: float
) -> tuple[OrderedDict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(arrays, metrics, info) of a reply that passed every generic check; ``RejectedReply`` otherwise."""
    _check_records(content)
    info = check_info(content)
    metrics = check_metrics(content)
    check_evaluation(content)
    return check_arrays(content, expected, value_limit), metrics, info


def count_check(metrics: Mapping[str, Any], key: str, most: int | None = None) -> str | None:
    """Why ``metrics[key]`` is not a count (an integer >= 0, at most ``most``), or None."""
    value = metrics[key]
    if not _finite_number(value) or value < 0 or float(value) != int(value):
        return f"{key} must be a non-negative integer, got {value}"
    if most is not None and value > most:
        return f"{key} = {int(value)} exceeds the {most} training samples the site declared when it joined"
    return None
