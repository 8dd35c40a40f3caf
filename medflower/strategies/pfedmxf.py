"""pFedMxF (docs/methods/pfedmxf.md) and its LoRA baselines in a federated class-incremental protocol.

One run walks T tasks of C classes (``data/tasks.py``: labels are positions in the class order), with
``rounds-per-task`` federated rounds each. The model is a frozen backbone whose q and k projections carry
a trainable update (``models/qk_delta.py``) plus one linear head over every class; after each round every
site reports its accuracy over all classes seen so far, and ``summary.json`` gets Last and Avg.
This module is the protocol (both halves and the run-config options); the maths are beside it in ``spectral.py``
(frequency allocation, union spectrum), ``lora_merge.py`` (the baselines' merges) and ``incremental_heads.py``
(the classifier), summary.json's and summary.md's per-task accuracy in ``incremental_report.py``.

- ``pfedmxf``: spectral coefficients. The server's ``FrequencyAllocator`` gives every (task, site) its own
  block of ``n-frequency`` coordinates (disjoint modulo conjugate symmetry by default). A site trains its
  own coefficients with everyone else's frozen; the server scatters all of them into one union spectrum
  (Eq. 13: averaging only where a coordinate is shared). Past tasks' spectra act as merged weights.
  Before round 1 the whole plan (every known site's budget in every task) is checked against the usable
  coordinates of the smallest adapted shape (``plan_capacity``). ``shared`` (the ablation) averages a
  coordinate over this round's replies only; where none holds it, it keeps its value.
- ``fedavg-lora``: LoRA on q and k, A and B averaged separately (Eq. 5, with the interference of Eq. 6);
  merged into the frozen weights at the end of each task, then a fresh LoRA.
- ``fedstack``: FLoRA; p_k-scaled B_k and A_k stacked on the rank axis, so B A = Σ p_k B_k A_k exactly
  (Eqs. 7-8), merged every round; a fresh LoRA every round.

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

What leaves a site each round: its own spectral coefficients (pfedmxf: 2 x n_k per attention block) or
its LoRA A and B (baselines), the head, and n_k = its training rows of the task. Evaluation: metrics only.
What comes to a site: the union spectrum of every allocated coordinate with its coordinates and task
(pfedmxf; plus its own coordinates), or the merged ΔW of q and k and the current LoRA (baselines); the head.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log

from ..contract import (
    ArraySpec,
    ClientHalf,
    FederatedStrategy,
    Reply,
    count_check,
    derive_seed,
    from_record,
    register_strategy,
    to_record,
    validate_arrays,
    weighted_mean,
)
from ..data import DataError, make_loader
from ..data.tasks import count_incremental_tasks, incremental_task, parse_task_classes
from ..models import build_model
from ..models.qk_delta import LoRAQK, qk_modules, spectral_delta
from ..options import Option, bad, non_negative, one_of, positive
from ..training import ExtraLoss, train_epochs
from .incremental_heads import MaskedLogits, aac_log_probs, frozen_rows, logit_mask, mean_feature, set_block_mean
from .incremental_report import IncrementalReport, incremental_summary
from .lora_merge import lora_product, stack_lora
from .spectral import FrequencyAllocator, SiteBlock, dense_spectrum, plan_capacity, shared_block_mean, union_spectrum

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


def configured_budget(cfg, partition_id: int) -> int | None:
    """The budget the run config gives a partition: pfedmxf-n-frequency[partition] when it lists sites (None when it
    lists too few), else n-frequency."""
    per_site = [int(p) for p in cfg.pfedmxf_n_frequency.split(",") if p.strip()]
    if not per_site:
        return cfg.n_frequency
    return per_site[partition_id] if partition_id < len(per_site) else None


class PFedMxFClient(IncrementalClient):
    """Own coefficients trainable, everyone else's of the task frozen, past tasks merged."""

    def __init__(self, runtime):
        super().__init__(runtime)
        runtime.model_overrides = {"n_frequency": self.n_frequency()}

    def n_frequency(self) -> int:
        """This site's coefficient budget: node-config n-frequency, else pfedmxf-n-frequency[partition], else
        n-frequency."""
        rt = self.rt
        if rt.context.node_config.get("n-frequency"):
            return int(rt.context.node_config["n-frequency"])
        budget = configured_budget(rt.cfg, rt.partition_id)
        if budget is None:
            raise DataError(
                f"run-config pfedmxf-n-frequency = {rt.cfg.pfedmxf_n_frequency!r} has no value for partition "
                f"{rt.partition_id}; give one value per partition id"
            )
        return budget

    def query(self, message: Message) -> RecordDict:
        content = super().query(message)
        content["metrics"]["n-frequency"] = float(self.n_frequency())
        return content

    def load(self, arrays: Mapping[str, np.ndarray], training: bool) -> None:
        device = self.rt.device
        model = self.rt.model.to(device)
        layouts: dict[tuple[int, int], SpectrumLayout] = {}
        with torch.no_grad():
            for name, module in qk_modules(model).items():
                shape = (module.dim_qk, module.dim_in)
                if shape not in layouts:
                    layouts[shape] = SpectrumLayout.of(arrays, shape, self.task, training)
                layout, values = layouts[shape], arrays[f"{name}.spectrum"]
                module.merged.copy_(
                    spectral_delta(
                        torch.as_tensor(
                            dense_spectrum(layout.coords[layout.past], values[:, layout.past], shape), device=device
                        ),
                        module.scale,
                    )
                )
                module.frozen.copy_(
                    torch.as_tensor(
                        dense_spectrum(layout.coords[layout.now], values[:, layout.now], shape), device=device
                    )
                )
                if training:
                    module.coords.copy_(torch.as_tensor(layout.own_coords, device=device))
                    module.coefficients.copy_(torch.as_tensor(values[:, layout.own_positions]))
                else:
                    module.coefficients.zero_()
        self.rt.model.set_trainable({k: arrays[k] for k in HEAD}, strict=False)

    def upload(self) -> OrderedDict[str, np.ndarray]:
        params = self.rt.model.get_trainable()
        return OrderedDict((k, v) for k, v in params.items() if k.endswith(".coefficients"))


@dataclass
class SpectrumLayout:
    """Where a received union spectrum's coordinates go on this site, for one matrix shape: past tasks
    (merged), the other sites' coordinates of the current task (frozen), its own (trainable)."""

    coords: np.ndarray
    past: np.ndarray
    now: np.ndarray
    own_coords: np.ndarray
    own_positions: np.ndarray

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray], shape: tuple[int, int], task: int, training: bool) -> SpectrumLayout:
        key = shape_key(shape)
        coords, tasks = arrays[f"freq.{key}.coords"], arrays[f"freq.{key}.task"]
        own_coords = arrays[f"freq.{key}.own"] if training else np.zeros(0, np.int64)
        own = np.isin(coords, own_coords)
        positions = np.searchsorted(coords, own_coords)  # coords are sorted, and hold every own coordinate
        if training and not np.array_equal(coords[np.minimum(positions, len(coords) - 1)], own_coords):
            raise ValueError("the union spectrum does not contain this site's own coordinates")
        return cls(coords, tasks < task, (tasks == task) & ~own, own_coords, positions)


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


def shape_key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


# ----------------------------------------------------------------------------- server half
def parse_n_frequency_list(v: Any) -> str:
    """'' or comma-separated integers >= 1 (one per partition id)."""
    text = str(v).strip()
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise ValueError("must be empty or comma-separated integers >= 1, one per partition id")
    return text


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
PFEDMXF_OPTIONS = (
    Option(
        "n-frequency", 3000, "pfedmxf: spectral coefficients per adapted matrix, client and task", positive, "pfedmxf"
    ),
    Option(
        "pfedmxf-n-frequency",
        "",
        "pfedmxf: per-site n-frequency by partition id, e.g. '3000,1500'; empty = "
        "n-frequency (a node-config n-frequency wins)",
        None,
        "pfedmxf",
        parse_n_frequency_list,
    ),
    Option("fourier-scale", 150.0, "pfedmxf: scale of Re(IDFT2(S)) (peft FourierFT's scaling)", positive, "pfedmxf"),
    Option(
        "conjugate-aware",
        True,
        "pfedmxf: allocate coordinates disjoint modulo (u,v) ~ (-u,-v), so updates are "
        "exactly orthogonal; false = the paper",
        None,
        "pfedmxf",
    ),
    Option(
        "frequency-sharing",
        "disjoint",
        "pfedmxf: disjoint = own coordinates per (site, task); shared = one "
        "block per task for all sites (the paper's ablation)",
        one_of("disjoint", "shared"),
        "pfedmxf",
    ),
)


class IncrementalStrategy(FederatedStrategy):
    """T tasks x rounds-per-task rounds; heads averaged by n_k; every site evaluated after every round."""

    options = INCREMENTAL_OPTIONS
    tasks = ("classification",)  # class-incremental tasks
    report = IncrementalReport  # summary.md: accuracy over the seen classes after every task, Last and Avg

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


@register_strategy
class PFedMxF(IncrementalStrategy):
    """pFedMxF server: frequency allocation, union spectrum, head averaging.

    Leaves a site: its own coefficients (2 x n_k per attention block), the head and n_k; with the default
    aac-prototype='feature-mean' the head's current-task rows are the site's mean feature of that task.
    """

    name = "pfedmxf"
    client_half = PFedMxFClient
    options = (*INCREMENTAL_OPTIONS, *PFEDMXF_OPTIONS)
    adapter = "fourier"  # spectral coefficients on the q and k projections

    @classmethod
    def model_fields(cls, cfg, class_names: list[str]) -> dict[str, Any]:
        return {"adapter": cls.adapter, "n_frequency": cfg.n_frequency, "fourier_scale": cfg.fourier_scale}

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        cfg = self.cfg
        self.allocator = FrequencyAllocator(
            list(self.modules.values()), cfg.seed, cfg.conjugate_aware, shared=cfg.frequency_sharing == "shared"
        )
        self.blocks: dict[tuple[int, str], SiteBlock] = {}  # (task, client) -> its coefficients and weight
        self.plan_checked: frozenset[int] = frozenset()  # the nodes whose budgets the plan was checked for

    def n_frequency(self, node_id: int) -> int:
        return int(self.nodes[node_id].extra.get("n-frequency", self.cfg.n_frequency))

    def configured_budget(self, partition_id: int) -> int:
        """What the run config gives a partition (n-frequency where pfedmxf-n-frequency lists too few sites)."""
        budget = configured_budget(self.cfg, partition_id)
        return self.cfg.n_frequency if budget is None else budget

    def fits(self, budgets: list[int]) -> bool:
        modules = list(self.modules.values())
        return plan_capacity(modules, budgets, self.num_tasks, self.cfg.conjugate_aware, self.allocator.shared).fits

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        """A query's n-frequency (a site's own budget, node-config n-frequency) is a positive integer that fits
        the q/k matrices on its own."""
        if problem := super().check_reply_values(phase, reply):
            return problem
        if phase == "query" and "n-frequency" in reply.metrics:
            if count_check(reply.metrics, "n-frequency") or reply.metrics["n-frequency"] < 1:
                return "n-frequency must be a positive integer"
            own = int(reply.metrics["n-frequency"]) != self.configured_budget(reply.partition_id)
            if own and not self.fits([int(reply.metrics["n-frequency"])]):  # the run config's: check_plan says
                return f"n-frequency {int(reply.metrics['n-frequency'])} does not fit the q/k matrices even alone"
        return None

    def refuse_until_fits(self, candidates: list[int], why: str) -> None:
        """Refuse ``candidates`` (last first) until the known sites' blocks fit together: one site cannot stop the
        run. Nothing is refused when refusing all of them would not make the plan fit (a run-config problem)."""
        rest = [n for n in self.ordered_nodes() if n not in candidates]
        if not candidates or not rest or not self.fits([self.n_frequency(n) for n in rest]):
            return  # every site, or not enough: check_plan names the run-config key
        for node_id in reversed(candidates):
            if self.fits([self.n_frequency(n) for n in self.ordered_nodes()]):
                return
            info = self.nodes.pop(node_id)
            self.reject(
                self.completed_rounds + 1,
                "plan",
                info.client,
                f"{why} makes the sites' blocks exceed the q/k matrices; refused",
            )

    def check_plan(self) -> None:
        """Refuse, before round 1 sends anything to train, a run whose blocks would not fit: every known site
        (with its own budget) in every task, against the usable coordinates of every adapted q/k shape."""
        nodes = self.ordered_nodes()
        budgets = [self.n_frequency(n) for n in nodes]
        plan = plan_capacity(
            list(self.modules.values()), budgets, self.num_tasks, self.cfg.conjugate_aware, self.allocator.shared
        )
        rows, cols = plan.shape
        usable = (
            "conjugate classes (conjugate-aware=true)"
            if self.cfg.conjugate_aware
            else "coordinates (conjugate-aware=false)"
        )
        if plan.fits:
            log(
                INFO,
                "[medflower] pfedmxf plan: %d tasks x %d per task = %d of the %d usable %s of a %dx%d matrix",
                plan.tasks,
                plan.per_task,
                plan.need,
                plan.capacity,
                usable,
                rows,
                cols,
            )
            return
        key, value = (
            ("pfedmxf-n-frequency", self.cfg.pfedmxf_n_frequency)
            if self.cfg.pfedmxf_n_frequency
            else ("n-frequency", self.cfg.n_frequency)
        )
        uniform = set(budgets) == {self.cfg.n_frequency} and not self.cfg.pfedmxf_n_frequency  # n-frequency alone
        limit = f"lower n-frequency to at most {plan.largest}"
        if plan.shared:
            uses = (
                f"frequency-sharing='shared' takes one block per task as long as the largest budget: "
                f"{plan.tasks} tasks x {plan.per_task}"
            )
        elif uniform:
            uses = f"{len(budgets)} sites x {plan.tasks} tasks x {budgets[0]}"
        else:
            sites = ", ".join(f"{self.nodes[n].client}={b}" for n, b in zip(nodes, budgets))
            uses = (
                f"the sites' budgets ({sites}; a node-config n-frequency wins) sum to {plan.per_task} per "
                f"task; {plan.tasks} tasks x {plan.per_task}"
            )
            limit += f" for every site, or make the budgets sum to at most {plan.capacity // plan.tasks} per task"
        raise bad(
            key,
            value,
            f"{uses} = {plan.need} coordinates needed, but a {rows}x{cols} q/k matrix has "
            f"{plan.capacity} usable {usable}; {limit}",
        )

    def before_round(self, task: int, nodes: list[int]) -> None:
        if self.plan_checked != set(self.nodes):  # the sites and their budgets are known (again)
            nodes_now = self.ordered_nodes()
            raised = [n for n in nodes_now if self.n_frequency(n) > self.configured_budget(self.nodes[n].partition_id)]
            self.refuse_until_fits(raised, "its node-config n-frequency")
            if self.plan_checked:  # a site that joined later must fit beside the others
                self.refuse_until_fits([n for n in nodes_now if n not in self.plan_checked], "joining")
            else:  # before round 1: a plan the run config makes too large is a config error
                self.check_plan()
            self.plan_checked = frozenset(self.nodes)
        for node_id in [n for n in nodes if n in self.nodes]:  # lexicographic (task, partition id): partition order
            info = self.nodes[node_id]
            allocation = self.allocator.allocate(task, info.client, info.partition_id, self.n_frequency(node_id))
            if (task, info.client) not in self.blocks:
                self.blocks[(task, info.client)] = SiteBlock(
                    OrderedDict((name, np.zeros((2, allocation.n), np.float32)) for name in self.modules)
                )

    def union(self, upto_task: int) -> dict[str, Any]:
        """Per shape the sorted union of the allocated coordinates of tasks <= ``upto_task`` with their task,
        and per module the union spectrum's values [2, U] (one scatter per shape for all its modules)."""
        out: dict[str, Any] = {}
        allocations = [a for a in self.allocator.allocations if a.task <= upto_task]
        blocks = [self.blocks[(a.task, a.client)] for a in allocations]
        for shape in sorted(set(self.modules.values())):
            names = [name for name, module_shape in self.modules.items() if module_shape == shape]
            coords = [self.allocator.coords(a, shape) for a in allocations] or [np.zeros(0, np.int64)]
            tasks = np.concatenate([np.full(a.n, a.task, np.int32) for a in allocations] or [np.zeros(0, np.int32)])
            rows = [np.concatenate([b.coefficients[name] for name in names]) for b in blocks] or [
                np.zeros((2 * len(names), 0), np.float32)
            ]
            unique, values = union_spectrum(coords, rows, [b.weight for b in blocks] or [0.0])
            first = np.unique(np.concatenate(coords), return_index=True)[1]  # shared blocks belong to one task
            out[f"freq.{shape_key(shape)}.coords"] = unique.astype(np.int64)
            out[f"freq.{shape_key(shape)}.task"] = tasks[first]
            out.update((f"{name}.spectrum", values[2 * i : 2 * i + 2]) for i, name in enumerate(names))
        return out

    def model_arrays(self, task: int) -> OrderedDict[str, np.ndarray]:
        return OrderedDict(self.union(task))

    def node_arrays(self, node_id: int, task: int) -> OrderedDict[str, np.ndarray]:
        allocation = self.allocator.get(task, self.nodes[node_id].client)
        return OrderedDict(
            (f"freq.{shape_key(shape)}.own", self.allocator.coords(allocation, shape).astype(np.int64))
            for shape in sorted(set(self.modules.values()))
        )

    def reply_spec(self, node_id: int) -> ArraySpec:
        n = self.n_frequency(node_id)
        return OrderedDict(
            [*((f"{name}.coefficients", ((2, n), "float32")) for name in self.modules), *self.head_spec.items()]
        )

    def aggregate_updates(self, rnd: int, task: int, replies: list[Reply]) -> None:
        if self.allocator.shared:
            self.merge_shared(task, replies)
            return
        for reply in replies:
            self.blocks[(task, reply.client)] = SiteBlock(
                OrderedDict((name, reply.arrays[f"{name}.coefficients"]) for name in self.modules), reply.num_examples
            )

    def merge_shared(self, task: int, replies: list[Reply]) -> None:
        """``frequency-sharing='shared'``: the task's block becomes the n_k-weighted mean of this round's replies
        where one holds a position, its previous value elsewhere (``shared_block_mean``); every holder's stored
        block then carries that value, so ``union`` returns it and no site's older coefficients enter it."""
        holders = [a for a in self.allocator.allocations if a.task == task]
        stored = [self.blocks[(task, a.client)] for a in holders]
        length = max(a.n for a in holders)
        weights = {r.client: r.num_examples for r in replies}
        merged = {}
        for name in self.modules:
            previous = shared_block_mean(
                np.zeros((2, length), np.float32), [b.coefficients[name] for b in stored], [b.weight for b in stored]
            )  # what union() gives now
            merged[name] = shared_block_mean(
                previous,
                [r.arrays[f"{name}.coefficients"] for r in replies],
                self.shares([r.num_examples for r in replies]),
            )
        for allocation, block in zip(holders, stored):
            self.blocks[(task, allocation.client)] = SiteBlock(
                OrderedDict((name, merged[name][:, : allocation.n].copy()) for name in self.modules),
                weights.get(allocation.client, block.weight),
            )

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays = OrderedDict((k, self.global_arrays[k]) for k in HEAD)
        for (task, client), block in sorted(self.blocks.items()):
            arrays.update((f"coef/{task}/{client}/{name}", value) for name, value in block.coefficients.items())
        return arrays, {
            "allocations": self.allocator.table(),
            "weights": [[t, c, b.weight] for (t, c), b in sorted(self.blocks.items())],
        }

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        head = OrderedDict((k, arrays[k]) for k in HEAD)
        if problem := validate_arrays(head, self.head_spec):
            raise ValueError(f"checkpoint does not fit this model: {problem}")
        self.global_arrays.update(head)
        self.allocator.restore(meta["allocations"])
        weights = {(int(t), str(c)): float(w) for t, c, w in meta["weights"]}
        self.blocks = {
            (a.task, a.client): SiteBlock(
                OrderedDict((name, np.array(arrays[f"coef/{a.task}/{a.client}/{name}"])) for name in self.modules),
                weights[(a.task, a.client)],
            )
            for a in self.allocator.allocations
        }


@register_strategy
class FedAvgLoRA(IncrementalStrategy):
    """FedAvg-LoRA: A and B averaged separately (Eq. 5); B̄Ā merged at the end of each task, then a fresh LoRA.

    Leaves a site: its LoRA A and B on q and k, the head and n_k.
    """

    name = "fedavg-lora"
    client_half = LoRAClient
    adapter = "lora-qk"  # LoRA on the q and k slices only

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        cfg = self.cfg
        self.lora_names = [k for k in self.spec if k not in HEAD]
        self.scale = cfg.lora_alpha / cfg.lora_rank
        self.merged = OrderedDict((name, np.zeros((2, *shape), np.float32)) for name, shape in self.modules.items())

    def fresh_lora(self, salt: int) -> None:
        """A seeded fresh LoRA (A as peft initialises it, B = 0), identical for every site."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.cfg.seed, salt, 77))
            for name, (rows, cols) in self.modules.items():
                module = LoRAQK(cols, rows, self.cfg.lora_rank, self.cfg.lora_alpha)
                self.global_arrays[f"{name}.lora_A"] = module.lora_A.detach().numpy().copy()
                self.global_arrays[f"{name}.lora_B"] = module.lora_B.detach().numpy().copy()

    def model_arrays(self, task: int) -> OrderedDict[str, np.ndarray]:
        arrays = OrderedDict((f"{name}.merged", value) for name, value in self.merged.items())
        arrays.update((k, self.global_arrays[k]) for k in self.lora_names)
        return arrays

    def aggregate_updates(self, rnd: int, task: int, replies: list[Reply]) -> None:
        self.global_arrays.update(
            weighted_mean(
                [{k: r.arrays[k] for k in self.lora_names} for r in replies],
                self.shares([r.num_examples for r in replies]),
            )
        )

    def end_task(self, task: int) -> None:
        """Merge B̄Ā into the frozen weights, then start the next task from a fresh LoRA."""
        for name in self.modules:
            self.merged[name] = self.merged[name] + lora_product(
                self.global_arrays[f"{name}.lora_A"], self.global_arrays[f"{name}.lora_B"], self.scale
            )
        self.fresh_lora(task)

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays = OrderedDict(self.global_arrays)
        arrays.update((f"merged/{name}", value) for name, value in self.merged.items())
        return arrays, {}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if not k.startswith("merged/")}, meta)
        self.merged = OrderedDict((name, np.array(arrays[f"merged/{name}"])) for name in self.modules)


@register_strategy
class FedStack(FedAvgLoRA):
    """FedStack / FLoRA: stacked p_k B_k and A_k (Eq. 7) give Σ p_k B_k A_k exactly (Eq. 8), merged every round,
    then a fresh LoRA. Here the server ships the merged ΔW of q and k instead of the stacks, so a site that
    missed rounds needs no replay.

    Leaves a site: its LoRA A and B on q and k, the head and n_k.
    """

    name = "fedstack"

    def aggregate_updates(self, rnd: int, task: int, replies: list[Reply]) -> None:
        weights = list(self.shares([r.num_examples for r in replies]))
        for name in self.modules:
            a, b = stack_lora(
                [r.arrays[f"{name}.lora_A"] for r in replies], [r.arrays[f"{name}.lora_B"] for r in replies], weights
            )
            self.merged[name] = self.merged[name] + lora_product(a, b, self.scale)
        self.stats.extra["stacked_rank"] = sum(r.arrays[self.lora_names[0]].shape[1] for r in replies)
        self.fresh_lora(1000 + rnd)

    def end_task(self, task: int) -> None:
        """Nothing left to merge: every round already merged its update."""
