"""Experiment tracking: the server's run records, mirrored to TensorBoard or MLflow (docs/experiments.md#tracking).

Run config ``tracking`` picks the tracker, ``tracking-uri`` where it writes, ``tracking-experiment`` the MLflow
experiment. The ``RunRecorder`` (medflower/results.py) hands each record it writes to a ``RunTracking``, which turns
it into a tracker's calls:

- the run config (and what its 'auto' settings became) as parameters;
- per round, ``global/<metric>``: the mean over the sites that computed it; ``sites/<site>/<metric>``: each site's
  evaluation metrics, and its training metrics (``train_loss``, ``train_steps``, ...); ``server/<field>``: bytes up
  and down, failed and rejected replies, aggregation and round seconds, ε, the pooled metrics;
- at the end, the run folder's summary files as artifacts (TensorBoard: summary.md as text, curves.png as an image).

Tracking never stops a run: the first error of a tracker is logged once and tracking is off for the rest of it.
The libraries are optional (``pip install 'medflower[tracking]'``) and imported only when asked for.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Protocol

from flwr.common.logger import log

from . import run_folder
from .options import Option, one_of
from .results import safe_name

TRACKERS = ("none", "tensorboard", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # tracker -> the package it needs
DEFAULT_EXPERIMENT = "medflower"
STATE_FILE = run_folder.TRACKING_STATE  # in the run folder: the MLflow run a resumed run continues

TRACKING_OPTIONS: tuple[Option, ...] = (
    Option(
        "tracking",
        "none",
        "mirror the run to an experiment tracker: the run config, per-round global and per-site metrics, bytes, ε, "
        "round times and the summary files (docs/experiments.md#tracking; pip install 'medflower[tracking]')",
        one_of(*TRACKERS),
    ),
    Option(
        "tracking-uri",
        "",
        "tensorboard: the folder holding one log folder per run ('' = tensorboard/ in output-dir); mlflow: the "
        "tracking URI (http://host:5000, sqlite:///path/to/mlflow.db, ...) or a folder for a local SQLite store "
        "('' = mlflow.db in output-dir, artifacts in its mlartifacts/)",
    ),
    Option(
        "tracking-experiment",
        "",
        f"mlflow: the experiment the run goes to ('' = {DEFAULT_EXPERIMENT}; the experiment runner: the YAML "
        "file's name)",
    ),
)
TRACKING_KEYS = frozenset(o.key for o in TRACKING_OPTIONS)


def missing_package(tracking: str) -> str | None:
    """Why ``tracking`` cannot run in this environment (its package is not installed), or None."""
    import importlib.util

    package = PACKAGES.get(tracking)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return f"tracking={tracking!r} needs the {package} package: pip install 'medflower[tracking]'"


class Tracker(Protocol):
    """What a run's tracker does; ``RunTracking`` calls it and turns it off at its first error."""

    def log_params(self, params: Mapping[str, str]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_files(self, paths: Sequence[Path]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (lists, strings, booleans, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as {dotted key: text}."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple, bool)) or value is None else str(value)
    return out


# server record fields that are no measurement of the round
_NOT_METRICS = frozenset({"kind", "round", "client", "time", "evaluated_in", "n", "pooled_sites"})


class RunTracking:
    """Turns a run's records into a ``Tracker``'s calls, and keeps any tracker error from reaching the run."""

    def __init__(self, tracker: Tracker, name: str):
        self.tracker: Tracker | None = tracker
        self.name = name
        self._evals: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    @property
    def active(self) -> bool:
        return self.tracker is not None

    def _call(self, action: Callable[[Tracker], None]) -> None:
        if self.tracker is None:
            return
        try:
            action(self.tracker)
        except Exception as err:  # a tracker must never stop a run: said once, then tracking is off
            tracker, self.tracker = self.tracker, None
            log(
                WARNING,
                "[medflower] tracking (%s) failed and is off for the rest of this run: %s: %s",
                self.name,
                type(err).__name__,
                err,
            )
            with contextlib.suppress(Exception):  # the error was reported just above
                tracker.close(failed=True)

    def config(self, config: Mapping[str, Any]) -> None:
        params = flat_params(config)
        self._call(lambda t: t.log_params(params))

    def client(self, rnd: int, client: str, kind: str, metrics: Mapping[str, Any]) -> None:
        """A site's record: its numbers under sites/<site>/; evaluation metrics also count for the round's mean."""
        site = safe_name(client) or "site"
        values = {}
        for name, value in metrics.items():
            if (number := _number(value)) is None:
                continue
            if kind == "eval":
                self._evals[rnd][name].append(number)
            label = name if kind == "eval" or name.startswith(f"{kind}_") else f"{kind}_{name}"
            values[f"sites/{site}/{safe_name(label)}"] = number
        if values:
            self._call(lambda t: t.log_metrics(values, rnd))

    def server(self, rnd: int, fields: Mapping[str, Any]) -> None:
        """A server record: its numbers under server/, and the mean of each evaluation metric of the rounds whose
        evaluations came in since the last server record (run-config evaluate-in-train: the round before)."""
        values = {
            f"server/{safe_name(k)}": v
            for k, raw in fields.items()
            if k not in _NOT_METRICS and (v := _number(raw)) is not None
        }
        if values:
            self._call(lambda t: t.log_metrics(values, rnd))
        self.flush()

    def flush(self) -> None:
        """The mean over sites of every evaluation metric of the rounds not yet logged."""
        for rnd in sorted(self._evals):
            means = {f"global/{safe_name(m)}": sum(v) / len(v) for m, v in self._evals[rnd].items()}
            self._call(lambda t, means=means, rnd=rnd: t.log_metrics(means, rnd))
        self._evals.clear()

    def files(self, paths: Sequence[Path]) -> None:
        existing = [Path(p) for p in paths if Path(p).is_file()]
        self.flush()
        self._call(lambda t: t.log_files(existing))

    def close(self, failed: bool = False) -> None:
        self._call(lambda t: t.close(failed))
        self.tracker = None


# ---------------------------------------------------------------------------------------------------- TensorBoard
class TensorBoardTracker:
    """torch's SummaryWriter into ``log_dir``: scalars per round; the config, summary.md and summary.json as text,
    curves.png as an image. A resumed run purges the steps after ``purge_after`` (the rounds it redoes)."""

    def __init__(self, log_dir: Path, purge_after: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        if purge_after == 0:  # a new run in this folder: the events of an earlier run there would mix in
            for stale in log_dir.glob("events.out.tfevents.*"):
                stale.unlink()
        self.log_dir = log_dir
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_after + 1 if purge_after else None)

    def log_params(self, params: Mapping[str, str]) -> None:
        rows = ["| key | value |", "|---|---|"] + [f"| {k} | {v.replace('|', '/')} |" for k, v in params.items()]
        self.writer.add_text("config", "\n".join(rows), global_step=0)
        self.writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_files(self, paths: Sequence[Path]) -> None:
        for path in paths:
            if path.suffix == ".png":
                import numpy as np
                from PIL import Image

                with Image.open(path) as image:
                    pixels = np.asarray(image.convert("RGB"))
                self.writer.add_image(path.stem, pixels, dataformats="HWC")
            elif path.suffix == ".md":
                self.writer.add_text(path.stem, path.read_text())
            elif path.suffix == ".json":
                self.writer.add_text(path.stem, "```\n" + path.read_text() + "\n```")
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


# ---------------------------------------------------------------------------------------------------- MLflow
def mlflow_location(uri: str, output_dir: Path) -> tuple[str, str | None]:
    """(tracking URI, artifact location of a new experiment): '' = a SQLite store in ``output_dir``; a folder = a
    SQLite store in it; a URI as given. A SQLite store keeps its artifacts beside it (mlartifacts/), not in the
    working directory."""
    if not uri:
        folder = output_dir
    elif "://" in uri or uri.startswith(("sqlite:", "file:", "databricks")):
        folder = None
    else:
        folder = Path(uri).expanduser()
    if folder is not None:
        folder = folder.resolve()
        folder.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{folder / 'mlflow.db'}", (folder / "mlartifacts").as_uri()
    if uri.startswith("sqlite:///"):
        return uri, (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    return uri, None


class MlflowTracker:
    """One MLflow run, through ``MlflowClient``: parameters, metrics per round (step = round), the summary files as
    artifacts. A resumed run continues the MLflow run its folder names (tracking.json)."""

    def __init__(self, uri: str, artifacts: str | None, experiment: str, run_name: str, run_dir: Path, resume: bool):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.state = run_dir / STATE_FILE
        self.run_id = self._resumed(uri) if resume else None
        if self.run_id is None:
            experiment_id = self._experiment(experiment, artifacts)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            self.state.write_text(json.dumps({"tracking": "mlflow", "uri": uri, "run_id": self.run_id}))
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self.logged = dict(self.client.get_run(self.run_id).data.params)

    def _resumed(self, uri: str) -> str | None:
        """The MLflow run of the run folder's earlier part, if it is in this store."""
        try:
            state = json.loads(self.state.read_text())
        except (OSError, ValueError):
            return None
        if state.get("uri") != uri or not state.get("run_id"):
            return None
        try:
            return self.client.get_run(state["run_id"]).info.run_id
        except Exception:  # deleted, or another store's: a new MLflow run
            return None

    def _experiment(self, name: str, artifacts: str | None) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except Exception:  # another run of the same file created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
        except ImportError:  # pragma: no cover - older MLflow
            limit = 500
        # a resumed run logged its parameters already; MLflow refuses to change one (resume-from, num-rounds, ...)
        new = [Param(k, v[:limit]) for k, v in params.items() if k not in self.logged]
        for start in range(0, len(new), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=new[start : start + 100])
        self.logged.update({p.key: p.value for p in new})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_files(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


# ---------------------------------------------------------------------------------------------------- opening
def tensorboard_dir(cfg: Any, run_dir: Path) -> Path:
    """The run's log folder: <tracking-uri or <output-dir>/tensorboard>/<run folder name>."""
    root = Path(cfg.tracking_uri).expanduser() if cfg.tracking_uri else Path(run_dir).parent / "tensorboard"
    return root / Path(run_dir).name


def open_tracking(cfg: Any, run_dir: Path, completed_rounds: int = 0) -> RunTracking | None:
    """The run's tracking as its run config asks (None: tracking='none'). A tracker that cannot start (its package
    missing, an unreachable server) is said once and the run goes on without it. ``completed_rounds``: the rounds a
    resumed run keeps."""
    if cfg.tracking == "none":
        return None
    run_dir = Path(run_dir)
    try:
        if problem := missing_package(cfg.tracking):
            raise ImportError(problem)
        if cfg.tracking == "tensorboard":
            log_dir = tensorboard_dir(cfg, run_dir)
            tracker: Tracker = TensorBoardTracker(log_dir, purge_after=completed_rounds)
            where = f"log folder {log_dir.resolve()} (tensorboard --logdir {log_dir.parent.resolve()})"
        else:
            uri, artifacts = mlflow_location(cfg.tracking_uri, run_dir.parent)
            experiment = cfg.tracking_experiment or DEFAULT_EXPERIMENT
            tracker = MlflowTracker(uri, artifacts, experiment, run_dir.name, run_dir, resume=bool(cfg.resume_from))
            where = f"experiment {experiment!r} at {uri} (mlflow ui --backend-store-uri {uri})"
    except Exception as err:
        log(WARNING, "[medflower] tracking (%s) could not start; the run goes on without it: %s", cfg.tracking, err)
        return None
    log(INFO, "[medflower] tracking with %s: %s", cfg.tracking, where)
    return RunTracking(tracker, cfg.tracking)
