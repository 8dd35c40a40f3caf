"""Persistence: the strategy's checkpoint after each round, resuming from one, and the in-memory copy a failed round
falls back to.

``PersistenceMixin`` is the part of ``FederatedStrategy`` (server.py) that writes and reads what ``state`` /
``load_state`` (the method's hooks, server.py) define, through the checkpoint store (checkpoint.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.logger import log

from .checkpoint import Checkpointer, non_finite


class PersistenceMixin:
    """Checkpoints and round rollback: ``save_checkpoint`` (after each round), ``restore`` (resume-from; refuses a
    checkpoint of another strategy or run config), ``snapshot`` and ``non_finite_state`` (the state a round must
    not keep).

    Reads from the rest of ``FederatedStrategy``: ``name``, ``cfg``, ``recorder``, ``checkpointer``, ``privacy``,
    ``completed_rounds``, ``elapsed_s``, ``run_uid`` (``restore`` sets the last three) and the hooks ``state`` /
    ``load_state`` (server.py).
    """

    def save_checkpoint(self) -> None:
        arrays, meta = self.state()
        self.checkpointer.save(
            arrays,
            {
                "strategy": self.name,
                "completed_rounds": self.completed_rounds,
                "elapsed_s": self.elapsed_s,
                "config": self.cfg.fingerprint(),
                "array_order": list(arrays),
                "strategy_meta": meta,
                "privacy": self.privacy.state_dict() if self.privacy else None,
                "run_uid": self.run_uid,
            },
        )

    def restore(self, directory: Path) -> None:
        store = Checkpointer(directory)
        arrays, meta = store.load()
        if meta.get("strategy") != self.name:
            raise ValueError(f"checkpoint in {directory} is from strategy {meta.get('strategy')!r}, not {self.name!r}")
        before = self.cfg.defaults()  # a key added since the checkpoint was written had its default then
        then_of = {k: meta["config"].get(k, before.get(k)) for k in self.cfg.fingerprint()}
        differing = {k: (v, then_of[k]) for k, v in self.cfg.fingerprint().items() if then_of[k] != v}
        if differing:
            key, (now, then) = next(iter(differing.items()))
            raise ValueError(f"cannot resume: run-config '{key}' is {now!r} now but was {then!r} in {directory}")
        self.load_state(arrays, meta.get("strategy_meta", {}))
        if self.privacy is not None and meta.get("privacy"):
            self.privacy.load_state_dict(meta["privacy"])
        if self.privacy is not None:  # rounds released before the crash and redone now count too
            self.privacy.count_unfinished(self.recorder.run_dir)
        self.completed_rounds = int(meta["completed_rounds"])
        self.elapsed_s = float(meta.get("elapsed_s", 0.0))
        self.run_uid = str(meta.get("run_uid", ""))  # '': a checkpoint from before run identities (state by name)
        log(INFO, "[medflower] resumed %s from %s after round %d", self.name, store.loaded, self.completed_rounds)

    def snapshot(self) -> tuple[OrderedDict[str, np.ndarray], dict[str, Any]]:
        """A copy of ``state()`` (what ``load_state`` restores when a round's aggregate is not finite)."""
        arrays, meta = self.state()
        return OrderedDict((k, np.array(v, copy=True)) for k, v in arrays.items()), json.loads(json.dumps(meta))

    def non_finite_state(self) -> str | None:
        """Why the state after a round must not be kept (an array with NaN/Inf), or None."""
        bad = non_finite(self.state()[0])
        return f"the aggregate is not finite ({len(bad)} arrays with NaN/Inf, e.g. {bad[0]})" if bad else None
