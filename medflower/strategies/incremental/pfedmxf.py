"""pFedMxF (docs/methods/pfedmxf.md) in the federated class-incremental protocol: spectral coefficients on q and k,
disjoint frequencies per site and task.

The protocol (tasks, rounds, heads, evaluation, outputs) is ``protocol.py``'s, which the LoRA baselines share; this
module is pFedMxF's: its site, its server and its run-config keys. The maths are beside it in ``spectral.py``
(frequency allocation, union spectrum).

The server's ``FrequencyAllocator`` gives every (task, site) its own block of ``n-frequency`` coordinates (disjoint
modulo conjugate symmetry by default). A site trains its own coefficients with everyone else's frozen; the server
scatters all of them into one union spectrum (Eq. 13: averaging only where a coordinate is shared). Past tasks'
spectra act as merged weights. Before round 1 the whole plan (every known site's budget in every task) is checked
against the usable coordinates of the smallest adapted shape (``plan_capacity``). ``shared`` (the ablation) averages
a coordinate over this round's replies only; where none holds it, it keeps its value.

What leaves a site each round: its own spectral coefficients (2 x n_k per attention block), the head, and n_k = its
training rows of the task. Evaluation: metrics only. What comes to a site: the union spectrum of every allocated
coordinate with its coordinates and task, plus its own coordinates; the head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log

from ...contract import ArraySpec, Reply, count_check, register_strategy, validate_arrays
from ...data import DataError
from ...models.qk_delta import qk_modules, spectral_delta
from ...options import Option, bad, one_of, positive
from .protocol import HEAD, INCREMENTAL_OPTIONS, IncrementalClient, IncrementalStrategy
from .spectral import FrequencyAllocator, SiteBlock, dense_spectrum, plan_capacity, shared_block_mean, union_spectrum


# ----------------------------------------------------------------------------- client half
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
    contract_case: ClassVar[dict[str, Any]] = {
        **IncrementalStrategy.contract_case,
        "stop_after": 2,
        "why": "stops at the end of task 1; round 3 has no fault",
    }

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
