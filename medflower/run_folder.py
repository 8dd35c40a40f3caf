"""The run folder: the one place that names what a run writes in its folder (docs/layout.md, "A run's folder"),
which of it marks a folder as already holding a run, and what ``overwrite=true`` deletes.

Every module that reads or writes a run folder takes the names from here: the server's recorder and checkpoint
store, the privacy ledger's release marks, the tracker's state, the progress bar, ``predict``/``export`` and the
experiment runner. The ServerApp readies a new run's folder with ``prepare_new``.
"""

from __future__ import annotations

import shutil
from logging import WARNING
from pathlib import Path

from flwr.common.logger import log

from .options import ConfigError

CONFIG = "config.json"  # the run config and what its 'auto' settings became
METRICS = "metrics.jsonl"  # one record per site and round, then the server's
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
CURVES = "curves.png"
SITE_BARS = "sites.png"  # each site's final metrics as bars, beside curves.png
SITE_FIGURES = "sites"  # simulation: sites/<site>/, each simulated site's own pictures
CHECKPOINT = "checkpoint"  # round-NNNNNN/ folders (contract/checkpoint.py)
CLIENT_STATE = "client-state"  # simulation: client-state/partition-<p>/, each site's own state
PRIVACY_RELEASES = "privacy-releases.jsonl"  # one line per round whose training was sent (privacy/ledger.py)
TRACKING_STATE = "tracking.json"  # the MLflow run a resumed run continues (tracking.py)

MARKS = (METRICS, CHECKPOINT, CLIENT_STATE, SUMMARY_JSON)  # a folder holding any of these holds a run
OUTPUTS = (
    CONFIG,
    METRICS,
    SUMMARY_JSON,
    SUMMARY_MD,
    CURVES,
    SITE_BARS,
    SITE_FIGURES,
    CHECKPOINT,
    CLIENT_STATE,
    PRIVACY_RELEASES,
    TRACKING_STATE,
)  # what a run writes: overwrite=true deletes these and nothing else


def partition_state(run_dir: Path, partition_id: int) -> Path:
    """A simulated site's own state folder in the run folder."""
    return Path(run_dir) / CLIENT_STATE / f"partition-{partition_id}"


def held_outputs(run_dir: Path) -> list[str]:
    """The marks of a run that ``run_dir`` holds (empty: no run there)."""
    return [name for name in MARKS if (Path(run_dir) / name).exists()]


def delete_outputs(run_dir: Path) -> None:
    """Delete what a run wrote in ``run_dir`` (overwrite=true); other files in the folder stay."""
    for name in OUTPUTS:
        path = Path(run_dir) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def prepare_new(run_dir: Path, overwrite: bool) -> None:
    """Ready ``run_dir`` for a new run (no resume-from): an absent folder, or one that holds no run, is used as it
    is; one that already holds a run is refused, unless ``overwrite`` (run-config overwrite=true), which deletes
    that run's outputs (docs/deployment.md, "Faults")."""
    held = held_outputs(run_dir)
    if not held:
        return
    if not overwrite:
        raise ConfigError(
            f"run folder {run_dir.resolve()} already holds a run ({', '.join(held)}): set run-config "
            f"'resume-from' to it to continue that run, or 'overwrite=true' to delete it and start over "
            f"(or choose another 'run-name' / 'output-dir')"
        )
    log(WARNING, "[medflower] %s holds a run: overwrite=true, deleting it and starting over", run_dir.resolve())
    delete_outputs(run_dir)
