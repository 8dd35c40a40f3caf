"""The shared local loop's step hook (``train_epochs(step=...)``): a hook that is the task step trains bit for bit as
the built-in one; a step that sets its own gradient gets one optimizer step and row-weighted means; a skipped batch
is no step; a non-finite loss stops before the optimizer steps; the hook's forward is the loop's precision; DP-SGD is
refused with a custom step; local-steps bound a round's steps; and Per-FedAvg's, FedSpeed's and ELCFS's steps run in
this loop."""

import copy
from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers import LinearModel, half_mse, half_mse_gradient, half_mse_loss
from torch import nn

import medflower.strategies.continual.elcfs as el
import medflower.strategies.continual.perfedavg as pfa
import medflower.strategies.fedspeed as fs
from medflower.privacy.dp_sgd import PrivateTraining
from medflower.training import OptimizerSpec, StepLoss, task_loss, task_step, train_epochs

CPU = torch.device("cpu")
RNG = np.random.default_rng(0)
BATCHES = [(RNG.normal(size=(n, 3)), RNG.normal(size=n)) for n in (4, 3)]
W0 = {"w": np.array([0.5, -1.0, 2.0]), "b": np.array([0.3])}


def linear():
    model = LinearModel(W0["w"], W0["b"])
    return model, [(torch.tensor(x), torch.tensor(y)) for x, y in BATCHES]


def net_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (5, 4, 6)]


def test_a_hook_that_is_the_task_step_trains_bit_for_bit_as_the_built_in_step():
    model, batches = net_and_batches()
    twin = copy.deepcopy(model)

    def step(net, batch, opt, forward):
        x, y = batch
        with forward():
            loss = task_loss("classification", net(x), y)
        return StepLoss(loss)

    opt = OptimizerSpec("adamw", 1e-2, weight_decay=0.01)
    built_in = train_epochs(model, batches, epochs=2, optimizer=opt, device=CPU)
    hooked = train_epochs(twin, batches, epochs=2, optimizer=opt, device=CPU, step=step)
    assert hooked == built_in and built_in["train_steps"] == 6.0
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
        assert a.grad is None and b.grad is None  # the loop leaves no gradient behind


def test_a_step_that_sets_its_gradient_gets_one_optimizer_step_and_row_weighted_means():
    """The step sets ∇ of ½·mean((xw + b − y)²) and reports it over the first row and the rest separately: SGD steps
    w ← w − lr·∇ once per batch, and each mean is weighted by its own rows over the run."""
    model, batches = linear()
    lr = 0.1

    def step(net, batch, opt, forward):
        x, y = batch
        with forward():
            loss = half_mse(net(x), y)
        grads = torch.autograd.grad(loss, [net.w, net.b])
        net.w.grad, net.b.grad = grads
        with torch.no_grad():
            first, rest = half_mse(net(x[:1]), y[:1]), half_mse(net(x[1:]), y[1:])
        return StepLoss(None, means={"first": (first, 1), "rest": (rest, len(y) - 1)})

    seen = []
    metrics = train_epochs(
        model,
        batches,
        epochs=2,
        optimizer=OptimizerSpec("sgd", lr, momentum=0.0),
        device=CPU,
        after_epoch=seen.append,
        step=step,
        losses=("rest", "first"),
    )
    w = {k: v.copy() for k, v in W0.items()}
    first, rest = [], []
    for _ in range(2):
        for x, y in BATCHES:
            first.append((half_mse_loss(w, x[:1], y[:1]), 1))
            rest.append((half_mse_loss(w, x[1:], y[1:]), len(y) - 1))
            g = half_mse_gradient(w, x, y)
            w = {k: w[k] - lr * g[k] for k in w}
    np.testing.assert_allclose(model.w.detach().numpy(), w["w"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(model.b.detach().numpy(), w["b"], rtol=1e-12, atol=1e-12)
    mean = lambda pairs: sum(v * n for v, n in pairs) / sum(n for _, n in pairs)  # noqa: E731
    assert list(metrics) == ["rest", "first", "train_steps"] and seen == [1, 2]
    assert metrics["first"] == pytest.approx(mean(first), rel=1e-12)
    assert metrics["rest"] == pytest.approx(mean(rest), rel=1e-12)
    assert metrics["train_steps"] == 4.0 and model.w.grad is None


def test_a_skipped_batch_is_no_step_and_no_step_reports_zero_means():
    model, batches = linear()
    calls = []

    def skip(net, batch, opt, forward):
        calls.append(len(batch[1]))

    metrics = train_epochs(
        model, batches, epochs=1, optimizer=OptimizerSpec("adam", 0.1), device=CPU, step=skip, losses=("a", "b")
    )
    assert calls == [4, 3] and metrics == {"a": 0.0, "b": 0.0, "train_steps": 0.0}
    np.testing.assert_array_equal(model.w.detach().numpy(), W0["w"])


def nan_loss(net, batch, opt, forward):
    x, y = batch
    return StepLoss(half_mse(net(x), y) * float("nan"))


def inf_mean(net, batch, opt, forward):
    x, y = batch
    net.w.grad, net.b.grad = torch.ones_like(net.w), torch.ones_like(net.b)
    return StepLoss(None, means={"train_loss": (torch.tensor(float("inf")), len(y))})


@pytest.mark.parametrize("step", [nan_loss, inf_mean], ids=["backpropagated loss", "reported mean"])
def test_a_non_finite_loss_stops_the_loop_before_the_optimizer_steps(step):
    model, batches = linear()
    with pytest.raises(FloatingPointError, match="training loss became (nan|inf) at step 0; lower lr"):
        train_epochs(model, batches, epochs=1, optimizer=OptimizerSpec("sgd", 0.1), device=CPU, step=step)
    np.testing.assert_array_equal(model.w.detach().numpy(), W0["w"])


def test_an_undeclared_mean_and_a_step_without_a_loss_are_refused():
    model, batches = linear()

    def step(net, batch, opt, forward):
        return StepLoss(half_mse(net(batch[0]), batch[1]), means={"other": (0.0, 1)})

    with pytest.raises(ValueError, match="reports \\['other'\\]"):
        train_epochs(model, batches, epochs=1, optimizer=OptimizerSpec("sgd", 0.1), device=CPU, step=step)
    with pytest.raises(ValueError, match="reports its losses in means"):
        StepLoss(None)  # a step that sets its own gradients has nothing else the loop could check


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_hooks_forward_is_the_loops_precision_and_its_backward_is_outside_it(precision, dtype):
    model, batches = net_and_batches()
    seen = []

    def step(net, batch, opt, forward):
        x, y = batch
        with forward():
            logits = net(x)
            seen.append(logits.dtype)
        seen.append(torch.is_autocast_enabled("cpu"))
        return StepLoss(task_loss("classification", logits, y))

    train_epochs(model, batches[:1], epochs=1, optimizer=OptimizerSpec(), device=CPU, precision=precision, step=step)
    assert seen == [dtype, False]


def test_dp_sgd_is_refused_with_a_custom_step():
    model, batches = linear()
    with pytest.raises(ValueError, match="DP-SGD trains by the task step only"):
        train_epochs(
            model,
            batches,
            epochs=1,
            optimizer=OptimizerSpec("sgd", 0.1),
            device=CPU,
            private=PrivateTraining(1.0, 1.0),
            step=task_step(model),
        )


def test_per_fedavg_fedspeed_and_elcfs_step_in_the_shared_loop(monkeypatch):
    """Each method's local training is one ``train_epochs`` call with its step, so the loop's checks are theirs:
    a NaN target stops each of them with the loop's error."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs["step"].__name__, kwargs.get("losses", ("train_loss",))))
        return train_epochs(*args, **kwargs)

    for module in (pfa, fs, el):
        monkeypatch.setattr(module, "train_epochs", spy)
    model, batches = linear()
    params = OrderedDict(w=model.w, b=model.b)
    sgd = OptimizerSpec("sgd", 0.1, momentum=0.0)
    zeros = {k: torch.zeros_like(p) for k, p in params.items()}
    runs = [
        lambda b: pfa.perfedavg_steps(model, params, b, half_mse, alpha=0.1, optimizer=sgd),
        lambda b: fs.fedspeed_steps(
            model, params, b, half_mse, optimizer=sgd, anchor=zeros, g_hat=zeros, lam=1.0, rho=0.1, alpha=0.5
        ),
        lambda b: el.episodic_steps(model, b, lambda x: x, half_mse, inner_lr=0.1, optimizer=sgd),
    ]
    for run in runs:
        assert run(batches)["train_steps"] == 2.0
    assert calls == [
        ("meta_step", ("train_loss", "meta_loss")),
        ("speed_step", ("train_loss",)),
        ("episodic_step", ("train_loss", "outer_loss")),
    ]
    poisoned = [(x, torch.full_like(y, float("nan"))) for x, y in batches]
    for run in runs:
        before = [p.detach().clone() for p in params.values()]
        with pytest.raises(FloatingPointError, match="training loss became nan at step 0"):
            run(poisoned)
        for p, v in zip(params.values(), before):
            assert torch.equal(p.detach(), v)  # stopped before the optimizer stepped


def test_local_steps_take_exactly_that_many_steps_across_passes_and_after_epoch_sees_whole_passes_only():
    """max_steps (run-config local-steps) = 7 over 3 batches a pass: passes 1 and 2 whole, 1 step of pass 3; the
    parameters equal 2 epochs plus one more step on the first batch, done by hand."""
    model, batches = net_and_batches()
    twin = copy.deepcopy(model)
    opt = OptimizerSpec("sgd", 1e-2)
    passes = []
    out = train_epochs(model, batches, epochs=1, optimizer=opt, device=CPU, max_steps=7, after_epoch=passes.append)
    assert out["train_steps"] == 7.0 and passes == [1, 2]
    train_epochs(twin, batches + batches + batches[:1], epochs=1, optimizer=opt, device=CPU)  # the same 7 batches
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
    exact = train_epochs(copy.deepcopy(twin), batches, epochs=5, optimizer=opt, device=CPU, max_steps=3)
    assert exact["train_steps"] == 3.0  # a pass that ends on the last step: no further pass
    assert train_epochs(model, [], epochs=1, optimizer=opt, device=CPU, max_steps=4)["train_steps"] == 0.0


def test_local_steps_set_the_planned_dp_sgd_epsilon_and_strategies_with_their_own_loop_refuse_them():
    from helpers import TINY

    from medflower.config import ConfigError, ExperimentConfig, defaults
    from medflower.privacy.dp_sgd import dp_sgd_epsilon, planned_dp_sgd_epsilon

    def cfg(**extra):
        return ExperimentConfig.from_run_config({**defaults(), **TINY, **extra})

    private = cfg(**{"dp-sgd": True, "local-steps": 3, "batch-size": 10})
    # 100 images at batch 10: sample rate 1/10; 4 rounds of 3 steps, not 4 epochs of 10 batches
    assert planned_dp_sgd_epsilon(private, 100, 4) == pytest.approx(
        dp_sgd_epsilon(private.dp_sgd_noise_multiplier, 0.1, 12, private.dp_delta)
    )
    assert planned_dp_sgd_epsilon(cfg(**{"dp-sgd": True, "batch-size": 10}), 100, 4) > planned_dp_sgd_epsilon(
        private, 100, 4
    )
    assert cfg(strategy="fedala", **{"local-steps": 5}).local_steps == 5
    for strategy in ("fedspeed", "fedkei", "pfedmxf"):
        with pytest.raises(ConfigError, match="local-steps.*trains by its own loop"):
            cfg(strategy=strategy, **{"local-steps": 5})


def test_a_run_with_local_steps_trains_that_many_steps_a_round(tmp_path):
    from helpers import TINY, records, run_dir_of

    from medflower.inprocess import run_inprocess

    config = {**TINY, "output-dir": str(tmp_path), "run-name": "steps", "num-rounds": 2, "local-steps": 3}
    config["batch-size"] = 8  # about 13 batches a pass on each site: 3 steps are fewer than one pass
    run_inprocess(config, 2)
    trained = records(run_dir_of(config), "train")
    assert len(trained) == 4 and {r["train_steps"] for r in trained} == {3.0}
