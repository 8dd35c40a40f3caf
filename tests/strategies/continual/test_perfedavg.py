"""Per-FedAvg (FO) (Fallah et al., NeurIPS 2020) as a FedKEI baseline: the meta-step and the personalisation step
against a hand computation on a quadratic loss; a site's curve is its personalised model's while the meta-model is
what it keeps and sends; the pool-mean start; the option checks; a short continual run."""

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from helpers import TINY, LinearModel, half_mse, half_mse_gradient, half_mse_loss, records, run_dir_of, site_runtime
from safetensors.numpy import load_file

from medflower.config import ExperimentConfig, defaults
from medflower.contract import from_record
from medflower.contract.checkpoint import Checkpointer
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies import STRATEGIES
from medflower.strategies.continual.perfedavg import PerFedAvg, PerFedAvgClient, perfedavg_steps, personalise
from medflower.training import OptimizerSpec

TASKS = {"num-tasks": 2, "task-epochs": 2, "optimizer": "sgd", "lr": 0.01, "batch-size": 16}


# ----------------------------------------------------------------------------- the meta-step by hand


RNG = np.random.default_rng(0)
CHUNKS = [(RNG.normal(size=(n, 3)), RNG.normal(size=n)) for n in (6, 5, 1)]  # D|D' = 3|3, 3|2, then one row: skipped
W0 = {"w": np.array([0.5, -1.0, 2.0]), "b": np.array([0.3])}


def test_a_meta_step_is_w_minus_beta_grad_at_the_inner_step_by_hand():
    alpha, beta = 0.4, 0.1
    model = LinearModel(W0["w"], W0["b"])
    params = OrderedDict(w=model.w, b=model.b)
    epochs_seen = []
    metrics = perfedavg_steps(
        model,
        params,
        [(torch.tensor(x), torch.tensor(y)) for x, y in CHUNKS],
        half_mse,
        alpha=alpha,
        optimizer=OptimizerSpec("sgd", beta, momentum=0.0),
        epochs=2,
        after_epoch=epochs_seen.append,
    )
    # by hand, Per-FedAvg (FO): w̃ = w − α∇f(w; D), w ← w − β∇f(w̃; D'), D the chunk's first half (rounded up)
    w = {k: v.copy() for k, v in W0.items()}
    inner, outer = [], []
    for _ in range(2):
        for x, y in CHUNKS[:2]:
            half = (len(y) + 1) // 2
            d, d2 = (x[:half], y[:half]), (x[half:], y[half:])
            g = half_mse_gradient(w, *d)
            tilde = {k: w[k] - alpha * g[k] for k in w}
            inner.append((half_mse_loss(w, *d), half))
            outer.append((half_mse_loss(tilde, *d2), len(y) - half))
            g2 = half_mse_gradient(tilde, *d2)
            w = {k: w[k] - beta * g2[k] for k in w}
    for k in w:
        np.testing.assert_allclose(params[k].detach().numpy(), w[k], rtol=1e-12, atol=1e-12)
    assert epochs_seen == [1, 2] and metrics["train_steps"] == 4.0  # 2 meta-steps per epoch; the 1-row chunk skipped
    mean = lambda pairs: sum(v * n for v, n in pairs) / sum(n for _, n in pairs)  # noqa: E731
    assert metrics["train_loss"] == pytest.approx(mean(inner), rel=1e-12)
    assert metrics["meta_loss"] == pytest.approx(mean(outer), rel=1e-12)


def test_alpha_zero_is_plain_sgd_on_the_second_halves():
    """α = 0: w̃ = w, so each meta-step is one SGD step on D' alone (a check that D' is what the outer step sees)."""
    model = LinearModel(W0["w"], W0["b"])
    params = OrderedDict(w=model.w, b=model.b)
    perfedavg_steps(
        model,
        params,
        [(torch.tensor(x), torch.tensor(y)) for x, y in CHUNKS],
        half_mse,
        alpha=0.0,
        optimizer=OptimizerSpec("sgd", 0.1, momentum=0.0),
    )
    w = {k: v.copy() for k, v in W0.items()}
    for x, y in CHUNKS[:2]:
        half = (len(y) + 1) // 2
        g = half_mse_gradient(w, x[half:], y[half:])
        w = {k: w[k] - 0.1 * g[k] for k in w}
    for k in w:
        np.testing.assert_allclose(params[k].detach().numpy(), w[k], rtol=1e-12, atol=1e-12)


def test_personalise_is_one_inner_step_and_returns_the_meta_model():
    model = LinearModel(W0["w"], W0["b"])
    params = OrderedDict(w=model.w, b=model.b)
    x, y = CHUNKS[0]
    saved = personalise(model, params, (torch.tensor(x), torch.tensor(y)), half_mse, alpha=0.4)
    g = half_mse_gradient(W0, x, y)
    for k, v in zip(params, saved):
        np.testing.assert_allclose(params[k].detach().numpy(), W0[k] - 0.4 * g[k], rtol=1e-12)
        np.testing.assert_array_equal(v.numpy(), W0[k])


# ----------------------------------------------------------------------------- a site
def test_a_site_reports_the_personalised_curve_and_keeps_and_sends_the_meta_model(tmp_path, monkeypatch):
    rt = site_runtime(tmp_path, "per-fedavg", **{**TASKS, "batch-size": 8})
    rt.config["round"] = 1
    evaluated, personalised = [], []
    original = personalise

    def spy(model, params, batch, loss_fn, alpha, device="cpu", precision="fp32"):
        before = model.get_trainable()
        saved = original(model, params, batch, loss_fn, alpha, device, precision)
        personalised.append((before, model.get_trainable(), len(batch[1])))
        return saved

    import medflower.strategies.continual.perfedavg as pfa

    monkeypatch.setattr(pfa, "personalise", spy)
    monkeypatch.setattr(pfa, "evaluate", lambda model, *a, **k: evaluated.append(model.get_trainable()) or {"auc": 0.5})
    import medflower.strategies.continual.protocol as protocol

    monkeypatch.setattr(
        protocol, "evaluate", lambda model, *a, **k: evaluated.append(model.get_trainable()) or {"auc": 0.5}
    )
    message = SimpleNamespace(content=RecordDict({"config": ConfigRecord({"round": 1})}))
    content = PerFedAvgClient(rt).train(message)
    sent = from_record(content["arrays"])
    metrics = content["metrics"]
    n = int(metrics["num-examples"])
    assert metrics["train_steps"] == 2 * (n // 16 + (n % 16 >= 2))  # per epoch: chunks of 2B rows, not of 1 row
    # evaluated: epoch 0 (the start), then each epoch's personalised model, then the meta-model (auc_meta)
    assert len(evaluated) == 4 and len(personalised) == 2
    for (meta, adapted, rows), seen in zip(personalised, evaluated[1:3]):
        assert rows == 8  # one training batch
        assert all(np.array_equal(seen[k], adapted[k]) for k in seen)  # the curve is the personalised model's
        assert not all(np.array_equal(adapted[k], meta[k]) for k in meta)
    final_meta = personalised[-1][0]
    for k in sent:  # the meta-model, restored after the evaluation, is kept and sent
        np.testing.assert_array_equal(sent[k], final_meta[k])
        np.testing.assert_array_equal(evaluated[3][k], final_meta[k])
    assert "auc_meta" in metrics and metrics["auc"] == metrics["auc_curve"][-1]


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("perfedavg-alpha", 0.0, "must be > 0"),
        ("perfedavg-alpha", -0.1, "must be > 0"),
        ("perfedavg-alpha", "big", "must be a number"),
        ("fedkei-variant", "C", "fedkei's initialisation; strategy 'per-fedavg' has its own"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "per-fedavg", key: value})


def test_it_is_registered_with_its_option():
    assert STRATEGIES["per-fedavg"] is PerFedAvg and not PerFedAvg.folds_evaluation
    assert {o.key: o.default for o in PerFedAvg.options}["perfedavg-alpha"] == 0.005


# ----------------------------------------------------------------------------- a continual run
def test_a_continual_run_starts_task_two_from_the_mean_of_the_pooled_meta_models(tiny):
    config = tiny(
        **{**TASKS, "strategy": "per-fedavg", "run-name": "pfa", "partition": "dirichlet", "dirichlet-alpha": 5.0}
    )
    summary, grid = run_inprocess(config, num_nodes=2)
    run_dir = run_dir_of(config)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert [m.metadata.group_id for m in train] == ["1", "1", "2", "2"]
    assert not train[0].content.array_records  # task 1: the fresh module
    state = Checkpointer(run_dir / "checkpoint").load()[1]["strategy_meta"]["pool"]
    task1 = [(e["num_examples"], load_file(str(run_dir / "checkpoint" / "pool" / e["file"]))) for e in state]
    task1 = [(n, a) for (n, a), e in zip(task1, state) if e["task"] == 1]
    assert len(task1) == 2 and task1[0][0] != task1[1][0]
    sent = from_record(train[2].content["arrays"])
    total = sum(n for n, _ in task1)
    for name, value in sent.items():
        np.testing.assert_allclose(value, sum(n * a[name] for n, a in task1) / total, rtol=1e-5, atol=1e-7)
    evals = records(run_dir, "eval")
    assert len(evals) == 4 and all({"auc_meta", "meta_loss"} <= set(r) for r in evals)
    assert all(len(r["auc_curve"]) == 3 for r in evals)
    assert set(summary["tasks"]) == {"1", "2"} and "variant" not in summary
    assert (run_dir / "summary.md").read_text().startswith("# per-fedavg on synthetic")
