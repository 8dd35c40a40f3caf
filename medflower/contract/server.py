"""The server half every strategy shares: ``FederatedStrategy``, its facts, its hooks and its round loop.

``FederatedStrategy`` drives the Grid directly (identify -> train -> aggregate -> evaluate -> checkpoint, round
by round). Methods override the hooks they need, or ``run_round`` for multi-phase protocols with custom actions.
The rest of the server loop is one concern per module, each a mixin it inherits: ``nodes.py`` (who is in the
federation, each round's sample), ``messaging.py`` (sending, waiting, checking and rejecting replies, byte counts),
``persistence.py`` (checkpoints, resume, a failed round's rollback), ``secure.py`` (SecAgg+ rounds) and
``evaluation.py`` (evaluation records, pooled metrics, evaluate-in-train, cross-site evaluation).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from .. import run_folder
from ..data.tasks import parse_task_classes
from ..options import Option
from ..privacy import PrivacyLedger, noised_mean
from ..records import ArraySpec, capped_shares, median_capped, spec_of, to_record, validate_arrays, weighted_mean
from ..results import RunRecorder, RunReport
from .checkpoint import Checkpointer
from .evaluation import EvaluationMixin
from .messaging import MessagingMixin, Reply, RoundStats
from .nodes import NodeInfo, NodesMixin
from .persistence import PersistenceMixin
from .secure import SecureAggregationMixin
from .site_registry import SiteRegistry

if TYPE_CHECKING:
    from ..settings import RunSettings
    from .client import ClientHalf


class FederatedStrategy(NodesMixin, MessagingMixin, PersistenceMixin, SecureAggregationMixin, EvaluationMixin):
    """Server half of a method; the default protocol is FedAvg-like rounds.

    A method is one subclass, registered with ``@register_strategy``. Its facts are class attributes (below),
    its own run-config keys are ``options``, its checks of the run config are ``check_config``; it overrides the
    hooks it needs: ``setup`` (state beyond ``global_arrays``), ``train_content``, ``aggregate_train``,
    ``evaluate_content``, ``reply_spec``, ``state``/``load_state``, or ``run_round`` for multi-phase protocols.
    The mixins' own extension points stay with their concern: ``check_reply_values`` and ``base_config``
    (messaging.py), ``sample_nodes`` (nodes.py), ``restore`` (persistence.py), ``aggregate_secure`` (secure.py).
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
    # Its own ``run_round`` skips the evaluate phase of the rounds ``evaluates_round`` says no to (run-config
    # evaluate-every); the default round does.
    sparse_evaluation: ClassVar[bool] = False
    # Its final model is one model, the same for every site: ``evaluate_content`` sends every site the same arrays
    # and its client half evaluates them as received, adding nothing the site keeps. Run-config
    # cross-site-evaluation then sends it to every site; without it each site's final model is its own (parts kept on
    # the site, or a model the server makes for that site alone) and only its own site evaluates it.
    global_model: ClassVar[bool] = False
    round_label: ClassVar[str] = "round"  # what one iteration of ``run`` is called in the log ("task" for FedKEI)
    # How summary.md and curves.png present its runs (results.RunReport; task streams name their own subclass).
    report: ClassVar[type[RunReport]] = RunReport
    # What the registry-wide contract tests (tests/contract/test_contract.py) need beyond the tiny run config, for a
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

    # ------------------------------------------------------------------ the method's hooks
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        """Arrays and JSON meta that define the strategy after a round."""
        return self.global_arrays, {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        problem = validate_arrays(arrays, self.spec) if arrays else None
        if problem:
            raise ValueError(f"checkpoint does not fit this model: {problem}")
        self.global_arrays = OrderedDict((k, np.array(v)) for k, v in arrays.items())

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

    def shares(self, weights: list[float] | np.ndarray) -> np.ndarray:
        """Aggregation shares from the sites' weights: each weight capped at run-config max-weight-over-median ×
        the median (3 or more sites), then each share at max-client-share (docs/reliability.md#aggregation-weights)."""
        return capped_shares(median_capped(weights, self.cfg.max_weight_over_median), self.cfg.max_client_share)

    def total_rounds(self) -> int:
        """Iterations of ``run``: num-rounds (FedKEI: the number of tasks)."""
        return self.cfg.num_rounds

    def task_class_order(self) -> list[int]:
        """The run's class order (``task-classes``) as the server sees it."""
        return parse_task_classes(self.cfg.task_classes, self.cfg.server_class_names(self.num_classes))

    def summary_extra(self) -> dict[str, Any]:
        """Method-specific entries of summary.json (they may replace the default ``final``)."""
        return {}

    # ------------------------------------------------------------------ the round loop
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
        if not self.evaluates_round(rnd):
            return
        contents = {n: self.evaluate_content(rnd, n) for n in self.ordered_nodes()}
        self.stats.extra.update(self.record_evaluation(rnd, self.exchange(grid, "evaluate", contents, rnd)))

    def every_site_failed(self) -> bool:
        """Whether the round's training (default protocol) got no valid reply and every site asked raised an error
        (not a timeout: a site that did not answer says nothing about the model it was sent)."""
        errors = self.stats.errors.get("train", 0)
        return self.stats.trained == 0 and self.stats.asked > 0 and errors == self.stats.asked
