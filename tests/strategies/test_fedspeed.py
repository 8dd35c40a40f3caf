"""FedSpeed (Sun et al., ICLR 2023, Algorithm 1): the perturbed quasi-gradient, the prox-corrected step, the ĝ update
and the upload against a hand computation on a quadratic loss; the server's plain mean; a site's ĝ across a restart;
the option checks; and a short run that learns."""

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict
from helpers import TINY, VIT_TINY, half_mse, records, run_dir_of

from medflower.config import ExperimentConfig, defaults
from medflower.contract import ClientRuntime, Reply, from_record, to_record
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies import STRATEGIES
from medflower.strategies.fedspeed import FedSpeed, FedSpeedClient, dual_and_upload, fedspeed_steps
from medflower.training import OptimizerSpec


# ----------------------------------------------------------------------------- the local steps by hand
class Linear(torch.nn.Module):
    """pred = x·w + b; a buffer counts the training forward passes that are kept (the running-statistics stand-in)."""

    def __init__(self, w, b):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.tensor(b, dtype=torch.float64))
        self.register_buffer("passes", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        if self.training:
            self.passes += 1
        return x @ self.w + self.b


RNG = np.random.default_rng(0)
BATCHES = [(RNG.normal(size=(4, 3)), RNG.normal(size=4)) for _ in range(2)]  # K = 2 steps
X0 = {"w": np.array([0.5, -1.0, 2.0]), "b": np.array([0.3])}  # x^t, where the site starts
G_HAT = {"w": np.array([0.2, -0.1, 0.05]), "b": np.array([-0.4])}  # ĝ_i^{t−1}


def gradient(p, x, y):
    r = x @ p["w"] + p["b"] - y
    return {"w": x.T @ r / len(y), "b": np.array([r.mean()])}


@pytest.mark.parametrize("rho, alpha", [(0.3, 0.7), (0.3, 1.0), (0.0, 0.7), (0.3, 0.0)])
def test_the_local_steps_dual_update_and_upload_are_algorithm_1_by_hand(rho, alpha):
    lam, lr = 2.0, 0.1
    model = Linear(X0["w"], X0["b"])
    params = OrderedDict(w=model.w, b=model.b)
    metrics = fedspeed_steps(
        model,
        params,
        [(torch.tensor(x), torch.tensor(y)) for x, y in BATCHES],
        half_mse,
        optimizer=OptimizerSpec("sgd", lr, momentum=0.0),
        anchor={k: torch.tensor(v) for k, v in X0.items()},
        g_hat={k: torch.tensor(v) for k, v in G_HAT.items()},
        lam=lam,
        rho=rho,
        alpha=alpha,
    )
    # by hand: lines 7-11 of Algorithm 1 for each of the K = 2 batches
    x = {k: v.copy() for k, v in X0.items()}
    losses = []
    for bx, by in BATCHES:
        g1 = gradient(x, bx, by)
        losses.append(0.5 * np.mean((bx @ x["w"] + x["b"] - by) ** 2))
        norm = np.sqrt(sum((g**2).sum() for g in g1.values()))  # one norm over every array
        y = {k: x[k] + rho * g1[k] / norm for k in x}
        g2 = gradient(y, bx, by)
        quasi = {k: (1 - alpha) * g1[k] + alpha * g2[k] for k in x}
        x = {k: x[k] - lr * (quasi[k] - G_HAT[k] + (x[k] - X0[k]) / lam) for k in x}
    for k in x:
        np.testing.assert_allclose(params[k].detach().numpy(), x[k], rtol=1e-12, atol=1e-12)
    assert metrics == {"train_loss": pytest.approx(np.mean(losses), rel=1e-12), "train_steps": 2.0}
    assert float(model.passes) == 2  # the perturbed pass leaves the buffers as the unperturbed pass set them

    # lines 13-14: ĝ_i^t = ĝ_i^{t−1} − (x_K − x^t)/λ, x̂_i = x_K − λ·ĝ_i^t
    new_g, upload = dual_and_upload(x, X0, G_HAT, lam)
    for k in x:
        g_t = G_HAT[k] - (x[k] - X0[k]) / lam
        np.testing.assert_allclose(new_g[k], g_t, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(upload[k], x[k] - lam * g_t, rtol=1e-6, atol=1e-6)
        assert new_g[k].dtype == upload[k].dtype == np.float32


def test_a_running_statistic_has_no_dual_and_travels_as_trained():
    x_k = {"conv.weight": np.array([1.0, 2.0], np.float32), "bn.running_mean": np.array([0.5], np.float32)}
    anchor = {"conv.weight": np.array([0.0, 1.0], np.float32), "bn.running_mean": np.array([0.1], np.float32)}
    new_g, upload = dual_and_upload(x_k, anchor, {"conv.weight": np.zeros(2, np.float32)}, 4.0)
    assert list(new_g) == ["conv.weight"] and list(upload) == list(x_k)
    np.testing.assert_allclose(new_g["conv.weight"], [-0.25, -0.25])
    np.testing.assert_allclose(upload["conv.weight"], [2.0, 3.0])  # x_K − λĝ = x_K + (x_K − x^t) in round 1
    np.testing.assert_array_equal(upload["bn.running_mean"], x_k["bn.running_mean"])


def test_the_server_takes_the_plain_mean_of_the_uploads():
    server = object.__new__(FedSpeed)
    server.global_arrays = OrderedDict(a=np.zeros(2, np.float32))
    server.spec = OrderedDict(a=((2,), "float32"))
    ups = [np.array([1.0, 2.0], np.float32), np.array([3.0, -4.0], np.float32), np.array([2.0, 5.0], np.float32)]
    replies = [
        Reply(i, f"c{i}", OrderedDict(a=u), {"num-examples": n}, {}) for i, (u, n) in enumerate(zip(ups, (1, 10, 100)))
    ]
    server.aggregate_train(1, replies)
    np.testing.assert_allclose(server.global_arrays["a"], [2.0, 1.0])  # 1/|S|, not the size weights
    assert server.global_arrays["a"].dtype == np.float32


# ----------------------------------------------------------------------------- a site, message by message
def site(tmp_path, **run_config) -> ClientRuntime:
    sgd = {"optimizer": "sgd", "momentum": 0.0, "lr": 0.05}
    cfg = ExperimentConfig.from_run_config({**defaults(), **TINY, **sgd, "strategy": "fedspeed", **run_config})
    node = {"partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "state")}
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
    return ClientRuntime(cfg, context, {"round": 0}, 0, 2)


def train(rt: ClientRuntime, rnd: int, arrays) -> OrderedDict:
    rt.config["round"] = rnd
    message = SimpleNamespace(content=RecordDict({"arrays": to_record(arrays), "config": ConfigRecord({"round": rnd})}))
    return from_record(FedSpeedClient(rt).train(message)["arrays"])


def test_a_site_keeps_its_dual_across_rounds_and_a_restart(tmp_path):
    rt = site(tmp_path)
    lam = rt.cfg.fedspeed_lambda
    x1 = OrderedDict(rt.initial_arrays)
    up1 = train(rt, 1, x1)
    xk1 = rt.model.get_trainable()
    g1 = FedSpeedClient(rt).personal().load(before=2)
    assert list(g1) == list(x1)  # ViT + LoRA: no running statistics
    for k in x1:
        np.testing.assert_allclose(g1[k], -(xk1[k] - x1[k]) / lam, rtol=1e-5, atol=1e-7)  # ĝ^0 = 0
        np.testing.assert_allclose(up1[k], xk1[k] - lam * g1[k], rtol=1e-5, atol=1e-6)
    assert any(np.abs(g1[k]).max() > 0 for k in g1)

    x2 = OrderedDict((k, (v + 0.01).astype(v.dtype)) for k, v in x1.items())
    up2 = train(rt, 2, x2)
    xk2 = rt.model.get_trainable()
    g2 = FedSpeedClient(rt).personal().load(before=3)
    for k in x2:  # ĝ^2 = ĝ^1 − (x_K − x^2)/λ: round 2 started from round 1's ĝ
        np.testing.assert_allclose(g2[k], g1[k] - (xk2[k] - x2[k]) / lam, rtol=1e-5, atol=1e-6)

    restarted = site(tmp_path)  # a fresh process: empty context.state, the same state folder
    from_disk = FedSpeedClient(restarted).personal().load(before=2)
    for k in g1:
        np.testing.assert_array_equal(from_disk[k], g1[k])
    again = train(restarted, 2, x2)  # round 2 again, as a resumed run sends it: the same reply
    for k in up2:
        np.testing.assert_array_equal(again[k], up2[k])


def test_a_whole_backbone_keeps_no_dual_for_batchnorm_statistics_and_sends_them_as_trained(tmp_path):
    rt = site(tmp_path, backbone="resnet18", adapter="full")
    x1 = OrderedDict(rt.initial_arrays)
    statistic = "backbone.layer1.0.bn1.running_var"
    assert statistic in x1
    up = train(rt, 1, x1)
    xk = rt.model.get_trainable()
    g = FedSpeedClient(rt).personal().load(before=2)
    assert "backbone.conv1.weight" in g and not any(k.endswith(("running_mean", "running_var")) for k in g)
    np.testing.assert_array_equal(up[statistic], xk[statistic])
    assert not np.allclose(up[statistic], x1[statistic])  # trained: the statistics moved
    w, w0 = xk["backbone.conv1.weight"], x1["backbone.conv1.weight"]
    np.testing.assert_allclose(up["backbone.conv1.weight"], 2 * w - w0, rtol=1e-5, atol=1e-6)  # x_K − λĝ, round 1


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("fedspeed-lambda", 0.0, "must be > 0"),
        ("fedspeed-lambda", -1.0, "must be > 0"),
        ("fedspeed-rho", -0.1, "must be >= 0"),
        ("fedspeed-alpha", 1.5, r"\[0, 1\]"),
        ("fedspeed-alpha", -0.2, r"\[0, 1\]"),
        ("fedspeed-alpha", "high", "must be a number"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedspeed", key: value})


def test_it_is_registered_with_its_options():
    assert STRATEGIES["fedspeed"] is FedSpeed
    assert {o.key: o.default for o in FedSpeed.options} == {
        "fedspeed-lambda": 10.0,
        "fedspeed-rho": 0.1,
        "fedspeed-alpha": 0.9,
    }


# ----------------------------------------------------------------------------- runs
def test_without_the_perturbation_it_is_feddyn_with_alpha_one_over_lambda(tiny):
    """ρ = 0: the local objective, the dual update and the server step are FedDyn's (Acar et al.) with α = 1/λ."""
    from medflower.contract.checkpoint import Checkpointer

    base = tiny(optimizer="sgd", momentum=0.0, lr=0.05, **{"num-rounds": 2})  # Adam would magnify float order
    dyn = {**base, "strategy": "feddyn", "feddyn-alpha": 0.05, "run-name": "dyn"}
    speed = {**base, "strategy": "fedspeed", "fedspeed-rho": 0.0, "fedspeed-lambda": 20.0, "run-name": "speed"}
    a, _ = run_inprocess(dyn, num_nodes=2)
    b, _ = run_inprocess(speed, num_nodes=2)
    x_dyn = Checkpointer(run_dir_of(dyn) / "checkpoint").load()[0]
    x_speed = Checkpointer(run_dir_of(speed) / "checkpoint").load()[0]
    for k, v in x_speed.items():
        if not k.startswith("feddyn-h/"):
            np.testing.assert_allclose(v, x_dyn[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert a["final"]["auc"] == pytest.approx(b["final"]["auc"], abs=1e-4)


def test_fedspeed_learns_in_process(tiny):
    config = tiny(strategy="fedspeed", **VIT_TINY, lr=0.003, **{"run-name": "speed", "num-rounds": 4})
    summary, _ = run_inprocess(config, num_nodes=3)
    evals = records(run_dir_of(config), "eval")
    first = np.mean([r["auc"] for r in evals if r["round"] == 1])
    assert summary["final"]["auc"] > 0.8 and summary["final"]["auc"] > first, (first, summary["final"])
    assert all(r["fedspeed_g_hat_norm"] > 0 for r in records(run_dir_of(config), "train"))
