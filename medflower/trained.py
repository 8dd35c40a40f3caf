"""A finished (or interrupted) run's model, rebuilt at a site: what ``medflower.predict`` and ``medflower.export`` use.

A run folder holds the run config (``config.json``), the server's checkpoints (``checkpoint/round-NNNNNN/``) and,
in a simulation, each site's own state (``client-state/partition-<id>/``). A site's model is assembled by the
strategy's own code, exactly as in the run's last evaluation: the server half writes the evaluate message of the
checkpoint's round for that site (``evaluate_content``: the global arrays, or that site's aggregate), and the client
half's ``evaluate`` puts the site's model together (the received arrays plus what the site kept in its own state,
which never left it). Where the client half would score the model on its splits (``ClientRuntime.evaluate_splits``),
the model is handed to the caller instead. Nothing in the run folder is written: the site's state is read from a
copy.

A personalised method needs the site: ``--site`` names it (a name in the run's metrics, or ``partition-<id>``) and
its state is read from the run folder (a simulation) or from ``--state-dir`` (a SuperNode's node-config state-dir).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar
from unittest import mock

import numpy as np
import torch
from flwr.app import Context, RecordDict
from flwr.common.logger import log

from . import run_folder
from .config import ConfigError, ExperimentConfig, all_options
from .contract.checkpoint import Checkpointer, CheckpointError, PersonalState
from .contract.client import ClientRuntime, _cached_model
from .contract.nodes import NodeInfo
from .data import DataError, describe_source, source_task
from .models import ModelError
from .records import from_record
from .results import read_records, safe_name

T = TypeVar("T")
PARTITION = re.compile(r"partition-(\d+)")
STATE_OF_THE_ACCOUNTANT = ("dp-sgd",)  # PersonalState keys that hold no part of the model


class RunError(ValueError):
    """A run folder, site or site state that cannot give a model; the message says which and why."""


@dataclass(frozen=True)
class Site:
    """One site of a run: its name (as the run's records name it; None when unknown), its partition id among
    ``num_partitions`` (a simulation) and the folder of its own state (None: it has none here)."""

    name: str | None
    partition_id: int
    num_partitions: int
    state_dir: Path | None

    @property
    def label(self) -> str:
        return self.name or f"partition-{self.partition_id}"


class TrainedRun:
    """A run folder opened for its model: the run config, the newest valid checkpoint, the run's classes."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser()
        if not self.folder.is_dir():
            raise RunError(f"run folder {self.folder} does not exist (or is not a folder)")
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise RunError(
                f"{self.folder} is not a run folder: it has no config.json (a run folder is <output-dir>/<run-name>, "
                "written by the ServerApp)"
            )
        try:
            config = json.loads(config_path.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise RunError(f"{config_path} is not valid JSON: {err}") from None
        if not isinstance(config, dict):
            raise RunError(f"{config_path} is not a JSON object")
        self.resolved: dict[str, Any] = dict(config.pop("resolved", None) or {})
        known = {o.key for o in all_options()}
        if unknown := sorted(set(config) - known):
            log(
                WARNING, "[medflower] %s: ignoring run-config keys this version does not know: %s", config_path, unknown
            )
        # the site registry is the server's node-id mapping of a deployment: no part of the model
        run_config = {k: v for k, v in config.items() if k in known} | {"site-registry": ""}
        try:
            self.cfg = ExperimentConfig.from_run_config(run_config, check_paths=False)
        except (ConfigError, ValueError) as err:
            raise RunError(f"{config_path}: {err}") from None
        store = Checkpointer(self.folder / run_folder.CHECKPOINT)
        try:
            self.arrays, self.meta = store.load()
        except FileNotFoundError:
            raise RunError(
                f"{self.folder} has no checkpoint (checkpoint/round-NNNNNN/): the run did not finish a round, so "
                "there is no model to use"
            ) from None
        except CheckpointError as err:
            raise RunError(str(err)) from None
        self.checkpoint = store.loaded
        if self.meta.get("strategy") != self.cfg.strategy:
            raise RunError(
                f"{self.checkpoint} is a checkpoint of strategy {self.meta.get('strategy')!r}, but config.json "
                f"names {self.cfg.strategy!r}"
            )
        self.round = int(self.meta["completed_rounds"])
        self.run_uid = str(self.meta.get("run_uid", ""))  # names the run's folder below a SuperNode's state-dir

    # ------------------------------------------------------------------ what the run holds
    @functools.cached_property
    def records(self) -> list[dict[str, Any]]:
        return read_records(self.folder / run_folder.METRICS)

    @functools.cached_property
    def site_names(self) -> list[str]:
        """The sites that sent the server a training or evaluation record, in the order they first did."""
        names = (r.get("client") for r in self.records if r.get("kind") in ("train", "eval"))
        return list(dict.fromkeys(n for n in names if isinstance(n, str)))

    @functools.cached_property
    def summary(self) -> dict[str, Any] | None:
        path = self.folder / run_folder.SUMMARY_JSON
        try:
            return json.loads(path.read_text()) if path.is_file() else None
        except (ValueError, UnicodeDecodeError):
            return None

    @functools.cached_property
    def classes(self) -> tuple[int, list[str]]:
        """(number of classes or structures, their names), as the server read them when the run started."""
        cfg = self.cfg
        try:
            num = cfg.declared_num_classes or describe_source(cfg.data_spec())[0]
            return num, list(cfg.server_class_names(num))
        except (DataError, OSError) as err:
            raise RunError(
                f"the run's classes are named by its data source {cfg.dataset!r}, which cannot be read here: {err}"
            ) from None

    @property
    def num_classes(self) -> int:
        return self.classes[0]

    @property
    def class_names(self) -> list[str]:
        return self.classes[1]

    @property
    def task(self) -> str:
        return self.cfg.model_task

    def model_spec(self, task: str | None = None):
        """The run's ModelSpec for images (the frozen-encoder mode's model takes encoder outputs; this one the images
        themselves, with the same arrays)."""
        spec = self.cfg.model_spec(self.class_names)
        return dataclasses.replace(spec, task=task or self.task, encoded_inputs=False)

    @property
    def model_classes(self) -> int:
        return self.cfg.strategy_class.model_classes(self.num_classes)

    def strategy(self):
        """The strategy's server half with the checkpoint's state, as the run left it after its last round."""
        from .results import RunRecorder

        method = self.cfg.strategy_class
        initial = _cached_model(self.model_spec(), self.model_classes)[1]
        strategy = method(self.cfg, RunRecorder(self.folder), initial, self.num_classes)
        try:
            strategy.load_state(self.arrays, self.meta.get("strategy_meta", {}))
        except (ValueError, ModelError) as err:
            raise RunError(f"{self.checkpoint}: {err}") from None
        strategy.completed_rounds = self.round
        strategy.run_uid = self.run_uid
        return strategy

    # ------------------------------------------------------------------ sites
    def site(self, name: str | None = None, state_dir: str | Path | None = None) -> Site | None:
        """The site ``name`` names (a site of the run's records, or ``partition-<id>``), with its own state: in
        ``state_dir`` (a SuperNode's node-config state-dir, or one ``partition-<id>`` folder in it) when given, else
        in the run folder's ``client-state/``. None when neither is given (the global model)."""
        if state_dir is not None:
            return self._deployed_site(name, Path(state_dir).expanduser())
        if name is None:
            return None
        sites = self.site_names
        if match := PARTITION.fullmatch(name) or re.fullmatch(r"(\d+)", name):
            partition = int(match.group(1))
            total = max(len(sites), partition + 1)
            named = self._simulated_name(partition, total) if sites else None
            return Site(named, partition, total, self._state_folder(partition))
        if name not in sites:
            shown = ", ".join(sites) if sites else "none (metrics.jsonl names no site)"
            raise RunError(f"site {name!r} is not a site of the run in {self.folder}; its sites: {shown}")
        total = len(sites)
        for partition in range(total):
            if self._simulated_name(partition, total) == name:
                return Site(name, partition, total, self._state_folder(partition))
        raise RunError(
            f"site {name!r} is a site of the run but no partition of its data ({total} partitions) is named so here; "
            "give its partition as --site partition-<id>, or its own state with --state-dir"
        )

    def _simulated_name(self, partition: int, total: int) -> str | None:
        """The name a simulated site of partition ``partition`` of ``total`` gave itself (ClientRuntime.client)."""
        context = Context(
            run_id=0,
            node_id=partition + 1,
            node_config={"partition-id": partition, "num-partitions": total},
            state=RecordDict(),
            run_config={},
        )
        try:
            return ClientRuntime(self.cfg, context, {}, partition, total).client
        except (DataError, ConfigError, OSError) as err:
            log(WARNING, "[medflower] cannot name partition %d of %s: %s", partition, self.folder, err)
            return None

    def _state_folder(self, partition: int) -> Path | None:
        folder = run_folder.partition_state(self.folder, partition)
        return folder if folder.is_dir() else None

    @property
    def state_folder_name(self) -> str:
        """The run's folder below a SuperNode's state-dir: ``<run-name>-<run-uid>`` (``ClientRuntime.state_dir``)."""
        name = safe_name(self.folder.name) or "run"
        uid = safe_name(self.run_uid)
        return f"{name}-{uid}" if uid else name

    def _deployed_site(self, name: str | None, state_dir: Path) -> Site:
        """A SuperNode's site: its state below node-config state-dir (``<state-dir>/<run-name>/partition-<id>``)."""
        if not state_dir.is_dir():
            raise RunError(f"--state-dir {state_dir} does not exist (or is not a folder)")
        if PARTITION.fullmatch(state_dir.name):
            folders = [state_dir]
        else:
            run_folder = self.state_folder_name
            base = state_dir / run_folder if (state_dir / run_folder).is_dir() else state_dir
            folders = sorted(p for p in base.iterdir() if p.is_dir() and PARTITION.fullmatch(p.name))
        if not folders:
            raise RunError(
                f"--state-dir {state_dir}: no partition-<id>/ folder in it or in {state_dir / self.state_folder_name} "
                "(a SuperNode keeps a run's state in <node-config state-dir>/<run-name>-<run-uid>/partition-<id>/)"
            )
        wanted = None
        if name is not None and (match := PARTITION.fullmatch(name)):
            wanted = f"partition-{int(match.group(1))}"
        elif name is not None and len(folders) > 1:
            wanted = f"partition-{zlib.crc32(name.encode()) % 1_000_000}"  # a data-path site's default partition id
        chosen = [f for f in folders if wanted is None or f.name == wanted]
        if len(chosen) != 1:
            shown = ", ".join(f.name for f in folders)
            raise RunError(
                f"--state-dir {state_dir}: {'no' if not chosen else 'several'} site state folder(s) "
                f"{'for ' + repr(name) if name else ''} among {shown}; name one with --site partition-<id>"
            )
        folder = chosen[0]
        partition = int(PARTITION.fullmatch(folder.name).group(1))
        site_name = name if name is not None and not PARTITION.fullmatch(name) else None
        return Site(site_name, partition, 1, folder)


class SiteRuntime(ClientRuntime):
    """A ClientRuntime for one message at a site outside a run: the model is built from the run's own description
    (its classes and task, as the server read them) rather than from the site's data, which is read only when a
    client half asks for it; its state is a private copy of the site's."""

    run: TrainedRun
    site: Site | None
    state_copy: Path | None

    @functools.cached_property
    def _build(self):
        classes = int(self.config.get("model-classes") or self.config.get("num-classes") or self.run.model_classes)
        task = self.run.task
        if self.cfg.site_dataset_list:  # sites of several datasets: each site's own task
            task = source_task(
                self.cfg.data_spec(dataset=self.cfg.site_dataset(self.partition_id, self.num_partitions)[0])
            )
        spec = dataclasses.replace(self.run.model_spec(task), **self.model_overrides)
        return _cached_model(spec, classes)

    @property
    def client(self) -> str:
        return self.site.label if self.site is not None else "global"

    def state_dir(self) -> Path | None:
        return self.state_copy


@contextlib.contextmanager
def _watched_state_loads() -> Iterator[list[tuple[str, bool]]]:
    """Every PersonalState read while inside: (its key, whether it found a saved version)."""
    loads: list[tuple[str, bool]] = []
    original = PersonalState.load

    def load(self, before: int):
        found = original(self, before)
        loads.append((self.key, found is not None))
        return found

    with mock.patch.object(PersonalState, "load", load):
        yield loads


def per_site_server_model(run: TrainedRun, strategy) -> bool:
    """Whether the server sends each site its own arrays to evaluate (SGCA's aggregates, FedHCA2's models)."""
    names = run.site_names
    if len(names) < 2:
        return False
    seen = []
    for i, name in enumerate(names):
        strategy.nodes = {1: NodeInfo(1, i, name, 0)}
        content = strategy.evaluate_content(run.round, 1)
        arrays = from_record(content["arrays"]) if "arrays" in content.array_records else {}
        seen.append(arrays)
    first = seen[0]
    return any(list(a) != list(first) or any(not np.array_equal(a[k], first[k]) for k in a) for a in seen[1:])


def with_site_model(
    run: TrainedRun, site: Site | None, use: Callable[[torch.nn.Module, torch.device], T], device: str = "auto"
) -> T:
    """``use(model, device)`` on the site's model (the global one when ``site`` is None) as the strategy's client half
    assembles it for the run's last evaluation; returns what ``use`` returns. RunError when the model is per site
    and no site (or no state of it) is given, or when the strategy's sites evaluate with a routine of their own."""
    from .strategies.incremental.protocol import IncrementalClient

    cfg = run.cfg
    if issubclass(cfg.strategy_class.client_half, IncrementalClient):
        raise RunError(
            f"strategy {cfg.strategy!r} learns classes task by task: its sites score the classes seen so far through "
            "their own routing over the tasks' heads, not one model's outputs, which is what predict and export take"
        )
    strategy = run.strategy()
    if site is None and per_site_server_model(run, strategy):
        raise RunError(
            f"strategy {cfg.strategy!r} sends each site its own model (the server's per-site aggregate): pass --site "
            f"NAME (one of {', '.join(run.site_names)})"
        )
    name = site.label if site is not None else "global"
    strategy.nodes = {1: NodeInfo(1, site.partition_id if site else 0, name, 0)}
    content = strategy.evaluate_content(run.round, 1)
    config = dict(content["config"]) if "config" in content.config_records else {"round": run.round}
    node_config: dict[str, Any] = {"device": device}
    if site is not None:
        node_config.update({"partition-id": site.partition_id, "num-partitions": site.num_partitions})
    context = Context(run_id=0, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
    runtime = SiteRuntime(cfg, context, config, site.partition_id if site else 0, site.num_partitions if site else 1)
    runtime.run, runtime.site = run, site
    results: list[T] = []
    failed: list[BaseException] = []  # what ``use`` raised: the caller's error, passed on as it is

    def evaluate_splits(splits=("val", "test"), model: torch.nn.Module | None = None) -> dict[str, Any]:
        try:
            results.append(use(runtime.model if model is None else model, runtime.device))
        except BaseException as err:
            failed.append(err)
            raise
        return {}

    runtime.evaluate_splits = evaluate_splits  # where the client half would score its splits
    message = SimpleNamespace(
        content=content, metadata=SimpleNamespace(message_type="evaluate", group_id=str(run.round))
    )
    with tempfile.TemporaryDirectory(prefix="medflower-site-state-") as scratch:
        runtime.state_copy = None
        if site is not None and site.state_dir is not None:
            runtime.state_copy = Path(scratch) / "state"
            shutil.copytree(site.state_dir, runtime.state_copy)
        with _watched_state_loads() as loads:
            try:
                cfg.strategy_class.client_half(runtime).evaluate(message)
            except Exception as err:
                if failed:  # the caller's own error, whatever the client half made of it
                    raise failed[0] from None
                if isinstance(err, (RunError, ModelError)):
                    raise RunError(str(err)) from err
                # a client half that needs what is not here (its data, a file)
                raise RunError(
                    f"strategy {cfg.strategy!r} could not assemble the model of {name}: {type(err).__name__}: {err}"
                ) from err
    missing = sorted({key for key, found in loads if not found and key not in STATE_OF_THE_ACCOUNTANT})
    if missing:
        if site is None:
            raise RunError(
                f"strategy {cfg.strategy!r} keeps part of each site's model on the site ({', '.join(missing)}): pass "
                f"--site NAME (one of {', '.join(run.site_names) or 'the run sites'}), and --state-dir where that "
                "site's state is not in the run folder"
            )
        where = site.state_dir or run_folder.partition_state(run.folder, site.partition_id)
        raise RunError(
            f"site {name} has no saved {', '.join(missing)} state before round {run.round + 1} in {where}: it never "
            "trained in this run, or its state is elsewhere (--state-dir: the SuperNode's node-config state-dir)"
        )
    if not results:
        why = (
            "the server holds no model for it (a site that never trained in the run)"
            if "arrays" not in content.array_records and not missing
            else "its sites evaluate with a routine of their own, not one model's outputs"
        )
        raise RunError(f"strategy {cfg.strategy!r} gave {name} no model to predict with or export: {why}")
    return results[0]


def add_run_arguments(parser) -> None:
    """The options that name a trained model: the run folder, the site, and the site's own state folder."""
    parser.add_argument("--run", required=True, help="the run folder (<output-dir>/<run-name>)")
    parser.add_argument("--site", default=None, help="a site of the run (its name, or partition-<id>)")
    parser.add_argument(
        "--state-dir",
        default=None,
        help="the site's own state (a SuperNode's node-config state-dir), when not in --run",
    )
