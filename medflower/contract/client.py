"""The client runtime every strategy shares: one message on one site, its data, model, device and replies.

``ClientHalf`` receives one message with a ``ClientRuntime`` (config, the site's data, the model, the device) and
returns the reply's RecordDict. Whatever must survive between rounds on a site goes into ``PersonalState``
(``medflower/contract/checkpoint.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from .. import profiling
from ..data import (
    ClientData,
    DataError,
    SiteClasses,
    check_data_roots,
    load_client_data,
    load_site_data,
    make_loader,
)
from ..data.encoded import BoxPrompts, encoded, module_digest
from ..data.roots import check_model_paths, in_simulation
from ..models import AdaptedModel, build_model
from ..privacy.dp_sgd import PrivateTraining, dp_sgd_epsilon
from ..records import derive_seed, from_record, to_record
from ..results import few_steps_message, safe_name
from ..training import DeviceError, OptimizerSpec, evaluate, pick_device, train_epochs
from .checkpoint import PersonalState

if TYPE_CHECKING:
    from ..settings import RunSettings


@functools.lru_cache(maxsize=8)
def _cached_data(spec, partition_id: int, num_partitions: int) -> ClientData:
    return load_client_data(spec, partition_id, num_partitions)


@functools.lru_cache(maxsize=2)
def _cached_model(spec, num_classes: int) -> tuple[AdaptedModel, OrderedDict[str, np.ndarray]]:
    """A deterministic build and its initial trainable arrays (every handler sets all trainable
    arrays before use, so reusing the object across messages is a cache, not state)."""
    model = build_model(spec, num_classes)
    return model, model.get_trainable()


def model_inputs(raw: ClientData, model: AdaptedModel, cache_dir: str, batch_size: int, device) -> ClientData:
    """``raw``'s splits as ``model`` takes them (``ClientRuntime.data``): the frozen-encoder outputs are encoded once
    and then read from the site's cache folder (or this process's memory, data/encoded.py)."""
    splits = {}
    identity = None
    if model.spec.encoded_inputs:
        identity = (type(model).__name__, module_digest(model.backbone), model.input_norm_name, model.spec.img_size)
    was_training = model.training
    model.to(device).eval()  # the frozen encoder's function: BatchNorm's running statistics, TinyViT's cached biases
    try:
        for split in ("train", "val", "test"):
            dataset = getattr(raw, split)
            if identity is not None and len(dataset):
                dataset = encoded(
                    dataset,
                    model.encode,
                    identity=identity,
                    cache_dir=cache_dir,
                    batch_size=batch_size,
                    device=device,
                    what=raw.site or f"partition {raw.partition_id}",
                )
            if model.spec.sam_prompt == "box":
                dataset = BoxPrompts(dataset, raw.num_classes)
            splits[split] = dataset
    finally:
        model.train(was_training)
    return dataclasses.replace(raw, **splits)


@dataclass
class ClientRuntime:
    """Everything a client half needs for one message on one site."""

    cfg: RunSettings
    context: Context
    config: dict[str, Any]
    partition_id: int
    num_partitions: int
    data_path: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)  # ModelSpec fields a client half sets per site

    @classmethod
    def from_message(cls, message: Message, context: Context, cfg: RunSettings) -> ClientRuntime:
        """Site identity from the node config: its own ``data-path``, or a ``partition-id`` of shared data."""
        node = context.node_config
        config = dict(message.content["config"]) if "config" in message.content.config_records else {}
        data_path = str(node["data-path"]) if node.get("data-path") else None
        if data_path is None and cfg.dataset == "site":
            raise DataError("run-config dataset='site' but this SuperNode's node-config has no data-path")
        if data_path is not None:
            # A stable id for seeds and ordering when the site does not give one.
            name = str(node.get("site-name") or data_path)
            partition_id = int(node.get("partition-id", zlib.crc32(name.encode()) % 1_000_000))
            return cls(cfg, context, config, partition_id, 1, data_path)
        if "partition-id" not in node or "num-partitions" not in node:
            raise DataError(
                "node-config needs data-path, or partition-id and num-partitions "
                f"(it sets {', '.join(sorted(node)) or 'nothing'})"
            )
        return cls(cfg, context, config, int(node["partition-id"]), int(node["num-partitions"]))

    @property
    def round(self) -> int:
        return int(self.config.get("round", 0))

    def at_round(self, rnd: int) -> ClientRuntime:
        """A copy of this runtime for round ``rnd``: the same site, with a config of its own that says round ``rnd``
        (seeds, learning rate, per-site state versions and pictures follow it); this runtime is left as it is. What
        this runtime has loaded so far (data, model, device) the copy shares; ``keep_loaded`` takes back what the
        copy loads later."""
        copied = copy.copy(self)
        copied.config = {**self.config, "round": rnd}
        return copied

    def keep_loaded(self, other: ClientRuntime) -> None:
        """Take the site's data, model and device that ``other`` (a copy from ``at_round``) loaded and this runtime
        has not, so that one message loads them once: they do not depend on the round."""
        for name in _LOADED_ONCE:
            if name in vars(other) and name not in vars(self):
                vars(self)[name] = vars(other)[name]

    @functools.cached_property
    def raw_data(self) -> ClientData:
        """The site's data. Its own ``data-path``: all of it, labels mapped onto the run's classes (run-config
        class-names, else indices 0..num-classes-1; docs/data.md#class-names-for-site-data). Else its part of the
        data the run config names, read only below node-config ``data-roots`` (docs/data.md#data-roots)."""
        with profiling.phase("data"):
            return self._load_data()

    @functools.cached_property
    def data(self) -> ClientData:
        """The site's data as its model takes it: ``raw_data``, or in the frozen-encoder mode its splits' encoder
        outputs (computed once, kept in the site's cache folder), and with box prompts the splits marked to carry
        their masks' boxes (docs/models.md#litemedsam)."""
        if self.cfg.frozen_encoder_mode != "on" and self.cfg.sam_prompt != "box":
            return self.raw_data  # the images themselves: no model needed to say so
        with profiling.phase("data"):
            return model_inputs(self.raw_data, self.model, self.cache_dir(), self.cfg.batch_size, self.device)

    def _load_data(self) -> ClientData:
        if self.data_path is not None:
            base = self.cfg.data_spec(dataset="synthetic", cache_dir=self.cache_dir())  # split/resize/read settings
            classes = SiteClasses(
                int(self.config.get("num-classes") or self.cfg.declared_num_classes), tuple(self.cfg.class_name_list)
            )
            task = None if self.cfg.site_dataset_list else self.cfg.model_task
            return load_site_data(base, self.data_path, classes, task)
        dataset, index, count = self.cfg.site_dataset(self.partition_id, self.num_partitions)
        spec = self.cfg.data_spec(dataset=dataset, cache_dir=self.cache_dir())
        check_data_roots(spec, self.context.node_config)  # before any file of the run config's is opened
        data = _cached_data(spec, index, count)
        expected = int(self.config.get("num-classes") or data.num_classes)
        if data.num_classes > expected:
            raise DataError(
                f"{self.cfg.dataset}: this site has {data.num_classes} classes "
                f"but the run's model has {expected} (run-config num-classes)"
            )
        task = getattr(data, "task", "classification")
        if task != self.cfg.model_task and not self.cfg.site_dataset_list:
            raise DataError(
                f"{self.cfg.dataset}: this site holds {task} data but the run "
                f"trains a {self.cfg.model_task} model (run-config task)"
            )
        return data

    @functools.cached_property
    def _build(self) -> tuple[AdaptedModel, OrderedDict[str, np.ndarray]]:
        data = self.raw_data
        num_classes = int(self.config.get("model-classes") or self.config.get("num-classes") or data.num_classes)
        spec = dataclasses.replace(self.cfg.model_spec(data.class_names), **{"task": data.task, **self.model_overrides})
        check_model_paths(spec, self.context.node_config)  # before the model's files are opened
        with profiling.phase("model"):
            return _cached_model(spec, num_classes)

    @property
    def model(self) -> AdaptedModel:
        return self._build[0]

    @property
    def initial_arrays(self) -> OrderedDict[str, np.ndarray]:
        """The seeded initial trainable arrays, identical on every site and on the server."""
        return self._build[1]

    @functools.cached_property
    def device(self) -> torch.device:
        """node-config ``device`` (this SuperNode's choice, e.g. ``cuda:1``), else run-config ``device``; one this site
        lacks is refused with a DeviceError naming the node and the devices it has
        (docs/deployment.md#devices-and-gpus)."""
        name = self.context.node_config.get("device") or self.cfg.device
        try:
            return pick_device(str(name))
        except DeviceError as err:
            node = self.context.node_config.get("site-name") or f"partition {self.partition_id}"
            raise DeviceError(f"node {self.context.node_id} ({node}): {err}") from None

    def loader_options(self, shuffle: bool) -> dict[str, Any]:
        """On CUDA: pinned batches, and node-config ``loader-workers`` worker processes (default min(4, cores - 1))
        for loaders that draw no augmentation (a worker would repeat another's draws); single-process elsewhere."""
        if self.device.type != "cuda":
            return {}
        raw = self.context.node_config.get("loader-workers", max(min(4, (os.cpu_count() or 1) - 1), 0))
        if not str(raw).isdigit():
            raise DataError(f"node-config loader-workers = {raw!r}: a whole number of processes >= 0, e.g. 4")
        augmented = shuffle and bool(getattr(self.data.train, "augment", ""))
        return {"pin_memory": True, "workers": 0 if augmented else int(raw)}

    @property
    def client(self) -> str:
        node = self.context.node_config
        if self.cfg.site_dataset_list and not node.get("site-name"):
            return f"client-{self.partition_id}"  # sites of different datasets would share source site names
        return str(node.get("site-name") or self.raw_data.site or f"client-{self.partition_id}")

    def seed(self, purpose: int = 0) -> int:
        return derive_seed(self.cfg.seed, self.round, self.partition_id, purpose)

    def loader(self, split: str, shuffle: bool = False, batch_size: int | None = None) -> torch.utils.data.DataLoader:
        dataset = getattr(self.data, split)
        return make_loader(
            dataset, batch_size or self.cfg.batch_size, shuffle, self.seed(1), **self.loader_options(shuffle)
        )

    def optimizer(self) -> OptimizerSpec:
        """The run's optimizer at this round's learning rate, lr * lr-decay^(round-1)."""
        lr = self.cfg.lr * self.cfg.lr_decay ** max(self.round - 1, 0)
        return OptimizerSpec(self.cfg.optimizer, lr, self.cfg.momentum, self.cfg.weight_decay)

    def train_local(
        self,
        extra_loss=None,
        optimizer: OptimizerSpec | None = None,
        batch_size: int | None = None,
        model: torch.nn.Module | None = None,
        max_steps: int | None = None,
    ) -> dict[str, float]:
        """``local-epochs`` of the site's training split (or ``local-steps`` steps, or ``max_steps``) on ``model``
        (default: the site's model), seeded per site and round; with run-config dp-sgd, DP-SGD steps and the site's ε
        so far (``dp_sgd_epsilon``)."""
        torch.manual_seed(self.seed(2))
        private = PrivateTraining.from_config(self.cfg)
        loader = self.loader("train", shuffle=True, batch_size=batch_size)
        self.say_if_small(len(loader), batch_size or self.cfg.batch_size)
        with profiling.phase("train"):
            metrics = train_epochs(
                self.model if model is None else model,
                loader,
                epochs=self.cfg.local_epochs,
                max_steps=self.cfg.local_steps if max_steps is None else max_steps,
                optimizer=optimizer or self.optimizer(),
                device=self.device,
                extra_loss=extra_loss,
                private=private,
                precision=self.cfg.precision,
            )
        if private is not None:
            metrics["dp_sgd_epsilon"] = self.account_dp_sgd(private)
        return metrics

    def say_if_small(self, steps: int, batch_size: int) -> None:
        """Log once per site (and batch size) when its training split gives fewer than a handful of optimizer steps
        per epoch: how many, and what batch size would give more."""
        n = len(self.data.train)
        run = f"{self.context.run_id}:{self.config.get('state-dir') or self.config.get('run-name', '')}"
        key = (run, self.client, n, batch_size)
        if key in _SAID_SMALL or not (message := few_steps_message(n, steps, batch_size)):
            return
        _SAID_SMALL.add(key)
        log(WARNING, "[medflower] this site (%s) is small: %s", self.client, message)

    def account_dp_sgd(self, private: PrivateTraining) -> float:
        """The site's DP-SGD steps so far (kept in its state, so a restarted site goes on counting) and their ε."""
        state = self.personal_state("dp-sgd")
        before = state.load(before=self.round + 1)  # this round's earlier training calls count too
        steps = int(before["steps"][0]) if before is not None else 0
        steps += private.steps
        state.save(self.round, {"steps": np.array([steps], dtype=np.int64)})
        return dp_sgd_epsilon(private.noise_multiplier, private.sample_rate, steps, self.cfg.dp_delta)

    def evaluate_splits(
        self, splits: Iterable[str] = ("val", "test"), model: torch.nn.Module | None = None
    ) -> dict[str, Any]:
        """Metrics of ``model`` (default: the site's model): test metrics unprefixed, others as '<split>_<metric>'.

        A classification site also sends its test split's confusion counts (``confusion``, C×C ints) for the
        server's pooled metrics, unless the sites hold different datasets (``site-datasets``: no shared labels).
        A segmentation site scores structures its ground truth lacks by run-config ``empty-masks``. With the test
        split, at the first and the last round, the site also draws ``model`` on a few test images (``write_figure``).
        """
        out: dict[str, Any] = {}
        for split in splits:
            if len(getattr(self.data, split)) == 0:
                continue
            with profiling.phase("evaluate"):
                metrics = evaluate(
                    self.model if model is None else model,
                    self.loader(split),
                    self.device,
                    self.data.class_names,
                    confusion=split == "test" and not self.cfg.site_dataset_list,
                    empty_masks=self.cfg.empty_masks,
                    precision=self.cfg.precision,
                )
            out.update({(k if split == "test" else f"{split}_{k}"): v for k, v in metrics.items()})
        if "test" in splits:
            self.write_figure(self.model if model is None else model)
        return out

    def write_figure(self, model: torch.nn.Module) -> Path | None:
        """At the first and the last round, a picture of ``model``'s predictions on the first run-config
        ``site-figures`` images of the site's test split (contours of ground truth and prediction per structure; a
        classifier's class and probability), written into the site's own ``figures_dir`` and never sent. A picture
        that cannot be drawn is logged, never an evaluation error. Returns the file written, if any."""
        count = int(self.cfg.site_figures)
        if count <= 0 or self.round not in (1, self.cfg.num_rounds) or len(self.data.test) == 0:
            return None
        folder = self.figures_dir()
        if folder is None:
            return None
        from ..figures import sample_figure_name, write_site_figure

        path = folder / sample_figure_name(self.round)
        try:
            with profiling.phase("evaluate"):
                write_site_figure(
                    model,
                    self.raw_data.test,
                    self.loader("test", batch_size=min(count, len(self.data.test))),
                    self.device,
                    self.cfg.precision,
                    self.data.class_names,
                    path,
                    f"{self.client}: round {self.round} of {self.cfg.num_rounds}",
                )
        except Exception as err:  # a picture is never worth an evaluation
            log(
                WARNING,
                "[medflower] site %s: no picture of round %d (%s: %s)",
                self.client,
                self.round,
                type(err).__name__,
                err,
            )
            return None
        return path

    def cache_dir(self) -> str:
        """This site's decoded-image cache folder (docs/data.md#decoded-image-cache): node-config ``cache-dir``
        ('' turns the disk cache off), else the environment's ``MEDFLOWER_CACHE_DIR``, else
        ``$XDG_CACHE_HOME/medflower`` (``~/.cache/medflower``). The server never chooses it."""
        node = self.context.node_config
        if "cache-dir" in node:
            return str(node["cache-dir"])
        if os.environ.get("MEDFLOWER_CACHE_DIR") is not None:
            return os.environ["MEDFLOWER_CACHE_DIR"]
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "medflower")

    def state_dir(self) -> Path | None:
        """Folder for this site's persistent state: node-config 'state-dir' (a folder per run below it, named by the
        run's name and identity: ``<run-name>-<run-uid>``, so same-named runs never share it and a resumed run finds
        its own), else, in a simulation, the server's suggestion (its run folder's client-state/). A SuperNode never
        writes where the server says: without node-config state-dir its state lives in memory only (lost when it
        restarts)."""
        node_dir = self.context.node_config.get("state-dir")
        if node_dir:
            return Path(str(node_dir)) / self.run_folder_name() / f"partition-{self.partition_id}"
        if self.config.get("state-dir") and in_simulation():
            return Path(str(self.config["state-dir"])) / f"partition-{self.partition_id}"
        return None

    def personal_state(self, key: str) -> PersonalState:
        """This site's versioned state ``key`` (in its context and, with a state folder, on its disk)."""
        return PersonalState(self, key=key)

    def run_folder_name(self) -> str:
        """This run's folder below a site's own folders (node-config state-dir, figures-dir): the run's name and
        identity, ``<run-name>-<run-uid>``."""
        run_name = safe_name(str(self.config.get("run-name", "run"))) or "run"
        run_uid = safe_name(str(self.config.get("run-uid", "")))
        return f"{run_name}-{run_uid}" if run_uid else run_name

    def figures_dir(self) -> Path | None:
        """Folder for this site's pictures of its own test images (``write_figure``): node-config ``figures-dir``
        (a folder per run and site below it, ``<run-name>-<run-uid>/<site>/``; '' = none), else, in a simulation,
        the server's run folder's ``sites/<site>/`` (the folder the server suggests for client state, whose parent
        is the run folder). A SuperNode without node-config figures-dir writes no picture: its images never leave
        it, and it never writes where the server says."""
        node = self.context.node_config
        site = safe_name(self.client) or f"client-{self.partition_id}"
        if "figures-dir" in node:
            node_dir = str(node["figures-dir"])
            return Path(node_dir) / self.run_folder_name() / site if node_dir else None
        if self.config.get("state-dir") and in_simulation():
            return Path(str(self.config["state-dir"])).parent / "sites" / site
        return None


# ClientRuntime's cached properties: what one message loads once, the same whatever round the runtime says
_LOADED_ONCE = ("raw_data", "data", "_build", "device")
_SAID_SMALL: set[tuple[str, str, int, int]] = set()  # (run, site, ...) this process has told about


def defined_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` without those undefined on the site's data (NaN or infinite: AUC of a split holding one class, a
    mean over nothing): left out of the reply rather than sent, since the server refuses a reply with a non-finite
    number; the summary counts the sites each metric was computed on."""
    return {
        k: v for k, v in metrics.items() if (all(_finite(x) for x in v) if isinstance(v, (list, tuple)) else _finite(v))
    }


def _finite(value: Any) -> bool:
    return not isinstance(value, (int, float, np.number)) or math.isfinite(value)


def _metric_list(values: list | tuple) -> list[int] | list[float]:
    """A list metric as MetricRecord takes it: ints stay ints (counts), anything else becomes float."""
    if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in values):
        return [int(x) for x in values]
    return [float(x) for x in values]


class ClientHalf:
    """Client half of a method: one method per message category (and custom actions)."""

    def __init__(self, runtime: ClientRuntime):
        self.rt = runtime

    def query(self, message: Message) -> RecordDict:
        """Who this site is; nothing about its data but the number of training samples."""
        return self.reply(metrics={"num-train": len(self.rt.raw_data.train)})

    def train(self, message: Message) -> RecordDict:
        raise NotImplementedError

    def evaluate(self, message: Message) -> RecordDict:
        if "arrays" in message.content.array_records:
            self.rt.model.set_trainable(from_record(message.content["arrays"]))
        metrics = self.rt.evaluate_splits()
        return self.reply(metrics=metrics)

    def train_after_evaluating(self, message: Message) -> RecordDict:
        """run-config evaluate-in-train, rounds after the first: ``evaluate`` the message as the previous round's
        evaluate message (the same arrays, that round's number), then ``train``; the training reply carries the
        evaluation metrics in its ``evaluation`` record. Leaves a site: what ``train`` and ``evaluate`` send.

        ``evaluate`` sees a copy of the runtime for the previous round (``ClientRuntime.at_round``) as ``self.rt``;
        the runtime the message built, which the site app reads after the reply too, never changes its round. The
        half stays the same object, so what ``evaluate`` keeps on it for ``train`` (FedALA's ALA) is kept."""
        runtime = self.rt
        previous = runtime.at_round(runtime.round - 1)
        self.rt = previous
        try:
            evaluation = self.evaluate(message)["metrics"]
        finally:
            self.rt = runtime
        runtime.keep_loaded(previous)
        content = self.train(message)
        content["evaluation"] = evaluation
        return content

    def reply(
        self, arrays: Mapping[str, np.ndarray] | None = None, metrics: Mapping[str, Any] | None = None
    ) -> RecordDict:
        content = RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        k: _metric_list(v) if isinstance(v, (list, tuple)) else float(v)
                        for k, v in defined_metrics(metrics or {}).items()
                    }
                ),
                "info": ConfigRecord({"partition-id": self.rt.partition_id, "client": self.rt.client}),
            }
        )
        if arrays is not None:
            content["arrays"] = to_record(arrays)
        return content
