"""FedDBE (Zhang et al., NeurIPS 2023): the PRBM shift, the MR term and b_i's SGD step against a hand computation, the
server's z̄^g, b_i kept across a restart and never in a reply, the option checks, and a short run that learns."""

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import TINY, records, run_dir_of, send_to_site, site_runtime, training_starts

from medflower.config import ExperimentConfig, defaults
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies.feddbe import (
    GLOBAL_MEAN,
    MEAN,
    PRBM,
    DomainBiasEliminator,
    FedDBE,
    FedDBEClient,
    batch_mean,
    mean_regulariser,
    representation_dim,
    shift,
)


# ----------------------------------------------------------------------------- the equations by hand
class Toy(torch.nn.Module):
    """f(x) = A x (the feature extractor), head(z) = w·z (the task module)."""

    task_module = "head"

    def __init__(self):
        super().__init__()
        self.A = torch.nn.Linear(3, 2, bias=False)
        self.head = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.A.weight.copy_(torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]]))
            self.head.weight.copy_(torch.tensor([[1.0, -2.0]]))

    def forward(self, x):
        return self.head(self.A(x))


X = torch.tensor([[1.0, 2.0, 0.0], [0.0, -1.0, 1.0], [2.0, 0.0, 1.0]])


def test_shift_and_batch_mean_of_vectors_and_feature_maps():
    z = torch.arange(6.0).reshape(3, 2)
    b = torch.tensor([10.0, -1.0])
    np.testing.assert_allclose(shift(z, b).numpy(), z.numpy() + np.array([10.0, -1.0]))
    np.testing.assert_allclose(batch_mean(z).numpy(), [2.0, 3.0])
    grid = torch.arange(2 * 2 * 3 * 3, dtype=torch.float32).reshape(2, 2, 3, 3)
    shifted = shift(grid, b).numpy()
    np.testing.assert_allclose(shifted[:, 0], grid[:, 0].numpy() + 10)
    np.testing.assert_allclose(shifted[:, 1], grid[:, 1].numpy() - 1)
    np.testing.assert_allclose(batch_mean(grid).numpy(), grid.numpy().mean(axis=(0, 2, 3)), rtol=1e-6)


def test_the_mr_term_is_kappa_times_half_the_mean_squared_gap_of_the_running_mean():
    running, batch = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.0], requires_grad=True)
    g = torch.tensor([0.5, 0.5])
    loss, new = mean_regulariser(running, batch, g, kappa=4.0, momentum=0.25)
    by_hand_new = 0.75 * np.array([1.0, -2.0]) + 0.25 * np.array([3.0, 0.0])  # [1.5, -1.5]
    np.testing.assert_allclose(new.detach().numpy(), by_hand_new)
    assert float(loss) == pytest.approx(4.0 * np.mean(0.5 * (by_hand_new - 0.5) ** 2))
    loss.backward()  # d/d batch = κ·μ·(new − g)/D
    np.testing.assert_allclose(batch.grad.numpy(), 4.0 * 0.25 * (by_hand_new - 0.5) / 2, rtol=1e-6)


def test_the_prbm_hook_shifts_the_heads_input_and_learns_b_by_sgd():
    model = Toy()
    b0, g = np.array([0.5, -1.0], np.float32), np.array([0.0, 1.0], np.float32)
    dbe = DomainBiasEliminator(b0, g, kappa=2.0, momentum=0.5, lr=0.1)
    z = X @ model.A.weight.detach().T
    with dbe.attached(model):
        out = model(X)
        np.testing.assert_allclose(out.detach().numpy()[:, 0], (z.numpy() + b0) @ np.array([1.0, -2.0]), rtol=1e-6)
        mr = dbe.extra_loss(model, out, None)
        (out.sum() + mr).backward()
        # MR by hand: running = 0.5·0 + 0.5·mean f(x)
        running = 0.5 * z.numpy().mean(axis=0)
        assert float(mr) == pytest.approx(2.0 * np.mean(0.5 * (running - g) ** 2), rel=1e-6)
        np.testing.assert_allclose(dbe.running_array(), running, rtol=1e-6)
        # d(sum of outputs)/db = B·w (MR does not depend on b: it is on f(x) without b_i); one SGD step
        np.testing.assert_allclose(dbe.bias.grad.numpy(), [3.0, -6.0])
        model(X)  # the next forward applies the pending step first
        np.testing.assert_allclose(dbe.bias_array(), b0 - 0.1 * np.array([3.0, -6.0]), rtol=1e-6)
    assert not model.head._forward_pre_hooks  # detached on exit


def test_the_initialization_period_has_no_prbm_and_no_mr_but_keeps_the_running_mean():
    model = Toy()
    dbe = DomainBiasEliminator(np.array([5.0, 5.0], np.float32), None, momentum=0.1)
    with dbe.attached(model):
        out = model(X)
        np.testing.assert_allclose(out.detach().numpy(), Toy()(X).detach().numpy())  # no b_i
        assert dbe.extra_loss(model, out, None) is None
        model(X)
        dbe.extra_loss(model, out, None)
    z = (X @ model.A.weight.detach().T).numpy().mean(axis=0)
    np.testing.assert_allclose(dbe.running_array(), 0.9 * 0.1 * z + 0.1 * z, rtol=1e-6)  # two EMA steps from 0
    assert dbe.bias.grad is None and dbe.bias_array().tolist() == [5.0, 5.0]


def test_evaluation_adds_b_without_learning_it():
    model = Toy()
    dbe = DomainBiasEliminator(np.array([1.0, 1.0], np.float32), None, train=False)
    with dbe.attached(model), torch.no_grad():
        out = model(X)
    np.testing.assert_allclose(out.numpy(), Toy()(X).detach().numpy() + (1.0 - 2.0), rtol=1e-6)


def test_the_representation_dimension_comes_from_the_task_modules_first_layer():
    assert representation_dim({"head.weight": np.zeros((3, 7)), "head.bias": np.zeros(3)}) == 7
    assert representation_dim({"decoder.proj.weight": np.zeros((64, 12, 1, 1))}) == 12
    assert representation_dim({"decoder.blocks.0.conv1.0.weight": np.zeros((4, 8, 3, 3))}) is None


# ----------------------------------------------------------------------------- the server's z̄^g
def reply(arrays, n):
    return SimpleNamespace(arrays=arrays, num_examples=float(n))


def test_the_server_averages_the_first_rounds_means_once_and_fedavgs_the_model():
    server = FedDBE.__new__(FedDBE)
    server.cfg = SimpleNamespace(max_client_share=1.0, max_weight_over_median=10.0)
    server.global_arrays = OrderedDict(w=np.zeros(2, np.float32))
    server.spec = {"w": ((2,), "float32")}
    server.dim, server.global_mean = 2, None
    assert server.reply_spec(1) == {"w": ((2,), "float32"), MEAN: ((2,), "float32")}
    first = [
        reply({"w": np.array([1.0, 2.0], np.float32), MEAN: np.array([1.0, 0.0], np.float32)}, 1),
        reply({"w": np.array([4.0, 5.0], np.float32), MEAN: np.array([0.0, 3.0], np.float32)}, 3),
    ]
    server.aggregate_train(1, first)
    np.testing.assert_allclose(server.global_mean, [0.25, 2.25])  # (1·[1,0] + 3·[0,3]) / 4
    np.testing.assert_allclose(server.global_arrays["w"], [3.25, 4.25])
    assert server.reply_spec(1) == server.spec  # no mean asked for once z̄^g exists
    server.aggregate_train(2, [reply({"w": np.array([8.0, 8.0], np.float32)}, 1)])
    np.testing.assert_allclose(server.global_mean, [0.25, 2.25])  # fixed
    np.testing.assert_allclose(server.global_arrays["w"], [8.0, 8.0])
    arrays, _ = server.state()
    assert list(arrays) == ["w", GLOBAL_MEAN]
    server.global_mean = None
    server.load_state(arrays, {})
    np.testing.assert_allclose(server.global_mean, [0.25, 2.25])


def test_a_task_module_without_a_representation_input_is_refused_naming_the_strategy():
    server = FedDBE.__new__(FedDBE)
    with pytest.raises(ConfigError, match="'strategy'.*not a U-Net"):
        server.setup({"decoder.blocks.0.conv1.0.weight": np.zeros((4, 8, 3, 3), np.float32)})


# ----------------------------------------------------------------------------- a site, message by message
def send(rt, kind, rnd, arrays):
    return send_to_site(rt, FedDBEClient, kind, rnd, arrays)


def test_b_stays_on_the_site_across_a_restart_and_never_leaves_it(tmp_path, monkeypatch):
    rt = site_runtime(tmp_path, "feddbe")
    seen = training_starts(monkeypatch)
    first = send(rt, "train", 1, rt.initial_arrays)
    sent = first["arrays"]
    assert MEAN in sent and not any(PRBM in k for k in sent)
    assert np.all(FedDBEClient(rt).personal().load(before=2)[PRBM] == 0)  # no b_i in the initialization period
    g = OrderedDict(rt.initial_arrays)
    g[GLOBAL_MEAN] = np.asarray(sent[MEAN].numpy(), np.float32) + 0.5
    second = send(rt, "train", 2, g)
    assert set(second["arrays"]) == set(rt.initial_arrays)  # the model only: no mean, no b_i
    for k in rt.initial_arrays:
        np.testing.assert_array_equal(seen[1][k], rt.initial_arrays[k])  # training starts from the global arrays
    b = FedDBEClient(rt).personal().load(before=3)[PRBM]
    assert np.abs(b).sum() > 0
    evaluated = send(rt, "evaluate", 2, rt.initial_arrays)

    restarted = site_runtime(tmp_path, "feddbe")  # a fresh process: empty context.state, the same disk
    np.testing.assert_array_equal(FedDBEClient(restarted).personal().load(before=3)[PRBM], b)
    again = send(restarted, "evaluate", 2, rt.initial_arrays)
    assert dict(again["metrics"]) == dict(evaluated["metrics"])
    plain = send_to_site(restarted, FedDBEClient, "evaluate", 0, rt.initial_arrays)  # b_i = 0 before round 1
    assert dict(plain["metrics"]) != dict(evaluated["metrics"])


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("feddbe-kappa", -0.1, "must be >= 0"),
        ("feddbe-momentum", 0.0, r"must be in \(0, 1\]"),
        ("feddbe-momentum", 1.5, r"must be in \(0, 1\]"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "feddbe", key: value})


# ----------------------------------------------------------------------------- a short run
def test_feddbe_learns_in_process(tiny):
    config = tiny(strategy="feddbe", **{"run-name": "dbe", "num-rounds": 4})
    summary, _ = run_inprocess(config, num_nodes=3)
    evals = records(run_dir_of(config), "eval")
    first = np.mean([r["auc"] for r in evals if r["round"] == 1])
    assert summary["final"]["auc"] > 0.7 and summary["final"]["auc"] > first, (first, summary["final"])
    norms = {r["round"]: r["feddbe_prbm_norm"] for r in records(run_dir_of(config), "train")}
    assert norms[1] == 0 and norms[4] > 0


def test_feddbe_segments_with_a_per_channel_bias_on_the_decoders_input(tiny):
    seg = {"adapter": "bottleneck", "img-size": 32, "patch-size": 8, "optimizer": "adam", "partition": "natural"}
    config = tiny(
        strategy="feddbe",
        dataset="synthetic-seg",
        **seg,
        **{"run-name": "dbe-seg", "num-rounds": 3, "synthetic-size": 480, "lr": 3e-3},
    )
    summary, _ = run_inprocess(config, num_nodes=3)
    for values in summary["per_client"].values():
        assert 0.0 <= values["dice"] <= 1.0
    evals = records(run_dir_of(config), "eval")
    first = np.mean([r["loss"] for r in evals if r["round"] == 1])
    assert summary["final"]["loss"] < first
    norms = [r["feddbe_prbm_norm"] for r in records(run_dir_of(config), "train") if r["round"] == 3]
    assert min(norms) > 0
