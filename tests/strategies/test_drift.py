"""SCAFFOLD and FedDyn: the correction terms' gradients, the papers' client and server updates on real
replies, BatchNorm statistics, and the config check (resume and per-site state: tests/contract/test_contract.py)."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers import records, run_dir_of
from torch import nn

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import from_record
from medflower.inprocess import run_inprocess
from medflower.models import build_model
from medflower.strategies import drift

SGD = {"optimizer": "sgd", "momentum": 0.0, "lr": 0.05}


class Params(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 2))
        self.b = nn.Parameter(torch.randn(4))

    def trainable_parameters(self):
        return OrderedDict([("a", self.a), ("b", self.b)])


def test_scaffold_term_adds_c_minus_ci_and_feddyn_term_has_the_papers_gradient():
    torch.manual_seed(0)
    model = Params()
    direction = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    drift.linear_term(model, direction)(model, None, None).backward()
    torch.testing.assert_close(model.a.grad, direction["a"])
    torch.testing.assert_close(model.b.grad, direction["b"])
    model.zero_grad()
    h = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    anchor = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    drift.feddyn_term(model, h, anchor, 0.3)(model, None, None).backward()
    for k in ("a", "b"):
        torch.testing.assert_close(getattr(model, k).grad, -h[k] + 0.3 * (getattr(model, k).detach() - anchor[k]))


def capture(monkeypatch, strategy_class):
    captured = {}
    original = strategy_class.aggregate_train

    def spy(self, rnd, replies):
        before = OrderedDict((k, v.copy()) for k, v in self.global_arrays.items())
        original(self, rnd, replies)
        captured[rnd] = (replies, before)

    monkeypatch.setattr(strategy_class, "aggregate_train", spy)
    return captured


def test_scaffold_follows_option_ii_on_the_sites_and_the_server(tiny, monkeypatch):
    captured = capture(monkeypatch, drift.Scaffold)
    config = tiny(**{**SGD, "strategy": "scaffold", "run-name": "scaffold", "num-rounds": 2, "scaffold-global-lr": 0.5})
    summary, grid = run_inprocess(config, num_nodes=3)
    replies, x = captured[1]
    name = "head.weight"
    for r in replies:  # round 1: c = c_i = 0, so Δc = c_i⁺ = (x − y)/(K η) = −Δy/(K η)
        np.testing.assert_allclose(
            r.arrays[drift.CONTROL + name], -r.arrays[name] / (r.metrics["train_steps"] * 0.05), rtol=1e-4, atol=1e-6
        )
    round2 = from_record(
        [m for m in grid.sent if m.metadata.message_type == "train" and m.metadata.group_id == "2"][0].content["arrays"]
    )
    mean_dy = np.mean([r.arrays[name] for r in replies], axis=0)
    mean_dc = np.mean([r.arrays[drift.CONTROL + name] for r in replies], axis=0)
    np.testing.assert_allclose(round2[name], x[name] + 0.5 * mean_dy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(round2[drift.CONTROL + name], mean_dc, rtol=1e-5, atol=1e-6)  # |S| = N
    losses = [r["train_loss"] for r in records(run_dir_of(config), "train")]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


def test_feddyn_server_step_is_the_mean_minus_h_over_alpha(tiny, monkeypatch):
    captured = capture(monkeypatch, drift.FedDyn)
    config = tiny(**{"strategy": "feddyn", "run-name": "feddyn", "num-rounds": 2, "feddyn-alpha": 0.1})
    run_inprocess(config, num_nodes=3)
    replies, theta = captured[1]
    name = "head.bias"
    h = -0.1 / 3 * sum(r.arrays[name].astype(np.float64) - theta[name] for r in replies)
    expected = np.mean([r.arrays[name] for r in replies], axis=0) - h / 0.1
    theta_round2 = captured[2][1]  # the global arrays round 2 started from
    np.testing.assert_allclose(theta_round2[name], expected, rtol=1e-5, atol=1e-6)


def test_scaffold_refuses_adaptive_optimizers():
    with pytest.raises(ConfigError, match="optimizer='sgd' momentum=0"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "scaffold"})
    ExperimentConfig.from_run_config({**defaults(), "strategy": "scaffold", "optimizer": "sgd", "momentum": 0.0})


FULL_RESNET = {"backbone": "resnet18", "adapter": "full"}


def test_a_fully_trained_backbone_sends_batchnorm_statistics_that_never_leak_between_sites():
    cfg = ExperimentConfig.from_run_config({**defaults(), **FULL_RESNET, "img-size": 16, "backbone-weights": "none"})
    model = build_model(cfg.model_spec(), 3)
    names = model.trainable_names()
    assert "backbone.conv1.weight" in names and "backbone.bn1.running_mean" in names and "head.weight" in names
    assert not any(n.endswith("num_batches_tracked") for n in names)
    site_a = model.get_trainable()
    model.train()
    model(torch.randn(8, 3, 16, 16) * 3 + 1)  # a forward pass in train mode moves the statistics
    site_b = model.get_trainable()
    assert not np.allclose(site_a["backbone.bn1.running_mean"], site_b["backbone.bn1.running_mean"])
    model.set_trainable(site_a)  # what every message does before training: no statistic of site b survives
    for name, value in model.get_trainable().items():
        np.testing.assert_array_equal(value, site_a[name])


def test_drift_corrections_leave_batchnorm_statistics_to_a_plain_mean(tiny, monkeypatch):
    captured = capture(monkeypatch, drift.FedDyn)
    config = tiny(**{**FULL_RESNET, "strategy": "feddyn", "run-name": "dyn-full", "num-rounds": 2})
    run_inprocess(config, num_nodes=2)
    replies, _ = captured[1]
    statistic = "backbone.layer1.0.bn1.running_var"
    np.testing.assert_allclose(
        captured[2][1][statistic], np.mean([r.arrays[statistic] for r in replies], axis=0), rtol=1e-6
    )
    scaffold = capture(monkeypatch, drift.Scaffold)
    run_inprocess(
        tiny(**{**FULL_RESNET, **SGD, "strategy": "scaffold", "run-name": "scaffold-full", "num-rounds": 1}),
        num_nodes=2,
    )
    arrays = scaffold[1][0][0].arrays
    assert drift.CONTROL + "backbone.conv1.weight" in arrays and statistic in arrays
    assert not any(k.startswith(drift.CONTROL) and k.endswith(("running_mean", "running_var")) for k in arrays)


def test_lr_decay_scales_each_rounds_learning_rate(tiny, monkeypatch):
    from medflower.contract import client

    seen = []
    original = client.train_epochs

    def spy(*args, optimizer, **kwargs):
        seen.append(optimizer.lr)
        return original(*args, optimizer=optimizer, **kwargs)

    monkeypatch.setattr(client, "train_epochs", spy)
    run_inprocess(tiny(**{"strategy": "fedavg", "run-name": "decay", "lr": 0.01, "lr-decay": 0.5}), num_nodes=2)
    np.testing.assert_allclose(seen, [0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025])
