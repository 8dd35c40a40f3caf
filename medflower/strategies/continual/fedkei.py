"""FedKEI (docs/methods/fedkei.md; equations of the FedKEI paper): continual learning of new diseases from a pool
of past task modules.

One run walks T binary tasks (``data/tasks.py``). A module θ = (LoRA adapter ω, head φ) is fine-tuned
per task and client; the server keeps every θ_i^t in a knowledge pool on disk. Before task t ≥ 2 the
server clusters the pool (k-means++, adapters and heads separately), and server and clients learn
bi-level weights: α (inter-cluster, per client, inner loop, Eq. 6) and β (intra-cluster, global,
one outer step, Eqs. 8-9). The client initialises θ̃ = Σ_c α̂_c θ_c(β) (Eq. 5) and fine-tunes.
The task protocol (tasks, pool, fine-tuning, outputs) is ``protocol.py``'s, which the baselines share; this module
is what FedKEI adds to it: its start (the variants), its bi-level phase (``train.fedkei_inner``) and its run-config
keys. The maths are in ``bilevel.py``, the pool in ``knowledge_pool.py``.

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
from logging import WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log

from ...contract import derive_seed, register_strategy, to_record, unflatten
from ...data import make_loader
from ...options import Option, non_negative, one_of, positive
from .bilevel import (
    LossFn,
    beta_step,
    cluster_gradients,
    cluster_modules,
    group_membership,
    inner_loop,
    kmeans_membership,
    normalised,
)
from .protocol import SITE_CLASSES, TASK_EPOCHS, VARIANT_KEY, ContinualClient, ContinualStrategy

if TYPE_CHECKING:
    from ...settings import RunSettings


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
class FedKEIClient(ContinualClient):
    """A site's task stream: bi-level gradients (``train.fedkei_inner``) and per-task fine-tuning (``train``) from
    the start its variant picks."""

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

    def fedkei_inner(self, message: Message) -> RecordDict:
        """Inner loop on α over one epoch, then ∇_{θ_c} L w.r.t. every received cluster module (Eq. 9)."""
        started = time.monotonic()
        loss_fn, parts, device = self.module_setup()
        clusters = self.stacked_modules(message, parts, device)
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
        """The task's start by the variant (``start_from``): fresh, the sent module, or Σ α̂_c θ_c (Eq. 5)."""
        rt = self.rt
        if start_from(rt.cfg.fedkei_variant, sent="arrays" in message.content.array_records) != "clusters":
            return super().initialise(message, loss_fn, parts, device, train)  # fresh, or fedavg-init's pool mean
        metrics: dict[str, Any] = {}
        rt.model.set_trainable(rt.initial_arrays)
        clusters = self.stacked_modules(message, parts, device)
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


# ----------------------------------------------------------------------------- server half
VARIANTS = ("full", "A", "B", "C", "rand", "fedavg-init")


FEDKEI_OPTIONS = (
    Option(
        VARIANT_KEY,
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
# the protocol's keys and FedKEI's own, in the order they were always listed
OPTIONS = (TASK_EPOCHS, FEDKEI_OPTIONS[0], FEDKEI_OPTIONS[1], SITE_CLASSES, *FEDKEI_OPTIONS[2:])


@register_strategy
class FedKEI(ContinualStrategy):
    """FedKEI server: knowledge pool, k-means++ clusters, the β step; one iteration of ``run`` per task.

    Leaves a site: its module θ_i^t after every task (adapter + head) and n_i; in the bi-level phase
    its gradients w.r.t. the K cluster modules; with each task's metrics its test size and number of positive
    test images (n_test, n_test_positive). ``fedkei-variant`` picks full, A, B, C, rand or fedavg-init.
    """

    name = "fedkei"
    client_half = FedKEIClient
    options = OPTIONS
    extra_actions = (("train", "fedkei_inner"),)

    def start_description(self) -> str:
        return f"variant {self.cfg.fedkei_variant}, {gradient_mode(self.cfg)} gradient"

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

    def task_contents(self, grid, task: int, nodes: list[int]) -> dict[int, RecordDict]:
        """The fine-tuning message per node: the task's config and what a site starts from (nothing for task 1,
        ``rand`` or an empty pool; the pool's n_i-weighted mean for ``fedavg-init``; else the K cluster modules
        after the bi-level phase)."""
        variant = self.cfg.fedkei_variant
        extra = self.stats.extra
        if task == 1 or variant == "rand" or len(self.pool) == 0:  # the sites start fresh (``start_from``)
            arrays = None
        elif variant == "fedavg-init":
            arrays = self.pool_mean()
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

    def task_record(self, task: int) -> dict[str, Any]:
        return {**super().task_record(task), "variant": self.cfg.fedkei_variant}

    def bilevel_step(
        self, grid, task: int, nodes: list[int], beta: dict[str, np.ndarray], pools: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Cluster modules down, ∇_{θ_c} L up, one β step over the clients that answered (Eqs. 8-9)."""
        clusters = OrderedDict((p, cluster_modules(beta[p], pools[p])) for p in self.parts)
        expect = OrderedDict((p, (tuple(c.shape), "float32")) for p, c in clusters.items())
        contents = {n: RecordDict({"arrays": to_record(clusters), "config": self.base_config(task)}) for n in nodes}
        replies = self.counted_exchange(grid, "train.fedkei_inner", contents, task, expect, "bilevel_gradients")
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
        return {"variant": self.cfg.fedkei_variant, **super().summary_extra()}
