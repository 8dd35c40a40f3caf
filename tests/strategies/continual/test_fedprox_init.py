"""FedProx (Li et al., MLSys 2020) as a FedKEI baseline: the proximal term's gradient μ(θ − θ_start) toward the module
the task started from (task 1: the fresh module), μ = 0 equals fedkei's fedavg-init run exactly, a large μ holds the
module near its start, the pool-mean start, and the config checks."""

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict
from helpers import TINY, TINY_BLOCKS, records, run_dir_of, site_runtime
from safetensors.numpy import load_file

from medflower.config import ExperimentConfig, defaults
from medflower.contract import to_record
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies import STRATEGIES
from medflower.strategies.continual.fedprox_init import FedProxInit, FedProxInitClient
from medflower.strategies.fedavg import PROXIMAL_MU

TASKS = {"num-tasks": 2, "task-epochs": 2, "optimizer": "sgd", "lr": 0.05, "batch-size": 16}


def message(task: int, arrays=None):
    content = RecordDict({"config": ConfigRecord({"round": task})})
    if arrays is not None:
        content["arrays"] = to_record(arrays)
    return SimpleNamespace(content=content)


@pytest.mark.parametrize("sent", [False, True])
def test_the_proximal_gradient_is_mu_times_the_distance_to_the_tasks_start(tmp_path, sent):
    mu = 0.7
    rt = site_runtime(tmp_path, "fedprox-init", **TASKS, **{"proximal-mu": mu})
    rt.config.update({"round": 2 if sent else 1, "model-classes": 2})
    rng = np.random.default_rng(0)
    start = {k: (v + 0.1 * rng.normal(size=v.shape)).astype(v.dtype) for k, v in rt.initial_arrays.items()}
    client = FedProxInitClient(rt)
    msg = message(2, start) if sent else message(1)
    loss_fn, parts, device = client.module_setup()
    client.initialise(msg, loss_fn, parts, device, None)
    extra = client.finetune_loss(msg, None)
    anchor = start if sent else rt.initial_arrays  # task 1: toward the fresh module
    params = rt.model.trainable_parameters()
    moved = {k: (anchor[k] + rng.normal(size=anchor[k].shape)).astype(np.float32) for k in params}
    rt.model.set_trainable(moved)
    rt.model.zero_grad(set_to_none=True)
    value = extra(rt.model, None, None)
    value.backward()
    distance = {k: moved[k].astype(np.float64) - anchor[k] for k in params}
    assert float(value) == pytest.approx(0.5 * mu * sum((d**2).sum() for d in distance.values()), rel=1e-5)
    for k, p in params.items():
        np.testing.assert_allclose(p.grad.numpy(), mu * distance[k], rtol=1e-4, atol=1e-5)
    rt.model.set_trainable(rt.initial_arrays)


def test_mu_zero_adds_no_term(tmp_path):
    rt = site_runtime(tmp_path, "fedprox-init", **TASKS, **{"proximal-mu": 0.0})
    rt.config["round"] = 1
    assert FedProxInitClient(rt).finetune_loss(message(1), None) is None


def test_mu_zero_is_fedkei_fedavg_init_exactly(tiny):
    common = {**TASKS, "partition": "dirichlet", "dirichlet-alpha": 5.0}
    prox = tiny(**common, **{"strategy": "fedprox-init", "proximal-mu": 0.0, "run-name": "prox"})
    fedavg = tiny(**common, **{"strategy": "fedkei", "fedkei-variant": "fedavg-init", "run-name": "fedavg"})
    _, grid = run_inprocess(prox, num_nodes=2)
    run_inprocess(fedavg, num_nodes=2)
    key = lambda d: [(r["task"], r["client"], r["auc_curve"], r["train_loss"]) for r in records(d, "eval")]  # noqa: E731
    assert key(run_dir_of(prox)) == key(run_dir_of(fedavg))
    for path in sorted((run_dir_of(prox) / "checkpoint" / "pool").glob("task-*/*.safetensors")):
        other = run_dir_of(fedavg) / "checkpoint" / "pool" / path.parent.name / path.name
        x, y = load_file(str(path)), load_file(str(other))
        assert all(np.array_equal(x[k], y[k]) for k in x)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    # task 2 starts from the pool mean: each block's A and B and the head
    assert not train[0].content.array_records and len(train[2].content["arrays"]) == 2 * TINY_BLOCKS + 2


def test_a_large_mu_holds_the_module_near_its_start(tiny):
    distances = {}
    for mu in (0.0, 5.0):
        config = tiny(**{**TASKS, "strategy": "fedprox-init", "proximal-mu": mu, "run-name": f"mu{mu}", "num-tasks": 1})
        summary, _ = run_inprocess(config, num_nodes=2)
        pool = run_dir_of(config) / "checkpoint" / "pool" / "task-001"
        rt = site_runtime(run_dir_of(config), "fedprox-init")
        rt.config["model-classes"] = 2  # as the server's messages say: every task is binary
        start = rt.initial_arrays
        distances[mu] = [
            float(np.sqrt(sum(((a[k] - start[k]) ** 2).sum() for k in a)))
            for a in (load_file(str(p)) for p in sorted(pool.glob("*.safetensors")))
        ]
        assert "variant" not in summary
    assert len(distances[0.0]) == 2
    assert all(near < 0.7 * far for near, far in zip(distances[5.0], distances[0.0])), distances


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("proximal-mu", -0.1, "must be >= 0"),
        ("proximal-mu", "strong", "must be a number"),
        ("fedkei-variant", "B", "strategy 'fedprox-init' has its own"),
    ],
)
def test_bad_config_is_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedprox-init", key: value})


def test_it_is_registered_with_fedprox_s_option_object():
    assert STRATEGIES["fedprox-init"] is FedProxInit and not FedProxInit.folds_evaluation
    assert PROXIMAL_MU in FedProxInit.options and STRATEGIES["fedprox"].options[0] is PROXIMAL_MU
