"""What every strategy shares: messages per node, reply validation, checkpoints, byte counts.

Server half: ``FederatedStrategy`` drives the Grid directly (identify -> train -> aggregate
-> evaluate -> checkpoint, round by round). Methods override the hooks they need, or
``run_round`` for multi-phase protocols with custom actions.

Client half: ``ClientHalf`` receives one message with a ``ClientRuntime`` (config, the
site's data, the model, the device) and returns the reply's RecordDict. Whatever must
survive between rounds on a site goes into ``PersonalState`` (``context.state``, mirrored
to a local folder so a restarted site or a resumed run gets it back).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from safetensors.numpy import load_file, save_file

from ..config import ExperimentConfig
from ..data import ClientData, DataError, load_client_data, make_loader, site_data_spec
from ..data.tasks import parse_task_classes
from ..models import AdaptedModel, build_model
from ..results import RunRecorder
from ..training import OptimizerSpec, evaluate, pick_device, train_epochs
from ..training.metrics import CONFUSION, check_confusion, pooled_metrics

ArraySpec = Mapping[str, tuple[tuple[int, ...], str]]


# ----------------------------------------------------------------------------- arrays <-> records
def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """A fresh ArrayRecord (never share one between messages)."""
    record = ArrayRecord()
    for name, value in arrays.items():
        record[name] = Array(np.ascontiguousarray(value))
    return record


def from_record(record: ArrayRecord) -> "OrderedDict[str, np.ndarray]":
    return OrderedDict((name, record[name].numpy()) for name in record.keys())


def spec_of(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in arrays.items()}


def validate_arrays(arrays: Mapping[str, np.ndarray], expected: ArraySpec) -> str | None:
    """None if ``arrays`` has exactly the expected names, shapes, dtypes and finite values; else why not."""
    missing = [k for k in expected if k not in arrays]
    unexpected = [k for k in arrays if k not in expected]
    if missing or unexpected:
        return f"wrong array names (missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]})"
    for name, (shape, dtype) in expected.items():
        value = arrays[name]
        if tuple(value.shape) != tuple(shape):
            return f"array {name} has shape {tuple(value.shape)}, expected {tuple(shape)}"
        if str(value.dtype) != dtype:
            return f"array {name} has dtype {value.dtype}, expected {dtype}"
        if not np.isfinite(value).all():
            return f"array {name} has NaN/Inf values"
    return None


def weighted_mean(arrays: list[Mapping[str, np.ndarray]], weights: list[float]) -> "OrderedDict[str, np.ndarray]":
    """Σ_k w_k x_k / Σ_k w_k per array name, in float64, returned in the first reply's dtypes."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, first in arrays[0].items():
        acc = sum(wk * a[name].astype(np.float64) for wk, a in zip(w, arrays))
        out[name] = np.asarray(acc, dtype=first.dtype)
    return out


def stack_flat(replies: list[Mapping[str, np.ndarray]], spec: ArraySpec) -> np.ndarray:
    """[N, P] float32: row j is reply j's arrays of ``spec`` flattened in spec order (one copy, no temporaries)."""
    sizes = [int(np.prod(shape)) for shape, _ in spec.values()]
    out = np.empty((len(replies), sum(sizes)), dtype=np.float32)
    for j, arrays in enumerate(replies):
        offset = 0
        for name, size in zip(spec, sizes):
            out[j, offset:offset + size] = np.asarray(arrays[name]).ravel()
            offset += size
    return out


def unflatten(vector: np.ndarray, spec: ArraySpec) -> "OrderedDict[str, np.ndarray]":
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    offset = 0
    for name, (shape, dtype) in spec.items():
        size = int(np.prod(shape))
        out[name] = vector[offset:offset + size].reshape(shape).astype(dtype)
        offset += size
    return out


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers (run seed, round, partition, purpose)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


# ----------------------------------------------------------------------------- checkpoints
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

    def load(self) -> tuple["OrderedDict[str, np.ndarray]", dict[str, Any]]:
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


# ----------------------------------------------------------------------------- server half
@dataclass
class Reply:
    """One node's valid reply."""

    node_id: int
    client: str
    arrays: "OrderedDict[str, np.ndarray]"
    metrics: dict[str, float]
    config: dict[str, Any]

    @property
    def num_examples(self) -> float:
        return float(self.metrics.get("num-examples", 1.0))


@dataclass
class NodeInfo:
    node_id: int
    partition_id: int
    client: str
    num_train: int
    extra: dict[str, float] = field(default_factory=dict)  # the rest of its query reply (e.g. pfedmxf's n-frequency)


@dataclass
class RoundStats:
    bytes_down: int = 0
    bytes_up: int = 0
    failed: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    aggregation_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific fields of the round's server record


def _record_bytes(content: RecordDict) -> int:
    return sum(int(a.numpy().nbytes) for rec in content.array_records.values() for a in rec.values())


class FederatedStrategy:
    """Server half of a method; the default protocol is FedAvg-like rounds.

    Subclasses set ``name``, ``client_half`` and override ``train_content``,
    ``aggregate_train``, ``evaluate_content``, ``state``/``load_state`` or ``run_round``.
    """

    name: ClassVar[str] = ""
    client_half: ClassVar[type["ClientHalf"]]
    # Message actions beyond train/evaluate/query that the client half answers, e.g. ("train", "fedkei_inner").
    extra_actions: ClassVar[tuple[tuple[str, str], ...]] = ()
    round_label: ClassVar[str] = "round"  # what one iteration of ``run`` is called in the log ("task" for FedKEI)

    @classmethod
    def model_classes(cls, num_classes: int) -> int:
        """Output width of the model for a dataset with ``num_classes`` classes (the same, by default)."""
        return num_classes

    def __init__(self, cfg: ExperimentConfig, recorder: RunRecorder, initial: Mapping[str, np.ndarray], num_classes: int):
        self.cfg = cfg
        self.recorder = recorder
        self.num_classes = num_classes
        self.spec = spec_of(initial)
        self.global_arrays: OrderedDict[str, np.ndarray] = OrderedDict((k, v.copy()) for k, v in initial.items())
        self.completed_rounds = 0
        self.elapsed_s = 0.0
        self.nodes: dict[int, NodeInfo] = {}
        self.stats = RoundStats()
        self.checkpointer = Checkpointer(recorder.run_dir / "checkpoint")

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        """Arrays and JSON meta that define the strategy after a round."""
        return self.global_arrays, {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        problem = validate_arrays(arrays, self.spec) if arrays else None
        if problem:
            raise ValueError(f"checkpoint does not fit this model: {problem}")
        self.global_arrays = OrderedDict((k, np.array(v)) for k, v in arrays.items())

    def save_checkpoint(self) -> None:
        arrays, meta = self.state()
        self.checkpointer.save(arrays, {
            "strategy": self.name,
            "completed_rounds": self.completed_rounds,
            "elapsed_s": self.elapsed_s,
            "config": self.cfg.fingerprint(),
            "array_order": list(arrays),
            "strategy_meta": meta,
        })

    def restore(self, directory: Path) -> None:
        arrays, meta = Checkpointer(directory).load()
        if meta.get("strategy") != self.name:
            raise ValueError(f"checkpoint in {directory} is from strategy {meta.get('strategy')!r}, not {self.name!r}")
        differing = {k: (v, meta["config"].get(k)) for k, v in self.cfg.fingerprint().items() if meta["config"].get(k) != v}
        if differing:
            key, (now, then) = next(iter(differing.items()))
            raise ValueError(f"cannot resume: run-config '{key}' is {now!r} now but was {then!r} in {directory}")
        self.load_state(arrays, meta.get("strategy_meta", {}))
        self.completed_rounds = int(meta["completed_rounds"])
        self.elapsed_s = float(meta.get("elapsed_s", 0.0))
        log(INFO, "[medflower] resumed %s from %s after round %d", self.name, directory, self.completed_rounds)

    # ------------------------------------------------------------------ messaging
    def base_config(self, rnd: int, **extra: Any) -> ConfigRecord:
        return ConfigRecord({
            "round": rnd,
            "num-classes": self.num_classes,
            "model-classes": self.model_classes(self.num_classes),
            "run-name": self.recorder.run_dir.name,
            "state-dir": str((self.recorder.run_dir / "client-state").resolve()),
            **extra,
        })

    def exchange(
        self,
        grid: Grid,
        message_type: str,
        contents: Mapping[int, RecordDict],
        rnd: int,
        expect: ArraySpec | Callable[[int], ArraySpec] | None = None,
    ) -> list[Reply]:
        """Send one message per node, wait for replies, count bytes, log and drop failures.

        With ``expect`` (one spec, or a function of the node id when nodes send different shapes), a reply
        whose arrays do not match (names, shapes, dtypes, finite) is rejected: logged with its reason,
        counted in the round's metrics, left out.
        """
        messages = []
        for node_id, content in contents.items():
            self.stats.bytes_down += _record_bytes(content)
            messages.append(Message(content=content, dst_node_id=node_id, message_type=message_type, group_id=str(rnd)))
        if not messages:
            return []
        answered: set[int] = set()
        replies: list[Reply] = []
        for msg in grid.send_and_receive(messages, timeout=self.cfg.round_timeout):
            node_id = msg.metadata.src_node_id
            answered.add(node_id)
            client = self.client_name(node_id)
            if msg.has_error():
                reason = (msg.error.reason or "").strip().splitlines()
                reason_text = reason[-1] if reason else f"error code {msg.error.code}"
                log(WARNING, "[medflower] %s %d %s: %s failed: %s", self.round_label, rnd, message_type, client,
                    reason_text)
                self.stats.failed.append(f"{client}: {reason_text}")
                continue
            self.stats.bytes_up += _record_bytes(msg.content)
            arrays = from_record(msg.content["arrays"]) if "arrays" in msg.content.array_records else OrderedDict()
            metrics = dict(msg.content["metrics"]) if "metrics" in msg.content.metric_records else {}
            config = dict(msg.content["info"]) if "info" in msg.content.config_records else {}
            spec = expect(node_id) if callable(expect) else expect
            if spec is not None and (problem := validate_arrays(arrays, spec)):
                log(WARNING, "[medflower] %s %d %s: rejected reply of %s: %s", self.round_label, rnd, message_type, client,
                    problem)
                self.stats.rejected.append(f"{client}: {problem}")
                continue
            replies.append(Reply(node_id, client, arrays, metrics, config))
        for node_id in contents:
            if node_id not in answered:
                client = self.client_name(node_id)
                log(WARNING, "[medflower] %s %d %s: no reply from %s within %.0fs", self.round_label, rnd, message_type,
                    client, self.cfg.round_timeout)
                self.stats.failed.append(f"{client}: no reply")
        return replies

    def client_name(self, node_id: int) -> str:
        info = self.nodes.get(node_id)
        return info.client if info else f"node-{node_id}"

    def refresh_nodes(self, grid: Grid, rnd: int) -> None:
        """Ask nodes not seen before who they are (partition id, site name, training size)."""
        current = set(grid.get_node_ids())
        for gone in set(self.nodes) - current:
            log(WARNING, "[medflower] %s left the federation", self.nodes.pop(gone).client)
        unknown = sorted(current - set(self.nodes))
        if not unknown:
            return
        contents = {n: RecordDict({"config": self.base_config(rnd)}) for n in unknown}
        for reply in self.exchange(grid, "query", contents, rnd):
            info = NodeInfo(reply.node_id, int(reply.config["partition-id"]), str(reply.config["client"]),
                            int(reply.metrics.get("num-train", 0)), reply.metrics)
            self.nodes[reply.node_id] = info
            log(INFO, "[medflower] %s joined (partition %d, %d training samples)", info.client, info.partition_id,
                info.num_train)

    def ordered_nodes(self) -> list[int]:
        """Known nodes sorted by partition id (stable across runs, unlike node ids)."""
        return [n.node_id for n in sorted(self.nodes.values(), key=lambda n: (n.partition_id, n.client))]

    def sample_nodes(self, rnd: int) -> list[int]:
        """Seeded sample of ``fraction-train`` of the known nodes (by partition order)."""
        ordered = self.ordered_nodes()
        k = max(1, int(round(self.cfg.fraction_train * len(ordered))))
        if k >= len(ordered):
            return ordered
        rng = np.random.default_rng(derive_seed(self.cfg.seed, rnd, 17))
        return [ordered[i] for i in sorted(rng.choice(len(ordered), size=k, replace=False))]

    # ------------------------------------------------------------------ protocol
    def wait_for_nodes(self, grid: Grid) -> None:
        deadline = time.monotonic() + self.cfg.node_wait_timeout
        while len(list(grid.get_node_ids())) < self.cfg.min_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(list(grid.get_node_ids()))} nodes connected after "
                                   f"{self.cfg.node_wait_timeout:.0f}s; run-config 'min-nodes' = {self.cfg.min_nodes}")
            time.sleep(1.0)

    def task_class_order(self) -> list[int]:
        """The run's class order (``task-classes``) as the server sees it."""
        return parse_task_classes(self.cfg.task_classes, self.cfg.server_class_names(self.num_classes))

    def total_rounds(self) -> int:
        """Iterations of ``run``: num-rounds (FedKEI: the number of tasks)."""
        return self.cfg.num_rounds

    def summary_extra(self) -> dict[str, Any]:
        """Method-specific entries of summary.json (they may replace the default ``final``)."""
        return {}

    def run(self, grid: Grid) -> None:
        """Rounds completed_rounds+1 .. total_rounds(), a checkpoint after each."""
        self.wait_for_nodes(grid)
        for rnd in range(self.completed_rounds + 1, self.total_rounds() + 1):
            started = time.monotonic()
            self.stats = RoundStats()
            self.refresh_nodes(grid, rnd)
            if not self.nodes:
                raise RuntimeError(f"{self.round_label} {rnd}: no node answered; see the warnings above")
            self.run_round(grid, rnd)
            self.completed_rounds = rnd
            round_s = time.monotonic() - started
            self.elapsed_s += round_s
            self.recorder.log_server(rnd, bytes_down=self.stats.bytes_down, bytes_up=self.stats.bytes_up,
                                     failed=self.stats.failed, rejected=self.stats.rejected,
                                     num_failed=len(self.stats.failed), num_rejected=len(self.stats.rejected),
                                     aggregation_s=round(self.stats.aggregation_s, 4), round_s=round(round_s, 3),
                                     **self.stats.extra)
            self.save_checkpoint()
            log(INFO, "[medflower] %s %d/%d done in %.1fs: %s", self.round_label, rnd, self.total_rounds(), round_s,
                self.recorder.round_summary(rnd))

    def run_round(self, grid: Grid, rnd: int) -> None:
        selected = self.sample_nodes(rnd)
        contents = {n: self.train_content(rnd, n) for n in selected}
        replies = self.exchange(grid, "train", contents, rnd, expect=self.reply_spec)
        for reply in replies:
            self.recorder.log_client(rnd, reply.client, "train", reply.metrics)
        started = time.monotonic()
        if replies:
            self.aggregate_train(rnd, replies)
        else:
            log(WARNING, "[medflower] round %d: no valid training reply; the model is unchanged", rnd)
        self.stats.aggregation_s += time.monotonic() - started
        contents = {n: self.evaluate_content(rnd, n) for n in self.ordered_nodes()}
        self.record_evaluation(rnd, self.exchange(grid, "evaluate", contents, rnd))

    def record_evaluation(self, rnd: int, replies: list[Reply]) -> None:
        """Log each site's evaluation and put the pooled metrics of the round into its server record.

        Pooled: the sum of the valid ``confusion`` counts of the sites that answered, i.e. the metric on the
        union of their test splits (SiFT reports balanced accuracy on one pooled test set). Counts are untrusted:
        a malformed one is logged, counted as rejected and left out; the site's other metrics are kept.
        """
        width = self.model_classes(self.num_classes)
        total, sites = np.zeros((width, width), dtype=np.int64), 0
        for reply in replies:
            metrics = dict(reply.metrics)
            if CONFUSION in metrics:
                counts, problem = check_confusion(metrics[CONFUSION], width, metrics.get("n"))
                if problem:
                    log(WARNING, "[medflower] %s %d evaluate: ignored the counts of %s: %s", self.round_label, rnd,
                        reply.client, problem)
                    self.stats.rejected.append(f"{reply.client}: {problem}")
                    del metrics[CONFUSION]
                else:
                    total, sites = total + counts, sites + 1
            self.recorder.log_client(rnd, reply.client, "eval", metrics)
        if total.sum() > 0:
            self.stats.extra.update(pooled_metrics(total), pooled_sites=sites)

    def reply_spec(self, node_id: int) -> ArraySpec | None:
        """Arrays node ``node_id``'s training reply must carry (the same for every node, by default)."""
        return self.spec

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        return RecordDict({"arrays": to_record(self.global_arrays), "config": self.base_config(rnd)})

    def evaluate_content(self, rnd: int, node_id: int) -> RecordDict:
        return RecordDict({"arrays": to_record(self.global_arrays), "config": self.base_config(rnd)})

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        self.global_arrays = weighted_mean([r.arrays for r in replies], [r.num_examples for r in replies])


# ----------------------------------------------------------------------------- client half
@functools.lru_cache(maxsize=8)
def _cached_data(spec, partition_id: int, num_partitions: int) -> ClientData:
    return load_client_data(spec, partition_id, num_partitions)


@functools.lru_cache(maxsize=2)
def _cached_model(spec, num_classes: int) -> tuple[AdaptedModel, "OrderedDict[str, np.ndarray]"]:
    """A deterministic build and its initial trainable arrays (every handler sets all trainable
    arrays before use, so reusing the object across messages is a cache, not state)."""
    model = build_model(spec, num_classes)
    return model, model.get_trainable()


@dataclass
class ClientRuntime:
    """Everything a client half needs for one message on one site."""

    cfg: ExperimentConfig
    context: Context
    config: dict[str, Any]
    partition_id: int
    num_partitions: int
    data_path: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)  # ModelSpec fields a client half sets per site

    @classmethod
    def from_message(cls, message: Message, context: Context) -> "ClientRuntime":
        """Site identity from the node config: its own ``data-path``, or a ``partition-id`` of shared data."""
        cfg = ExperimentConfig.from_run_config(context.run_config, check_paths=False)
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
            raise DataError(f"node-config needs data-path, or partition-id and num-partitions (got {dict(node)})")
        return cls(cfg, context, config, int(node["partition-id"]), int(node["num-partitions"]))

    @property
    def round(self) -> int:
        return int(self.config.get("round", 0))

    @functools.cached_property
    def data(self) -> ClientData:
        if self.data_path is not None:
            base = self.cfg.data_spec(dataset="synthetic")  # only the split/resize settings are used
            data = _cached_data(site_data_spec(base, self.data_path), 0, 1)
        else:
            dataset, index, count = self.cfg.site_dataset(self.partition_id, self.num_partitions)
            data = _cached_data(self.cfg.data_spec(dataset=dataset), index, count)
        expected = int(self.config.get("num-classes") or data.num_classes)
        if data.num_classes > expected:
            raise DataError(f"{self.data_path or self.cfg.dataset}: this site has {data.num_classes} classes "
                            f"but the run's model has {expected} (run-config num-classes)")
        task = getattr(data, "task", "classification")
        if task != self.cfg.model_task and not self.cfg.site_dataset_list:
            raise DataError(f"{self.data_path or self.cfg.dataset}: this site holds {task} data but the run "
                            f"trains a {self.cfg.model_task} model (run-config task)")
        return data

    @functools.cached_property
    def _build(self) -> tuple[AdaptedModel, "OrderedDict[str, np.ndarray]"]:
        num_classes = int(self.config.get("model-classes") or self.config.get("num-classes") or self.data.num_classes)
        spec = dataclasses.replace(self.cfg.model_spec(self.data.class_names),
                                   **{"task": self.data.task, **self.model_overrides})
        return _cached_model(spec, num_classes)

    @property
    def model(self) -> AdaptedModel:
        return self._build[0]

    @property
    def initial_arrays(self) -> "OrderedDict[str, np.ndarray]":
        """The seeded initial trainable arrays, identical on every site and on the server."""
        return self._build[1]

    @functools.cached_property
    def device(self) -> torch.device:
        return pick_device(self.cfg.device)

    @property
    def client(self) -> str:
        node = self.context.node_config
        if self.cfg.site_dataset_list and not node.get("site-name"):
            return f"client-{self.partition_id}"  # sites of different datasets would share source site names
        return str(node.get("site-name") or self.data.site or f"client-{self.partition_id}")

    def seed(self, purpose: int = 0) -> int:
        return derive_seed(self.cfg.seed, self.round, self.partition_id, purpose)

    def loader(self, split: str, shuffle: bool = False, batch_size: int | None = None) -> torch.utils.data.DataLoader:
        return make_loader(getattr(self.data, split), batch_size or self.cfg.batch_size, shuffle, self.seed(1))

    def optimizer(self) -> OptimizerSpec:
        """The run's optimizer at this round's learning rate, lr * lr-decay^(round-1)."""
        lr = self.cfg.lr * self.cfg.lr_decay ** max(self.round - 1, 0)
        return OptimizerSpec(self.cfg.optimizer, lr, self.cfg.momentum, self.cfg.weight_decay)

    def train_local(self, extra_loss=None, optimizer: OptimizerSpec | None = None,
                    batch_size: int | None = None, model: torch.nn.Module | None = None) -> dict[str, float]:
        """``local-epochs`` of the site's training split on ``model`` (default: the site's model), seeded per site
        and round."""
        torch.manual_seed(self.seed(2))
        return train_epochs(self.model if model is None else model, self.loader("train", shuffle=True, batch_size=batch_size),
                            epochs=self.cfg.local_epochs, optimizer=optimizer or self.optimizer(), device=self.device,
                            extra_loss=extra_loss)

    def evaluate_splits(self, splits: Iterable[str] = ("val", "test"),
                        model: torch.nn.Module | None = None) -> dict[str, Any]:
        """Metrics of ``model`` (default: the site's model): test metrics unprefixed, others as '<split>_<metric>'.

        A classification site also sends its test split's confusion counts (``confusion``, C×C ints) for the
        server's pooled metrics, unless the sites hold different datasets (``site-datasets``: no shared labels).
        """
        out: dict[str, Any] = {}
        for split in splits:
            if len(getattr(self.data, split)) == 0:
                continue
            metrics = evaluate(self.model if model is None else model, self.loader(split), self.device, self.data.class_names,
                               confusion=split == "test" and not self.cfg.site_dataset_list)
            out.update({(k if split == "test" else f"{split}_{k}"): v for k, v in metrics.items()})
        return out

    def state_dir(self) -> Path | None:
        """Folder for this site's persistent state: node-config 'state-dir', else the server's suggestion."""
        base = self.context.node_config.get("state-dir") or self.config.get("state-dir")
        if not base:
            return None
        run_name = str(self.config.get("run-name", "run"))
        sub = Path(str(base)) / run_name if self.context.node_config.get("state-dir") else Path(str(base))
        return sub / f"partition-{self.partition_id}"


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
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata={"order": json.dumps(list(arrays))})
        os.replace(tmp, folder / f"round-{rnd}.safetensors")
        for old in sorted(self._saved_rounds())[: -self.keep]:
            (folder / f"round-{old}.safetensors").unlink(missing_ok=True)

    def _saved_rounds(self) -> list[int]:
        folder = self._dir()
        if folder is None or not folder.is_dir():
            return []
        return [int(p.name[len("round-"):-len(".safetensors")]) for p in folder.glob("round-*.safetensors")]

    def load(self, before: int) -> "OrderedDict[str, np.ndarray] | None":
        state = self.rt.context.state
        if self.key in state.array_records and f"{self.key}-meta" in state.config_records:
            if int(state[f"{self.key}-meta"]["round"]) < before:
                return from_record(state[self.key])
        candidates = [r for r in self._saved_rounds() if r < before]
        if not candidates:
            return None
        from safetensors import safe_open

        path = self._dir() / f"round-{max(candidates)}.safetensors"
        with safe_open(str(path), framework="numpy") as f:
            order = json.loads((f.metadata() or {}).get("order", "[]")) or list(f.keys())
            return OrderedDict((k, f.get_tensor(k)) for k in order)


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
        return self.reply(metrics={"num-train": len(self.rt.data.train)})

    def train(self, message: Message) -> RecordDict:
        raise NotImplementedError

    def evaluate(self, message: Message) -> RecordDict:
        if "arrays" in message.content.array_records:
            self.rt.model.set_trainable(from_record(message.content["arrays"]))
        metrics = self.rt.evaluate_splits()
        return self.reply(metrics=metrics)

    def reply(self, arrays: Mapping[str, np.ndarray] | None = None, metrics: Mapping[str, Any] | None = None) -> RecordDict:
        content = RecordDict({
            "metrics": MetricRecord({k: _metric_list(v) if isinstance(v, (list, tuple)) else float(v)
                                     for k, v in (metrics or {}).items()}),
            "info": ConfigRecord({"partition-id": self.rt.partition_id, "client": self.rt.client}),
        })
        if arrays is not None:
            content["arrays"] = to_record(arrays)
        return content
