"""FedAvg / FedProx / local through the real ServerApp and ClientApp code, in process."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers import records, run_dir_of
from safetensors.numpy import load_file

from medflower.contract import validate_arrays, weighted_mean
from medflower.inprocess import run_inprocess
from medflower.strategies import fedavg as fedavg_module


# ----------------------------------------------------------------------------- units
def test_weighted_mean_is_sample_weighted():
    a = OrderedDict(w=np.array([0.0, 2.0], np.float32))
    b = OrderedDict(w=np.array([4.0, 6.0], np.float32))
    out = weighted_mean([a, b], [1, 3])
    np.testing.assert_allclose(out["w"], [3.0, 5.0])
    assert out["w"].dtype == np.float32


@pytest.mark.parametrize(
    "arrays, reason",
    [
        ({"w": np.zeros((2, 2), np.float32)}, None),
        ({"w": np.full((2, 2), np.nan, np.float32)}, "NaN/Inf"),
        ({"w": np.array([[np.inf, 0], [0, 0]], np.float32)}, "NaN/Inf"),
        ({"w": np.zeros((2, 3), np.float32)}, "shape (2, 3), expected (2, 2)"),
        ({"w": np.zeros((2, 2), np.float64)}, "dtype float64"),
        ({"v": np.zeros((2, 2), np.float32)}, "wrong array names"),
        ({}, "wrong array names"),
    ],
)
def test_validate_arrays(arrays, reason):
    problem = validate_arrays(arrays, {"w": ((2, 2), "float32")})
    assert problem is None if reason is None else reason in problem


def test_proximal_term_value_and_gradient():
    model = torch.nn.Linear(3, 2)
    model.trainable_parameters = lambda: OrderedDict(model.named_parameters())
    anchor = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    term = fedavg_module.proximal_term(model, anchor, mu=0.5)(model, None, None)
    expected = 0.25 * sum((p.detach() ** 2).sum() for p in model.parameters())
    torch.testing.assert_close(term.detach(), expected)
    term.backward()
    torch.testing.assert_close(model.weight.grad, 0.5 * model.weight.detach())


# ----------------------------------------------------------------------------- protocol
def test_fedavg_learns_and_writes_outputs(tiny):
    config = tiny(**{"run-name": "fa", "num-rounds": 4, "run-figures": True})
    summary, grid = run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    for name in (
        "config.json",
        "metrics.jsonl",
        "summary.json",
        "summary.md",
        "curves.png",
        "checkpoint/round-000004/state.json",
        "checkpoint/round-000004/arrays.safetensors",
    ):
        assert (run_dir / name).is_file(), name
    assert set(summary) >= {"strategy", "dataset", "rounds", "final", "per_client", "communication", "wall_time_s"}
    assert summary["rounds"] == 4 and len(summary["per_client"]) == 3
    assert summary["final"]["auc"] > 0.7, summary["final"]
    first = np.mean([r["auc"] for r in records(run_dir, "eval") if r["round"] == 1])
    assert summary["final"]["auc"] > first
    # One fresh RecordDict per message, never shared.
    contents = [m.content for m in grid.sent]
    assert len({id(c) for c in contents}) == len(contents)


def test_resume_refuses_a_changed_config(tiny):
    part = tiny(**{"run-name": "p", "num-rounds": 1})
    run_inprocess(part, num_nodes=2)
    with pytest.raises(ValueError, match="run-config 'lr'"):
        run_inprocess(tiny(**{"num-rounds": 2, "lr": 0.5, "resume-from": str(run_dir_of(part))}), num_nodes=2)


def test_local_sites_keep_models_that_differ(tiny):
    config = tiny(strategy="local", **{"run-name": "loc", "num-rounds": 2})
    run_inprocess(config, num_nodes=2)
    states = [
        load_file(str(sorted((run_dir_of(config) / "client-state" / f"partition-{p}" / "personal").glob("*"))[-1]))
        for p in range(2)
    ]
    assert any(not np.array_equal(states[0][k], states[1][k]) for k in states[0])


def test_a_new_run_in_an_existing_folder_starts_over_with_overwrite(tiny):
    config = tiny(**{"run-name": "again", "num-rounds": 1})
    run_inprocess(config, num_nodes=2)
    summary, _ = run_inprocess({**config, "overwrite": True}, num_nodes=2)
    assert summary["rounds"] == 1
    assert len(records(run_dir_of(config), "server")) == 1


def test_a_reply_with_a_metric_named_like_a_record_field_is_rejected_and_the_run_goes_on(tiny, monkeypatch):
    """A metric called `round` used to overwrite the record's round: the run failed at its very end and could not
    be resumed. Now the reply is rejected (logged, counted) and the round goes on with the other sites."""
    original = fedavg_module.FedAvgClient.train

    def train(self, message):
        content = original(self, message)
        if self.rt.partition_id == 1:
            content["metrics"]["round"] = 99.0
        return content

    monkeypatch.setattr(fedavg_module.FedAvgClient, "train", train)
    config = tiny(**{"run-name": "reserved", "num-rounds": 2})
    summary, _ = run_inprocess(config, num_nodes=3)
    server = records(run_dir_of(config), "server")
    assert [r["num_rejected"] for r in server] == [1, 1]
    assert "metric names ['round'] are reserved" in server[0]["rejected"][0]
    trained = [(r["round"], r["client"]) for r in records(run_dir_of(config), "train")]
    assert len(trained) == 4 and all(rnd in (1, 2) for rnd, _ in trained)
    assert summary["rounds"] == 2 and summary["communication"]["rejected_replies"] == 2
