"""Messaging: what the server sends each node and how it takes the replies back (send, wait, count bytes, check
every reply, reject the bad ones).

``MessagingMixin`` is the part of ``FederatedStrategy`` (server.py) that owns the messages of every phase; ``Reply``
(one node's valid reply) and ``RoundStats`` (the round's bytes, failures and rejections) are what it hands the
others.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from .. import run_folder
from ..records import ArraySpec, from_record, record_bytes, scaled_update, update_norm_bounds
from .replies import RejectedReply, check_reply, count_check

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


class MessagingMixin:
    """The messages of every phase: ``base_config`` (what every message's config carries), ``exchange`` (send one
    message per node, wait, count bytes, check each reply, keep the valid ones), ``reject`` and
    ``check_reply_values`` (the checks beyond the generic ones; strategies extend it with ``super()``).

    Reads from the rest of ``FederatedStrategy``: ``cfg``, ``recorder``, ``num_classes``, ``run_uid``, ``stats``,
    ``nodes``, ``registry``, ``privacy``, ``round_label`` and ``model_classes`` (server.py), ``client_name``
    (nodes.py).
    """

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
        if message_type == "train":  # model updates (not a method's statistics or gradients: "train.<action>")
            self.bound_updates(rnd, message_type, contents, replies)
        return replies

    def bound_updates(self, rnd: int, message_type: str, contents: Mapping[int, RecordDict], replies: list[Reply]):
        """Scale down, in place, every training reply whose update (reply minus the arrays its node was sent, over
        the names and shapes both hold) is longer than run-config max-update-over-median × the round's median update
        norm (3 or more replies; records.update_norm_bounds; docs/reliability.md#the-size-of-one-sites-update).
        A reply inside reply-value-limit can still hold an update thousands of times an honest one; scaled to the
        bound it moves a mean by at most its share × the bound, and the honest sites' replies are untouched unless
        one of them is itself that far from the median."""
        if len(replies) < 3 or self.cfg.max_update_over_median <= 0:
            return
        sent = [
            from_record(contents[r.node_id]["arrays"]) if "arrays" in contents[r.node_id] else OrderedDict()
            for r in replies
        ]
        norms, bound = update_norm_bounds(sent, [r.arrays for r in replies], self.cfg.max_update_over_median)
        for reply, given, norm in zip(replies, sent, norms):
            if norm > bound:
                reply.arrays = scaled_update(given, reply.arrays, bound / norm)
                log(
                    WARNING,
                    "[medflower] %s %d %s: %s's update has norm %.4g, more than max-update-over-median = %g times "
                    "the median (%.4g): scaled down to %.4g",
                    self.round_label,
                    rnd,
                    message_type,
                    reply.client,
                    norm,
                    self.cfg.max_update_over_median,
                    bound / self.cfg.max_update_over_median,
                    bound,
                )
                self.stats.extra.setdefault("bounded", []).append(f"{reply.client}: norm {norm:.4g} -> {bound:.4g}")

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
