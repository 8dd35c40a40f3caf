"""FedALA (Zhang et al., AAAI 2023): the ALA blend and its weight step against a hand computation, the first-round
skip and the start phase, the site's state across a restart, the option checks, and a short run that learns."""

from collections import OrderedDict, defaultdict

import numpy as np
import pytest
import torch
from helpers import TINY, records, run_dir_of, send_to_site, site_runtime, training_starts

from medflower.config import ExperimentConfig, defaults
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies.fedala import (
    WEIGHT,
    AdaptiveLocalAggregation,
    FedALAClient,
    combine,
    parse_layer_idx,
    top_array_names,
)


# ----------------------------------------------------------------------------- the ALA step by hand
class TwoLayers(torch.nn.Module):
    """h = A x (the lower array), prediction = b·h + c (the top arrays b, c): squared loss, gradients by hand."""

    def __init__(self):
        super().__init__()
        self.A = torch.nn.Parameter(torch.zeros(2, 3))
        self.b = torch.nn.Parameter(torch.zeros(2))
        self.c = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return (x @ self.A.T) @ self.b + self.c


PATHS = {"A": "A", "b": "b", "c": "c"}
RNG = np.random.default_rng(0)
X = RNG.normal(size=(5, 3)).astype(np.float32)
Y = RNG.normal(size=5).astype(np.float32)
GLOBAL = OrderedDict(
    A=RNG.normal(size=(2, 3)).astype(np.float32),
    b=np.array([1.5, -2.0], np.float32),
    c=np.array([0.3], np.float32),
)
LOCAL = OrderedDict(
    A=RNG.normal(size=(2, 3)).astype(np.float32),  # the site's own lower array: replaced by the global one
    b=np.array([-0.5, 1.0], np.float32),
    c=np.array([-0.2], np.float32),
)


def squared(pred, y):
    return ((pred - y) ** 2).mean()


def test_one_weight_step_is_eq6_by_hand_clipped_and_the_lower_arrays_take_the_global():
    w0 = OrderedDict(b=np.array([0.5, 0.9], np.float32), c=np.array([0.2], np.float32))
    eta = 0.7
    blended, learnt, losses = AdaptiveLocalAggregation(eta=eta).run(
        TwoLayers(), PATHS, GLOBAL, LOCAL, w0, [(torch.tensor(X), torch.tensor(Y))], squared, start_phase=False
    )
    # by hand: Θ̂ = Θ_i + (Θ − Θ_i) ⊙ W, h = A_global x, r = Θ̂_b·h + Θ̂_c − y, L = mean r²
    x, y = X.astype(np.float64), Y.astype(np.float64)
    b_hat = LOCAL["b"] + (GLOBAL["b"] - LOCAL["b"]) * w0["b"]
    c_hat = LOCAL["c"] + (GLOBAL["c"] - LOCAL["c"]) * w0["c"]
    h = x @ GLOBAL["A"].T
    r = h @ b_hat + c_hat - y
    assert losses == [pytest.approx(np.mean(r**2), rel=1e-5)]
    grad_b = (2 / len(y)) * (r @ h) * (GLOBAL["b"] - LOCAL["b"])  # ∇_W = ∇_Θ̂ L ⊙ (Θ − Θ_i)
    grad_c = (2 / len(y)) * r.sum() * (GLOBAL["c"] - LOCAL["c"])
    raw = {"b": w0["b"] - eta * grad_b, "c": w0["c"] - eta * grad_c}
    for k in ("b", "c"):
        np.testing.assert_allclose(learnt[k], np.clip(raw[k], 0, 1), rtol=1e-5, atol=1e-6)
    # this data pushes one weight above 1 and one below 0: both clipped
    assert raw["b"].max() > 1 and raw["b"].min() < 0, raw
    assert set(learnt["b"]) == {0.0, 1.0}
    # Θ̂ with the learnt W; the lower array is the global one, not the site's
    np.testing.assert_array_equal(blended["A"], GLOBAL["A"])
    for k in ("b", "c"):
        np.testing.assert_allclose(blended[k], LOCAL[k] + (GLOBAL[k] - LOCAL[k]) * learnt[k], rtol=1e-6)
    assert list(blended) == list(GLOBAL) and all(v.dtype == np.float32 for v in blended.values())


def test_the_weight_gradient_matches_finite_differences_on_a_nonlinear_loss():
    """Autograd through Θ̂ against central differences of the loss in W (cross-entropy of a tanh layer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    paths = {k: k for k, _ in model.named_parameters()}
    g = OrderedDict((k, torch.randn_like(p).numpy()) for k, p in model.named_parameters())
    loc = OrderedDict((k, torch.randn_like(p).numpy()) for k, p in model.named_parameters())
    w = OrderedDict((k, np.full_like(g[k], 0.5)) for k in ("2.weight", "2.bias"))
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    loss_fn = torch.nn.functional.cross_entropy
    eta = 1e-3  # small enough that no weight leaves [0, 1]: the step is -eta * gradient
    _, learnt, _ = AdaptiveLocalAggregation(eta=eta).run(model, paths, g, loc, w, [(x, y)], loss_fn, False)

    def loss_at(weights):
        params = {k: torch.as_tensor(g[k]) for k in g}
        params.update(combine({k: torch.as_tensor(loc[k]) for k in w}, params, weights))
        return float(loss_fn(torch.func.functional_call(model, params, (x,)), y))

    eps = 1e-3
    for k in w:
        for i in range(w[k].size):
            plus = {n: torch.as_tensor(v, dtype=torch.float64).clone() for n, v in w.items()}
            minus = {n: v.clone() for n, v in plus.items()}
            plus[k].view(-1)[i] += eps
            minus[k].view(-1)[i] -= eps
            numeric = loss_at({n: v.float() for n, v in plus.items()}) - loss_at(
                {n: v.float() for n, v in minus.items()}
            )
            numeric /= 2 * eps
            step = (w[k].reshape(-1)[i] - learnt[k].reshape(-1)[i]) / eta
            assert step == pytest.approx(numeric, rel=2e-2, abs=2e-4), (k, i)


def test_the_start_phase_stops_on_the_loss_spread_or_at_the_cap():
    batches = [(torch.tensor(X), torch.tensor(Y))]
    same = OrderedDict((k, v.copy()) for k, v in GLOBAL.items())  # Θ_i = Θ: W cannot change the loss
    w = OrderedDict(b=np.ones(2, np.float32))
    run = AdaptiveLocalAggregation(num_pre_loss=4, max_epochs=50).run
    _, _, losses = run(TwoLayers(), PATHS, GLOBAL, same, w, batches, squared, start_phase=True)
    assert len(losses) == 5  # more than num_pre_loss epochs, then std 0 < threshold
    capped = AdaptiveLocalAggregation(num_pre_loss=4, max_epochs=3).run
    assert len(capped(TwoLayers(), PATHS, GLOBAL, same, w, batches, squared, start_phase=True)[2]) == 3
    strict = AdaptiveLocalAggregation(threshold=1e-12, num_pre_loss=2, max_epochs=7, eta=0.05).run
    assert len(strict(TwoLayers(), PATHS, GLOBAL, LOCAL, w, batches, squared, start_phase=True)[2]) == 7
    assert len(run(TwoLayers(), PATHS, GLOBAL, LOCAL, w, batches, squared, start_phase=False)[2]) == 1


def test_which_arrays_are_blended():
    names = ["blocks.0.a", "blocks.0.b", "blocks.1.a", "decoder.x.weight", "decoder.x.bias"]
    assert top_array_names(names, 2) == ["decoder.x.weight", "decoder.x.bias"]
    assert top_array_names(names, 3) == names[2:]
    assert top_array_names(names, "head", "decoder") == names[3:]
    assert top_array_names(names, "all") == names
    with pytest.raises(ValueError, match="only 5 trainable arrays"):
        top_array_names(names, 6)


# ----------------------------------------------------------------------------- a site, message by message
def site(tmp_path, **run_config):
    return site_runtime(tmp_path, "fedala", **run_config)


def send(rt, kind: str, rnd: int, arrays):
    return send_to_site(rt, FedALAClient, kind, rnd, arrays)


def shifted(arrays, by: float):
    return OrderedDict((k, (v + by).astype(v.dtype)) for k, v in arrays.items())


def test_a_sites_first_round_trains_the_global_model_and_later_rounds_blend(tmp_path, monkeypatch):
    rt = site(tmp_path, **{"ala-max-epochs": 12})
    seen = training_starts(monkeypatch)
    g1 = shifted(rt.initial_arrays, 0.01)
    first = send(rt, "train", 1, g1)
    assert first["metrics"]["ala_epochs"] == 0
    for k in g1:  # no local model yet: ALA is skipped, training starts from Θ^{t-1}
        np.testing.assert_array_equal(seen[0][k], g1[k])
    saved = FedALAClient(rt).personal().load(before=2)
    assert not any(k.startswith(WEIGHT) for k in saved)  # W starts at the first ALA
    second = send(rt, "train", 2, shifted(rt.initial_arrays, -0.01))
    assert 10 < second["metrics"]["ala_epochs"] <= 12  # the start phase: more than ala-num-pre-loss epochs
    head = [k for k in g1 if k.startswith("head.")]
    weights = {k[len(WEIGHT) :] for k in FedALAClient(rt).personal().load(before=3) if k.startswith(WEIGHT)}
    assert weights == set(head)  # ala-layer-idx='head'
    lower = [k for k in g1 if k not in weights]
    for k in lower:
        np.testing.assert_array_equal(seen[1][k], shifted(rt.initial_arrays, -0.01)[k])
    third = send(rt, "train", 3, shifted(rt.initial_arrays, 0.02))
    assert third["metrics"]["ala_epochs"] == 1  # one pass after the start phase


def test_a_restarted_site_goes_on_with_the_same_weights_and_local_model(tmp_path, monkeypatch):
    rt = site(tmp_path, **{"ala-max-epochs": 11})
    seen = training_starts(monkeypatch)
    send(rt, "train", 1, shifted(rt.initial_arrays, 0.01))
    send(rt, "train", 2, shifted(rt.initial_arrays, -0.01))
    in_memory = FedALAClient(rt).personal().load(before=3)
    g3 = shifted(rt.initial_arrays, 0.02)
    evaluated = send(rt, "evaluate", 2, g3)  # round 2's evaluation: the model round 3 will train from
    model_evaluated = rt.model.get_trainable()
    send(rt, "train", 3, g3)

    restarted = site(tmp_path, **{"ala-max-epochs": 11})  # a fresh process: empty context.state, the same disk
    from_disk = FedALAClient(restarted).personal().load(before=3)
    assert list(from_disk) == list(in_memory) and any(k.startswith(WEIGHT) for k in from_disk)
    for k in in_memory:
        np.testing.assert_array_equal(from_disk[k], in_memory[k])
    again = send(restarted, "evaluate", 2, g3)
    assert dict(again["metrics"]) == dict(evaluated["metrics"])
    send(restarted, "train", 3, g3)
    for k in seen[2]:  # the evaluated model is where round 3's training started, on both sites
        np.testing.assert_array_equal(seen[2][k], model_evaluated[k])
        np.testing.assert_array_equal(seen[3][k], seen[2][k])
    a = FedALAClient(rt).personal().load(before=4)
    b = FedALAClient(restarted).personal().load(before=4)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("ala-eta", 0.0, "must be > 0"),
        ("ala-eta", -1.0, "must be > 0"),
        ("ala-rand-percent", 0, "1..100"),
        ("ala-rand-percent", 101, "1..100"),
        ("ala-rand-percent", 50.5, "integer"),
        ("ala-layer-idx", 0, "'all' here"),
        ("ala-layer-idx", -2, "integer >= 1"),
        ("ala-layer-idx", "top", "integer >= 1"),
        ("ala-layer-idx", True, "integer >= 1"),
        ("ala-threshold", 0.0, "must be > 0"),
        ("ala-num-pre-loss", 0, "must be >= 1"),
        ("ala-max-epochs", 0, "must be >= 1"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedala", key: value})


def test_layer_idx_values():
    assert [parse_layer_idx(v) for v in (2, "3", 4.0, "head", "all")] == [2, 3, 4, "head", "all"]


def test_more_top_arrays_than_the_model_has_is_refused_at_the_start(tmp_path):
    config = {**TINY, "strategy": "fedala", "ala-layer-idx": 27, "output-dir": str(tmp_path), "run-name": "x"}
    with pytest.raises(ConfigError, match="'ala-layer-idx' = 27.*only 14 trainable arrays"):
        run_inprocess(config, num_nodes=2)


# ----------------------------------------------------------------------------- a short run
def test_fedala_learns_in_process(tiny):
    config = tiny(strategy="fedala", **{"run-name": "ala", "num-rounds": 4, "ala-max-epochs": 12})
    summary, _ = run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    evals = records(run_dir, "eval")
    first = np.mean([r["auc"] for r in evals if r["round"] == 1])
    assert summary["final"]["auc"] > 0.7 and summary["final"]["auc"] > first, (first, summary["final"])
    epochs = defaultdict(set)
    for r in records(run_dir, "train"):
        epochs[r["round"]].add(r["ala_epochs"])
    assert epochs[1] == {0} and min(epochs[2]) > 10 and epochs[3] == epochs[4] == {1}


def test_with_evaluate_in_train_a_training_message_runs_its_ala_once(tiny, monkeypatch):
    """The folded evaluation is the ALA the message then trains from: one ALA per message, not two."""
    calls = []
    original = AdaptiveLocalAggregation.run

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AdaptiveLocalAggregation, "run", counted)
    base = tiny(strategy="fedala", **{"num-rounds": 3, "ala-max-epochs": 2})
    run_inprocess({**base, "run-name": "plain"}, num_nodes=2)
    plain, calls[:] = len(calls), []
    run_inprocess({**base, "run-name": "folded", "evaluate-in-train": True}, num_nodes=2)
    # per site, plain: evaluate 1, train 2, evaluate 2, train 3, evaluate 3; folded: train 2 (with evaluate 1),
    # train 3 (with evaluate 2), evaluate 3 (round 1 trains the global model: no ALA)
    assert (plain, len(calls)) == (5 * 2, 3 * 2)
