"""FedCurv and EWC: diagonal-Fisher penalties in the two continual protocols
(docs/methods/baselines-continual.md#fedcurv-fedcurv; EWC: docs/methods/baselines-incremental.md#ewc-fedcurv-lora).

The maths both share: a site's empirical diagonal Fisher F = (1/n) Σ_i (∇_θ log p(y_i | x_i))² over its module θ
(``diagonal_fisher``), and a sum of diagonal quadratics

    Σ_j (θ − θ_j)ᵀ diag(F_j) (θ − θ_j) = θᵀ diag(u) θ − 2 θᵀ v + c,
    u = Σ_j F_j,  v = Σ_j F_j ⊙ θ_j,  c = Σ_j θ_jᵀ diag(F_j) θ_j

(``Quadratic``). FedCurv (Shoham et al., "Overcoming Forgetting in Federated Learning on Non-IID Data", NeurIPS 2019
workshop on FL) sums it over the other sites, with its u_t and v_t; EWC (Kirkpatrick et al., "Overcoming catastrophic
forgetting in neural networks", PNAS 2017, Eq. 3) over the past tasks. The local loss adds λ times it.

- ``fedcurv`` (FedKEI's continual protocol, ``fedkei.py``; a baseline of FedKEI's Tables I-IV): task t ≥ 2 starts
  from the pool's n_i-weighted mean (as ``fedkei-variant='fedavg-init'``) and fine-tunes with λ Σ_{j≠i} over the
  other sites' newest modules θ_j and their Fishers F_j.
  Leaves a site after each task: its module θ_i^t, its Fisher F_i^t and n_i. Comes to a site: the initial module and
  either u, v, c over the others (``fedcurv-downlink='sums'``: FedCurv's) or every other site's θ_j and F_j
  (``'modules'``: FedKEI's Table IV count, (2N+2)·|θ|; (2N+1)·|θ| here, the start and N − 1 others' pairs down).
- ``fedcurv-lora`` (the class-incremental protocol, ``pfedmxf.py``; the EWC row of pFedMxF's table): one LoRA on q/k
  for the whole run, A and B and the head averaged by n_k every round (FedAvg-LoRA without the merge at task end);
  after each task's last round every site computes the Fisher of the global end-of-task module on its data of that
  task, the server averages them by n_k (the Fisher of the federation's task data), and the sites then train with
  λ Σ_{s<t} (θ − θ*_s)ᵀ diag(F_s) (θ − θ*_s) over the past tasks' end-of-task modules θ*_s.
  Leaves a site: its LoRA A and B, the head and n_k each round; after a task's last round its Fisher over them.
  Comes to a site: the LoRA and head; from task 2 on, u, v and c of the past tasks.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from torch.func import functional_call, grad, vmap

from ..contract import ArraySpec, Reply, from_record, register_strategy, to_record, weighted_mean
from ..data import make_loader
from ..models.qk_delta import qk_modules
from ..options import Option, non_negative, one_of
from ..training import ExtraLoss
from .fedkei import OPTIONS as FEDKEI_OPTIONS
from .fedkei import FedKEI, ModuleStartClient
from .fedkei_bilevel import split_parts
from .incremental_heads import logit_mask
from .pfedmxf import HEAD, INCREMENTAL_OPTIONS, FedAvgLoRA, LoRAClient

FISHER = "fisher/"  # prefix of a Fisher's arrays in a reply and in the server's checkpoint
RECORD = "fedcurv"  # the message record that carries the penalty (u/<name>, v/<name>, c; or theta/<j>/, fisher/<j>/)
PER_SAMPLE_ELEMENTS = 1 << 24  # per-row gradients held at once (rows x parameters): vmap's chunk size follows

LAMBDA = Option(
    "fedcurv-lambda",
    1.0,
    "fedcurv, fedcurv-lora: weight lambda of the Fisher penalty lambda * sum_j (theta - theta_j)' diag(F_j) "
    "(theta - theta_j) (0: none)",
    non_negative,
    "fedcurv",
)
DOWNLINK = Option(
    "fedcurv-downlink",
    "sums",
    "fedcurv: what a site gets for its penalty: sums = FedCurv's u, v (and c) over the other sites (5|theta| per "
    "site and task with the start and the upload); modules = each other site's module and Fisher ((2N+1)|theta|)",
    one_of("sums", "modules"),
    "fedcurv",
)


# ----------------------------------------------------------------------------- the maths both strategies share
def diagonal_fisher(
    model: torch.nn.Module, batches: Iterable, device: torch.device, mask: torch.Tensor | None = None
) -> OrderedDict[str, np.ndarray]:
    """The empirical diagonal Fisher of ``model``'s trainable arrays, F = (1/n) Σ_i (∇_θ −log p(y_i | x_i))², over
    the rows of ``batches`` (x, y); the model in eval mode, float32. ``mask``: the softmax runs over these classes only
    (a class-incremental task's). An exchanged array that is no parameter (a BatchNorm statistic) gets F = 0.

    Per-row gradients by torch.func (vmap of grad): the square of a batch's mean gradient, as some FedCurv code
    takes, is not the Fisher."""
    model = model.to(device)
    was_training = model.training
    model.eval()
    paths = model.parameter_paths()
    params = {paths[k]: p.detach() for k, p in model.trainable_parameters().items()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (x.unsqueeze(0),)).float()
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0))

    size = sum(p.numel() for p in params.values())
    per_row = vmap(grad(loss), in_dims=(None, 0, 0), chunk_size=max(1, PER_SAMPLE_ELEMENTS // max(size, 1)))
    total = {path: torch.zeros_like(p, dtype=torch.float64) for path, p in params.items()}
    rows = 0
    if mask is not None:
        mask = mask.to(device)
    try:
        with warnings.catch_warnings():  # torch's fallback for attention under vmap is correct, only slower
            warnings.filterwarnings("ignore", message="There is a performance drop")
            for x, y in batches:
                grads = per_row(params, x.to(device), y.to(device))
                for path, g in grads.items():
                    total[path] += (g.double() ** 2).sum(dim=0)
                rows += len(y)
    finally:
        model.train(was_training)
    fisher = OrderedDict((name, np.zeros(shape, np.float32)) for name, (shape, _) in model.trainable_spec().items())
    for name, path in paths.items():
        fisher[name] = (total[path] / max(rows, 1)).cpu().numpy().astype(np.float32)
    return fisher


@dataclass(frozen=True)
class Quadratic:
    """Σ_j (θ − θ_j)ᵀ diag(F_j) (θ − θ_j) as θᵀ diag(u) θ − 2 θᵀ v + c per array name: FedCurv's u_t = Σ_j F_j and
    v_t = Σ_j F_j ⊙ θ_j, and the constant c = Σ_j θ_jᵀ diag(F_j) θ_j, which sets the value but not the gradient."""

    u: Mapping[str, np.ndarray]
    v: Mapping[str, np.ndarray]
    c: float

    @classmethod
    def of(cls, anchors: Iterable[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]]) -> Quadratic | None:
        """The sum over (θ_j, F_j) pairs, in float64; None for no pair (no penalty)."""
        u: dict[str, np.ndarray] = {}
        v: dict[str, np.ndarray] = {}
        c = 0.0
        for theta, fisher in anchors:
            for name, f in fisher.items():
                f, t = f.astype(np.float64), theta[name].astype(np.float64)
                u[name] = u.get(name, 0.0) + f
                v[name] = v.get(name, 0.0) + f * t
                c += float((f * t * t).sum())
        return cls(OrderedDict(u), OrderedDict(v), c) if u else None

    def plus(self, other: Quadratic | None) -> Quadratic:
        """The sum of two quadratics (EWC's penalty of one more task)."""
        if other is None:
            return self
        return Quadratic(
            OrderedDict((k, self.u[k] + other.u[k]) for k in self.u),
            OrderedDict((k, self.v[k] + other.v[k]) for k in self.v),
            self.c + other.c,
        )

    def value(self, theta: Mapping[str, np.ndarray]) -> float:
        total = self.c
        for name, u in self.u.items():
            t = theta[name].astype(np.float64)
            total += float((u * t * t).sum() - 2 * (self.v[name] * t).sum())
        return total

    def arrays(self) -> OrderedDict[str, np.ndarray]:
        """What travels: u and v in float32, c as one float64."""
        out = OrderedDict((f"u/{k}", np.asarray(u, np.float32)) for k, u in self.u.items())
        out.update((f"v/{k}", np.asarray(v, np.float32)) for k, v in self.v.items())
        out["c"] = np.array([self.c], np.float64)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Quadratic:
        """Read ``arrays()``, or every other site's module and Fisher (``theta/<j>/<name>``, ``fisher/<j>/<name>``)."""
        if "c" in arrays:
            u = OrderedDict((k[2:], a) for k, a in arrays.items() if k.startswith("u/"))
            v = OrderedDict((k[2:], a) for k, a in arrays.items() if k.startswith("v/"))
            if set(u) != set(v):
                raise ValueError("the penalty's u and v name different arrays")
            return cls(u, v, float(arrays["c"][0]))
        sites = sorted({k.split("/")[1] for k in arrays if k.startswith("theta/")}, key=int)
        anchors = []
        for j in sites:
            theta = OrderedDict((k[len(f"theta/{j}/") :], a) for k, a in arrays.items() if k.startswith(f"theta/{j}/"))
            fisher = OrderedDict((k, arrays[f"fisher/{j}/{k}"]) for k in theta)
            anchors.append((theta, fisher))
        quadratic = cls.of(anchors)
        if quadratic is None:
            raise ValueError("the penalty record holds neither u, v, c nor any site's module")
        return quadratic

    def penalty(self, params: Mapping[str, torch.Tensor], lam: float) -> ExtraLoss:
        """λ (θᵀ diag(u) θ − 2 θᵀ v + c) over ``params`` as a training loss term, gradient 2λ(u ⊙ θ − v). Computed as
        λ (Σ u (θ − m)² + r) with m = v / u where u > 0 and r = c − Σ v² / u, the same value without float32's
        cancellation between θᵀ diag(u) θ and c."""
        device = next(iter(params.values())).device
        terms, rest = [], self.c
        for name, p in params.items():
            u, v = np.asarray(self.u[name], np.float64), np.asarray(self.v[name], np.float64)
            held = u > 0
            m = np.divide(v, u, out=np.zeros_like(v), where=held)
            rest -= float((v[held] ** 2 / u[held]).sum())
            terms.append((p, torch.as_tensor(u, dtype=torch.float32, device=device), torch.as_tensor(m, device=device)))

        def extra(model, logits, labels) -> torch.Tensor:
            total = sum((u * (p.float() - m.float()) ** 2).sum() for p, u, m in terms)
            return lam * (total + rest)

        return extra


def fisher_arrays(fisher: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    return OrderedDict((FISHER + k, v) for k, v in fisher.items())


def part_mean(fisher: Mapping[str, np.ndarray], names: Iterable[str]) -> float:
    """The mean Fisher over the arrays ``names`` (a part: the adapter, the head), for the server's records."""
    return float(np.mean(np.concatenate([fisher[k].reshape(-1) for k in names])))


def fisher_problem(arrays: Mapping[str, np.ndarray]) -> str | None:
    """A Fisher is a mean of squares: why ``arrays``' Fisher part cannot be one, or None."""
    for name, value in arrays.items():
        if name.startswith(FISHER) and (value < 0).any():
            return f"{name} has negative values; a Fisher's diagonal is >= 0"
    return None


# ----------------------------------------------------------------------------- fedcurv: FedKEI's protocol
class FedCurvClient(ModuleStartClient):
    """Starts from the sent module (fresh without one), fine-tunes with λ times the received quadratic, uploads the
    module and its Fisher on the task's training split."""

    def finetune_loss(self, message: Message, train) -> ExtraLoss | None:
        self.quadratic = None
        if RECORD not in message.content.array_records:
            return None
        self.quadratic = Quadratic.from_arrays(from_record(message.content[RECORD]))
        return self.quadratic.penalty(self.rt.model.trainable_parameters(), float(self.rt.cfg.fedcurv_lambda))

    def upload(self, message: Message, train) -> OrderedDict[str, np.ndarray]:
        rt = self.rt
        arrays = rt.model.get_trainable()
        loader = make_loader(train, rt.cfg.batch_size, False, 0, **rt.loader_options(False))
        arrays.update(fisher_arrays(diagonal_fisher(rt.model, loader, rt.device)))
        if self.quadratic is not None:
            self.penalty = float(rt.cfg.fedcurv_lambda) * self.quadratic.value(rt.model.get_trainable())
        return arrays

    def train(self, message: Message) -> RecordDict:
        self.penalty = None
        content = super().train(message)
        if self.penalty is not None:
            content["metrics"]["fedcurv_penalty"] = self.penalty  # λ times the quadratic at the fine-tuned module
        return content


@register_strategy
class FedCurv(FedKEI):
    """FedCurv in FedKEI's continual protocol: the n_i-weighted mean of the pool as task t's start, and
    λ Σ_{j≠i} (θ − θ_j)ᵀ diag(F_j) (θ − θ_j) over the other sites' newest modules and Fishers while fine-tuning.

    Leaves a site: its module θ_i^t (adapter + head) and its diagonal Fisher F_i^t after every task, n_i; with each
    task's metrics its test size and positives (n_test, n_test_positive).
    """

    name = "fedcurv"
    client_half = FedCurvClient
    uses_variants = False  # its own start: fedkei-variant is refused
    options = (*(o for o in FEDKEI_OPTIONS if o.key in ("task-epochs", "fedkei-site-classes")), LAMBDA, DOWNLINK)
    extra_actions = ()

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        self.fishers: dict[str, tuple[int, OrderedDict[str, np.ndarray]]] = {}  # site -> (task, its newest Fisher)

    def anchors(self) -> dict[str, tuple[OrderedDict[str, np.ndarray], OrderedDict[str, np.ndarray]]]:
        """Per site with a Fisher: (θ_j, F_j), its module of the task the Fisher is of (the newest it finished)."""
        modules = {(e.task, e.client): m for e, m in zip(self.pool.entries, self.pool.modules)}
        return {c: (modules[(t, c)], f) for c, (t, f) in sorted(self.fishers.items()) if (t, c) in modules}

    def penalty_record(self, others: list[tuple[Mapping, Mapping]]) -> OrderedDict[str, np.ndarray] | None:
        if not others:
            return None
        if self.cfg.fedcurv_downlink == "sums":
            return Quadratic.of(others).arrays()
        arrays: OrderedDict[str, np.ndarray] = OrderedDict()
        for j, (theta, fisher) in enumerate(others):
            arrays.update((f"theta/{j}/{k}", v) for k, v in theta.items())
            arrays.update((f"fisher/{j}/{k}", v) for k, v in fisher.items())
        return arrays

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """Task 1 (or an empty pool): nothing, the sites start fresh. Else the pool's n_i-weighted mean to start from,
        and the penalty over every other site that has a Fisher."""
        init = None
        if task > 1 and len(self.pool):
            init = weighted_mean(self.pool.modules, self.shares([e.num_examples for e in self.pool.entries]))
        anchors = self.anchors()
        contents = {}
        for node in nodes:
            content = RecordDict({"config": self.base_config(task)})
            if init is not None:
                content["arrays"] = to_record(init)
            penalty = self.penalty_record([a for c, a in anchors.items() if c != self.client_name(node)])
            if penalty is not None:
                content[RECORD] = to_record(penalty)
            contents[node] = content
        self.stats.extra["fedcurv_anchors"] = sorted(anchors)
        return contents

    def finetune_spec(self) -> ArraySpec:
        return OrderedDict([*self.spec.items(), *((FISHER + k, s) for k, s in self.spec.items())])

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        return super().check_reply_values(phase, reply) or fisher_problem(reply.arrays)

    def finetuned(self, task: int, reply: Reply) -> None:
        """The module joins the pool; the site's Fisher replaces its previous one (the penalty's anchor)."""
        super().finetuned(task, reply)
        fisher = OrderedDict((k, np.array(reply.arrays[FISHER + k])) for k in self.spec)
        self.fishers[reply.client] = (task, fisher)
        means = self.stats.extra.setdefault("fisher_mean", {})
        means[reply.client] = {p: part_mean(fisher, spec) for p, spec in split_parts(self.spec).items()}

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        arrays = OrderedDict(arrays)
        for client, (_, fisher) in sorted(self.fishers.items()):
            arrays.update((f"{FISHER}{client}/{k}", v) for k, v in fisher.items())
        return arrays, {**meta, "fisher_tasks": {c: t for c, (t, _) in sorted(self.fishers.items())}}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state(arrays, meta)
        self.fishers = {
            client: (int(task), OrderedDict((k, np.array(arrays[f"{FISHER}{client}/{k}"])) for k in self.spec))
            for client, task in meta.get("fisher_tasks", {}).items()
        }


# ----------------------------------------------------------------------------- fedcurv-lora: class-incremental
class FedCurvLoRAClient(LoRAClient):
    """One LoRA for the whole run (the merged ΔW stays zero); training adds λ times the received past tasks'
    quadratic; ``fedcurv_fisher`` computes the Fisher of the received module on this site's rows of the task."""

    def load(self, arrays: Mapping[str, np.ndarray], training: bool) -> None:
        model = self.rt.model.to(self.rt.device)
        with torch.no_grad():
            for module in qk_modules(model).values():
                module.merged.zero_()
        model.set_trainable(arrays)

    def train(self, message: Message) -> RecordDict:
        record = message.content.array_records.get(RECORD)
        self.quadratic = Quadratic.from_arrays(from_record(record)) if record is not None else None
        return super().train(message)

    def training_objective(self, model: torch.nn.Module, train) -> tuple[torch.nn.Module, ExtraLoss | None]:
        if self.quadratic is None:
            return model, None
        return model, self.quadratic.penalty(self.rt.model.trainable_parameters(), float(self.rt.cfg.fedcurv_lambda))

    def fedcurv_fisher(self, message: Message) -> RecordDict:
        """The Fisher of the received end-of-task module on this site's training rows of the task, with the task's
        training softmax (``classifier``'s logit mask)."""
        rt, cfg = self.rt, self.rt.cfg
        self.load(from_record(message.content["arrays"]), training=False)
        train = self.split("train", seen=False)
        mask = logit_mask(cfg.classifier, cfg.classes_per_task, self.task, rt.model.head.out_features)
        loader = make_loader(train, cfg.batch_size, False, 0, **rt.loader_options(False))
        fisher = diagonal_fisher(rt.model, loader, rt.device, mask)
        return self.reply(arrays=fisher_arrays(fisher), metrics={"num-examples": len(train), "task": self.task})


@register_strategy
class FedCurvLoRA(FedAvgLoRA):
    """EWC with a federated Fisher on FedAvg-LoRA (q/k): one LoRA kept across tasks; after each task the n_k-weighted
    mean of the sites' Fishers of the global module on the task's data, and λ Σ_{s<t} (θ − θ*_s)ᵀ diag(F_s)(θ − θ*_s)
    in every later round's local loss.

    Leaves a site: its LoRA A and B on q and k, the head and n_k every round; after a task's last round its diagonal
    Fisher of the global LoRA and head on its rows of that task, and n_k.
    """

    name = "fedcurv-lora"
    client_half = FedCurvLoRAClient
    options = (*INCREMENTAL_OPTIONS, LAMBDA)
    extra_actions = (("train", "fedcurv_fisher"),)

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        self.quadratic: Quadratic | None = None  # the past tasks' penalty (u, v, c), summed task after task
        self.fisher_tasks: list[int] = []

    def model_arrays(self, task: int) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, self.global_arrays[k]) for k in self.lora_names)  # no merged ΔW: it stays zero

    def contents(self, nodes: list[int], rnd: int, training: bool) -> dict[int, RecordDict]:
        out = super().contents(nodes, rnd, training)
        if training and self.quadratic is not None:
            for content in out.values():
                content[RECORD] = to_record(self.quadratic.arrays())
        return out

    def end_task(self, task: int) -> None:
        """Nothing to merge: the LoRA carries on into the next task (the penalty needs its parameters)."""

    def run_round(self, grid, rnd: int) -> None:
        super().run_round(grid, rnd)
        if self.is_task_end(rnd):
            self.fisher_phase(grid, rnd)

    def fisher_phase(self, grid, rnd: int) -> None:
        """Every site's Fisher of the end-of-task module θ*_t on its task-t rows; their n_k-weighted mean F_t adds
        (θ − θ*_t)ᵀ diag(F_t)(θ − θ*_t) to the penalty."""
        task = self.task_of(rnd)
        expect = OrderedDict((FISHER + k, s) for k, s in self.spec.items())
        replies = self.exchange(
            grid, "train.fedcurv_fisher", self.contents(self.ordered_nodes(), rnd, False), rnd, expect=expect
        )
        learned = [r for r in replies if r.num_examples > 0]
        if not learned:
            return
        fisher = weighted_mean(
            [OrderedDict((k, r.arrays[FISHER + k]) for k in self.spec) for r in learned],
            self.shares([r.num_examples for r in learned]),
        )
        theta = OrderedDict((k, self.global_arrays[k]) for k in self.spec)
        added = Quadratic.of([(theta, fisher)])
        self.quadratic = added if self.quadratic is None else self.quadratic.plus(added)
        self.fisher_tasks.append(task)
        self.stats.extra.update(
            fisher_sites=[r.client for r in learned],
            fisher_mean={"lora": part_mean(fisher, self.lora_names), "head": part_mean(fisher, HEAD)},
        )

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        return super().check_reply_values(phase, reply) or fisher_problem(reply.arrays)

    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        arrays = OrderedDict(arrays)
        if self.quadratic is not None:
            arrays.update((f"{RECORD}/{k}", v) for k, v in self.quadratic_state().items())
        return arrays, {**meta, "fisher_tasks": list(self.fisher_tasks)}

    def quadratic_state(self) -> OrderedDict[str, np.ndarray]:
        """u and v in float64 (the sums keep accumulating over tasks), c."""
        out = OrderedDict((f"u/{k}", np.asarray(u, np.float64)) for k, u in self.quadratic.u.items())
        out.update((f"v/{k}", np.asarray(v, np.float64)) for k, v in self.quadratic.v.items())
        out["c"] = np.array([self.quadratic.c], np.float64)
        return out

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        prefix = f"{RECORD}/"
        super().load_state({k: v for k, v in arrays.items() if not k.startswith(prefix)}, meta)
        self.fisher_tasks = [int(t) for t in meta.get("fisher_tasks", [])]
        saved = {k[len(prefix) :]: np.array(v) for k, v in arrays.items() if k.startswith(prefix)}
        self.quadratic = Quadratic.from_arrays(saved) if saved else None
