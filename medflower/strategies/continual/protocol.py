"""The continual task protocol that FedKEI and its baselines run: a stream of binary tasks, one module per task and
site, a knowledge pool of every finished module.

Documented in docs/methods/fedkei.md ("Spec as implemented") and, for the baselines,
docs/methods/baselines-continual.md. One run walks T binary tasks (``data/tasks.py``): task t is the t-th class of a
site's class order against the classes before it. One iteration of the server loop is one task. The server sends
every sampled site what the task starts from (nothing: the fresh seeded module); the site initialises its module θ =
(LoRA adapter, head) from it, fine-tunes it ``task-epochs`` epochs with the test AUC after each epoch, and uploads
it with n_i. The server keeps every θ_i^t in the knowledge pool on disk (``knowledge_pool.py``) and the task's
metrics as the task's 'eval' record; summary.json/.md's per-task tables and curves.png come from ``report.py``.

A method of the protocol subclasses ``ContinualStrategy`` and ``ContinualClient`` and overrides only its hooks: what
a task starts from (server: ``start_module``, or ``task_contents`` for per-site messages or extra phases; client:
``initialise``), a term added to the task loss (``finetune_loss``), the local update (``finetune``), what a site
uploads (``upload``, with ``finetune_spec`` and ``finetuned`` on the server). Pieces several methods share:
``PoolMeanInit`` (the n_i-weighted mean of the pool as every task's start) and ``latest_modules`` (the modules of the
latest pooled task).

What leaves a site by default: after each task its module θ_i^t (adapter + head) and n_i, with the task's metrics its
test size and number of positive test images (n_test, n_test_positive).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log

from ... import run_folder
from ...contract import ArraySpec, ClientHalf, FederatedStrategy, Reply, from_record, to_record, weighted_mean
from ...data import DataError, make_loader
from ...data.tasks import (
    binary_task,
    client_class_order,
    count_tasks,
    parse_site_task_classes,
    parse_task_classes,
    site_class_order,
)
from ...options import Option, bad, parsed, positive
from ...training import ExtraLoss, evaluate, train_epochs
from .bilevel import LossFn, module_loss, part_width, split_parts
from .knowledge_pool import KnowledgePool, PoolEntry
from .report import ContinualReport, continual_summary

# ----------------------------------------------------------------------------- the protocol's run-config keys
TASK_EPOCHS = Option(
    "task-epochs",
    30,
    "fedkei: fine-tuning epochs per task (AUC on the task's test split after each)",
    positive,
    "fedkei",
)
SITE_CLASSES = Option(
    "fedkei-site-classes",
    "",
    "fedkei: per-site class orders '<site>=<c_0>,<c_1>,...;...' (site = name or partition id), each as long as "
    "task-classes: a site lacking a class names another in its place; a site's node-config task-classes wins",
    parsed(parse_site_task_classes),
    "fedkei",
)
CONTINUAL_OPTIONS = (TASK_EPOCHS, SITE_CLASSES)  # every method of the protocol reads these

# FedKEI's key that picks its start (fedkei.py): a method of the protocol that does not declare it has its own start
# and refuses it, so that a run config asking for a FedKEI variant of another method stops instead of being ignored.
VARIANT_KEY = "fedkei-variant"


# ----------------------------------------------------------------------------- client half
class ContinualClient(ClientHalf):
    """A site's task stream: per task, initialise the module, fine-tune it, report the AUC curve, upload it.

    By default a task starts from the module the server sent, else (task 1, an empty pool) from the fresh seeded one.
    """

    @property
    def task(self) -> int:
        return self.rt.round  # one iteration of the server loop is one task

    def class_order(self) -> list[int]:
        """This site's class order: its own list (node-config ``task-classes``, else its ``fedkei-site-classes``
        entry by site name or partition id) when it has one, else the run's order under ``task-order``."""
        rt = self.rt
        order = parse_task_classes(rt.cfg.task_classes, rt.data.class_names)
        own = rt.context.node_config.get("task-classes")
        where = "node-config task-classes"
        if not own:
            listed = parse_site_task_classes(rt.cfg.fedkei_site_classes)
            key = next((k for k in (rt.client, str(rt.partition_id)) if k in listed), None)
            own, where = listed.get(key), f"run-config fedkei-site-classes entry {key!r}"
        if own:
            return site_class_order(order, str(own), rt.data.class_names, where)
        return client_class_order(order, rt.cfg.task_order, rt.cfg.seed, rt.partition_id)

    def task_split(self, split: str):
        """This site's split of the current task; DataError when the task has no training rows here."""
        data = binary_task(getattr(self.rt.data, split), self.class_order(), self.task)
        if split == "train" and len(data) == 0:
            names = self.rt.data.class_names
            order = self.class_order()
            raise DataError(
                f"{self.rt.client}: task {self.task} ({names[order[self.task]]} vs "
                f"{[names[c] for c in order[: self.task]]}) has no training rows on this site"
            )
        return data

    def module_setup(self) -> tuple[LossFn, OrderedDict, torch.device]:
        """The model on the site's device in training mode; the task loss as a function of the module's parts
        (``bilevel.module_loss``), the parts (adapter, head) and the device."""
        rt = self.rt
        model = rt.model.to(rt.device).train()
        parts = split_parts(model.trainable_spec())
        return module_loss(model, parts, model.parameter_paths()), parts, rt.device

    def stacked_modules(
        self, message: Message, parts: Mapping[str, ArraySpec], device: torch.device
    ) -> list[torch.Tensor]:
        """The message's modules stacked per part (one [M, P] array per part: FedKEI's cluster modules, APPLE's
        previous modules), as tensors on ``device``; checked against this site's part widths."""
        record = message.content["arrays"]
        stacked = []
        for part, spec in parts.items():
            value = record[part].numpy()
            width = part_width(spec)
            if value.ndim != 2 or value.shape[1] != width:
                raise ValueError(
                    f"received {part} cluster modules of shape {value.shape}; this site's {part} has {width} parameters"
                )
            stacked.append(torch.as_tensor(value, device=device))
        return stacked

    def initialise(self, message: Message, loss_fn: LossFn, parts: OrderedDict, device: torch.device, train) -> dict:
        """Set the model's trainable arrays to the task's start and return metrics about it: the sent module, else
        the fresh seeded one. A method with another start overrides this."""
        rt = self.rt
        rt.model.set_trainable(rt.initial_arrays)
        if "arrays" in message.content.array_records:
            rt.model.set_trainable(from_record(message.content["arrays"]))
        return {}

    def finetune_loss(self, message: Message, train) -> ExtraLoss | None:
        """A term added to the task loss while fine-tuning (none by default; a method's regulariser).
        Called after ``initialise``, so the model holds the task's starting module."""
        return None

    def finetune(self, train, epochs: int, after_epoch, extra_loss: ExtraLoss | None, device: torch.device) -> dict:
        """Fine-tune the task's module: ``task-epochs`` epochs of the run's optimizer over every trainable
        parameter. A method with its own local update (Per-FedAvg's, FFA-LoRA's frozen A) overrides this."""
        rt = self.rt
        return train_epochs(
            rt.model,
            make_loader(train, rt.cfg.batch_size, True, rt.seed(1), **rt.loader_options(True)),
            epochs=epochs,
            optimizer=rt.optimizer(),
            device=device,
            extra_loss=extra_loss,
            after_epoch=after_epoch,
            precision=rt.cfg.precision,
        )

    def upload(self, message: Message, train) -> OrderedDict[str, np.ndarray]:
        """What leaves the site after the task: its fine-tuned module θ_i^t (adapter + head)."""
        return self.rt.model.get_trainable()

    def train(self, message: Message) -> RecordDict:
        """Initialise the task's module, fine-tune, AUC after every epoch, upload the module."""
        rt = self.rt
        loss_fn, parts, device = self.module_setup()
        train, test = self.task_split("train"), self.task_split("test")
        metrics = self.initialise(message, loss_fn, parts, device, train)
        extra_loss = self.finetune_loss(message, train)

        test_loader = make_loader(test, rt.cfg.batch_size, False, 0, **rt.loader_options(False))
        curve = [evaluate(rt.model, test_loader, device, precision=rt.cfg.precision)["auc"]]
        epoch_s: list[float] = []
        clock = [time.monotonic()]

        def after_epoch(_epoch: int) -> None:
            epoch_s.append(time.monotonic() - clock[0])
            curve.append(evaluate(rt.model, test_loader, device, precision=rt.cfg.precision)["auc"])
            clock[0] = time.monotonic()

        torch.manual_seed(rt.seed(2))
        result = self.finetune(train, rt.cfg.task_epochs, after_epoch, extra_loss, device)
        epochs = np.asarray(curve[1:], dtype=np.float64)
        metrics.update(result)
        metrics.update(
            {
                "auc": float(epochs[-1]),
                "lca": float(np.mean(epochs)) if np.isfinite(epochs).all() else float("nan"),
                "auc_init": float(curve[0]),
                "auc_curve": [float(v) for v in curve],
                "epoch_s": float(np.mean(epoch_s)),
                "num-examples": len(train),
                "n_test": len(test),
                "n_test_positive": int(test.labels.sum()),
                "new_class": self.class_order()[self.task],
            }
        )
        return self.reply(arrays=self.upload(message, train), metrics=metrics)


# ----------------------------------------------------------------------------- pieces methods share
def latest_modules(pool: KnowledgePool, task: int) -> tuple[list[PoolEntry], list[OrderedDict[str, np.ndarray]]]:
    """The pooled modules of the latest task before ``task`` (task t − 1 unless no site finished it), in client
    order; empty while the pool is."""
    tasks = [e.task for e in pool.entries if e.task < task]
    if not tasks:
        return [], []
    latest = max(tasks)
    chosen = [(e, m) for e, m in zip(pool.entries, pool.modules) if e.task == latest]
    return [e for e, _ in chosen], [m for _, m in chosen]


# ----------------------------------------------------------------------------- server half
class ContinualStrategy(FederatedStrategy):
    """The continual task protocol's server: one iteration of ``run`` per task; each finished module joins the
    knowledge pool. Every task starts fresh unless a method says otherwise (``start_module``, ``task_contents``).
    Not a strategy itself: FedKEI and the baselines subclass it."""

    local_steps = False  # its sites train by their own loop (local-epochs / task-epochs)

    client_half = ContinualClient
    options = CONTINUAL_OPTIONS
    tasks = ("classification",)  # a stream of binary tasks: the new class vs the classes seen before
    round_label = "task"
    report = ContinualReport  # summary.md: the per-task table; curves.png: AUC per epoch, task after task
    contract_case: ClassVar[dict[str, Any]] = {
        "config": {"num-tasks": 3, "task-epochs": 1, "optimizer": "sgd", "lr": 0.01},
        "train_kind": "eval",
        "no_arrays_down": (1,),
        "why": "walks tasks; task 1 starts from a fresh module (nothing sent down); a fine-tuning reply is "
        "logged as the task's 'eval' record",
    }

    @classmethod
    def model_classes(cls, num_classes: int) -> int:
        return 2  # every task is binary: the new class vs the classes seen before

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        if cfg.fedkei_variant != "full" and all(o.key != VARIANT_KEY for o in cls.options):
            raise bad(
                VARIANT_KEY,
                cfg.fedkei_variant,
                f"picks fedkei's initialisation; strategy {cls.name!r} has its own (leave fedkei-variant unset)",
            )

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        cfg = self.cfg
        self.parts = split_parts(self.spec)
        self.pool = KnowledgePool(self.recorder.run_dir / run_folder.CHECKPOINT / "pool", self.spec)
        self.num_tasks = count_tasks(self.task_class_order(), cfg.num_tasks)
        names = cfg.server_class_names(self.num_classes)
        for site, own in parse_site_task_classes(cfg.fedkei_site_classes).items():
            try:
                site_class_order(self.task_class_order(), own, names, f"site {site!r}")
            except DataError as exc:
                raise bad("fedkei-site-classes", cfg.fedkei_site_classes, str(exc)) from exc
        log(
            INFO,
            "[medflower] %s (%s): %d tasks; module %d adapter + %d head parameters",
            self.name,
            self.start_description(),
            self.num_tasks,
            *(part_width(spec) for spec in self.parts.values()),
        )

    def start_description(self) -> str:
        """How a task starts, for the log line of ``setup``."""
        return "its own start"

    def total_rounds(self) -> int:
        return self.num_tasks

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        return {}, {"pool": self.pool.index()}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.pool.restore(meta.get("pool", []))

    # ------------------------------------------------------------------ one task
    def counted_exchange(
        self, grid, action: str, contents: Mapping[int, RecordDict], task: int, expect: ArraySpec | None, phase: str
    ) -> list[Reply]:
        """``exchange`` with the phase's bytes each way, nodes and replies in the task's server record
        (``bytes.<phase>``)."""
        down, up = self.stats.bytes_down, self.stats.bytes_up
        replies = self.exchange(grid, action, contents, task, expect=expect)
        self.stats.extra.setdefault("bytes", {})[phase] = {
            "down": self.stats.bytes_down - down,
            "up": self.stats.bytes_up - up,
            "nodes": len(contents),
            "replies": len(replies),
        }
        return replies

    def pool_mean(self) -> OrderedDict[str, np.ndarray]:
        """The n_i-weighted mean of every pooled module (weights capped at ``max-client-share``)."""
        return weighted_mean(self.pool.modules, self.shares([e.num_examples for e in self.pool.entries]))

    def start_module(self, task: int) -> Mapping[str, np.ndarray] | None:
        """The module every site starts task ``task`` from; None: the fresh seeded module (the default)."""
        return None

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """The fine-tuning message per node: the task's config and ``start_module``. A method that sends each site
        its own start, or runs a phase before the task, overrides this."""
        return self.start_contents(task, nodes, self.start_module(task))

    def start_contents(
        self, task: int, nodes: list[int], arrays: Mapping[str, np.ndarray] | None
    ) -> dict[int, RecordDict]:
        """One fine-tuning message per node: the task's config and, unless ``arrays`` is None (a fresh start), the
        same module or stacked modules to start from."""
        contents = {}
        for node in nodes:
            content = RecordDict({"config": self.base_config(task)})
            if arrays is not None:
                content["arrays"] = to_record(arrays)
            contents[node] = content
        return contents

    def finetune_spec(self) -> ArraySpec:
        """The arrays every fine-tuning reply must hold: the module θ (a method may add its own)."""
        return self.spec

    def finetuned(self, task: int, reply: Reply) -> None:
        """A checked fine-tuning reply: its module θ_i^t joins the knowledge pool (the pool keeps the model's arrays
        only) and its metrics are the task's record. A method that uploads more (a Fisher) keeps it here."""
        self.pool.add(task, reply.client, reply.arrays, reply.num_examples)
        self.recorder.log_client(task, reply.client, "eval", reply.metrics, task=task)

    def task_record(self, task: int) -> dict[str, Any]:
        """Fields of the task's server record set before its messages go out."""
        return {"task": task, "pool_size": len(self.pool)}

    def run_round(self, grid, task: int) -> None:
        nodes = self.sample_nodes(task)
        self.stats.extra.update(self.task_record(task))
        contents = self.task_contents(grid, task, nodes)
        replies = self.counted_exchange(grid, "train", contents, task, self.finetune_spec(), "finetune")
        for reply in replies:
            self.finetuned(task, reply)
        if not replies:
            log(WARNING, "[medflower] task %d: no site finished fine-tuning; the pool is unchanged", task)

    def summary_extra(self) -> dict[str, Any]:
        return continual_summary(self.recorder.records("eval"))


class PoolMeanInit(ContinualStrategy):
    """The protocol with the pool-mean start: nothing for task 1 (or an empty pool), else the n_i-weighted mean of
    every pooled module, which the sites start from (``ContinualClient.initialise``). Not a strategy itself:
    fedprox-init, ffa-lora, per-fedavg and elcfs subclass it."""

    def start_module(self, task: int) -> Mapping[str, np.ndarray] | None:
        return self.pool_mean() if task > 1 and len(self.pool) > 0 else None
