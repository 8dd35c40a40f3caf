"""The experiment runner's progress: a bar with the runs under way, their rounds and an ETA; a line per finished run.

The runs write their own folders (``metrics.jsonl``: a server record per round; ``config.json``: the rounds the
strategy runs); a thread reads what a run has appended since it last looked, so the same works for runs in this
process and for runs behind ``flwr run``. On a terminal the bar is one line rewritten in place; elsewhere (a log
file, CI) a line per round.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from . import run_folder

BAR = 20  # characters of the bar


def duration(seconds: float) -> str:
    """``seconds`` as 42s, 3m05s or 1h02m."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@dataclass
class Job:
    """One (run, seed) of the file: its label, folder and the rounds it is expected to take."""

    label: str
    folder: Path
    rounds: int


class RoundReader:
    """The rounds a run folder's ``metrics.jsonl`` has finished, read incrementally (only new lines)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.offset = 0
        self.done = 0
        self.total: int | None = None

    def poll(self) -> int:
        path = self.folder / run_folder.METRICS
        if self.total is None and (self.folder / run_folder.CONFIG).is_file():
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # not written whole yet
                self.total = int(json.loads((self.folder / run_folder.CONFIG).read_text())["resolved"]["rounds"])
        try:
            with path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.done
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("kind") == "server" and "evaluated_in" not in record:
                self.done = max(self.done, int(record.get("round", 0)))
        return self.done


class Progress:
    """Tells how far the file's runs are: ``start(i)`` before run i, ``finish(i, summary)`` after it. Several runs may
    be under way at once (``python -m medflower.experiments --parallel N``): the line then names each with its round."""

    def __init__(self, jobs: list[Job], out: TextIO | None = None, interval: float = 1.0):
        self.jobs = jobs
        self.out = out or sys.stdout
        self.interval = interval
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.rounds_done = 0  # rounds of the finished runs
        self.running: dict[int, tuple[RoundReader, float]] = {}  # run index -> its reader, when it started
        self.shown: tuple[tuple[int, int], ...] | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------------------------- what is shown
    def eta(self, done_in_runs: int) -> float | None:
        """Seconds left: the time per round so far (finished runs' rounds and ``done_in_runs`` of those under way)
        times the rounds still to run (None before a round)."""
        done = self.rounds_done + done_in_runs
        if not done:
            return None
        left = sum(job.rounds for job in self.jobs) - done
        return (time.monotonic() - self.started) / done * max(left, 0)

    def line(self) -> str:
        with self._lock:
            running = sorted(self.running.items())
            done_now = sum(reader.done for _, (reader, _) in running)
            overall = self.rounds_done + done_now
            planned = max(sum(j.rounds for j in self.jobs), 1)
            filled = min(BAR, int(BAR * overall / planned))
            eta = self.eta(done_now)
            if len(running) == 1:
                i, (reader, _) = running[0]
                what = f"run {i + 1}/{len(self.jobs)} {self.jobs[i].label}: round {reader.done}/{self.jobs[i].rounds}"
            else:
                what = f"{len(running)} of {len(self.jobs)} runs under way: " + "; ".join(
                    f"{self.jobs[i].label} round {reader.done}/{self.jobs[i].rounds}" for i, (reader, _) in running
                )
            return (
                f"[{'#' * filled}{'.' * (BAR - filled)}] {what}, "
                f"{duration(time.monotonic() - self.started)} elapsed, ETA {'?' if eta is None else duration(eta)}"
            )

    def _show(self, force: bool = False) -> None:
        with self._lock:
            if not self.running:
                return
            key = tuple((i, reader.done) for i, (reader, _) in sorted(self.running.items()))
            if self.tty:
                self.out.write("\r\033[K" + self.line())
            elif force or key != self.shown:
                self.out.write(self.line() + "\n")
            self.shown = key
            self.out.flush()

    def _poll(self) -> int:
        """The finished rounds of the runs under way; once a run's config.json says how many it runs, that is its
        plan."""
        with self._lock:
            for i, (reader, _) in self.running.items():
                reader.poll()
                if reader.total:
                    self.jobs[i].rounds = reader.total
            return sum(reader.done for reader, _ in self.running.values())

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._poll()
                self._show()

    # --------------------------------------------------------------------------------- the runner's calls
    def start(self, i: int) -> None:
        with self._lock:
            self.running[i] = (RoundReader(self.jobs[i].folder), time.monotonic())
        self._show(force=True)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="medflower-progress", daemon=True)
                self._thread.start()

    def finish(self, i: int, summary: dict[str, Any] | None, metrics: list[str], failure: str = "") -> str:
        """The run's one-line result (its final metrics, ``failure``, or that it left no summary), printed and
        returned."""
        job = self.jobs[i]
        with self._lock:
            self._poll()
            reader, started = self.running.pop(i)
            self.rounds_done += job.rounds  # what is left of the plan no longer counts towards the ETA
            if failure:
                result = f"failed: {failure}"
            elif summary is None:
                result = "no summary.json (see the log above)"
            else:
                values = [f"{m}={v:.4f}" for m in metrics if isinstance(v := summary["final"].get(m), (int, float))]
                result = f"{summary.get('rounds', reader.done)} rounds, " + (
                    " ".join(values) or "no metric of the table"
                )
            text = f"[{i + 1}/{len(self.jobs)}] {job.label} done in {duration(time.monotonic() - started)}: {result}"
            self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.out.flush()
        return text

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self.running.clear()
            if self.tty:
                self.out.write("\r\033[K")
                self.out.flush()
