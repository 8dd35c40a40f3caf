"""Arrays on the wire: ArrayRecords <-> numpy, array specs, reply validation and the shared array maths."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

ArraySpec = Mapping[str, tuple[tuple[int, ...], str]]


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """A fresh ArrayRecord (never share one between messages)."""
    record = ArrayRecord()
    for name, value in arrays.items():
        record[name] = Array(np.ascontiguousarray(value))
    return record


def from_record(record: ArrayRecord) -> OrderedDict[str, np.ndarray]:
    return OrderedDict((name, record[name].numpy()) for name in record)


def spec_of(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in arrays.items()}


def validate_arrays(arrays: Mapping[str, np.ndarray], expected: ArraySpec) -> str | None:
    """None if ``arrays`` has exactly the expected names, shapes, dtypes and finite values; else why not."""
    missing = [k for k in expected if k not in arrays]
    unexpected = [k for k in arrays if k not in expected]
    if missing or unexpected:
        return (
            f"wrong array names (missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]})"
        )
    for name, (shape, dtype) in expected.items():
        value = arrays[name]
        if tuple(value.shape) != tuple(shape):
            return f"array {name} has shape {tuple(value.shape)}, expected {tuple(shape)}"
        if str(value.dtype) != dtype:
            return f"array {name} has dtype {value.dtype}, expected {dtype}"
        if not np.isfinite(value).all():
            return f"array {name} has NaN/Inf values"
    return None


def weighted_mean(arrays: list[Mapping[str, np.ndarray]], weights: list[float]) -> OrderedDict[str, np.ndarray]:
    """Σ_k w_k x_k / Σ_k w_k per array name, in float64, returned in the first reply's dtypes."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, first in arrays[0].items():
        acc = sum(wk * a[name].astype(np.float64) for wk, a in zip(w, arrays))
        out[name] = np.asarray(acc, dtype=first.dtype)
    return out


def capped_shares(weights: list[float] | np.ndarray, cap: float = 1.0) -> np.ndarray:
    """w_k / Σw with no share above ``cap``: the excess of a capped site goes to the others in proportion to their
    weights (repeated until none exceeds it). Weights are checked counts or spreads (finite, >= 0); all zero, or a
    cap below 1/K, gives equal shares."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0:
        return w
    if w.sum() <= 0 or cap * w.size <= 1.0:
        return np.full(w.size, 1.0 / w.size)
    shares = w / w.sum()
    capped = np.zeros(w.size, dtype=bool)
    while (shares > cap + 1e-12).any():
        capped |= shares > cap
        free = np.where(capped, 0.0, w if w[~capped].sum() > 0 else 1.0)  # zero-weight rest: equal parts
        shares = np.where(capped, cap, (1.0 - cap * capped.sum()) * free / free.sum())
    return shares


def median_capped(weights: list[float] | np.ndarray, factor: float) -> np.ndarray:
    """``weights`` with each one capped at ``factor`` × their median, when there are 3 or more and ``factor`` > 0
    (with 2, the median is their mean and caps nothing a dishonest site declares, so they are left as they are)."""
    w = np.asarray(weights, dtype=np.float64)
    if factor <= 0 or w.size < 3:
        return w
    median = float(np.median(w))
    return np.minimum(w, factor * median) if median > 0 else w


def update_norm(update: Mapping[str, np.ndarray]) -> float:
    """‖Δ‖₂ over every array of the update together (flat clipping, one bound for the whole update)."""
    return float(np.sqrt(sum(float(np.sum(np.square(u, dtype=np.float64))) for u in update.values())))


def common_update(given: Mapping[str, np.ndarray], reply: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """reply − given in float64, over the arrays both hold under the same name and shape."""
    return OrderedDict(
        (name, value.astype(np.float64) - given[name].astype(np.float64))
        for name, value in reply.items()
        if name in given and given[name].shape == value.shape
    )


def update_norm_bounds(
    sent: list[Mapping[str, np.ndarray]], replies: list[Mapping[str, np.ndarray]], factor: float
) -> tuple[list[float], float]:
    """(‖Δ_k‖₂ per reply, the bound): Δ_k is reply k minus what was sent to its site (``common_update``). The bound
    is ``factor`` × the median norm with 3 or more replies and ``factor`` > 0, else inf (with 2 the median is their
    mean, which a dishonest reply sets); inf too when the median is 0."""
    norms = [update_norm(common_update(given, reply)) for given, reply in zip(sent, replies)]
    median = float(np.median(norms)) if norms else 0.0
    return norms, factor * median if factor > 0 and len(norms) >= 3 and median > 0 else float("inf")


def scaled_update(
    given: Mapping[str, np.ndarray], reply: Mapping[str, np.ndarray], scale: float
) -> OrderedDict[str, np.ndarray]:
    """``reply`` with its update scaled by ``scale``: given + scale·(reply − given) for every array of
    ``common_update`` (the others as sent), in the reply's dtypes."""
    update = common_update(given, reply)
    return OrderedDict(
        (name, (given[name] + scale * update[name]).astype(value.dtype) if name in update else value)
        for name, value in reply.items()
    )


def stack_flat(replies: list[Mapping[str, np.ndarray]], spec: ArraySpec) -> np.ndarray:
    """[N, P] float32: row j is reply j's arrays of ``spec`` flattened in spec order (one copy, no temporaries)."""
    sizes = [int(np.prod(shape)) for shape, _ in spec.values()]
    out = np.empty((len(replies), sum(sizes)), dtype=np.float32)
    for j, arrays in enumerate(replies):
        offset = 0
        for name, size in zip(spec, sizes):
            out[j, offset : offset + size] = np.asarray(arrays[name]).ravel()
            offset += size
    return out


def unflatten(vector: np.ndarray, spec: ArraySpec) -> OrderedDict[str, np.ndarray]:
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    offset = 0
    for name, (shape, dtype) in spec.items():
        size = int(np.prod(shape))
        out[name] = vector[offset : offset + size].reshape(shape).astype(dtype)
        offset += size
    return out


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers (run seed, round, partition, purpose)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def record_bytes(content: RecordDict) -> int:
    """Bytes of the array values a message carries (what the round's bytes_up / bytes_down count), from the
    arrays' metadata: nothing is decoded (a reply is counted before it is checked)."""
    return sum(array_nbytes(a) for record in content.array_records.values() for a in record.values())


def array_nbytes(array: Array) -> int:
    """Bytes of an array's values from its metadata (nothing decoded); its serialized size if that is unreadable."""
    try:
        return int(np.dtype(array.dtype).itemsize) * int(np.prod([int(n) for n in array.shape]))
    except (TypeError, ValueError):
        return len(array.data)
