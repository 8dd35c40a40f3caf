"""What survives a crash: the server's checkpoint store and each site's versioned personal state.

Layout of a run's ``checkpoint/`` (docs/layout.md, "Checkpoints"):

    checkpoint/round-000005/arrays.safetensors   the strategy's arrays after round 5
    checkpoint/round-000005/state.json           its JSON state, with the sha256 of arrays.safetensors
    checkpoint/round-000004/...                  the previous ones, ``keep`` in all

A round is written into ``checkpoint/.tmp-round-000005-<pid>/`` (both files fsynced), which one ``os.rename``
makes ``round-000005`` (the parent folder fsynced after it): a crash leaves the previous round as the newest
complete one. ``load`` returns the newest round that reads back and matches its digest; one that does not is
named in a warning and skipped. The older layout (``state.json`` + ``arrays.safetensors`` directly in
``checkpoint/``, written by two renames) is still read, as the oldest candidate, so earlier runs resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from flwr.app import ConfigRecord
from flwr.common.logger import log
from safetensors import safe_open
from safetensors.numpy import load as load_bytes
from safetensors.numpy import save as save_bytes

from .. import run_folder
from ..records import from_record, to_record


class SiteRuntime(Protocol):
    """What ``PersonalState`` reads of a site's runtime (``client.ClientRuntime`` is one)."""

    context: Any

    def state_dir(self) -> Path | None: ...


ARRAYS = "arrays.safetensors"
STATE = "state.json"
DIGEST = "arrays_sha256"  # state.json's field: sha256 of the round's arrays.safetensors, checked on load
ROUND = re.compile(r"round-(\d{6,})")
_MOVED_ASIDE = re.compile(r"\.old-round-(\d{6,})-\d+")  # a round being replaced by a new save of the same round
_STALE = re.compile(r"\.(tmp|old)-round-\d{6,}-\d+")


class CheckpointError(ValueError):
    """No checkpoint in a folder could be used; the message names each one tried and why it was refused."""


class _Unusable(Exception):
    """One checkpoint cannot be used (the reason is the message)."""


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable; a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def non_finite(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the floating-point arrays holding a NaN or an infinity."""
    return [
        k
        for k, v in arrays.items()
        if np.issubdtype(np.asarray(v).dtype, np.inexact) and not np.isfinite(np.asarray(v)).all()
    ]


def _round_of(path: Path) -> int | None:
    match = ROUND.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _candidate_round(path: Path) -> int:
    """The round of a round folder or of a moved-aside one."""
    match = ROUND.fullmatch(path.name) or _MOVED_ASIDE.fullmatch(path.name)
    return int(match.group(1)) if match else -1


class Checkpointer:
    """The strategy's state after each round: ``keep`` round folders, each written in one atomic rename.

    ``directory`` is a run's ``checkpoint/`` folder, or one ``round-NNNNNN`` folder in it (then ``load`` reads
    that round only: a run resumed from a chosen round).
    """

    def __init__(self, directory: Path, keep: int = 3):
        if int(keep) < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.dir = Path(directory)
        self.keep = int(keep)
        self.loaded: Path | None = None  # the folder the last ``load`` read

    # ------------------------------------------------------------------ writing
    def round_dir(self, rnd: int) -> Path:
        return self.dir / f"round-{rnd:06d}"

    def rounds(self) -> list[int]:
        """The rounds that have a folder here, oldest first (whether or not they are valid)."""
        if not self.dir.is_dir():
            return []
        return sorted(r for p in self.dir.iterdir() if p.is_dir() and (r := _round_of(p)) is not None)

    def save(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> Path:
        """Write ``arrays`` and ``meta`` as round ``meta['completed_rounds']`` (else the newest round + 1) and
        prune to the newest ``keep`` rounds; returns the round's folder. Refuses (ValueError) arrays holding a
        NaN or an infinity: a non-finite model never replaces a checkpoint."""
        if bad := non_finite(arrays):
            raise ValueError(
                f"refusing to checkpoint non-finite arrays {bad} in {self.dir}: the previous checkpoint is kept"
            )
        if "completed_rounds" in meta:
            rnd = int(meta["completed_rounds"])
        else:
            rnd = max(self.rounds(), default=0) + 1
        data = save_bytes({k: np.ascontiguousarray(v) for k, v in arrays.items()})
        text = json.dumps({**meta, DIGEST: hashlib.sha256(data).hexdigest()}, indent=1, sort_keys=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".tmp-round-{rnd:06d}-{os.getpid()}"
        target = self.round_dir(rnd)
        aside = self.dir / f".old-round-{rnd:06d}-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            write_durable(tmp / ARRAYS, data)
            write_durable(tmp / STATE, text.encode())
            fsync_dir(tmp)
            if target.exists():  # the same round saved again (SiFT's hops, a round redone after a resume)
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(target, aside)
            os.rename(tmp, target)
            fsync_dir(self.dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if aside.is_dir() and not target.exists():  # put the round being replaced back (load also finds it)
                with contextlib.suppress(OSError):
                    os.rename(aside, target)
            raise
        self._prune()
        return target

    def _prune(self) -> None:
        """Drop rounds beyond the newest ``keep``, leftovers of interrupted saves and, once ``keep`` rounds exist,
        the older layout's files."""
        rounds = self.rounds()
        for rnd in rounds[: -self.keep]:
            shutil.rmtree(self.round_dir(rnd), ignore_errors=True)
        for path in self.dir.iterdir():
            if path.is_dir() and _STALE.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)
        if len(rounds) >= self.keep:
            for name in (STATE, ARRAYS, f"{STATE}.tmp", f"{ARRAYS}.tmp"):
                (self.dir / name).unlink(missing_ok=True)
        fsync_dir(self.dir)

    def discard_after(self, rnd: int) -> list[Path]:
        """Delete the round folders after ``rnd`` (a run resumed from round ``rnd`` redoes them), moved-aside ones
        included; returns them."""
        gone = [path for path in self.candidates() if path != self.dir and _candidate_round(path) > rnd]
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        if gone:
            fsync_dir(self.dir)
            log(
                WARNING,
                "[medflower] resuming after round %d: deleted the later checkpoints %s",
                rnd,
                ", ".join(str(p) for p in gone),
            )
        return gone

    # ------------------------------------------------------------------ reading
    def candidates(self) -> list[Path]:
        """The checkpoints ``load`` tries, newest first: the round folders (a round folder being replaced by a new
        save of the same round right after it), then the older layout's ``checkpoint/`` itself."""
        if _round_of(self.dir) is not None:
            return [self.dir] if self.dir.is_dir() else []
        if not self.dir.is_dir():
            return []
        found: list[tuple[int, bool, Path]] = []
        for path in self.dir.iterdir():
            if path.is_dir() and (ROUND.fullmatch(path.name) or _MOVED_ASIDE.fullmatch(path.name)):
                found.append((_candidate_round(path), path.name.startswith("round-"), path))
        ordered = [path for _, _, path in sorted(found, reverse=True)]
        if (self.dir / STATE).is_file() or (self.dir / ARRAYS).is_file():
            ordered.append(self.dir)
        return ordered

    def exists(self) -> bool:
        """Whether there is any checkpoint to try (``load`` says whether one is valid)."""
        return bool(self.candidates())

    def load(self) -> tuple[OrderedDict[str, np.ndarray], dict[str, Any]]:
        """Arrays (in their saved order) and meta of the newest valid checkpoint. Each one refused is logged with
        its path and reason; none valid raises FileNotFoundError (none at all) or CheckpointError (listing each
        one tried and why)."""
        candidates = self.candidates()
        if not candidates:
            raise FileNotFoundError(f"no checkpoint in {self.dir}")
        refused: list[str] = []
        for path in candidates:
            try:
                arrays, meta = read_checkpoint(path, legacy=path == self.dir and _round_of(path) is None)
            except _Unusable as why:
                log(WARNING, "[medflower] checkpoint %s is unusable: %s; trying the previous one", path, why)
                refused.append(f"{path}: {why}")
                continue
            if refused:
                log(WARNING, "[medflower] using checkpoint %s (newer ones refused: see above)", path)
            else:
                log(INFO, "[medflower] checkpoint %s loaded", path)
            self.loaded = path
            return arrays, meta
        raise CheckpointError(f"no valid checkpoint in {self.dir}; tried:\n  " + "\n  ".join(refused))


def read_checkpoint(folder: Path, legacy: bool = False) -> tuple[OrderedDict[str, np.ndarray], dict[str, Any]]:
    """One checkpoint folder's arrays and meta, or ``_Unusable`` with the reason. ``legacy``: the older layout,
    which has no digest."""
    state_path, arrays_path = folder / STATE, folder / ARRAYS
    if not state_path.is_file():
        raise _Unusable(f"{STATE} is missing")
    try:
        meta = json.loads(state_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise _Unusable(f"{STATE} is not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise _Unusable(f"{STATE} is not a JSON object")
    if not arrays_path.is_file():
        raise _Unusable(f"{ARRAYS} is missing")
    data = arrays_path.read_bytes()
    digest = meta.pop(DIGEST, None)
    if digest is None and not legacy:
        raise _Unusable(f"{STATE} has no '{DIGEST}'")
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise _Unusable(f"{ARRAYS} does not match the sha256 in {STATE} (changed or partly written)")
    rnd = _candidate_round(folder)
    if rnd >= 0 and "completed_rounds" in meta and int(meta["completed_rounds"]) != rnd:
        raise _Unusable(f"{STATE} is of round {meta['completed_rounds']}, not {rnd}")
    try:
        arrays = load_bytes(data)
    except Exception as err:  # safetensors raises its own error types for a malformed file
        raise _Unusable(f"{ARRAYS} is unreadable ({err})") from None
    order = meta.get("array_order", list(arrays))
    if sorted(order) != sorted(arrays):
        raise _Unusable(f"{ARRAYS} holds {sorted(arrays)} but {STATE} names {sorted(order)}")
    return OrderedDict((k, arrays[k]) for k in order), meta


def resolve_checkpoint_dir(resume_from: str) -> Path:
    """The checkpoint folder ``resume-from`` names: a run folder, its ``checkpoint/``, or one ``round-NNNNNN``
    folder in it (resume from that round); raise with a clear message otherwise."""
    path = Path(resume_from).expanduser()
    for candidate in (path / run_folder.CHECKPOINT, path):
        if Checkpointer(candidate).exists():
            return candidate
    raise FileNotFoundError(
        f"run-config 'resume-from' = {resume_from!r}: no checkpoint in {path.resolve()} or "
        f"{path.resolve() / 'checkpoint'} (looked for round-NNNNNN/ folders with {STATE} + {ARRAYS}, "
        f"and the older {STATE} + {ARRAYS} directly in checkpoint/)"
    )


def run_folder_of(checkpoint_dir: Path) -> Path:
    """The run folder a checkpoint folder (``checkpoint/`` or ``checkpoint/round-NNNNNN/``) belongs to."""
    folder = Path(checkpoint_dir)
    if _round_of(folder) is not None:
        folder = folder.parent
    return folder.parent if folder.name == run_folder.CHECKPOINT else folder


def arrays_digest(arrays: Mapping[str, np.ndarray], order: list[str]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``arrays`` in ``order``."""
    h = hashlib.sha256()
    for k in order:
        v = np.ascontiguousarray(arrays[k])
        h.update(json.dumps([k, v.dtype.str, list(v.shape)]).encode())
        h.update(v.tobytes())
    return h.hexdigest()


class PersonalState:
    """Versioned per-site arrays: ``context.state`` plus a mirror on the site's disk.

    ``load(before=r)`` returns the newest version saved for a round < r, so a run resumed
    at round r sees exactly what an uninterrupted run saw, even if the site had already
    trained a later round before the server stopped. Each version is one file
    ``round-<r>.safetensors`` (written to a temporary file, fsynced, renamed), carrying the digest of its arrays;
    a version that does not read back is named in a warning and the previous one is used.
    """

    keep = 3

    def __init__(self, runtime: SiteRuntime, key: str = "personal"):
        self.rt = runtime
        self.key = key

    def _dir(self) -> Path | None:
        base = self.rt.state_dir()
        return base / self.key if base else None

    def save(self, rnd: int, arrays: Mapping[str, np.ndarray]) -> None:
        state = self.rt.context.state
        state[self.key] = to_record(arrays)
        state[f"{self.key}-meta"] = ConfigRecord({"round": rnd})
        folder = self._dir()
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        order = list(arrays)
        tmp = folder / f"round-{rnd}.safetensors.tmp"
        write_durable(
            tmp,
            save_bytes(
                {k: np.ascontiguousarray(v) for k, v in arrays.items()},
                metadata={"order": json.dumps(order), "sha256": arrays_digest(arrays, order)},
            ),
        )
        os.replace(tmp, folder / f"round-{rnd}.safetensors")
        fsync_dir(folder)
        for old in sorted(self._saved_rounds())[: -self.keep]:
            (folder / f"round-{old}.safetensors").unlink(missing_ok=True)

    def _saved_rounds(self) -> list[int]:
        folder = self._dir()
        if folder is None or not folder.is_dir():
            return []
        found = (re.fullmatch(r"round-(\d+)\.safetensors", p.name) for p in folder.glob("round-*.safetensors"))
        return [int(m.group(1)) for m in found if m]

    def load(self, before: int) -> OrderedDict[str, np.ndarray] | None:
        state = self.rt.context.state
        in_memory = self.key in state.array_records and f"{self.key}-meta" in state.config_records
        if in_memory and int(state[f"{self.key}-meta"]["round"]) < before:
            return from_record(state[self.key])
        candidates = sorted((r for r in self._saved_rounds() if r < before), reverse=True)
        refused = []
        for rnd in candidates:
            path = self._dir() / f"round-{rnd}.safetensors"
            try:
                arrays = read_personal(path)
            except Exception as err:  # safetensors raises its own error types for a malformed file
                log(WARNING, "[medflower] per-site state %s is unreadable (%s); using the previous version", path, err)
                refused.append(f"{path}: {err}")
                continue
            return arrays
        if refused:
            raise ValueError(f"no readable per-site state before round {before}: " + "; ".join(refused))
        return None


def read_personal(path: Path) -> OrderedDict[str, np.ndarray]:
    """One per-site state file, its arrays checked against the digest it carries (files without one: unchecked)."""
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        order = json.loads(meta.get("order", "[]")) or list(f.keys())
        arrays = OrderedDict((k, f.get_tensor(k)) for k in order)
    if "sha256" in meta and arrays_digest(arrays, order) != meta["sha256"]:
        raise ValueError("its arrays do not match the sha256 it carries")
    return arrays
