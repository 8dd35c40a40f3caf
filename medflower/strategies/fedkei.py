"""FedKEI (docs/methods/fedkei.md; equations of the FedKEI paper): continual learning of new diseases from a pool of past task modules.

One run walks T binary tasks (``data/tasks.py``). A module θ = (LoRA adapter ω, head φ) is fine-tuned
per task and client; the server keeps every θ_i^t in a knowledge pool on disk. Before task t ≥ 2 the
server clusters the pool (k-means++, adapters and heads separately), and server and clients learn
bi-level weights: α (inter-cluster, per client, inner loop, Eq. 6) and β (intra-cluster, global,
one outer step, Eqs. 8-9). The client initialises θ̃ = Σ_c α̂_c θ_c(β) (Eq. 5) and fine-tunes.

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

import contextlib
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log
from safetensors.numpy import load_file, save_file
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import safe_name
from ..data import DataError, make_loader
from ..data.tasks import binary_task, client_class_order, count_tasks, parse_task_classes
from ..models import adapter_module
from ..results import continual_summary
from ..training import evaluate, train_epochs
from .base import ArraySpec, ClientHalf, FederatedStrategy, Reply, derive_seed, from_record, stack_flat, \
    to_record, unflatten, validate_arrays, weighted_mean

PARTS = ("adapter", "head")  # clustered, weighted and sent separately (the paper's two parameter spaces)
GRAD_MODES = ("exact", "first-order", "direct")  # direct = variant C (no back-propagation through the inner loop)


def part_width(spec: ArraySpec) -> int:
    """Parameters of a part: the length of its flattened vector."""
    return sum(int(np.prod(shape)) for shape, _ in spec.values())


def split_parts(spec: ArraySpec) -> "OrderedDict[str, OrderedDict[str, tuple[tuple[int, ...], str]]]":
    """The module's array spec split into its adapter arrays (backbone) and head arrays (the rest)."""
    parts: OrderedDict[str, OrderedDict] = OrderedDict((p, OrderedDict()) for p in PARTS)
    for name, shape_dtype in spec.items():
        parts["adapter" if adapter_module(name) is not None else "head"][name] = shape_dtype
    if not parts["adapter"] or not parts["head"]:
        raise ValueError("fedkei needs a model with adapter arrays and head arrays (adapter='none'?)")
    return parts


# ----------------------------------------------------------------------------- server math
def kmeans_membership(points: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Binary membership B [K, M] of k-means++ (scikit-learn) on the M pooled modules, K = min(k, M).

    Clusters that end up empty (possible with duplicate modules) are dropped, so every row has a member.
    """
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    m = len(points)
    k = min(k, m)
    if k == 1:
        return np.ones((1, m))
    with warnings.catch_warnings():  # "fewer distinct clusters than n_clusters" when modules coincide
        warnings.simplefilter("ignore", ConvergenceWarning)
        labels = KMeans(n_clusters=k, init="k-means++", n_init=1, random_state=seed).fit(
            points.astype(np.float64)).labels_
    members = np.zeros((k, m))
    members[labels, np.arange(m)] = 1.0
    return members[members.sum(axis=1) > 0]


def group_membership(groups: Sequence[str]) -> np.ndarray:
    """Membership [G, M] of one row per distinct group (variant A: a client's own past modules)."""
    names = sorted(set(groups))
    return np.array([[1.0 if g == name else 0.0 for g in groups] for name in names])


def normalised(members: np.ndarray) -> np.ndarray:
    """β_c = B_c / Σ_j B_cj (Eq. 3, and β's initial value before Eq. 4)."""
    return members / members.sum(axis=1, keepdims=True)


def cluster_modules(beta: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """θ_c(β_c) = Σ_j β_cj θ_j for every cluster (Eq. 4): [K, M] @ [M, P] -> [K, P] float32."""
    return (beta.astype(np.float64) @ pool.astype(np.float64)).astype(np.float32)


def beta_step(beta: np.ndarray, pool: np.ndarray, cluster_grads: Iterable[np.ndarray], eta2: float) -> np.ndarray:
    """One outer step (Eqs. 8-9): β_c <- β_c − η2 Σ_i Θᵀ ∇_{θ_c} L_i, Θ = [θ_1 .. θ_M] as columns.

    ``cluster_grads`` holds each client's [K, P] gradients w.r.t. the cluster modules.
    """
    total = np.zeros((beta.shape[0], pool.shape[1]))
    for grads in cluster_grads:
        total += grads.astype(np.float64)
    return beta - eta2 * (total @ pool.astype(np.float64).T)


# ----------------------------------------------------------------------------- client math
# loss_fn(thetas, batch): the task loss of the model with module parts ``thetas`` (flat tensors, PARTS order).
LossFn = Callable[[Sequence[torch.Tensor], Any], torch.Tensor]


@dataclass
class InnerLoop:
    """The result of the inner loop on α (Eq. 6, one step per batch of one epoch)."""

    alphas: list[torch.Tensor]  # α_i^t per part; with create_graph a function of the cluster modules
    step_grads: list[torch.Tensor]  # Σ_s ∇_θ̃ L at each step's α (what the first-order form needs)
    mean_loss: float
    steps: int


def inner_loop(loss_fn: LossFn, clusters: Sequence[torch.Tensor], batches: Iterable[Any], eta1: float,
               create_graph: bool = False) -> InnerLoop:
    """α <- α − η1 ∇_α L(θ̃(α)) over ``batches`` from α = 1/K, θ̃(α) = Σ_c α_c θ_c (Eqs. 5-6).

    With ``create_graph`` the steps stay differentiable w.r.t. ``clusters`` (which must require grad).
    """
    alphas = [torch.full((c.shape[0],), 1.0 / c.shape[0], dtype=c.dtype, device=c.device, requires_grad=True)
              for c in clusters]
    step_grads = [torch.zeros(c.shape[1], dtype=c.dtype, device=c.device) for c in clusters]
    total, steps = 0.0, 0
    for batch in batches:
        if create_graph:
            thetas = [a @ c for a, c in zip(alphas, clusters)]
            loss = loss_fn(thetas, batch)
            grads = torch.autograd.grad(loss, alphas, create_graph=True)
        else:
            # ∇_α L = Θ_K ∇_θ̃ L: one backward to θ̃, which also gives the first-order form's step gradients
            thetas = [(a.detach() @ c.detach()).requires_grad_(True) for a, c in zip(alphas, clusters)]
            loss = loss_fn(thetas, batch)
            theta_grads = torch.autograd.grad(loss, thetas)
            grads = [c.detach() @ g for c, g in zip(clusters, theta_grads)]
            step_grads = [s + g for s, g in zip(step_grads, theta_grads)]
        alphas = [a - eta1 * g for a, g in zip(alphas, grads)]
        if not create_graph:
            alphas = [a.detach() for a in alphas]
        if not np.isfinite(loss.item()):
            raise FloatingPointError(f"inner-loop loss became {loss.item()} at step {steps}; lower fedkei-eta1")
        total += loss.item()
        steps += 1
    if steps == 0:
        raise DataError("the inner loop got no training batch")
    return InnerLoop(alphas, step_grads, total / steps, steps)


def outer_gradient(loss_fn: LossFn, thetas: Sequence[torch.Tensor], batches: Iterable[tuple[Any, int]]) -> tuple[list[torch.Tensor], float]:
    """∇_θ̃ of the mean loss over ``batches`` (pairs of batch and its size) at module parts ``thetas``."""
    leaves = [t.detach().requires_grad_(True) for t in thetas]
    acc = [torch.zeros_like(t) for t in leaves]
    total, count = 0.0, 0
    for batch, size in batches:
        loss = loss_fn(leaves, batch)
        grads = torch.autograd.grad(loss * size, leaves)
        acc = [a + g for a, g in zip(acc, grads)]
        total += loss.item() * size
        count += size
    if count == 0:
        raise DataError("the outer loss got no training batch")
    return [a / count for a in acc], total / count


def cluster_gradients(loss_fn: LossFn, clusters: Sequence[torch.Tensor], inner_batches: Iterable[Any],
                      outer_batches: Iterable[tuple[Any, int]], eta1: float, mode: str = "exact"
                      ) -> tuple[list[torch.Tensor], InnerLoop, float]:
    """∇_{θ_c} L(θ̃(α_i^t)) for every cluster module (Eq. 9's client factor), per part [K, P].

    With g = ∇_θ̃ L_outer at θ̃(α_i^t) and u_k = θ_kᵀ g (= ∂L/∂α_k):
    - ``exact``: α_i^t,c·g + (∂α_i^t/∂θ_c)ᵀ u by autograd through the unrolled inner loop (Hessian terms kept);
    - ``first-order``: α_i^t,c·g − η1·u_c·Σ_s g_s, the paper's (α'_c I − η1 θ_c gᵀ)ᵀ g' for one step;
    - ``direct`` (variant C): α_i^t,c·g, α_i^t held fixed.
    """
    if mode not in GRAD_MODES:
        raise ValueError(f"gradient mode {mode!r}: valid choices are {', '.join(GRAD_MODES)}")
    exact = mode == "exact"
    leaves = [c.detach().clone().requires_grad_(exact) for c in clusters]
    # Fused attention kernels have no double backward; the math kernel does (and is what they compute).
    with sdpa_kernel(SDPBackend.MATH) if exact else contextlib.nullcontext():
        inner = inner_loop(loss_fn, leaves, inner_batches, eta1, create_graph=exact)
        alphas = [a.detach() for a in inner.alphas]
        g, outer_loss = outer_gradient(loss_fn, [a @ c.detach() for a, c in zip(alphas, leaves)], outer_batches)
        u = [c.detach() @ gp for c, gp in zip(leaves, g)]
        grads = [torch.outer(a, gp) for a, gp in zip(alphas, g)]
        if exact:
            through = torch.autograd.grad(inner.alphas, leaves, grad_outputs=u, allow_unused=True)
            grads = [d + (t if t is not None else 0.0) for d, t in zip(grads, through)]
    if mode == "first-order":
        grads = [d - eta1 * torch.outer(up, s) for d, up, s in zip(grads, u, inner.step_grads)]
    return [x.detach() for x in grads], inner, outer_loss


def module_loss(model: torch.nn.Module, parts: Mapping[str, ArraySpec], raw_names: Mapping[str, str]) -> LossFn:
    """The model's cross-entropy with its module replaced by flat part vectors (torch.func.functional_call)."""
    layout = [[(raw_names[name], shape, int(np.prod(shape))) for name, (shape, _) in spec.items()]
              for spec in parts.values()]

    def loss(thetas: Sequence[torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        params: dict[str, torch.Tensor] = {}
        for part, theta in zip(layout, thetas):
            offset = 0
            for raw, shape, size in part:
                params[raw] = theta[offset:offset + size].view(shape)
                offset += size
        x, y = batch
        return torch.nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    return loss


# ----------------------------------------------------------------------------- client half
class FedKEIClient(ClientHalf):
    """A site's task stream: bi-level gradients (``train.fedkei_inner``) and per-task fine-tuning (``train``)."""

    @property
    def task(self) -> int:
        return self.rt.round  # one iteration of the server loop is one task

    def class_order(self) -> list[int]:
        rt = self.rt
        order = parse_task_classes(rt.cfg.task_classes, rt.data.class_names)
        return client_class_order(order, rt.cfg.task_order, rt.cfg.seed, rt.partition_id)

    def task_split(self, split: str):
        """This site's split of the current task; DataError when the task has no training rows here."""
        data = binary_task(getattr(self.rt.data, split), self.class_order(), self.task)
        if split == "train" and len(data) == 0:
            names = self.rt.data.class_names
            order = self.class_order()
            raise DataError(f"{self.rt.client}: task {self.task} ({names[order[self.task]]} vs "
                            f"{[names[c] for c in order[:self.task]]}) has no training rows on this site")
        return data

    def _setup(self) -> tuple[LossFn, OrderedDict, torch.device]:
        rt = self.rt
        model = rt.model.to(rt.device).train()
        parts = split_parts(model.trainable_spec())
        return module_loss(model, parts, model.parameter_paths()), parts, rt.device

    def _batches(self, data, shuffle: bool, purpose: int, device: torch.device):
        loader = make_loader(data, self.rt.cfg.batch_size, shuffle, self.rt.seed(purpose))
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
                raise ValueError(f"received {part} cluster modules of shape {value.shape}; this site's {part} "
                                 f"has {width} parameters")
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
            loss_fn, clusters, self._inner_batches(train, device), self._batches(train, False, 5, device), float(self.rt.config["eta1"]), str(self.rt.config["grad"]))
        arrays = OrderedDict((part, g.cpu().numpy().astype(np.float32)) for part, g in zip(parts, grads))
        return self.reply(arrays=arrays, metrics={
            "num-examples": len(train), "inner_loss": inner.mean_loss, "outer_loss": outer_loss,
            "inner_steps": inner.steps, "bilevel_s": time.monotonic() - started})

    def train(self, message: Message) -> RecordDict:
        """Initialise the task's module (fresh, a sent module, or Σ α̂_c θ_c), fine-tune, AUC after every epoch."""
        rt = self.rt
        loss_fn, parts, device = self._setup()
        train, test = self.task_split("train"), self.task_split("test")
        init = str(rt.config["init"])
        metrics: dict[str, Any] = {}
        rt.model.set_trainable(rt.initial_arrays)
        if init == "module":
            rt.model.set_trainable(from_record(message.content["arrays"]))
        elif init == "clusters":
            clusters = self._clusters(message, parts, device)
            started = time.monotonic()
            inner = inner_loop(loss_fn, clusters, self._inner_batches(train, device), float(rt.config["eta1"]))
            theta = [a @ c for a, c in zip(inner.alphas, clusters)]
            module = OrderedDict()
            for vector, spec in zip(theta, parts.values()):
                module.update(unflatten(vector.cpu().numpy(), spec))
            rt.model.set_trainable(module)
            metrics.update({f"alpha_{p}": a.cpu().tolist() for p, a in zip(parts, inner.alphas)})
            metrics.update(alpha_s=time.monotonic() - started, alpha_loss=inner.mean_loss)
        elif init != "fresh":
            raise ValueError(f"unknown init {init!r}")

        test_loader = make_loader(test, rt.cfg.batch_size, False, 0)
        curve = [evaluate(rt.model, test_loader, device)["auc"]]
        epoch_s: list[float] = []
        clock = [time.monotonic()]

        def after_epoch(_epoch: int) -> None:
            epoch_s.append(time.monotonic() - clock[0])
            curve.append(evaluate(rt.model, test_loader, device)["auc"])
            clock[0] = time.monotonic()

        torch.manual_seed(rt.seed(2))
        result = train_epochs(rt.model, make_loader(train, rt.cfg.batch_size, True, rt.seed(1)),
                              epochs=rt.cfg.task_epochs, optimizer=rt.optimizer(), device=device,
                              after_epoch=after_epoch)
        epochs = np.asarray(curve[1:], dtype=np.float64)
        metrics.update(result)
        metrics.update({
            "auc": float(epochs[-1]), "lca": float(np.mean(epochs)) if np.isfinite(epochs).all() else float("nan"),
            "auc_init": float(curve[0]), "auc_curve": [float(v) for v in curve],
            "epoch_s": float(np.mean(epoch_s)), "num-examples": len(train), "n_test": len(test),
            "n_test_positive": int(test.labels.sum()), "new_class": self.class_order()[self.task],
        })
        return self.reply(arrays=rt.model.get_trainable(), metrics=metrics)


# ----------------------------------------------------------------------------- knowledge pool
@dataclass
class PoolEntry:
    task: int
    client: str
    num_examples: float
    file: str  # relative to the pool folder


class KnowledgePool:
    """Every client's module after every task, one safetensors file each (written atomically on arrival)."""

    def __init__(self, directory: Path, spec: ArraySpec):
        self.dir = Path(directory)
        self.spec = spec
        self._items: dict[tuple[int, str], tuple[PoolEntry, OrderedDict[str, np.ndarray]]] = {}

    def __len__(self) -> int:
        return len(self._items)

    @property
    def entries(self) -> list[PoolEntry]:
        """In (task, client) order, whatever order the replies arrived in (k-means++ depends on it)."""
        return [entry for _, (entry, _) in sorted(self._items.items())]

    @property
    def modules(self) -> list[OrderedDict[str, np.ndarray]]:
        return [module for _, (_, module) in sorted(self._items.items())]

    def add(self, task: int, client: str, arrays: Mapping[str, np.ndarray], num_examples: float) -> None:
        file = f"task-{task:03d}/{safe_name(client) or 'client'}.safetensors"
        path = self.dir / file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: np.ascontiguousarray(arrays[k]) for k in self.spec}, str(tmp),
                  metadata={"task": str(task), "client": client, "num_examples": str(num_examples)})
        os.replace(tmp, path)
        self._items[(task, client)] = (PoolEntry(task, client, float(num_examples), file),
                                       OrderedDict((k, np.array(arrays[k])) for k in self.spec))

    def index(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.entries]

    def restore(self, index: list[dict[str, Any]]) -> None:
        """Reload the entries of a checkpoint's index; a missing or mismatched file is an error naming it."""
        self._items = {}
        for item in index:
            entry = PoolEntry(**item)
            path = self.dir / entry.file
            if not path.is_file():
                raise FileNotFoundError(f"knowledge pool file {path} listed in the checkpoint is missing")
            arrays = load_file(str(path))
            if problem := validate_arrays(arrays, self.spec):
                raise ValueError(f"knowledge pool file {path} does not fit this model: {problem}")
            self._items[(entry.task, entry.client)] = (entry, OrderedDict((k, arrays[k]) for k in self.spec))

    def matrix(self, spec: ArraySpec) -> np.ndarray:
        """[M, P] float32: the pooled modules' ``spec`` arrays flattened, one row per entry."""
        return stack_flat(self.modules, spec)


# ----------------------------------------------------------------------------- server half
class FedKEI(FederatedStrategy):
    """FedKEI server: knowledge pool, k-means++ clusters, the β step; one iteration of ``run`` per task.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; in the bi-level phase
    its gradients w.r.t. the K cluster modules. ``fedkei-variant`` picks full, A, B, C, rand or fedavg-init.
    """

    name = "fedkei"
    client_half = FedKEIClient
    extra_actions = (("train", "fedkei_inner"),)
    round_label = "task"

    @classmethod
    def model_classes(cls, num_classes: int) -> int:
        return 2  # every task is binary: the new class vs the classes seen before

    def __init__(self, cfg, recorder, initial, num_classes):
        super().__init__(cfg, recorder, initial, num_classes)
        self.parts = split_parts(self.spec)
        self.pool = KnowledgePool(recorder.run_dir / "checkpoint" / "pool", self.spec)
        self.num_tasks = count_tasks(self.task_class_order(), cfg.num_tasks)
        log(INFO, "[medflower] fedkei (variant %s, %s gradient): %d tasks; module %d adapter + %d head parameters",
            cfg.fedkei_variant, cfg.fedkei_grad, self.num_tasks,
            *(part_width(spec) for spec in self.parts.values()))

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

    def _phase(self, grid, action: str, contents: Mapping[int, RecordDict], task: int, expect: ArraySpec | None,
               phase: str) -> list[Reply]:
        down, up = self.stats.bytes_down, self.stats.bytes_up
        replies = self.exchange(grid, action, contents, task, expect=expect)
        self.stats.extra.setdefault("bytes", {})[phase] = {
            "down": self.stats.bytes_down - down, "up": self.stats.bytes_up - up, "nodes": len(contents),
            "replies": len(replies)}
        return replies

    def run_round(self, grid, task: int) -> None:
        variant = self.cfg.fedkei_variant
        nodes = self.sample_nodes(task)
        config = {"eta1": self.cfg.fedkei_eta1}
        extra = self.stats.extra
        extra.update(task=task, variant=variant, pool_size=len(self.pool))
        if task == 1 or variant == "rand" or len(self.pool) == 0:
            init, arrays = "fresh", None
        elif variant == "fedavg-init":
            init = "module"
            arrays = weighted_mean(self.pool.modules, [e.num_examples for e in self.pool.entries])
        else:
            init = "clusters"
            started = time.monotonic()
            pools = {part: self.pool.matrix(spec) for part, spec in self.parts.items()}
            beta = self.weights(task, pools)
            extra.update({f"k_{p}": int(b.shape[0]) for p, b in beta.items()})
            extra.update({f"clusters_{p}": [[int(j) for j in np.flatnonzero(row)] for row in b]
                          for p, b in beta.items()})
            self.stats.aggregation_s += time.monotonic() - started
            if variant in ("C", "full"):
                beta = self.bilevel_step(grid, task, nodes, beta, pools)
            arrays = OrderedDict((p, cluster_modules(beta[p], pools[p])) for p in self.parts)
        contents = {}
        for node in nodes:
            content = RecordDict({"config": self.base_config(task, **config, init=init)})
            if arrays is not None:
                content["arrays"] = to_record(arrays)
            contents[node] = content
        replies = self._phase(grid, "train", contents, task, self.spec, "finetune")
        for reply in replies:
            self.pool.add(task, reply.client, reply.arrays, reply.num_examples)
            self.recorder.log_client(task, reply.client, "eval", reply.metrics, task=task)
        if not replies:
            log(WARNING, "[medflower] task %d: no site finished fine-tuning; the pool is unchanged", task)

    def bilevel_step(self, grid, task: int, nodes: list[int], beta: dict[str, np.ndarray],
                     pools: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Cluster modules down, ∇_{θ_c} L up, one β step over the clients that answered (Eqs. 8-9)."""
        mode = "direct" if self.cfg.fedkei_variant == "C" else self.cfg.fedkei_grad
        clusters = OrderedDict((p, cluster_modules(beta[p], pools[p])) for p in self.parts)
        expect = OrderedDict((p, (tuple(c.shape), "float32")) for p, c in clusters.items())
        contents = {n: RecordDict({"arrays": to_record(clusters), "config": self.base_config(
            task, eta1=self.cfg.fedkei_eta1, grad=mode)}) for n in nodes}
        replies = self._phase(grid, "train.fedkei_inner", contents, task, expect, "bilevel_gradients")
        for reply in replies:
            self.recorder.log_client(task, reply.client, "bilevel", reply.metrics, task=task)
        started = time.monotonic()
        if not replies:
            log(WARNING, "[medflower] task %d: no bi-level gradient arrived; beta keeps its k-means value", task)
            return beta
        updated = {p: beta_step(beta[p], pools[p], [r.arrays[p] for r in replies], self.cfg.fedkei_eta2)
                   for p in self.parts}
        self.stats.aggregation_s += time.monotonic() - started
        self.stats.extra.update(bilevel_clients=[r.client for r in replies],
                                beta_change={p: float(np.abs(updated[p] - beta[p]).sum()) for p in self.parts})
        return updated

    def summary_extra(self) -> dict[str, Any]:
        return {"variant": self.cfg.fedkei_variant, **continual_summary(self.recorder.records("eval"))}
