"""FedAMP in FedKEI's protocol: the attention weights ξ and the proximal term by hand, the protocol in process (each
site's cloud model u_i, the plain mean for a site absent from the last task, bytes), resume, and the option checks."""

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict
from helpers import TINY, extended_by_a_task, records, run_dir_of, site_runtime
from safetensors.numpy import load_file

from medflower.config import ExperimentConfig, defaults
from medflower.contract import from_record, stack_flat, to_record
from medflower.contract.checkpoint import Checkpointer
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies.continual import fedamp as fa

TASKS = {"strategy": "fedamp", "num-tasks": 2, "task-epochs": 1, "optimizer": "sgd", "lr": 0.01, "batch-size": 32}


# ----------------------------------------------------------------------------- ξ and the proximal term by hand
def test_attention_weights_by_hand():
    modules = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])  # squared distances from row 0: 1 and 4
    alpha, sigma = 0.6, 2.0
    xi = fa.attention_weights(modules, 0, alpha, sigma)
    a1, a2 = alpha * np.exp(-1 / 2) / 2, alpha * np.exp(-4 / 2) / 2  # α·A'(d²), A'(x) = exp(−x/σ)/σ
    np.testing.assert_allclose(xi, [1 - a1 - a2, a1, a2], rtol=1e-12)
    # row 1: squared distances 1 (to row 0) and 5 (to row 2); the closer module weighs more
    xi1 = fa.attention_weights(modules, 1, alpha, sigma)
    np.testing.assert_allclose(xi1[[0, 2]], [alpha * np.exp(-1 / 2) / 2, alpha * np.exp(-5 / 2) / 2], rtol=1e-12)
    assert xi1[1] == pytest.approx(1 - xi1[0] - xi1[2]) and xi1[0] > xi1[2]
    u = xi @ modules  # the cloud model u_0 = Σ_j ξ_0j θ_j
    np.testing.assert_allclose(u, [a1, 2 * a2])
    with pytest.raises(ValueError, match="self-weight xi_ii .* < 0 over 3 modules.*lower fedamp-alpha"):
        fa.attention_weights(modules, 0, alpha=5.0, sigma=2.0)


def test_the_default_step_keeps_every_self_weight_non_negative():
    assert fa.message_step(0.3, 2.0, 5) == 0.3  # fedamp-alpha as given
    assert fa.message_step(0.0, 2.0, 5) == 0.5  # 0: σ/(M − 1)
    assert fa.message_step(0.0, 2.0, 1) == 2.0  # one module: only itself
    same = np.zeros((4, 3))  # identical modules: every A' at its largest, 1/σ
    xi = fa.attention_weights(same, 2, fa.message_step(0.0, 2.0, 4), 2.0)
    np.testing.assert_allclose(xi, [1 / 3, 1 / 3, 0, 1 / 3], atol=1e-15)


def test_the_proximal_term_is_lambda_over_two_alpha_times_the_squared_distance(tmp_path):
    rt = site_runtime(tmp_path, "fedamp", **{"fedamp-lambda": 0.3, "fedamp-alpha": 0.7})
    client = fa.FedAMPClient(rt)
    u = rt.model.get_trainable()
    config = ConfigRecord({"round": 2, fa.ALPHA: 0.2})  # the step the server used (not the site's run config)
    message = SimpleNamespace(content=RecordDict({"arrays": to_record(u), "config": config}))
    extra = client.finetune_loss(message, None)
    rng = np.random.default_rng(0)
    moved = {k: v + rng.normal(scale=0.1, size=v.shape).astype(v.dtype) for k, v in u.items()}
    rt.model.set_trainable(moved)
    squared = sum(float(((moved[k].astype(np.float64) - u[k]) ** 2).sum()) for k in u)
    term = extra(rt.model, None, None)
    assert term.requires_grad and float(term.detach()) == pytest.approx(0.3 / (2 * 0.2) * squared, rel=1e-4)
    no_cloud = SimpleNamespace(content=RecordDict({"config": ConfigRecord({"round": 1})}))
    assert client.finetune_loss(no_cloud, None) is None  # task 1: no u_i, no term
    off = fa.FedAMPClient(site_runtime(tmp_path / "off", "fedamp", **{"fedamp-lambda": 0.0}))
    assert off.finetune_loss(message, None) is None


# ----------------------------------------------------------------------------- the protocol, in process
def messages(grid, task: int):
    return {
        m.metadata.dst_node_id: m
        for m in grid.sent
        if m.metadata.message_type == "train" and m.metadata.group_id == str(task)
    }


def pooled(run_dir, task: int):
    """The pool's modules of ``task`` by site, from the run's checkpoint."""
    index = Checkpointer(run_dir / "checkpoint").load()[1]["strategy_meta"]["pool"]
    return {
        e["client"]: load_file(str(run_dir / "checkpoint" / "pool" / e["file"])) for e in index if e["task"] == task
    }


def test_each_site_starts_from_its_cloud_model_and_an_absent_site_from_the_mean(tiny, monkeypatch):
    starts, losses = {}, []
    original = fa.ContinualClient.finetune

    def spy(self, train, epochs, after_epoch, extra_loss, device):
        starts[(self.rt.client, self.task)] = self.rt.model.get_trainable()
        losses.append((self.task, extra_loss is not None))
        return original(self, train, epochs, after_epoch, extra_loss, device)

    monkeypatch.setattr(fa.ContinualClient, "finetune", spy)

    def drop(node_id, message):  # node 3 misses task 1's fine-tuning: no module of it in the pool
        return node_id == 3 and message.metadata.message_type == "train" and message.metadata.group_id == "1"

    config = tiny(**{**TASKS, "run-name": "amp", "fedamp-alpha": 0.3})
    summary, grid = run_inprocess(config, num_nodes=3, drop=drop)
    run_dir = run_dir_of(config)
    assert not any(m.content.array_records for m in messages(grid, 1).values())
    task1 = pooled(run_dir, 1)
    names = sorted(task1)
    assert len(names) == 2
    spec = {k: (v.shape, str(v.dtype)) for k, v in task1[names[0]].items()}
    matrix = stack_flat([task1[n] for n in names], spec)
    server = records(run_dir, "server")[1]
    assert server["fedamp_clients"] == names and server["fedamp_task"] == 1 and server["fedamp_alpha"] == 0.3
    sent = messages(grid, 2)
    clients = {r["client"] for r in records(run_dir, "eval") if r["task"] == 2}
    assert len(sent) == 3 and len(clients) == 3
    assert clients - set(names) == {"site-2"}
    for node, message in sent.items():
        client = f"site-{node - 1}"  # InProcessGrid: node n holds partition n - 1
        u = from_record(message.content["arrays"])
        assert message.content["config"][fa.ALPHA] == 0.3
        assert list(starts[(client, 2)]) == list(u)  # fine-tuning starts from u_i
        for name, value in u.items():
            np.testing.assert_array_equal(starts[(client, 2)][name], value)
        if client == "site-2":
            xi = np.array([0.5, 0.5])  # the plain mean
        else:
            xi = fa.attention_weights(matrix, names.index(client), 0.3, 1.0)
            assert 0 < xi[names.index(client)] < 1 and np.all(xi > 0)
        np.testing.assert_allclose(server["fedamp_weights"][client], xi, rtol=1e-12)
        np.testing.assert_allclose(stack_flat([u], spec)[0], xi @ matrix.astype(np.float64), rtol=1e-5, atol=1e-7)
    assert sorted(losses) == [(1, False), (1, False), (2, True), (2, True), (2, True)]
    # bytes: 2·|θ| per site in task 2 (u_i down, θ_i up)
    assert (server["bytes_down"] + server["bytes_up"]) / 3 == 2 * matrix.shape[1] * 4
    assert set(summary["tasks"]) == {"1", "2"} and "variant" not in summary


def test_too_large_a_step_stops_the_run_naming_the_keys(tiny):
    with pytest.raises(ValueError, match="self-weight .* lower fedamp-alpha or raise fedamp-sigma"):
        run_inprocess(tiny(**{**TASKS, "run-name": "big", "fedamp-alpha": 100.0}), num_nodes=3)


def test_a_finished_run_extended_by_a_task_equals_an_uninterrupted_one(tiny):
    full, part = extended_by_a_task(tiny, TASKS)
    key = lambda d: [(r["task"], r["client"], r["auc_curve"], r["train_loss"]) for r in records(d, "eval")]  # noqa: E731
    assert key(full) == key(part)
    weights = lambda d: [r.get("fedamp_weights") for r in records(d, "server")]  # noqa: E731
    assert weights(full) == weights(part)


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("fedamp-alpha", -0.1, "must be >= 0"),
        ("fedamp-sigma", -1.0, "must be > 0"),
        ("fedamp-lambda", -0.1, "must be >= 0"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedamp", key: value})
