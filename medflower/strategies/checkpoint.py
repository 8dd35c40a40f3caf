"""What survives a crash: the server's checkpoint store and each site's versioned personal state."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from .records import from_record, to_record

if TYPE_CHECKING:
    from .client import ClientRuntime


class Checkpointer:
    """Strategy state after each round: arrays as safetensors, the rest as JSON (atomic writes)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    def save(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "arrays.safetensors.tmp"
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp))
        os.replace(tmp, self.dir / "arrays.safetensors")
        tmp_meta = self.dir / "state.json.tmp"
        tmp_meta.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(tmp_meta, self.dir / "state.json")

    def exists(self) -> bool:
        return (self.dir / "state.json").is_file() and (self.dir / "arrays.safetensors").is_file()

    def load(self) -> tuple[OrderedDict[str, np.ndarray], dict[str, Any]]:
        meta = json.loads((self.dir / "state.json").read_text())
        arrays = load_file(str(self.dir / "arrays.safetensors"))
        order = meta.get("array_order", list(arrays))
        return OrderedDict((k, arrays[k]) for k in order), meta


def resolve_checkpoint_dir(resume_from: str) -> Path:
    """Accept a run folder or its checkpoint/ folder; raise with a clear message otherwise."""
    path = Path(resume_from).expanduser()
    for candidate in (path / "checkpoint", path):
        if Checkpointer(candidate).exists():
            return candidate
    raise FileNotFoundError(
        f"run-config 'resume-from' = {resume_from!r}: no checkpoint (state.json + arrays.safetensors) "
        f"in {path.resolve()} or {path.resolve() / 'checkpoint'}"
    )


class PersonalState:
    """Versioned per-site arrays: ``context.state`` plus a mirror on the site's disk.

    ``load(before=r)`` returns the newest version saved for a round < r, so a run resumed
    at round r sees exactly what an uninterrupted run saw, even if the site had already
    trained a later round before the server stopped.
    """

    keep = 3

    def __init__(self, runtime: ClientRuntime, key: str = "personal"):
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
        tmp = folder / f"round-{rnd}.safetensors.tmp"
        save_file(
            {k: np.ascontiguousarray(v) for k, v in arrays.items()},
            str(tmp),
            metadata={"order": json.dumps(list(arrays))},
        )
        os.replace(tmp, folder / f"round-{rnd}.safetensors")
        for old in sorted(self._saved_rounds())[: -self.keep]:
            (folder / f"round-{old}.safetensors").unlink(missing_ok=True)

    def _saved_rounds(self) -> list[int]:
        folder = self._dir()
        if folder is None or not folder.is_dir():
            return []
        return [int(p.name[len("round-") : -len(".safetensors")]) for p in folder.glob("round-*.safetensors")]

    def load(self, before: int) -> OrderedDict[str, np.ndarray] | None:
        state = self.rt.context.state
        in_memory = self.key in state.array_records and f"{self.key}-meta" in state.config_records
        if in_memory and int(state[f"{self.key}-meta"]["round"]) < before:
            return from_record(state[self.key])
        candidates = [r for r in self._saved_rounds() if r < before]
        if not candidates:
            return None
        path = self._dir() / f"round-{max(candidates)}.safetensors"
        with safe_open(str(path), framework="numpy") as f:
            order = json.loads((f.metadata() or {}).get("order", "[]")) or list(f.keys())
            return OrderedDict((k, f.get_tensor(k)) for k in order)
