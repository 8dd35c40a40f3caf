"""Where a site's time goes, per message: opt-in timing records for benchmarks/deployment_overhead.py.

With the environment variable ``MEDFLOWER_PROFILE`` set to a file path, every message a site handles appends one
JSON line to that file (docs/benchmarks.md#deployment-start-up-tax): when the server created the message, when the
handling process started (``/proc``), when medflower's entry point was imported, the seconds spent importing the
site's app, building the model, loading the data, training and evaluating, and when the handler returned. Nothing of
it leaves the site: the file is the operator's. Unset (the default), the timers cost two ``perf_counter`` calls.

Standard library only: the ClientApp's entry point imports it before anything heavy.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator

PROFILE_ENV = "MEDFLOWER_PROFILE"
PHASES = ("imports", "model", "data", "train", "evaluate")

_local = threading.local()


def process_start_time() -> float | None:
    """This process's start (seconds since the epoch) from /proc (Linux), or None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        start_ticks = int(fields[19])  # field 22 of proc(5), counted after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def enabled() -> bool:
    return bool(os.environ.get(PROFILE_ENV))


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the seconds spent inside to ``name`` of the message being handled (if one is being timed)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        totals = getattr(_local, "totals", None)
        if totals is not None:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - started


@contextlib.contextmanager
def timed_message() -> Iterator[dict[str, float]]:
    """Collect ``phase`` totals of one message on this thread; yields the dict they go into."""
    previous = getattr(_local, "totals", None)
    _local.totals = totals = {}
    try:
        yield totals
    finally:
        _local.totals = previous


def write(record: dict) -> None:
    """Append one record to ``$MEDFLOWER_PROFILE`` (one line per write; O_APPEND keeps lines whole)."""
    path = os.environ.get(PROFILE_ENV)
    if not path:
        return
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
