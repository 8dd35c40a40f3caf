"""The federated class-incremental protocol that pFedMxF and its baselines run: tasks of new classes, a few rounds
each, one head over every class.

Documented in docs/methods/pfedmxf.md ("Spec as implemented") and, for the other baselines,
docs/methods/baselines-incremental.md. One run walks T tasks of C classes (``data/tasks.py``: labels are positions
in the class order), with ``rounds-per-task`` federated rounds each. The model is a frozen backbone whose q and k
projections carry a trainable update (``models/qk_delta.py``) plus one linear head over every class; after each
round every site reports its accuracy over all classes seen so far, and ``summary.json`` gets Last and Avg
(``report.py``). The classifier is ``heads.py``'s.

A method of the protocol subclasses ``IncrementalStrategy`` and ``IncrementalClient`` and fills in their hooks: the
q/k state every node gets (``model_arrays``) and what only one node gets (``node_arrays``), how the replies' q/k
updates are aggregated (``aggregate_updates``) and what happens at a task's end (``end_task``) on the server; how a
site loads the received state (``load``), what it trains on (``training_objective``) and sends (``upload``).
``LoRAClient`` is the site of the LoRA baselines (merged ΔW frozen, LoRA A and B trained).

Classifier (``classifier``): ``aac`` trains task t's block of head rows with a softmax over that task's
classes (Eq. 16) and predicts with the prototype router (Eqs. 17-18); ``unified`` trains and predicts with
one softmax over every seen class (Eq. 15). Heads are averaged with weights n_k (Eq. 19). Rows outside the
training softmax (aac: other tasks'; unified: future classes') leave local training bit-identical, weight
decay included (``frozen_rows``).

Decision (``aac-prototype``): the router's μ_t is the mean of task t's head rows, and the within-task
cross-entropy's gradient sums to zero over those rows, so training never moves μ_t: taken literally
(``weights``) the router keeps its random initialisation. With ``feature-mean`` (default) a site sets its
block's row mean to the mean feature of its task-t training rows after local training, which leaves every
within-task probability unchanged; averaging the heads by n_k then makes μ_t the federation's task mean.

What leaves a site each round: its q/k update (the method's), the head, and n_k = its training rows of the task.
Evaluation: metrics only. What comes to a site: the method's q/k state and the head.
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

from ...contract import ClientHalf, FederatedStrategy, Reply, from_record, to_record, weighted_mean
from ...data import make_loader
from ...data.tasks import count_incremental_tasks, incremental_task, parse_task_classes
from ...models import build_model
from ...models.qk_delta import qk_modules
from ...options import Option, bad, non_negative, one_of, positive
from ...training import ExtraLoss, train_epochs
from .heads import MaskedLogits, aac_log_probs, frozen_rows, logit_mask, mean_feature, set_block_mean
from .report import IncrementalReport, incremental_summary

HEAD = ("head.weight", "head.bias")


# ----------------------------------------------------------------------------- client half
class IncrementalClient(ClientHalf):
    """A site's class-incremental training (``train``) and evaluation over the seen classes (``evaluate``)."""

    def class_order(self) -> list[int]:
        return parse_task_classes(self.rt.cfg.task_classes, self.rt.data.class_names)

    @property
    def task(self) -> int:
        return int(self.rt.config["task"])

    def split(self, split: str, seen: bool):
        return incremental_task(
            getattr(self.rt.data, split), self.class_order(), self.rt.cfg.classes_per_task, self.task, seen=seen
        )

    def load(self, arrays: Mapping[str, np.ndarray], training: bool) -> None:
        """Put the received state (q/k updates and head) into the model."""
        raise NotImplementedError

    def upload(self) -> OrderedDict[str, np.ndarray]:
        """What this site sends after training (besides the head)."""
        raise NotImplementedError

    def training_objective(self, model: torch.nn.Module, train) -> tuple[torch.nn.Module, ExtraLoss | None]:
        """The module local training calls (the masked model) and a term added to its loss (none). A baseline
        wraps or regularises here: an EWC penalty, an LwF distillation that needs the batch's inputs."""
        return model, None

    def train(self, message: Message) -> RecordDict:
        rt, cfg = self.rt, self.rt.cfg
        model = rt.model
        self.load(from_record(message.content["arrays"]), training=True)
        train = self.split("train", seen=False)
        metrics: dict[str, float] = {"num-examples": len(train), "task": self.task}
        if len(train) == 0:  # e.g. Dirichlet skew left this site without the task's classes: nothing to learn
            log(
                WARNING,
                "[medflower] %s has no training rows of task %d; it sends its state unchanged",
                rt.client,
                self.task,
            )
        else:
            params = model.trainable_parameters()
            heads = [p for n, p in params.items() if n in HEAD]
            adapters = [p for n, p in params.items() if n not in HEAD]
            lr = rt.optimizer().lr  # lr-decay applies to both groups
            groups = [{"params": adapters, "lr": lr}, {"params": heads, "lr": (cfg.head_lr or cfg.lr) * lr / cfg.lr}]
            mask = logit_mask(cfg.classifier, cfg.classes_per_task, self.task, model.head.out_features)
            trained, extra_loss = self.training_objective(MaskedLogits(model, mask), train)
            torch.manual_seed(rt.seed(2))
            loader = make_loader(train, cfg.batch_size, True, rt.seed(1), **rt.loader_options(True))
            with frozen_rows(model.head, ~mask):
                metrics.update(
                    train_epochs(
                        trained,
                        loader,
                        epochs=cfg.local_epochs,
                        optimizer=rt.optimizer(),
                        device=rt.device,
                        extra_loss=extra_loss,
                        param_groups=groups,
                        precision=cfg.precision,
                    )
                )
            if cfg.classifier == "aac" and cfg.aac_prototype == "feature-mean":
                with torch.no_grad():
                    set_block_mean(
                        model.head.weight,
                        cfg.classes_per_task,
                        self.task,
                        mean_feature(model, make_loader(train, cfg.batch_size, False, 0), rt.device),
                    )
        arrays = self.upload()
        arrays.update((k, v) for k, v in model.get_trainable().items() if k in HEAD)
        return self.reply(arrays=arrays, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, message: Message) -> RecordDict:
        """Accuracy over every class seen so far; with AAC also the router's task accuracy and the
        accuracy within the true task."""
        rt, cfg = self.rt, self.rt.cfg
        model = rt.model.to(rt.device).eval()
        self.load(from_record(message.content["arrays"]), training=False)
        test = self.split("test", seen=True)
        c, t = cfg.classes_per_task, self.task
        correct = routed = within = 0
        for x, y in make_loader(test, cfg.batch_size, False, rt.seed(1)):
            x, y = x.to(rt.device), y.to(rt.device)
            features = model.features(x).float()
            if cfg.classifier == "aac":
                scores, router = aac_log_probs(features, model.head.weight.float(), model.head.bias.float(), c, t)
                true_task = torch.div(y, c, rounding_mode="floor")
                routed += int((router.argmax(dim=1) == true_task).sum())
                blocks = scores.reshape(len(y), t, c)[torch.arange(len(y), device=y.device), true_task]
                within += int((blocks.argmax(dim=1) == y % c).sum())
            else:
                scores = model.head(features)[:, : t * c]
            correct += int((scores.argmax(dim=1) == y).sum())
        n = len(test)
        metrics = {
            "accuracy": correct / n if n else float("nan"),
            "n": n,
            "task": t,
            "task_end": int(rt.config.get("task-end", 0)),
        }
        if cfg.classifier == "aac" and n:
            metrics.update(router_accuracy=routed / n, within_task_accuracy=within / n)
        return self.reply(metrics=metrics)


class LoRAClient(IncrementalClient):
    """Merged ΔW of q and k frozen, the received LoRA A and B trained."""

    def load(self, arrays: Mapping[str, np.ndarray], training: bool) -> None:
        model = self.rt.model.to(self.rt.device)
        with torch.no_grad():
            for name, module in qk_modules(model).items():
                module.merged.copy_(torch.as_tensor(arrays[f"{name}.merged"]))
        model.set_trainable({k: v for k, v in arrays.items() if not k.endswith(".merged")})

    def upload(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, v) for k, v in self.rt.model.get_trainable().items() if k not in HEAD)


# ----------------------------------------------------------------------------- server half
INCREMENTAL_OPTIONS = (
    Option("rounds-per-task", 5, "class-incremental runs: federated rounds per task", positive, "incremental"),
    Option(
        "classifier",
        "aac",
        "class-incremental runs: aac = a head per task + prototype router, unified = one softmax over the seen classes",
        one_of("aac", "unified"),
        "incremental",
    ),
    Option(
        "aac-prototype",
        "feature-mean",
        "aac: the router's task prototype (mean of the task's head rows) is set "
        "to the task's mean feature after local training, or left as trained (weights: the paper taken "
        "literally; it never moves)",
        one_of("feature-mean", "weights"),
        "incremental",
    ),
    Option(
        "head-lr",
        0.0,
        "class-incremental runs: learning rate of the heads (0 = lr; the paper uses 1e-3 heads, 1e-5 adapter)",
        non_negative,
        "incremental",
    ),
)


class IncrementalStrategy(FederatedStrategy):
    """T tasks x rounds-per-task rounds; heads averaged by n_k; every site evaluated after every round. Not a strategy
    itself: pFedMxF and the baselines subclass it."""

    local_steps = False  # its sites train by their own loop (local-epochs / task-epochs)

    options = INCREMENTAL_OPTIONS
    tasks = ("classification",)  # class-incremental tasks
    report = IncrementalReport  # summary.md: accuracy over the seen classes after every task, Last and Avg
    contract_case: ClassVar[dict[str, Any]] = {
        "config": {
            "num-tasks": 2,
            "classes-per-task": 2,
            "rounds-per-task": 2,
            "n-frequency": 64,
            "lora-rank": 2,
            "optimizer": "adam",
            "lr": 0.01,
            "partition": "qbli",
        },
        "rounds": 4,
        "why": "two tasks of two rounds; the stopped run dies inside task 2",
    }

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        if cfg.task_order != "sync":
            raise bad("task-order", cfg.task_order, "class-incremental tasks share one class order (sync)")

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        cfg, num_classes = self.cfg, self.num_classes
        self.num_tasks = count_incremental_tasks(self.task_class_order(), cfg.classes_per_task, cfg.num_tasks)
        with torch.random.fork_rng(devices=[]):  # the q/k modules' shapes (the arrays do not show them all)
            self.modules = {
                name: (m.dim_qk, m.dim_in) for name, m in qk_modules(build_model(cfg.model_spec(), num_classes)).items()
            }
        self.head_spec = OrderedDict((k, self.spec[k]) for k in HEAD)
        log(
            INFO,
            "[medflower] %s (%s classifier): %d tasks x %d classes, %d rounds per task; %d q/k matrices",
            self.name,
            cfg.classifier,
            self.num_tasks,
            cfg.classes_per_task,
            cfg.rounds_per_task,
            2 * len(self.modules),
        )

    def total_rounds(self) -> int:
        return self.num_tasks * self.cfg.rounds_per_task

    def task_of(self, rnd: int) -> int:
        return (rnd - 1) // self.cfg.rounds_per_task + 1

    def is_task_end(self, rnd: int) -> bool:
        return rnd % self.cfg.rounds_per_task == 0

    # ------------------------------------------------------------------ method hooks
    def model_arrays(self, task: int) -> OrderedDict[str, np.ndarray]:
        """The q/k state every node gets this round (built once per phase; the head is added by the caller)."""
        raise NotImplementedError

    def node_arrays(self, node_id: int, task: int) -> OrderedDict[str, np.ndarray]:
        """What only this node gets for training (pfedmxf: its own coordinates)."""
        return OrderedDict()

    def aggregate_updates(self, rnd: int, task: int, replies: list[Reply]) -> None:
        raise NotImplementedError

    def end_task(self, task: int) -> None:
        """After the last round of a task."""

    # ------------------------------------------------------------------ one round
    def contents(self, nodes: list[int], rnd: int, training: bool) -> dict[int, RecordDict]:
        """One message per node: the shared state plus (training) the node's own arrays; a fresh record each."""
        task = self.task_of(rnd)
        shared = self.model_arrays(task)
        shared.update((k, self.global_arrays[k]) for k in HEAD)
        config = {"task": task, "task-end": int(self.is_task_end(rnd))}
        return {
            n: RecordDict(
                {
                    "arrays": to_record({**shared, **(self.node_arrays(n, task) if training else {})}),
                    "config": self.base_config(rnd, **config),
                }
            )
            for n in nodes
        }

    def run_round(self, grid, rnd: int) -> None:
        task = self.task_of(rnd)
        nodes = self.sample_nodes(rnd)
        self.before_round(task, nodes)
        nodes = [n for n in nodes if n in self.nodes]  # before_round may refuse a site
        contents = self.contents(nodes, rnd, training=True)
        replies = self.exchange(grid, "train", contents, rnd, expect=self.reply_spec)
        for reply in replies:
            self.recorder.log_client(rnd, reply.client, "train", reply.metrics, task=task)
        learned = [r for r in replies if r.num_examples > 0]
        started = time.monotonic()
        if learned:
            self.global_arrays.update(
                weighted_mean(
                    [{k: r.arrays[k] for k in HEAD} for r in learned], self.shares([r.num_examples for r in learned])
                )
            )
            self.aggregate_updates(rnd, task, learned)
        else:
            log(WARNING, "[medflower] round %d: no site trained task %d; the model is unchanged", rnd, task)
        if self.is_task_end(rnd):
            self.end_task(task)
        self.stats.aggregation_s += time.monotonic() - started
        self.stats.extra.update(task=task, task_end=int(self.is_task_end(rnd)))
        contents = self.contents(self.ordered_nodes(), rnd, training=False)
        for reply in self.exchange(grid, "evaluate", contents, rnd):
            self.recorder.log_client(rnd, reply.client, "eval", reply.metrics)

    def before_round(self, task: int, nodes: list[int]) -> None:
        """Per-node preparation before the training messages are built (pfedmxf: allocation)."""

    def summary_extra(self) -> dict[str, Any]:
        return {"classifier": self.cfg.classifier, **incremental_summary(self.recorder.records("eval"))}
