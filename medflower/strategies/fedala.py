"""FedALA: Adaptive Local Aggregation for personalised federated learning (Zhang et al., AAAI 2023).

The server is FedAvg. Each site keeps its previous local model Θ_i^{t-1} and, before training, blends the received
global model Θ^{t-1} into it (the paper's Eqs. 4-5):

    Θ̂_i = Θ^{t-1}                                          for the lower arrays,
    Θ̂_i = Θ_i^{t-1} + (Θ^{t-1} − Θ_i^{t-1}) ⊙ W_i           for the top ``ala-layer-idx`` arrays,

with elementwise weights W_i ∈ [0, 1] learnt on a random ``ala-rand-percent`` % of its training split (Eq. 6):
W_i ← clip(W_i − η ∇_{W_i} L(Θ̂_i), 0, 1), the gradient taken through Θ̂_i with Θ_i^{t-1} and Θ^{t-1} fixed. Local
training then starts from Θ̂_i. The method as implemented, and its decisions:
docs/methods/baselines-fedavg-like.md#fedala.

What leaves a site: the trainable arrays (adapters + head) after local training and n_k, as in FedAvg. W_i and the
site's local model stay in its personal state (``PersonalState``, key ``fedala``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from torch import nn
from torch.func import functional_call

from ..contract import ClientHalf, FederatedStrategy, PersonalState, derive_seed, from_record, register_strategy
from ..data import make_loader
from ..options import Option, bad, positive
from ..training.loops import autocast
from ..training.losses import task_loss

WEIGHT = "ala-weight/"  # prefix of W_i's arrays in the site's state (the rest is its local model)
ALA_SEED = 31  # seed purpose of the ALA sample (rt.seed's 1 and 2 are the loaders and local training)


def parse_layer_idx(value: Any) -> int | str:
    """p: an integer >= 1 (the last p trainable arrays), 'head' (the task module's arrays) or 'all'."""
    if value in ("head", "all"):
        return value
    why = "must be an integer >= 1 (the last p trainable arrays), 'head' (the head or decoder) or 'all'"
    if isinstance(value, bool):
        raise ValueError(why)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(why)
    if value < 1:
        raise ValueError(why + ("; the reference's 0 (every array) is 'all' here" if value == 0 else ""))
    return value


def _percent(v: int) -> str | None:
    return None if 1 <= v <= 100 else "must be a percentage in 1..100"


def _at_least_one(v: int) -> str | None:
    return None if v >= 1 else "must be >= 1"


OPTIONS = (
    Option("ala-eta", 1.0, "fedala: learning rate eta of the ALA weights W (Eq. 6; reference 1.0)", positive, "fedala"),
    Option(
        "ala-rand-percent",
        80,
        "fedala: percentage s of the site's training split W is learnt on each round (reference 80)",
        _percent,
        "fedala",
    ),
    Option(
        "ala-layer-idx",
        "head",
        "fedala: the top arrays ALA blends, p counted in trainable arrays from the end (an integer), 'head' (the "
        "head's or decoder's arrays) or 'all'; the lower ones take the global model",
        None,
        "fedala",
        parse_layer_idx,
    ),
    Option(
        "ala-threshold",
        0.1,
        "fedala: the first ALA trains W until the std of the last ala-num-pre-loss epoch losses is below this "
        "(reference 0.1)",
        positive,
        "fedala",
    ),
    Option(
        "ala-num-pre-loss",
        10,
        "fedala: how many recent epoch losses the first ALA's stopping rule looks at (reference 10)",
        _at_least_one,
        "fedala",
    ),
    Option(
        "ala-max-epochs",
        20,
        "fedala: cap on the epochs of W training in a site's first ALA (the reference has none)",
        _at_least_one,
        "fedala",
    ),
)


def top_array_names(names: Sequence[str], layer_idx: int | str, task_module: str = "head") -> list[str]:
    """The arrays ALA blends (in ``names``' order): the last ``layer_idx`` ones, the task module's, or all."""
    names = list(names)
    if layer_idx == "all":
        return names
    if layer_idx == "head":
        top = [n for n in names if n.startswith(task_module + ".")]
        if not top:
            raise ValueError(f"ala-layer-idx='head': no trainable array starts with {task_module!r}")
        return top
    if int(layer_idx) > len(names):
        raise ValueError(f"ala-layer-idx={layer_idx}: the model has only {len(names)} trainable arrays")
    return names[-int(layer_idx) :]


def combine(
    local: Mapping[str, torch.Tensor], global_: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]
) -> OrderedDict[str, torch.Tensor]:
    """Eq. 5 on the arrays of ``weights``: Θ_i + (Θ − Θ_i) ⊙ W_i."""
    return OrderedDict((k, local[k] + (global_[k] - local[k]) * w) for k, w in weights.items())


@dataclass(frozen=True)
class AdaptiveLocalAggregation:
    """The W training of one ALA (the paper's Algorithm 1, lines 6-16; the reference's ``ALA.py``).

    Each batch: the loss of the model with Θ̂_i (``combine``) in place of the top arrays, the gradient with respect to
    W_i by autograd (= ∇_{Θ̂_i}L ⊙ (Θ − Θ_i), Eq. 6), W_i ← clip(W_i − η·grad, 0, 1). The start phase (a site's first
    ALA) repeats epochs until the standard deviation of the last ``num_pre_loss`` epoch losses is below ``threshold``
    (and more than ``num_pre_loss`` epochs ran), at most ``max_epochs``; later ALAs run one epoch.
    """

    eta: float = 1.0
    threshold: float = 0.1
    num_pre_loss: int = 10
    max_epochs: int = 20

    def run(
        self,
        model: nn.Module,
        paths: Mapping[str, str],
        global_: Mapping[str, np.ndarray],
        local: Mapping[str, np.ndarray],
        weights: Mapping[str, np.ndarray],
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        start_phase: bool,
        device: torch.device | str = "cpu",
        precision: str = "fp32",
    ) -> tuple[OrderedDict[str, np.ndarray], OrderedDict[str, np.ndarray], list[float]]:
        """Θ̂_i (every array of ``global_``: the global one below, Eq. 5 on the arrays of ``weights``), the learnt
        W_i and the epoch losses. ``paths`` maps an array name to its parameter in ``model`` (what
        ``functional_call`` takes); ``batches`` is iterated once per epoch."""
        device = torch.device(device)

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a), device=device)

        g = {k: tensor(v) for k, v in global_.items()}
        theta = {k: tensor(local[k]) for k in weights}
        w = OrderedDict((k, tensor(v).clone().requires_grad_(True)) for k, v in weights.items())
        fixed = {paths[k]: g[k] for k in g if k not in w}  # the lower arrays: the global model's
        losses: list[float] = []
        was_training = model.training
        model.train()
        try:
            while True:
                total, seen = 0.0, 0
                for x, y in batches:
                    x, y = x.to(device), y.to(device)
                    top = combine(theta, g, w)
                    with autocast(device, precision):
                        logits = functional_call(model, {**fixed, **{paths[k]: v for k, v in top.items()}}, (x,))
                        loss = loss_fn(logits, y)
                    grads = torch.autograd.grad(loss, list(w.values()), allow_unused=True)
                    with torch.no_grad():
                        for weight, grad in zip(w.values(), grads):
                            if grad is not None:
                                weight.sub_(self.eta * grad).clamp_(0.0, 1.0)
                    total += float(loss.detach()) * len(y)
                    seen += len(y)
                losses.append(total / max(seen, 1))
                if not start_phase or len(losses) >= self.max_epochs:
                    break
                recent = losses[-self.num_pre_loss :]
                if len(losses) > self.num_pre_loss and float(np.std(recent)) < self.threshold:
                    break
        finally:
            model.train(was_training)
        with torch.no_grad():
            top = combine(theta, g, w)
        blended = OrderedDict(
            (k, top[k].detach().cpu().numpy().astype(v.dtype) if k in top else np.array(v)) for k, v in global_.items()
        )
        learnt = OrderedDict((k, v.detach().cpu().numpy().astype(weights[k].dtype)) for k, v in w.items())
        return blended, learnt, losses


def _same(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- client half
class FedALAClient(ClientHalf):
    """ALA on the received global model, then local training from Θ̂_i; the trained arrays go up and, with W_i,
    into the site's state."""

    def personal(self) -> PersonalState:
        return PersonalState(self.rt, key="fedala")

    def aggregation(self) -> AdaptiveLocalAggregation:
        cfg = self.rt.cfg
        return AdaptiveLocalAggregation(cfg.ala_eta, cfg.ala_threshold, cfg.ala_num_pre_loss, cfg.ala_max_epochs)

    def sample(self, rnd: int) -> torch.utils.data.DataLoader:
        """A seeded ``ala-rand-percent`` % of the training split (at least one sample), unshuffled, unaugmented."""
        rt = self.rt
        train = rt.data.train
        count = max(1, int(len(train) * rt.cfg.ala_rand_percent / 100))
        rng = np.random.default_rng(derive_seed(rt.cfg.seed, rnd, rt.partition_id, ALA_SEED))
        rows = np.sort(rng.choice(len(train), size=count, replace=False)).tolist()
        subset = torch.utils.data.Subset(train, rows)
        return make_loader(
            subset, rt.cfg.batch_size, False, derive_seed(rt.cfg.seed, rnd, rt.partition_id, ALA_SEED + 1)
        )

    def initialise(
        self, global_arrays: Mapping[str, np.ndarray], rnd: int
    ) -> tuple[OrderedDict[str, np.ndarray], OrderedDict[str, np.ndarray] | None, dict[str, float]]:
        """Θ̂_i for round ``rnd`` from the received global arrays and the site's state saved before ``rnd``, the learnt
        W_i (None: no ALA) and metrics. A site without a local model yet starts from the global one (the reference
        skips ALA in a client's first round); its first ALA starts W_i at ones and runs the start phase.

        Within one message the same inputs give the same ALA (seeded, no state written), so it runs once: with
        evaluate-in-train a training message evaluates the ALA it then trains from."""
        done = getattr(self, "_ala", None)
        if done is not None and done[0] == rnd and _same(done[1], global_arrays):
            return done[2]
        result = self._initialise(global_arrays, rnd)
        self._ala = (rnd, global_arrays, result)
        return result

    def _initialise(
        self, global_arrays: Mapping[str, np.ndarray], rnd: int
    ) -> tuple[OrderedDict[str, np.ndarray], OrderedDict[str, np.ndarray] | None, dict[str, float]]:
        rt = self.rt
        saved = self.personal().load(before=rnd)
        if saved is None:
            return OrderedDict((k, np.array(v)) for k, v in global_arrays.items()), None, {"ala_epochs": 0.0}
        model = rt.model.to(rt.device)
        local = OrderedDict((k, saved[k]) for k in global_arrays)
        weights = OrderedDict((k[len(WEIGHT) :], v) for k, v in saved.items() if k.startswith(WEIGHT))
        start_phase = not weights
        if start_phase:
            top = top_array_names(list(model.parameter_paths()), rt.cfg.ala_layer_idx, model.task_module)
            weights = OrderedDict((k, np.ones_like(global_arrays[k])) for k in top)
        torch.manual_seed(derive_seed(rt.cfg.seed, rnd, rt.partition_id, ALA_SEED + 2))
        task = getattr(model, "task", "classification")
        blended, learnt, losses = self.aggregation().run(
            model,
            model.parameter_paths(),
            global_arrays,
            local,
            weights,
            self.sample(rnd),
            lambda logits, y: task_loss(task, logits, y),
            start_phase,
            rt.device,
            rt.cfg.precision,
        )
        flat = np.concatenate([w.reshape(-1) for w in learnt.values()])
        metrics = {"ala_epochs": float(len(losses)), "ala_loss": losses[-1], "ala_weight_mean": float(flat.mean())}
        return blended, learnt, metrics

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        blended, weights, ala_metrics = self.initialise(from_record(message.content["arrays"]), rt.round)
        rt.model.set_trainable(blended)
        metrics = {**rt.train_local(), **ala_metrics}
        trained = rt.model.get_trainable()
        state = OrderedDict(trained)
        state.update((WEIGHT + k, v) for k, v in (weights or {}).items())
        self.personal().save(rt.round, state)
        metrics["num-examples"] = len(rt.data.train)
        return self.reply(arrays=trained, metrics=metrics)

    def evaluate(self, message: Message) -> RecordDict:
        """The model this site would train from next round: ALA of the received global arrays (the round's new
        global model) with its local model and W_i, as the ALA of its next training round will give it (same state,
        same seed); nothing is saved. The reference evaluates the local models right after ALA, every round."""
        rt = self.rt
        blended, _, _ = self.initialise(from_record(message.content["arrays"]), rt.round + 1)
        rt.model.set_trainable(blended)
        return self.reply(metrics=rt.evaluate_splits())


# ----------------------------------------------------------------------------- server half
@register_strategy
class FedALA(FederatedStrategy):
    """FedALA (Zhang et al., AAAI 2023): FedAvg on the server (θ ← Σ_k n_k θ_k / Σ_k n_k); each site starts its
    training from its Adaptive Local Aggregation Θ̂_i = Θ_i + (Θ − Θ_i) ⊙ W_i on the top ``ala-layer-idx`` arrays
    and the global Θ below (Eqs. 4-5), W_i ∈ [0, 1] learnt on ``ala-rand-percent`` % of its data (Eq. 6).

    Leaves a site: trainable arrays (adapters + head) after local training and n_k; W_i and the site's local model
    stay on it.
    """

    name = "fedala"
    contract_case = {
        "config": {"ala-max-epochs": 2},
        "why": "the contract suites check messages, checkpoints and resume; W's training to convergence (up to 20 "
        "epochs in a site's first ALA) is tests/strategies/test_fedala.py's",
    }
    client_half = FedALAClient
    folds_evaluation = True  # its evaluate is the ALA its next training starts from
    options = OPTIONS

    def setup(self, initial: Mapping[str, np.ndarray]) -> None:
        p = self.cfg.ala_layer_idx
        if isinstance(p, int) and p > len(initial):
            raise bad("ala-layer-idx", p, f"the model has only {len(initial)} trainable arrays")
