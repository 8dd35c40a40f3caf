"""The experiment runner's progress: a bar with the runs under way, their rounds and an ETA; a line per finished run.

The runs write their own folders (``metrics.jsonl``: a server record per round; ``config.json``: the rounds the
strategy runs); a thread reads what a run has appended since it last looked, so the same works for runs in this
process and for runs behind ``flwr run``. On a terminal the bar is one line rewritten in place; elsewhere (a log
file, CI) a line per round.

A folder may hold an earlier run when a run starts. A run that starts over (``overwrite=true``) deletes those files, so
until it writes its own, the files found there at its start are not read. A stopped run continued from its checkpoint
(``--resume``) keeps its records: its rounds so far show on the bar but do not count towards the ETA, which is the
time per round of this process's rounds times the rounds still to run.
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
    continued: bool = False  # a stopped run continued from its checkpoint: its records so far are earlier rounds


class RoundReader:
    """The rounds a run folder's ``metrics.jsonl`` has finished, read incrementally (only new lines).

    ``continued``: the records already there are this run's (a stopped run continued from its checkpoint); they are
    read now, and ``earlier`` is their rounds. Otherwise the files there now are an earlier run's, which the run
    deletes (``overwrite=true``): they are not read until they change, and a file that shrinks is read again from its
    start."""

    def __init__(self, folder: Path, continued: bool = False):
        self.folder = folder
        self.offset = 0
        self.done = 0
        self.total: int | None = None
        # the files as they are now, an earlier run's unless this run continues it: not read until they change
        self.stale = {} if continued else {path: self._stamp(path) for path in (self._metrics, self._config)}
        self.earlier = self.poll() if continued else 0

    @property
    def _metrics(self) -> Path:
        return self.folder / run_folder.METRICS

    @property
    def _config(self) -> Path:
        return self.folder / run_folder.CONFIG

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int, int] | None:
        try:
            stat = path.stat()
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _current(self, path: Path) -> bool:
        """Whether ``path`` is this run's: it exists and is not the file an earlier run left there."""
        stamp = self._stamp(path)
        return stamp is not None and stamp != self.stale.get(path)

    def poll(self) -> int:
        path, config = self._metrics, self._config
        if self.total is None and self._current(config):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # not written whole yet
                self.total = int(json.loads(config.read_text())["resolved"]["rounds"])
        if not self._current(path):
            return self.done
        try:
            with path.open("rb") as f:
                if f.seek(0, 2) < self.offset:  # replaced by a shorter file: read it from its start
                    self.offset = self.done = 0
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
        self.rounds_done = 0  # rounds of the finished runs, run by this process
        self.rounds_before = 0  # rounds the runs under way or finished had run before this process continued them
        self.running: dict[int, tuple[RoundReader, float]] = {}  # run index -> its reader, when it started
        self.shown: tuple[tuple[int, int], ...] | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------------------------- what is shown
    def eta(self, done_in_runs: int) -> float | None:
        """Seconds left: the time per round so far (finished runs' rounds and ``done_in_runs`` of those under way,
        both run by this process) times the rounds still to run (None before a round)."""
        done = self.rounds_done + done_in_runs
        if not done:
            return None
        left = sum(job.rounds for job in self.jobs) - self.rounds_before - done
        return (time.monotonic() - self.started) / done * max(left, 0)

    def line(self) -> str:
        with self._lock:
            running = sorted(self.running.items())
            # max: a resumed run drops records after its checkpoint's round, which ``earlier`` may have counted
            done_now = sum(max(reader.done - reader.earlier, 0) for _, (reader, _) in running)
            overall = self.rounds_before + self.rounds_done + done_now
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
            reader = RoundReader(self.jobs[i].folder, continued=self.jobs[i].continued)
            self.running[i] = (reader, time.monotonic())
            self.rounds_before += reader.earlier
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
            self.rounds_done += max(job.rounds - reader.earlier, 0)  # the rest of its plan leaves the ETA
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
