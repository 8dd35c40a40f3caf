"""A Grid that calls the ClientApp in this process: fast tests and the benchmark's baseline.

Flower's simulation runs ClientApps in Ray actors behind a SuperLink; for unit and resume
tests we need the same ServerApp/ClientApp code driven deterministically without that
machinery. Flower ships no in-process Grid, so this small one implements its interface.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

# (node_id, message) -> True to drop the message (simulates a node that does not answer).
DropRule = Callable[[int, Message], bool]


class InProcessGrid(Grid):
    """Nodes 1..N with node configs ``partition-id``/``num-partitions`` and their own ``context.state``."""

    replies_at_once = True  # send_and_receive answers every message before it returns (medflower's server loop)

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: dict,
        node_configs: list[dict] | None = None,
        drop: DropRule | None = None,
        record_sent: bool = True,
    ):
        self.client_app = client_app
        # Tests read every message the ServerApp sent (``sent``); a long experiment must not keep them, since each
        # holds its arrays (10 ResNet-18 sites: about 1.3 GB more per round).
        self.record_sent = record_sent
        self.drop = drop
        self.contexts: dict[int, Context] = {}
        for i in range(num_nodes):
            node_config = {"partition-id": i, "num-partitions": num_nodes, **((node_configs or [{}] * num_nodes)[i])}
            self.contexts[i + 1] = Context(
                run_id=1, node_id=i + 1, node_config=node_config, state=RecordDict(), run_config=dict(run_config)
            )
        self.sent: list[Message] = []
        self._run = None
        # Flower stamps messages with the identity of the task that creates them.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("InProcessGrid answers through send_and_receive only")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("InProcessGrid answers through send_and_receive only")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for message in messages:
            if self.record_sent:
                self.sent.append(message)
            node_id = message.metadata.dst_node_id
            if node_id not in self.contexts or (self.drop and self.drop(node_id, message)):
                continue
            # Each node gets its own copy, as over the wire: a mod may change the records it receives (SecAgg+'s
            # pops its stage), and one content object can be addressed to several nodes.
            delivered = copy.copy(message)
            delivered.content = copy.deepcopy(message.content)
            try:
                replies.append(self.client_app(delivered, self.contexts[node_id]))
            except Exception as err:  # the real runtime turns ClientApp exceptions into error replies
                reason = "".join(traceback.format_exception_only(err)).strip()
                replies.append(Message(Error(code=1, reason=reason), reply_to=message))
        return replies


def run_inprocess(
    run_config: dict,
    num_nodes: int,
    drop: DropRule | None = None,
    node_configs: list[dict] | None = None,
    record_sent: bool = True,
) -> tuple[dict, InProcessGrid]:
    """Run the medflower ServerApp logic against ``num_nodes`` in-process ClientApps (``record_sent=False``: the
    grid keeps no sent message, for long runs)."""
    from .client_app import app as client_app
    from .config import defaults
    from .server_app import run_experiment

    full = {**defaults(), **run_config}
    grid = InProcessGrid(client_app, num_nodes, full, node_configs=node_configs, drop=drop, record_sent=record_sent)
    return run_experiment(grid, full), grid
