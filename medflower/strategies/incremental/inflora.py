"""InfLoRA (Yan-Shuo Liang and Wu-Jun Li, "InfLoRA: Interference-Free Low-Rank Adaptation for Continual Learning",
CVPR 2024) in the federated class-incremental protocol (``protocol.py``)
(docs/methods/baselines-incremental.md#inflora-inflora).

LoRA on the q and k slices, ΔW = (alpha/r)·B A, with the dimensionality-reduction matrix A [r, d_in] *designed*
per task and frozen (the paper's B_t; peft's naming is used here): only B and the head train. Before task t the
server
1. updates the subspace memory M (DualGPM) from the input representation of task t-1 (as the model is after
   task t-1), keeping the fewest new directions of the residual (I - M Mᵀ) H whose energy brings M's share of
   ‖H‖² up to ε_{t-1} (``update_memory``);
2. designs A_t: its rows are the top-r eigenvectors of the new task's input covariance projected onto the
   orthogonal complement of M (``design_reduction``), so A_t M = 0 and any B leaves the outputs on the old
   tasks' inputs in span(M) unchanged.
The input covariance of an attention block is the uncentred C = mean over tokens of x xᵀ of its qkv input
(q and k share that input, hence one A per block, used for both). A site computes it for its rows of task t
(and of task t-1) once per task, in an extra phase (``train.inflora_stats``); the server's n_k-weighted mean of
the sites' C_k is the covariance of the pooled data exactly (every image has the same number of tokens).
The sites train B with A frozen; the server averages B, which is exact since A is shared:
Σ_k p_k B_k A = (Σ_k p_k B_k) A. At the end of the task B A is merged into the frozen weights.

What leaves a site: once per task, per attention block, the uncentred covariance of its qkv inputs over its
training rows of the new task and of the previous task (d_in x d_in each) with the two row counts; every round its
LoRA B on q and k, the head and n_k. What comes to it: the merged ΔW of q and k, the task's A and B, the head.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
import scipy.linalg
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log

from ...contract import ArraySpec, Reply, count_check, from_record, register_strategy, to_record, weighted_mean
from ...data import make_loader
from ...data.tasks import incremental_task
from ...models.qk_delta import QKDelta, qk_modules
from ...options import Option, bad, unit_interval_open_left
from .fedavg_lora import FedAvgLoRA
from .lora_merge import lora_product
from .protocol import HEAD, INCREMENTAL_OPTIONS, LoRAClient

OLD_EXAMPLES = "inflora-old-examples"  # a stats reply's count of the previous task's rows
OPTIONS = (
    Option(
        "inflora-epsilon",
        0.95,
        "inflora: DualGPM energy threshold after task 1 (the authors' lamb: 0.95 on CIFAR-100, 0.98 on ImageNet-R)",
        unit_interval_open_left,
        "inflora",
    ),
    Option(
        "inflora-epsilon-end",
        1.0,
        "inflora: the threshold after task t is eps + (end - eps)*(t-1)/T (the authors' lame, 1.0)",
        unit_interval_open_left,
        "inflora",
    ),
)


# ----------------------------------------------------------------------------- the maths
def pooled_covariance(covariances: list[np.ndarray], weights: list[float]) -> np.ndarray | None:
    """Σ_k w_k C_k / Σ_k w_k in float64 (None when no weight is positive): with w_k = n_k and C_k a site's mean
    of x xᵀ over its n_k·N tokens, the mean over the union of the sites' tokens."""
    total = float(np.sum(weights)) if weights else 0.0
    if total <= 0:
        return None
    return sum(float(w) * c.astype(np.float64) for w, c in zip(weights, covariances)) / total


def complement_basis(memory: np.ndarray) -> np.ndarray:
    """An orthonormal basis [d, d - m] of the orthogonal complement of the memory's span (memory: [d, m])."""
    if memory.shape[1] == 0:
        return np.eye(memory.shape[0])
    return scipy.linalg.null_space(memory.T)


def top_directions(covariance: np.ndarray, basis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending) and eigenvectors [d, k] of the covariance restricted to span(basis): those of
    Qᵀ C Q mapped back by Q, i.e. the left singular vectors of the projected representation Q Qᵀ H."""
    if basis.shape[1] == 0:
        return np.zeros(0), np.zeros((basis.shape[0], 0))
    values, vectors = np.linalg.eigh(basis.T @ covariance @ basis)
    order = np.argsort(values)[::-1]
    directions = basis @ vectors[:, order]
    signs = np.sign(directions[np.abs(directions).argmax(axis=0), np.arange(directions.shape[1])])
    return np.clip(values[order], 0.0, None), directions * np.where(signs == 0, 1.0, signs)  # a fixed sign per vector


def design_reduction(covariance: np.ndarray, memory: np.ndarray, rank: int) -> np.ndarray:
    """InfLoRA's A_t [rank, d] (the paper's B_t, Sec. 4.2): the top-``rank`` eigenvectors of the new task's input
    covariance projected onto the complement of span(memory), as rows. The rows are orthonormal and orthogonal to
    the memory; where the complement has fewer than ``rank`` dimensions the remaining rows are zero."""
    d = covariance.shape[0]
    _, directions = top_directions(covariance, complement_basis(memory))
    a = np.zeros((rank, d))
    k = min(rank, directions.shape[1])
    a[:k] = directions[:, :k].T
    return a


def update_memory(memory: np.ndarray, covariance: np.ndarray, epsilon: float) -> np.ndarray:
    """DualGPM's update after a task (Sec. 4.2; GPM's criterion): the energy of a representation H is
    ‖H‖² ∝ trace(C); if the memory holds less than ε of it, add the fewest top directions of the residual
    (I - M Mᵀ) H that bring it to ε. Returns the new basis [d, m'] (orthonormal columns)."""
    total = float(np.trace(covariance))
    if total <= 0:
        return memory
    captured = float(np.trace(memory.T @ covariance @ memory)) if memory.shape[1] else 0.0
    if captured >= epsilon * total:
        return memory
    values, directions = top_directions(covariance, complement_basis(memory))
    usable = int(np.sum(values > 1e-12 * total))
    reached = np.nonzero(captured + np.cumsum(values[:usable]) >= epsilon * total * (1 - 1e-12))[0]
    r = int(reached[0]) + 1 if len(reached) else usable
    return np.concatenate([memory, directions[:, :r]], axis=1)


def threshold(epsilon: float, epsilon_end: float, task: int, num_tasks: int) -> float:
    """ε after task ``task`` (1-based): rising linearly from ``epsilon`` by (end - ε)/T per task (the authors'
    code)."""
    return epsilon + (epsilon_end - epsilon) * (task - 1) / num_tasks


@torch.no_grad()
def input_covariances(
    model: torch.nn.Module, modules: Mapping[str, QKDelta], rows, batch_size: int, device: torch.device
) -> OrderedDict[str, np.ndarray]:
    """Per q/k module: the uncentred covariance (mean over every token of every row of x xᵀ, float64 sums) of the
    input of the qkv projection it adapts, for the rows of ``rows`` (zeros without rows)."""
    sums = {name: torch.zeros(m.dim_in, m.dim_in, dtype=torch.float64, device=device) for name, m in modules.items()}
    tokens = dict.fromkeys(modules, 0)

    def hook_of(name: str):
        def hook(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] += x.T @ x
            tokens[name] += x.shape[0]

        return hook

    handles = [
        model.get_submodule(name.rsplit(".", 1)[0]).qkv.register_forward_pre_hook(hook_of(name)) for name in modules
    ]
    try:
        model.to(device).eval()
        for x, _ in make_loader(rows, batch_size, False, 0):
            model(x.to(device))
    finally:
        for handle in handles:
            handle.remove()
    return OrderedDict((name, (sums[name] / max(tokens[name], 1)).float().cpu().numpy()) for name in modules)


# ----------------------------------------------------------------------------- client half
class InfLoRAClient(LoRAClient):
    """Trains B (A frozen, as received) and the head on the merged ΔW; answers the per-task statistics phase."""

    def train(self, message: Message) -> RecordDict:
        reductions = [m.lora_A for m in qk_modules(self.rt.model).values()]
        for a in reductions:
            a.requires_grad_(False)  # no gradient: the optimizer skips it (no step, no weight decay)
        try:
            return super().train(message)
        finally:
            for a in reductions:
                a.requires_grad_(True)

    def upload(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, v) for k, v in self.rt.model.get_trainable().items() if k.endswith(".lora_B"))

    def inflora_stats(self, message: Message) -> RecordDict:
        """The input covariances of the task's training rows (and of the previous task's) under the merged ΔW."""
        rt, cfg = self.rt, self.rt.cfg
        model = rt.model.to(rt.device)
        arrays = from_record(message.content["arrays"])
        modules = qk_modules(model)
        with torch.no_grad():
            for name, module in modules.items():
                module.merged.copy_(torch.as_tensor(arrays[f"{name}.merged"]))
                module.lora_B.zero_()  # the model as it is before this task's update
        out: OrderedDict[str, np.ndarray] = OrderedDict()
        metrics: dict[str, float] = {"task": self.task}
        for task, suffix, count in ((self.task, "cov", "num-examples"), (self.task - 1, "cov_old", OLD_EXAMPLES)):
            if task < 1:
                continue
            rows = incremental_task(rt.data.train, self.class_order(), cfg.classes_per_task, task, seen=False)
            covariances = input_covariances(model, modules, rows, cfg.batch_size, rt.device)
            out.update((f"{name}.{suffix}", c) for name, c in covariances.items())
            metrics[count] = len(rows)
        return self.reply(arrays=out, metrics=metrics)


# ----------------------------------------------------------------------------- server half
@register_strategy
class InfLoRA(FedAvgLoRA):
    """InfLoRA: per task, A designed from the pooled input covariance projected off the DualGPM memory and frozen;
    B averaged (exact: Σ p_k B_k A = (Σ p_k B_k) A), B A merged at the end of the task; the memory then grows.

    Leaves a site: once per task the uncentred covariance of each attention block's qkv input over its rows of the
    new and of the previous task (d_in x d_in per block) and the two row counts; every round its LoRA B on q and k,
    the head and n_k.
    """

    name = "inflora"
    client_half = InfLoRAClient
    options = (*INCREMENTAL_OPTIONS, *OPTIONS)
    extra_actions = (("train", "inflora_stats"),)
    contract_case: ClassVar[dict[str, Any]] = {
        **FedAvgLoRA.contract_case,
        "stop_after": 2,
        "why": "stops at the end of task 1: the resumed run designs task 2's A",
    }

    @classmethod
    def check_config(cls, cfg, check_paths: bool) -> None:
        super().check_config(cfg, check_paths)
        if cfg.inflora_epsilon > cfg.inflora_epsilon_end:
            raise bad(
                "inflora-epsilon",
                cfg.inflora_epsilon,
                f"must be at most inflora-epsilon-end = {cfg.inflora_epsilon_end} (the threshold only rises)",
            )

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        super().setup(initial)
        width = min(cols for _, cols in self.modules.values())
        if self.cfg.lora_rank > width:
            raise bad("lora-rank", self.cfg.lora_rank, f"A's rows are directions of the {width}-wide q/k input")
        self.b_names = [k for k in self.lora_names if k.endswith(".lora_B")]
        self.memory = OrderedDict((name, np.zeros((cols, 0))) for name, (_, cols) in self.modules.items())
        self.designed = 0  # the task whose A global_arrays holds

    def stats_spec(self, task: int) -> ArraySpec:
        spec = OrderedDict((f"{name}.cov", ((cols, cols), "float32")) for name, (_, cols) in self.modules.items())
        if task > 1:
            spec.update((f"{name}.cov_old", ((cols, cols), "float32")) for name, (_, cols) in self.modules.items())
        return spec

    def reply_spec(self, node_id: int) -> ArraySpec:
        return OrderedDict((k, self.spec[k]) for k in [*self.b_names, *HEAD])

    def check_reply_values(self, phase: str, reply: Reply) -> str | None:
        """A statistics reply's previous-task count is a count; its covariances are symmetric with a
        non-negative diagonal."""
        if problem := super().check_reply_values(phase, reply):
            return problem
        if phase != "train":
            return None
        if OLD_EXAMPLES in reply.metrics and (
            problem := count_check(reply.metrics, OLD_EXAMPLES, self.nodes[reply.node_id].num_train)
        ):
            return problem
        for name, value in reply.arrays.items():
            if name.endswith((".cov", ".cov_old")):
                scale = 1e-4 * (1.0 + float(np.abs(value).max(initial=0.0)))
                if float(np.abs(value - value.T).max(initial=0.0)) > scale or float(np.diag(value).min()) < 0:
                    return f"{name} is not a covariance (symmetric, non-negative diagonal)"
        return None

    # ------------------------------------------------------------------ the task's design phase
    def run_round(self, grid, rnd: int) -> None:
        task = self.task_of(rnd)
        if self.designed != task:
            self.design(grid, rnd, task)
        super().run_round(grid, rnd)

    def design(self, grid, rnd: int, task: int) -> None:
        """The statistics phase (every known site), the memory update from task t-1 and task t's A (B = 0)."""
        arrays = OrderedDict((f"{name}.merged", value) for name, value in self.merged.items())
        contents = {
            n: RecordDict({"arrays": to_record(arrays), "config": self.base_config(rnd, task=task)})
            for n in self.ordered_nodes()
        }
        replies = self.exchange(grid, "train.inflora_stats", contents, rnd, expect=self.stats_spec(task))
        for reply in replies:
            self.recorder.log_client(rnd, reply.client, "inflora_stats", reply.metrics)
        started = time.monotonic()
        if task > 1:
            weights = [float(r.metrics.get(OLD_EXAMPLES, 0)) for r in replies]
            epsilon = threshold(self.cfg.inflora_epsilon, self.cfg.inflora_epsilon_end, task - 1, self.num_tasks)
            if sum(weights) > 0:
                for name in self.modules:
                    old = pooled_covariance([r.arrays[f"{name}.cov_old"] for r in replies], weights)
                    self.memory[name] = update_memory(self.memory[name], old, epsilon)
            else:
                log(WARNING, "[medflower] task %d: no statistics of task %d; the memory is unchanged", task, task - 1)
        weights = [r.num_examples for r in replies]
        if sum(weights) <= 0:
            log(WARNING, "[medflower] task %d: no statistics of the task; A spans the memory's complement", task)
        for name, (rows, cols) in self.modules.items():
            covariance = pooled_covariance([r.arrays[f"{name}.cov"] for r in replies], weights)
            a = design_reduction(
                np.zeros((cols, cols)) if covariance is None else covariance, self.memory[name], self.cfg.lora_rank
            )
            self.global_arrays[f"{name}.lora_A"] = np.stack([a, a]).astype(np.float32)  # one A for q and k
            self.global_arrays[f"{name}.lora_B"] = np.zeros((2, rows, self.cfg.lora_rank), np.float32)
        self.designed = task
        self.stats.aggregation_s += time.monotonic() - started
        dims = [m.shape[1] for m in self.memory.values()]
        self.stats.extra.update(inflora_stats_clients=[r.client for r in replies], inflora_memory=dims)
        log(
            INFO,
            "[medflower] inflora task %d: memory %d..%d of %d dimensions",
            task,
            min(dims),
            max(dims),
            min(cols for _, cols in self.modules.values()),
        )

    # ------------------------------------------------------------------ rounds and tasks
    def aggregate_updates(self, rnd: int, task: int, replies: list[Reply]) -> None:
        """FedAvg of B: with A shared, Σ_k p_k B_k A = (Σ_k p_k B_k) A exactly."""
        self.global_arrays.update(
            weighted_mean(
                [{k: r.arrays[k] for k in self.b_names} for r in replies],
                self.shares([r.num_examples for r in replies]),
            )
        )

    def end_task(self, task: int) -> None:
        """Merge B A into the frozen weights; B restarts at zero (the next task's A is designed before it)."""
        for name in self.modules:
            self.merged[name] = self.merged[name] + lora_product(
                self.global_arrays[f"{name}.lora_A"], self.global_arrays[f"{name}.lora_B"], self.scale
            )
            self.global_arrays[f"{name}.lora_B"] = np.zeros_like(self.global_arrays[f"{name}.lora_B"])

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
        arrays, meta = super().state()
        arrays = OrderedDict(arrays)
        arrays.update((f"memory/{name}", m) for name, m in self.memory.items() if m.shape[1])
        return arrays, {**meta, "designed": self.designed}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state({k: v for k, v in arrays.items() if not k.startswith("memory/")}, meta)
        self.memory = OrderedDict(
            (name, np.array(arrays[f"memory/{name}"]) if f"memory/{name}" in arrays else np.zeros((cols, 0)))
            for name, (_, cols) in self.modules.items()
        )
        self.designed = int(meta.get("designed", 0))
