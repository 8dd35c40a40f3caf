"""FedKEI (docs/methods/fedkei.md; equations of the FedKEI paper): continual learning of new diseases from a pool
of past task modules.

One run walks T binary tasks (``data/tasks.py``). A module θ = (LoRA adapter ω, head φ) is fine-tuned
per task and client; the server keeps every θ_i^t in a knowledge pool on disk. Before task t ≥ 2 the
server clusters the pool (k-means++, adapters and heads separately), and server and clients learn
bi-level weights: α (inter-cluster, per client, inner loop, Eq. 6) and β (intra-cluster, global,
one outer step, Eqs. 8-9). The client initialises θ̃ = Σ_c α̂_c θ_c(β) (Eq. 5) and fine-tunes.
This module is the protocol (both halves and the run-config options); the maths are in ``fedkei_bilevel.py``,
the pool in ``knowledge_pool.py``, summary.json/.md's per-task tables and curves.png in ``continual_report.py``.

What leaves a site: after each task its fine-tuned module θ_i^t (adapter + head) and n_i; in the
bi-level phase the gradients ∇_{θ_c} L_i w.r.t. the K cluster modules. What comes to a site: K
cluster modules, twice (before and after the β step). Per task and client (3K+1)·|θ|.

Decisions where the paper is vague (also in docs/methods/fedkei.md):
- The outer loss (Eq. 7) is the mean task loss over the client's training split of the task at
  α_i^t, the α after the inner epoch; the test split stays untouched for the reported AUC.
- Variant C sends ∇_{θ_c} L at α_i^t with α_i^t held fixed (β by plain gradient descent on the task
  loss, no back-propagation through the inner loop).
- Variant A uses one "cluster" per client (the mean of its past modules), K = number of such clients.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log

from ..contract import (
    ArraySpec,
    ClientHalf,
    FederatedStrategy,
    Reply,
    derive_seed,
    from_record,
    register_strategy,
    to_record,
    unflatten,
    weighted_mean,
)
from ..data import DataError, make_loader
from ..data.tasks import (
    binary_task,
    client_class_order,
    count_tasks,
    parse_site_task_classes,
    parse_task_classes,
    site_class_order,
)
from ..options import Option, bad, non_negative, one_of, parsed, positive
from ..training import ExtraLoss, evaluate, train_epochs
from .continual_report import ContinualReport, continual_summary
from .fedkei_bilevel import (
    LossFn,
    beta_step,
    cluster_gradients,
    cluster_modules,
    group_membership,
    inner_loop,
    kmeans_membership,
    module_loss,
    normalised,
    part_width,
    split_parts,
)
from .knowledge_pool import KnowledgePool

if TYPE_CHECKING:
    from ..settings import RunSettings


# ----------------------------------------------------------------------------- settings both halves read
# Static settings come from the run config on both sides (the variant, fedkei-grad, fedkei-eta1); what the server
# decides per task travels in the message: the task (its round), and the module or cluster modules to start from.
def gradient_mode(cfg: RunSettings) -> str:
    """The ∇_{θ_c} L a site sends in the bi-level phase: variant C's direct form, else ``fedkei-grad``."""
    return "direct" if cfg.fedkei_variant == "C" else cfg.fedkei_grad


def start_from(variant: str, sent: bool) -> str:
    """How a site initialises the task's module: ``fresh`` when the server sent nothing to start from (task 1,
    variant rand, or an empty pool), else the sent ``module`` (fedavg-init) or Σ α̂_c θ_c of the sent
    ``clusters`` (Eq. 5)."""
    if not sent:
        return "fresh"
    return "module" if variant == "fedavg-init" else "clusters"


# ----------------------------------------------------------------------------- client half
class FedKEIClient(ClientHalf):
    """A site's task stream: bi-level gradients (``train.fedkei_inner``) and per-task fine-tuning (``train``)."""

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

    def _setup(self) -> tuple[LossFn, OrderedDict, torch.device]:
        rt = self.rt
        model = rt.model.to(rt.device).train()
        parts = split_parts(model.trainable_spec())
        return module_loss(model, parts, model.parameter_paths()), parts, rt.device

    def _batches(self, data, shuffle: bool, purpose: int, device: torch.device):
        loader = make_loader(
            data, self.rt.cfg.batch_size, shuffle, self.rt.seed(purpose), **self.rt.loader_options(shuffle)
        )
        for x, y in loader:
            yield (x.to(device), y.to(device)), len(y)

    def _inner_batches(self, train, device: torch.device):
        """The inner loop's epoch: the same batches in the bi-level and the fine-tune phase, so α̂ is the
        α_i^t that β was tuned for."""
        return (batch for batch, _ in self._batches(train, True, 4, device))

    def _clusters(self, message: Message, parts: Mapping[str, ArraySpec], device: torch.device) -> list[torch.Tensor]:
        record = message.content["arrays"]
        clusters = []
        for part, spec in parts.items():
            value = record[part].numpy()
            width = part_width(spec)
            if value.ndim != 2 or value.shape[1] != width:
                raise ValueError(
                    f"received {part} cluster modules of shape {value.shape}; this site's {part} has {width} parameters"
                )
            clusters.append(torch.as_tensor(value, device=device))
        return clusters

    def fedkei_inner(self, message: Message) -> RecordDict:
        """Inner loop on α over one epoch, then ∇_{θ_c} L w.r.t. every received cluster module (Eq. 9)."""
        started = time.monotonic()
        loss_fn, parts, device = self._setup()
        clusters = self._clusters(message, parts, device)
        train = self.task_split("train")
        torch.manual_seed(self.rt.seed(3))
        grads, inner, outer_loss = cluster_gradients(
            loss_fn,
            clusters,
            self._inner_batches(train, device),
            self._batches(train, False, 5, device),
            float(self.rt.cfg.fedkei_eta1),
            gradient_mode(self.rt.cfg),
        )
        arrays = OrderedDict((part, g.cpu().numpy().astype(np.float32)) for part, g in zip(parts, grads))
        return self.reply(
            arrays=arrays,
            metrics={
                "num-examples": len(train),
                "inner_loss": inner.mean_loss,
                "outer_loss": outer_loss,
                "inner_steps": inner.steps,
                "bilevel_s": time.monotonic() - started,
            },
        )

    def initialise(self, message: Message, loss_fn: LossFn, parts: OrderedDict, device: torch.device, train) -> dict:
        """Set the model's trainable arrays to the task's start (fresh, a sent module, or Σ α̂_c θ_c, Eq. 5) and
        return metrics about it. A baseline with another initialisation overrides this."""
        rt = self.rt
        init = start_from(rt.cfg.fedkei_variant, sent="arrays" in message.content.array_records)
        metrics: dict[str, Any] = {}
        rt.model.set_trainable(rt.initial_arrays)
        if init == "module":
            rt.model.set_trainable(from_record(message.content["arrays"]))
        elif init == "clusters":
            clusters = self._clusters(message, parts, device)
            started = time.monotonic()
            inner = inner_loop(loss_fn, clusters, self._inner_batches(train, device), float(rt.cfg.fedkei_eta1))
            theta = [a @ c for a, c in zip(inner.alphas, clusters)]
            module = OrderedDict()
            for vector, spec in zip(theta, parts.values()):
                module.update(unflatten(vector.cpu().numpy(), spec))
            rt.model.set_trainable(module)
            metrics.update({f"alpha_{p}": a.cpu().tolist() for p, a in zip(parts, inner.alphas)})
            metrics.update(alpha_s=time.monotonic() - started, alpha_loss=inner.mean_loss)
        return metrics

    def finetune_loss(self, message: Message, train) -> ExtraLoss | None:
        """A term added to the task loss while fine-tuning (none for FedKEI; a baseline's regulariser).
        Called after ``initialise``, so the model holds the task's starting module."""
        return None

    def finetune(self, train, epochs: int, after_epoch, extra_loss: ExtraLoss | None, device: torch.device) -> dict:
        """Fine-tune the task's module: ``task-epochs`` epochs of the run's optimizer over every trainable
        parameter. A baseline with its own local update (Per-FedAvg's, FFA-LoRA's frozen A) overrides this."""
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
        loss_fn, parts, device = self._setup()
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


class ModuleStartClient(FedKEIClient):
    """FedKEI's site for a baseline that sends one module to start from: the sent module, else (task 1, an empty
    pool) the fresh seeded one."""

    def initialise(self, message: Message, loss_fn: LossFn, parts: OrderedDict, device: torch.device, train) -> dict:
        rt = self.rt
        rt.model.set_trainable(rt.initial_arrays)
        if "arrays" in message.content.array_records:
            rt.model.set_trainable(from_record(message.content["arrays"]))
        return {}


# ----------------------------------------------------------------------------- server half
VARIANTS = ("full", "A", "B", "C", "rand", "fedavg-init")


OPTIONS = (
    Option(
        "task-epochs",
        30,
        "fedkei: fine-tuning epochs per task (AUC on the task's test split after each)",
        positive,
        "fedkei",
    ),
    Option(
        "fedkei-variant",
        "full",
        "fedkei: full (bi-level), C (beta by plain gradient), B (clusters + alpha), A "
        "(per-client means + alpha); baselines rand, fedavg-init",
        one_of(*VARIANTS),
        "fedkei",
    ),
    Option(
        "fedkei-k-adapter",
        3,
        "fedkei: k-means++ clusters of the pooled adapters (K = min(K, pool size))",
        positive,
        "fedkei",
    ),
    Option(
        "fedkei-site-classes",
        "",
        "fedkei: per-site class orders '<site>=<c_0>,<c_1>,...;...' (site = name or partition id), each as long as "
        "task-classes: a site lacking a class names another in its place; a site's node-config task-classes wins",
        parsed(parse_site_task_classes),
        "fedkei",
    ),
    Option("fedkei-k-head", 3, "fedkei: k-means++ clusters of the pooled heads", positive, "fedkei"),
    Option("fedkei-eta1", 0.05, "fedkei: inner-loop SGD step on alpha (one epoch)", non_negative, "fedkei"),
    Option("fedkei-eta2", 0.05, "fedkei: outer step on beta", non_negative, "fedkei"),
    Option(
        "fedkei-grad",
        "exact",
        "fedkei: gradient through the inner loop; exact = autograd with the Hessian term, "
        "first-order = the paper's closed form",
        one_of("exact", "first-order"),
        "fedkei",
    ),
)


@register_strategy
class FedKEI(FederatedStrategy):
    """FedKEI server: knowledge pool, k-means++ clusters, the β step; one iteration of ``run`` per task.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; in the bi-level phase
    its gradients w.r.t. the K cluster modules; with each task's metrics its test size and number of positive
    test images (n_test, n_test_positive). ``fedkei-variant`` picks full, A, B, C, rand or fedavg-init.
    """

    name = "fedkei"
    client_half = FedKEIClient
    options = OPTIONS
    tasks = ("classification",)  # a stream of binary tasks: the new class vs the classes seen before
    extra_actions = (("train", "fedkei_inner"),)
    round_label = "task"
    uses_variants = True  # fedkei-variant picks the start; a baseline with its own start sets False (and refuses it)
    report = ContinualReport  # summary.md: the per-task table; curves.png: AUC per epoch, task after task

    @classmethod
    def model_classes(cls, num_classes: int) -> int:
        return 2  # every task is binary: the new class vs the classes seen before

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        if not cls.uses_variants and cfg.fedkei_variant != "full":
            raise bad(
                "fedkei-variant",
                cfg.fedkei_variant,
                f"picks fedkei's initialisation; strategy {cls.name!r} has its own (leave fedkei-variant unset)",
            )

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        cfg = self.cfg
        self.parts = split_parts(self.spec)
        self.pool = KnowledgePool(self.recorder.run_dir / "checkpoint" / "pool", self.spec)
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
            f"variant {cfg.fedkei_variant}, {gradient_mode(cfg)} gradient" if self.uses_variants else "its own start",
            self.num_tasks,
            *(part_width(spec) for spec in self.parts.values()),
        )

    def total_rounds(self) -> int:
        return self.num_tasks

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        return {}, {"pool": self.pool.index()}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.pool.restore(meta.get("pool", []))

    # ------------------------------------------------------------------ one task
    def weights(self, task: int, pools: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Initial intra-cluster weights β per part: k-means++ membership (B, C, full) or per client (A)."""
        beta = {}
        for i, part in enumerate(self.parts):
            if self.cfg.fedkei_variant == "A":
                members = group_membership([e.client for e in self.pool.entries])
            else:
                k = self.cfg.fedkei_k_adapter if part == "adapter" else self.cfg.fedkei_k_head
                members = kmeans_membership(pools[part], k, derive_seed(self.cfg.seed, task, 31 + i))
            beta[part] = normalised(members)
        return beta

    def _phase(
        self, grid, action: str, contents: Mapping[int, RecordDict], task: int, expect: ArraySpec | None, phase: str
    ) -> list[Reply]:
        down, up = self.stats.bytes_down, self.stats.bytes_up
        replies = self.exchange(grid, action, contents, task, expect=expect)
        self.stats.extra.setdefault("bytes", {})[phase] = {
            "down": self.stats.bytes_down - down,
            "up": self.stats.bytes_up - up,
            "nodes": len(contents),
            "replies": len(replies),
        }
        return replies

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """The fine-tuning message per node: the task's config and what a site starts from (nothing for task 1,
        ``rand`` or an empty pool; the pool's n_i-weighted mean for ``fedavg-init``; else the K cluster modules
        after the bi-level phase). A baseline with another initialisation overrides this."""
        variant = self.cfg.fedkei_variant
        extra = self.stats.extra
        if task == 1 or variant == "rand" or len(self.pool) == 0:  # the sites start fresh (``start_from``)
            arrays = None
        elif variant == "fedavg-init":
            arrays = weighted_mean(self.pool.modules, self.shares([e.num_examples for e in self.pool.entries]))
        else:
            started = time.monotonic()
            pools = {part: self.pool.matrix(spec) for part, spec in self.parts.items()}
            beta = self.weights(task, pools)
            extra.update({f"k_{p}": int(b.shape[0]) for p, b in beta.items()})
            extra.update(
                {f"clusters_{p}": [[int(j) for j in np.flatnonzero(row)] for row in b] for p, b in beta.items()}
            )
            self.stats.aggregation_s += time.monotonic() - started
            if variant in ("C", "full"):
                beta = self.bilevel_step(grid, task, nodes, beta, pools)
            arrays = OrderedDict((p, cluster_modules(beta[p], pools[p])) for p in self.parts)
        return self.start_contents(task, nodes, arrays)

    def start_contents(
        self, task: int, nodes: list[int], arrays: Mapping[str, np.ndarray] | None
    ) -> dict[int, RecordDict]:
        """One fine-tuning message per node: the task's config and, unless ``arrays`` is None (a fresh start), the
        same module or cluster modules to start from."""
        contents = {}
        for node in nodes:
            content = RecordDict({"config": self.base_config(task)})
            if arrays is not None:
                content["arrays"] = to_record(arrays)
            contents[node] = content
        return contents

    def finetune_spec(self) -> ArraySpec:
        """The arrays every fine-tuning reply must hold: the module θ (a baseline may add its own)."""
        return self.spec

    def finetuned(self, task: int, reply: Reply) -> None:
        """A checked fine-tuning reply: its module θ_i^t joins the knowledge pool (the pool keeps the model's arrays
        only) and its metrics are the task's record. A baseline that uploads more (a Fisher) keeps it here."""
        self.pool.add(task, reply.client, reply.arrays, reply.num_examples)
        self.recorder.log_client(task, reply.client, "eval", reply.metrics, task=task)

    def run_round(self, grid, task: int) -> None:
        nodes = self.sample_nodes(task)
        self.stats.extra.update(task=task, pool_size=len(self.pool))
        if self.uses_variants:
            self.stats.extra["variant"] = self.cfg.fedkei_variant
        contents = self.task_contents(grid, task, nodes)
        replies = self._phase(grid, "train", contents, task, self.finetune_spec(), "finetune")
        for reply in replies:
            self.finetuned(task, reply)
        if not replies:
            log(WARNING, "[medflower] task %d: no site finished fine-tuning; the pool is unchanged", task)

    def bilevel_step(
        self, grid, task: int, nodes: list[int], beta: dict[str, np.ndarray], pools: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Cluster modules down, ∇_{θ_c} L up, one β step over the clients that answered (Eqs. 8-9)."""
        clusters = OrderedDict((p, cluster_modules(beta[p], pools[p])) for p in self.parts)
        expect = OrderedDict((p, (tuple(c.shape), "float32")) for p, c in clusters.items())
        contents = {n: RecordDict({"arrays": to_record(clusters), "config": self.base_config(task)}) for n in nodes}
        replies = self._phase(grid, "train.fedkei_inner", contents, task, expect, "bilevel_gradients")
        for reply in replies:
            self.recorder.log_client(task, reply.client, "bilevel", reply.metrics, task=task)
        started = time.monotonic()
        if not replies:
            log(WARNING, "[medflower] task %d: no bi-level gradient arrived; beta keeps its k-means value", task)
            return beta
        updated = {
            p: beta_step(beta[p], pools[p], [r.arrays[p] for r in replies], self.cfg.fedkei_eta2) for p in self.parts
        }
        self.stats.aggregation_s += time.monotonic() - started
        self.stats.extra.update(
            bilevel_clients=[r.client for r in replies],
            beta_change={p: float(np.abs(updated[p] - beta[p]).sum()) for p in self.parts},
        )
        return updated

    def summary_extra(self) -> dict[str, Any]:
        summary = continual_summary(self.recorder.records("eval"))
        return {"variant": self.cfg.fedkei_variant, **summary} if self.uses_variants else summary
