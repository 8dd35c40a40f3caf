"""The server loop every strategy shares: nodes, messages, reply validation, rounds, checkpoints, byte counts.

``FederatedStrategy`` drives the Grid directly (identify -> train -> aggregate -> evaluate -> checkpoint, round
by round). Methods override the hooks they need, or ``run_round`` for multi-phase protocols with custom actions.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from .. import run_folder
from ..data.tasks import parse_task_classes
from ..options import ConfigError, Option
from ..privacy import PrivacyLedger, noised_mean
from ..records import (
    ArraySpec,
    capped_shares,
    derive_seed,
    median_capped,
    record_bytes,
    spec_of,
    to_record,
    validate_arrays,
    weighted_mean,
)
from ..results import RESERVED_FIELDS, RunRecorder, RunReport
from ..training.metrics import CONFUSION, check_confusion, pooled_metrics
from .checkpoint import Checkpointer, non_finite
from .replies import RejectedReply, check_metric_values, check_reply, count_check
from .site_registry import SiteRegistry

if TYPE_CHECKING:
    from ..settings import RunSettings
    from .client import ClientHalf


REPLY_POLL_S = 0.2


def send_and_receive(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """Flower's ``Grid.send_and_receive`` with a 0.2-s poll: Flower 1.41's deployment grid asks the SuperLink for
    replies every 3 s, which every phase of a round waits 1.5 s on average (docs/benchmarks.md#deployment-start-up-tax);
    one poll is one small request to the SuperLink. A grid whose ``send_and_receive`` answers at once
    (``replies_at_once``: medflower's in-process grid) is asked through it, with nothing to poll."""
    if getattr(grid, "replies_at_once", False):
        return list(grid.send_and_receive(messages, timeout=timeout))
    waiting = {message_id for message_id in grid.push_messages(messages) if message_id}
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while waiting:
        arrived = list(grid.pull_messages(sorted(waiting)))
        replies += arrived
        waiting -= {reply.metadata.reply_to_message_id for reply in arrived}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(REPLY_POLL_S)
    return replies


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of an evaluation (reply metrics or a metrics.jsonl record): no lists (confusion counts), no record
    fields."""
    return {
        k: v
        for k, v in metrics.items()
        if k not in RESERVED_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


@dataclass
class Reply:
    """One node's valid reply."""

    node_id: int
    client: str
    arrays: OrderedDict[str, np.ndarray]
    metrics: dict[str, float]
    config: dict[str, Any]
    evaluation: dict[str, Any] = field(default_factory=dict)  # evaluate-in-train: the previous round's evaluation

    @property
    def num_examples(self) -> float:
        """n_k, the aggregation weight a site declares (checked: a count, at most its declared training size)."""
        return float(self.metrics.get("num-examples", 1.0))

    @property
    def partition_id(self) -> int:
        return int(self.config["partition-id"])

    @property
    def client_claim(self) -> str:
        """The site name the reply declares (``client`` is the name the server knows the node by)."""
        return str(self.config["client"])


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
    asked: int = 0  # nodes sent a training message in the round's default protocol (dp='server''s m)
    trained: int | None = None  # valid training replies of the default protocol (None: a protocol of its own)
    errors: dict[str, int] = field(default_factory=dict)  # error replies (the site raised) per message type
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific fields of the round's server record

    def counts(self) -> dict[str, Any]:
        """The fields every server record carries: bytes each way and the failed and rejected sites."""
        return {
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "failed": self.failed,
            "rejected": self.rejected,
            "num_failed": len(self.failed),
            "num_rejected": len(self.rejected),
        }


class FederatedStrategy:
    """Server half of a method; the default protocol is FedAvg-like rounds.

    A method is one subclass, registered with ``@register_strategy``. Its facts are class attributes (below),
    its own run-config keys are ``options``, its checks of the run config are ``check_config``; it overrides the
    hooks it needs: ``setup`` (state beyond ``global_arrays``), ``train_content``, ``aggregate_train``,
    ``evaluate_content``, ``reply_spec``, ``state``/``load_state``, or ``run_round`` for multi-phase protocols.
    docs/adding-a-method.md walks through it.
    """

    name: ClassVar[str] = ""
    client_half: ClassVar[type[ClientHalf] | None] = None
    # Run-config keys this method (family) reads, declared once here; a key shared by several strategies is one
    # Option object that each lists.
    options: ClassVar[tuple[Option, ...]] = ()
    tasks: ClassVar[tuple[str, ...]] = ("classification", "segmentation")  # model tasks it can train
    adapter: ClassVar[str | None] = None  # the adapter it always trains (the run's 'adapter' must be left unset)
    trains_backbone: ClassVar[bool] = False  # may train the whole backbone (adapter='full')
    mixed_tasks: ClassVar[bool] = False  # shares only the encoder, so sites may hold different tasks (site-datasets)
    # Its sites compute on the images themselves, beyond the model's forward (ELCFS's amplitude spectra), so the
    # frozen-encoder mode, whose loaders hold encoder outputs, cannot serve it (docs/models.md#frozen-encoder-mode).
    reads_pixels: ClassVar[bool] = False
    # Its sites train only through ClientRuntime.train_local, so run-config local-steps bounds their local training;
    # a method with its own loop (local-epochs or task-epochs) says False, and a run that sets local-steps is refused.
    local_steps: ClassVar[bool] = True
    # Message actions beyond train/evaluate/query that the client half answers, e.g. ("train", "fedkei_inner").
    extra_actions: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Client-level DP modes its exchange allows (docs/privacy.md#which-strategies-can-use-it): 'site' needs every
    # training reply to update arrays the site received under the same names; 'server' needs the default
    # aggregation (one mean over the replies).
    client_dp: ClassVar[tuple[str, ...]] = ()
    # Its sites train only through ClientRuntime.train_local with extra loss terms that touch no sample, so DP-SGD
    # (run-config dp-sgd) can privatise every step (docs/privacy.md#sample-level-dp-sgd).
    dp_sgd: ClassVar[bool] = False
    # Its aggregate is the n_k-weighted mean of updates of arrays every site received alike, so Flower's SecAgg+ can
    # hide the single updates (run-config secagg; ``aggregate_secure``).
    secagg: ClassVar[bool] = False
    # Its round is the default one (train, aggregate, evaluate) and its client half's ``evaluate`` of a training
    # message's arrays, done before training, is the previous round's evaluation: run-config evaluate-in-train may
    # carry it in the training reply (``ClientHalf.train_after_evaluating``) and skip the evaluate phase.
    folds_evaluation: ClassVar[bool] = False
    # Its final model is one model, the same for every site: ``evaluate_content`` sends every site the same arrays
    # and its client half evaluates them as received, adding nothing the site keeps. Run-config
    # cross-site-evaluation then sends it to every site; without it each site's final model is its own (parts kept on
    # the site, or a model the server makes for that site alone) and only its own site evaluates it.
    global_model: ClassVar[bool] = False
    round_label: ClassVar[str] = "round"  # what one iteration of ``run`` is called in the log ("task" for FedKEI)
    # How summary.md and curves.png present its runs (results.RunReport; task streams name their own subclass).
    report: ClassVar[type[RunReport]] = RunReport
    # What the registry-wide contract tests (tests/test_contract.py) need beyond the tiny run config, for a
    # strategy whose protocol differs from one round = one train message per site: "config" (run-config keys),
    # "rounds" (iterations of the run), "stop_after" (the round after which the interrupted run dies), "train_kind"
    # (the record kind of a valid training reply), "arrays_up" (False: training replies carry metrics only),
    # "no_arrays_down" (rounds whose messages carry no arrays: a tuple, or "all", or {"after": r}), "why".
    contract_case: ClassVar[dict[str, Any]] = {}

    @classmethod
    def model_classes(cls, num_classes: int) -> int:
        """Output width of the model for a dataset with ``num_classes`` classes (the same, by default)."""
        return num_classes

    @classmethod
    def model_fields(cls, cfg: RunSettings, class_names: list[str]) -> dict[str, Any]:
        """ModelSpec fields the method decides (its adapter, its head); the rest come from the run config."""
        return {"adapter": cls.adapter} if cls.adapter else {}

    @classmethod
    def check_config(cls, cfg: RunSettings, check_paths: bool) -> None:
        """Refuse a run config this method cannot run (raise ``options.bad(key, value, why)``); the generic checks
        (tasks, adapter, mixed tasks) already ran. ``check_paths``: also check the files it names exist."""

    def __init__(self, cfg: RunSettings, recorder: RunRecorder, initial: Mapping[str, np.ndarray], num_classes: int):
        self.cfg = cfg
        self.recorder = recorder
        self.num_classes = num_classes
        shared = self.server_arrays(initial)
        self.spec = spec_of(shared)
        self.global_arrays: OrderedDict[str, np.ndarray] = OrderedDict((k, np.array(v)) for k, v in shared.items())
        self.completed_rounds = 0
        self.elapsed_s = 0.0
        # The run's identity for the sites' state folders (node-config state-dir): new for every run, kept by a
        # resumed one, so that runs of the same name never share, prune or read each other's per-site state.
        self.run_uid = uuid.uuid4().hex
        self.nodes: dict[int, NodeInfo] = {}
        self.federation_size = 0  # N: the nodes known when the round started (a node rejected in it still counts)
        self.stats = RoundStats()
        self.checkpointer = Checkpointer(recorder.run_dir / run_folder.CHECKPOINT, keep=cfg.keep_checkpoints)
        self.registry = SiteRegistry.load(cfg.site_registry) if cfg.site_registry else None
        self.privacy = PrivacyLedger(cfg) if cfg.dp != "none" or cfg.dp_sgd else None
        self.setup(initial)

    def server_arrays(self, initial: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The part of the model's initial trainable arrays the server holds (all of them, by default)."""
        return initial

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        """Method state beyond ``global_arrays`` (control variates, pools, per-client aggregates...)."""

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

    # ------------------------------------------------------------------ messaging
    def base_config(self, rnd: int, **extra: Any) -> ConfigRecord:
        return ConfigRecord(
            {
                "round": rnd,
                "num-classes": self.num_classes,
                "model-classes": self.model_classes(self.num_classes),
                "run-name": self.recorder.run_dir.name,
                "run-uid": self.run_uid,
                "state-dir": str((self.recorder.run_dir / run_folder.CLIENT_STATE).resolve()),
                **extra,
            }
        )

    def exchange(
        self,
        grid: Grid,
        message_type: str,
        contents: Mapping[int, RecordDict],
        rnd: int,
        expect: ArraySpec | Callable[[int], ArraySpec] | None = None,
        timeout: float | None = None,
    ) -> list[Reply]:
        """Send one message per node, wait for replies, count bytes, and keep only the replies that pass the checks.

        Every reply of every phase goes through ``replies.check_reply`` (records, identity, metrics, and the arrays
        of ``expect``: one spec, or a function of the node id when nodes send different shapes; None = no arrays)
        and then this strategy's ``check_reply_values``. A reply that fails, or whose handling raises anything, is
        rejected: logged with its reason, counted in the round's metrics, left out; the round goes on.
        ``timeout`` (default run-config round-timeout) bounds the wait for replies.
        """
        timeout = self.cfg.round_timeout if timeout is None else timeout
        messages = []
        for node_id, content in contents.items():
            self.stats.bytes_down += record_bytes(content)
            messages.append(Message(content=content, dst_node_id=node_id, message_type=message_type, group_id=str(rnd)))
        if not messages:
            return []
        answered: set[int] = set()
        replies: list[Reply] = []
        started = time.monotonic()
        received = send_and_receive(grid, messages, timeout)
        phases = self.stats.extra.setdefault("phase_s", {})  # wall time of each message type's exchange this round
        phases[message_type] = round(phases.get(message_type, 0.0) + time.monotonic() - started, 3)
        for msg in received:
            node_id = msg.metadata.src_node_id
            client = self.client_name(node_id)
            if node_id not in contents or node_id in answered:
                self.reject(rnd, message_type, client, "a reply that was not asked for")
                continue
            answered.add(node_id)
            if msg.has_error():
                self.stats.errors[message_type] = self.stats.errors.get(message_type, 0) + 1
                reason = (msg.error.reason or "").strip().splitlines()
                reason_text = reason[-1][:500] if reason else f"error code {msg.error.code}"
                log(
                    WARNING,
                    "[medflower] %s %d %s: %s failed: %s",
                    self.round_label,
                    rnd,
                    message_type,
                    client,
                    reason_text,
                )
                self.stats.failed.append(f"{client}: {reason_text}")
                continue
            try:
                self.stats.bytes_up += record_bytes(msg.content)
                spec = expect(node_id) if callable(expect) else expect
                arrays, metrics, info = check_reply(msg.content, spec, self.cfg.reply_value_limit)
                evaluation = dict(msg.content["evaluation"]) if "evaluation" in msg.content else {}  # checked above
                reply = Reply(node_id, client, arrays, metrics, info, evaluation)
                problem = self.check_reply_values(message_type.partition(".")[0], reply)
            except RejectedReply as err:
                problem = str(err)
            except Exception as err:  # whatever one node's reply breaks, only that node is dropped
                problem = f"{type(err).__name__} while checking the reply: {str(err)[:300]}"
            if problem:
                self.reject(rnd, message_type, client, problem)
                continue
            replies.append(reply)
        for node_id in contents:
            if node_id not in answered:
                client = self.client_name(node_id)
                log(
                    WARNING,
                    "[medflower] %s %d %s: no reply from %s within %.0fs",
                    self.round_label,
                    rnd,
                    message_type,
                    client,
                    timeout,
                )
                self.stats.failed.append(f"{client}: no reply")
        return replies

    def reject(self, rnd: int, message_type: str, client: str, problem: str) -> None:
        log(
            WARNING,
            "[medflower] %s %d %s: rejected reply of %s: %s",
            self.round_label,
            rnd,
            message_type,
            client,
            problem,
        )
        self.stats.rejected.append(f"{client}: {problem}")

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        """Why a reply that passed the generic checks still cannot be used, or None. Strategies extend it (call
        ``super()``) for the values they read (budgets, capacities, spreads).

        Here: a query declares ``num-train`` (a count) and a site name the registry (run-config site-registry)
        gives this node; every later reply comes from the identity the node declared when it joined (a node that
        changed its settings is forgotten and asked again at the next round), and its ``num-examples`` is a count
        no larger than the training size it declared.
        """
        metrics, known = reply.metrics, self.nodes.get(reply.node_id)
        if phase == "query":
            if "num-train" not in metrics:
                return "a query reply must declare num-train"
            if problem := count_check(metrics, "num-train"):
                return problem
            if self.registry is not None:
                return self.registry.check(reply.node_id, str(reply.config["client"]))
            return None
        if known is None:
            return "a reply from a node that has not joined (no query reply)"
        claimed = (str(reply.config["client"]), int(reply.config["partition-id"]))
        if claimed != (known.client, known.partition_id):
            self.nodes.pop(reply.node_id, None)  # re-read its settings at the next round
            return (
                f"identity changed to site {claimed[0]!r}, partition {claimed[1]} (it joined as {known.client!r}, "
                f"partition {known.partition_id}); it is asked again at the next round"
            )
        if "num-examples" in metrics and (problem := count_check(metrics, "num-examples", known.num_train)):
            self.nodes.pop(reply.node_id, None)
            return problem
        if phase == "train" and self.privacy is not None:  # an impossible DP-SGD ε (docs/privacy.md#accounting)
            return self.privacy.check_train_reply(known.client, known.num_train, metrics)
        return None

    def shares(self, weights: list[float] | np.ndarray) -> np.ndarray:
        """Aggregation shares from the sites' weights: each weight capped at run-config max-weight-over-median ×
        the median (3 or more sites), then each share at max-client-share (docs/reliability.md#aggregation-weights)."""
        return capped_shares(median_capped(weights, self.cfg.max_weight_over_median), self.cfg.max_client_share)

    def client_name(self, node_id: int) -> str:
        info = self.nodes.get(node_id)
        return info.client if info else f"node-{node_id}"

    def refresh_nodes(self, grid: Grid, rnd: int) -> None:
        """Ask nodes not seen before who they are (partition id, site name, training size); refuse a node that
        claims the site name or partition id of another node. A node's first answer includes starting its site
        worker (imports) and reading its data, so the wait is node-wait-timeout when that is longer than
        round-timeout."""
        current = set(grid.get_node_ids())
        for gone in set(self.nodes) - current:
            log(WARNING, "[medflower] %s left the federation", self.nodes.pop(gone).client)
        unknown = sorted(current - set(self.nodes))
        if not unknown:
            return
        contents = {n: RecordDict({"config": self.base_config(rnd)}) for n in unknown}
        wait = max(self.cfg.round_timeout, self.cfg.node_wait_timeout)
        for reply in self.exchange(grid, "query", contents, rnd, timeout=wait):
            info = NodeInfo(
                reply.node_id, reply.partition_id, reply.client_claim, int(reply.metrics["num-train"]), reply.metrics
            )
            holder = next(
                (n for n in self.nodes.values() if n.client == info.client or n.partition_id == info.partition_id),
                None,
            )
            if holder is not None:
                self.reject(
                    rnd,
                    "query",
                    f"node-{reply.node_id}",
                    f"claims site {info.client!r}, partition {info.partition_id}, already held by node "
                    f"{holder.node_id} ({holder.client!r}, partition {holder.partition_id}); refused",
                )
                continue
            self.nodes[reply.node_id] = info
            log(
                INFO,
                "[medflower] %s joined (partition %d, %d training samples)",
                info.client,
                info.partition_id,
                info.num_train,
            )

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
                raise TimeoutError(
                    f"only {len(list(grid.get_node_ids()))} nodes connected after "
                    f"{self.cfg.node_wait_timeout:.0f}s; run-config 'min-nodes' = {self.cfg.min_nodes}"
                )
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
        if self.registry is None and type(grid).__name__ == "HttpGrid":  # a deployment (simulation: InMemoryGrid)
            log(
                WARNING,
                "[medflower] no site-registry: a site name is bound to its node only while that node is connected, "
                "so a node that claims the name of a site that has left is taken for that site (its per-site "
                "aggregates included); with node authentication, set site-registry (docs/reliability.md#who-a-site-is)",
            )
        first = self.completed_rounds + 1
        previous_before = None  # the state before the last round that aggregated training replies
        for rnd in range(first, self.total_rounds() + 1):
            if self.privacy is not None and not self.privacy.allows_next_round():
                log(
                    WARNING,
                    "[medflower] stopping before %s %d: it would spend more than dp-target-epsilon = %g",
                    self.round_label,
                    rnd,
                    self.cfg.dp_target_epsilon,
                )
                break
            started = time.monotonic()
            self.stats = RoundStats()
            self.refresh_nodes(grid, rnd)
            self.federation_size = len(self.nodes)
            if not self.nodes:
                raise RuntimeError(f"{self.round_label} {rnd}: no node answered; see the warnings above")
            if self.privacy is not None and rnd == first:  # DP-SGD's plan per site, from the sizes they declared
                self.privacy.check_sites({n.client: n.num_train for n in self.nodes.values()}, self.total_rounds())
            before = self.snapshot()
            if self.privacy is not None:
                self.privacy.mark_release(self.recorder.run_dir, rnd)
            self.run_round(grid, rnd)
            if problem := self.non_finite_state():
                self.load_state(*before)
                log(WARNING, "[medflower] %s %d failed: %s; the previous model is kept", self.round_label, rnd, problem)
                self.stats.extra["round_failed"] = problem
            elif self.every_site_failed() and previous_before is not None:
                self.load_state(*previous_before)  # the model before the last aggregate, which broke every site
                log(
                    WARNING,
                    "[medflower] %s %d: every site's training failed after round %d's aggregate; rolled back to the "
                    "model before it",
                    self.round_label,
                    rnd,
                    rnd - 1,
                )
                self.stats.extra["rolled_back"] = f"round {rnd - 1}'s aggregate: every site's training failed after it"
                before = None  # one step back at most: if the sites still fail, the cause is not that aggregate
            previous_before = before if self.stats.trained else None
            if self.privacy is not None:
                trained = {r["client"]: r for r in self.recorder.records("train") if r["round"] == rnd}
                self.stats.extra.update(self.privacy.after_round(trained))
            self.completed_rounds = rnd
            round_s = time.monotonic() - started
            self.elapsed_s += round_s
            self.recorder.log_server(
                rnd,
                **self.stats.counts(),
                aggregation_s=round(self.stats.aggregation_s, 4),
                round_s=round(round_s, 3),
                **self.stats.extra,
            )
            self.save_checkpoint()
            log(
                INFO,
                "[medflower] %s %d/%d done in %.1fs: %s",
                self.round_label,
                rnd,
                self.total_rounds(),
                round_s,
                self.recorder.round_summary(rnd),
            )

    def cross_site_evaluation(self, grid: Grid) -> dict[str, Any]:
        """Run-config cross-site-evaluation, after the last round: the site x model matrix of the final models
        (summary.json's ``cross_site``; docs/experiments.md#cross-site-evaluation).

        ``matrix[site][model]``: the metrics of ``model`` on ``site``'s test split (and validation split, prefixed
        ``val_``). With one global model (``global_model``) each known site gets one evaluate message carrying it
        (``evaluate_content``, as the last round's evaluate phase sent it), its reply fills its row of the one column
        ``global``, and the messages' bytes go into a server record of their own (``cross_site``), so the run's
        communication totals count them. Otherwise each site's final model is its own and never leaves it (nor does
        the server send a model it makes for one site to another): the matrix is its diagonal, each site's own model
        on its own data as the last round's evaluation recorded it, and nothing is sent."""
        rnd = self.completed_rounds
        if rnd == 0:
            return {"round": 0, "models": [], "matrix": {}, "note": f"no {self.round_label} completed: no final model"}
        if not self.global_model:
            last = {r["client"]: r for r in self.recorder.records("eval") if r["round"] == rnd}
            return {
                "round": rnd,
                "models": sorted(last),
                "matrix": {site: {site: scalar_metrics(r)} for site, r in sorted(last.items())},
                "off_diagonal": (
                    f"not available: with strategy {self.name!r} each site's final model is its own and never "
                    "leaves it, so no site evaluates another site's model; the diagonal is each site's own model on "
                    f"its own data, from the evaluation of {self.round_label} {rnd}"
                ),
            }
        self.stats = RoundStats()
        started = time.monotonic()
        self.refresh_nodes(grid, rnd)  # a resumed run that had already finished knows no node yet
        contents = {n: self.evaluate_content(rnd, n) for n in self.ordered_nodes()}
        replies = self.exchange(grid, "evaluate", contents, rnd)
        self.recorder.log_server(
            rnd,
            cross_site=True,
            **self.stats.counts(),
            round_s=round(time.monotonic() - started, 3),
        )
        answered = {r.node_id for r in replies}
        result: dict[str, Any] = {
            "round": rnd,
            "models": ["global"],
            "matrix": {
                r.client: {"global": scalar_metrics(r.metrics)} for r in sorted(replies, key=lambda r: r.client)
            },
        }
        if missing := sorted(self.client_name(n) for n in contents if n not in answered):
            result["no_reply"] = missing
        log(
            INFO,
            "[medflower] cross-site evaluation: the global model of %s %d on %d of %d sites",
            self.round_label,
            rnd,
            len(replies),
            len(contents),
        )
        return result

    def every_site_failed(self) -> bool:
        """Whether the round's training (default protocol) got no valid reply and every site asked raised an error
        (not a timeout: a site that did not answer says nothing about the model it was sent)."""
        errors = self.stats.errors.get("train", 0)
        return self.stats.trained == 0 and self.stats.asked > 0 and errors == self.stats.asked

    def snapshot(self) -> tuple[OrderedDict[str, np.ndarray], dict[str, Any]]:
        """A copy of ``state()`` (what ``load_state`` restores when a round's aggregate is not finite)."""
        arrays, meta = self.state()
        return OrderedDict((k, np.array(v, copy=True)) for k, v in arrays.items()), json.loads(json.dumps(meta))

    def non_finite_state(self) -> str | None:
        """Why the state after a round must not be kept (an array with NaN/Inf), or None."""
        bad = non_finite(self.state()[0])
        return f"the aggregate is not finite ({len(bad)} arrays with NaN/Inf, e.g. {bad[0]})" if bad else None

    def run_round(self, grid: Grid, rnd: int) -> None:
        selected = self.sample_nodes(rnd)
        contents = {n: self.train_content(rnd, n) for n in selected}
        self.stats.asked = len(contents)
        if self.cfg.secagg:
            self.secure_train(grid, rnd, contents)
        else:
            replies = self.exchange(grid, "train", contents, rnd, expect=self.reply_spec)
            self.stats.trained = len(replies)
            if self.evaluates_in_train(rnd):
                self.record_carried_evaluation(grid, rnd, replies, asked=set(contents))
            for reply in replies:
                self.recorder.log_client(rnd, reply.client, "train", reply.metrics)
            started = time.monotonic()
            if replies:
                self.aggregate_train(rnd, replies)
            else:
                log(WARNING, "[medflower] round %d: no valid training reply; the model is unchanged", rnd)
            self.stats.aggregation_s += time.monotonic() - started
        if self.cfg.evaluate_in_train and rnd < self.total_rounds():
            return  # this round's evaluation comes with the next round's training replies
        contents = {n: self.evaluate_content(rnd, n) for n in self.ordered_nodes()}
        self.stats.extra.update(self.record_evaluation(rnd, self.exchange(grid, "evaluate", contents, rnd)))

    def evaluates_in_train(self, rnd: int) -> bool:
        """Whether round ``rnd``'s training messages ask for the previous round's evaluation first (run-config
        evaluate-in-train; the sites decide the same from the run config and the round)."""
        return bool(self.cfg.evaluate_in_train) and rnd > 1

    def record_carried_evaluation(self, grid: Grid, rnd: int, replies: list[Reply], asked: set[int]) -> None:
        """evaluate-in-train: round ``rnd - 1``'s evaluation, from the training replies of round ``rnd`` and an
        evaluate message (as round ``rnd - 1`` would have sent it) to the nodes not sampled for training. Its
        pooled metrics go into a server record of round ``rnd - 1`` of their own (``evaluated_in``: ``rnd``)."""
        evaluated = [Reply(r.node_id, r.client, OrderedDict(), r.evaluation, r.config) for r in replies if r.evaluation]
        for reply in replies:
            if not reply.evaluation:
                log(WARNING, "[medflower] round %d: %s sent no evaluation of round %d", rnd, reply.client, rnd - 1)
        # a node asked to train that failed has no evaluation of round rnd - 1 either (as if its evaluate failed)
        rest = {n: self.evaluate_content(rnd - 1, n) for n in self.ordered_nodes() if n not in asked}
        if rest:
            evaluated += self.exchange(grid, "evaluate", rest, rnd - 1)
        pooled = self.record_evaluation(rnd - 1, evaluated)
        if pooled:
            self.recorder.log_server(rnd - 1, evaluated_in=rnd, **pooled)
        log(INFO, "[medflower] %s %d evaluation: %s", self.round_label, rnd - 1, self.recorder.round_summary(rnd - 1))

    def secure_train(self, grid: Grid, rnd: int, contents: Mapping[int, RecordDict]) -> None:
        """The training phase as Flower's SecAgg+ (medflower/privacy/secagg.py): only the n_k-weighted mean of the
        sites' updates reaches ``aggregate_secure``. It is checked like a reply (names, shapes, finite, within
        reply-value-limit); each site's training metrics are checked like a reply's before they are logged."""
        from ..privacy.secagg import SecureRoundError, protocol_bytes, secure_mean_update

        def count(content: RecordDict, down: bool) -> None:
            size = record_bytes(content) + protocol_bytes(content)
            if down:
                self.stats.bytes_down += size
            else:
                self.stats.bytes_up += size

        # max_weight: the largest declared size, each capped at max-weight-over-median × the median (3+ sites), so
        # that one site's declaration cannot shrink the honest weights below the quantisation's resolution
        declared = [self.nodes[n].num_train for n in contents if n in self.nodes]
        cap = float(max(median_capped(declared, self.cfg.max_weight_over_median)))
        try:
            mean, results = secure_mean_update(grid, rnd, contents, float(max(cap, 1)), self.cfg, count)
        except Exception as err:  # a round that cannot be secured, or the workflow failing: skipped, never the run
            why = str(err) if isinstance(err, SecureRoundError) else f"{type(err).__name__}: {str(err)[:300]}"
            if isinstance(err, SecureRoundError) and self.completed_rounds == 0:
                raise ConfigError(  # no round of this federation was ever secured: a run that would train nothing
                    f"run-config 'secagg' = True cannot run: {why}; set min-nodes to the sites SecAgg+ needs "
                    "(docs/privacy.md#secure-aggregation)"
                ) from None
            log(WARNING, "[medflower] round %d: SecAgg+ round skipped: %s; the model is unchanged", rnd, why)
            self.stats.failed.append(f"secagg: round skipped: {why}")
            self.stats.extra["secagg_sites"] = 0
            return
        for node_id, fitres in results:
            # Untrusted like any reply's metrics; a bad set is dropped, but the site's masked update stays in the
            # sum: SecAgg+ cannot take one site out of it (nor check its weight n_k, docs/privacy.md).
            client = self.client_name(node_id)
            try:
                self.recorder.log_client(rnd, client, "train", check_metric_values(dict(fitres.metrics)))
            except RejectedReply as exc:
                log(WARNING, "[medflower] round %d: ignored the training metrics of %s: %s", rnd, client, exc)
                self.stats.rejected.append(f"{client}: {exc}")
        self.stats.extra["secagg_sites"] = len(results)
        self.stats.trained = len(results)
        started = time.monotonic()
        spec = self.reply_spec(next(iter(contents)))
        if mean is not None and list(mean) == list(spec):  # dequantised in float64: back to the arrays' dtypes
            mean = OrderedDict((k, np.asarray(v, dtype=spec[k][1])) for k, v in mean.items())
        problem = "the protocol halted (too few sites answered)" if mean is None else validate_arrays(mean, spec)
        if problem is None and any(np.abs(v).max(initial=0) > self.cfg.reply_value_limit for v in mean.values()):
            problem = f"a value beyond reply-value-limit = {self.cfg.reply_value_limit:g}"
        if problem:
            log(WARNING, "[medflower] round %d: SecAgg+ gave no usable sum: %s; the model is unchanged", rnd, problem)
            self.stats.failed.append(f"secagg: {problem}")
        else:
            self.aggregate_secure(rnd, mean, [node_id for node_id, _ in results])
        self.stats.aggregation_s += time.monotonic() - started

    def aggregate_secure(self, rnd: int, mean_update: Mapping[str, np.ndarray], sites: list[int]) -> None:
        """With secagg: the global arrays plus the n_k-weighted mean update of ``sites`` (the nodes in the sum)."""
        self.global_arrays = OrderedDict(
            (k, np.asarray(v + mean_update[k], dtype=v.dtype)) for k, v in self.global_arrays.items()
        )

    def record_evaluation(self, rnd: int, replies: list[Reply]) -> dict[str, Any]:
        """Log each site's evaluation of round ``rnd``; return the round's pooled metrics (for its server record).

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
                    log(
                        WARNING,
                        "[medflower] %s %d evaluate: ignored the counts of %s: %s",
                        self.round_label,
                        rnd,
                        reply.client,
                        problem,
                    )
                    self.stats.rejected.append(f"{reply.client}: {problem}")
                    del metrics[CONFUSION]
                else:
                    total, sites = total + counts, sites + 1
            self.recorder.log_client(rnd, reply.client, "eval", metrics)
        return {**pooled_metrics(total), "pooled_sites": sites} if total.sum() > 0 else {}

    def reply_spec(self, node_id: int) -> ArraySpec | None:
        """Arrays node ``node_id``'s training reply must carry (the same for every node, by default)."""
        return self.spec

    def train_content(self, rnd: int, node_id: int) -> RecordDict:
        return RecordDict({"arrays": to_record(self.global_arrays), "config": self.base_config(rnd)})

    def evaluate_content(self, rnd: int, node_id: int) -> RecordDict:
        return RecordDict({"arrays": to_record(self.global_arrays), "config": self.base_config(rnd)})

    def aggregate_train(self, rnd: int, replies: list[Reply]) -> None:
        """The n_k-weighted mean of the replies; with dp='server' the uniform mean of the clipped updates over the
        sites asked, plus the Gaussian noise (medflower/privacy/client_dp.py)."""
        if self.cfg.dp == "server":
            self.global_arrays = noised_mean(
                self.global_arrays,
                [r.arrays for r in replies],
                self.stats.asked,
                self.cfg.dp_clipping_norm,
                self.cfg.dp_noise_multiplier,
            )
            return
        self.global_arrays = weighted_mean([r.arrays for r in replies], self.shares([r.num_examples for r in replies]))
