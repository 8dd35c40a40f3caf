"""FedAvg / FedProx / local through the real ServerApp and ClientApp code, in process."""

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from medflower.inprocess import run_inprocess
from medflower.strategies import fedavg as fedavg_module
from medflower.strategies.base import Checkpointer, validate_arrays, weighted_mean


def records(run_dir: Path, kind: str):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def run_dir_of(config) -> Path:
    return Path(config["output-dir"]) / config["run-name"]


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
    config = tiny(**{"run-name": "fa", "num-rounds": 4})
    summary, grid = run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    for name in ("config.json", "metrics.jsonl", "summary.json", "summary.md", "curves.png",
                 "checkpoint/state.json", "checkpoint/arrays.safetensors"):
        assert (run_dir / name).is_file(), name
    assert set(summary) >= {"strategy", "dataset", "rounds", "final", "per_client", "communication", "wall_time_s"}
    assert summary["rounds"] == 4 and len(summary["per_client"]) == 3
    assert summary["final"]["auc"] > 0.7, summary["final"]
    first = np.mean([r["auc"] for r in records(run_dir, "eval") if r["round"] == 1])
    assert summary["final"]["auc"] > first
    server = records(run_dir, "server")
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in server)
    # One fresh RecordDict per message, never shared.
    contents = [m.content for m in grid.sent]
    assert len({id(c) for c in contents}) == len(contents)


def test_bad_reply_is_rejected_and_round_goes_on(tiny, monkeypatch):
    original = fedavg_module.FedAvgClient.train

    def poisoned(self, message):
        content = original(self, message)
        if self.rt.partition_id == 1:
            name = next(iter(content["arrays"].keys()))
            bad = content["arrays"][name].numpy().copy()
            bad[...] = np.nan
            from flwr.app import Array

            content["arrays"][name] = Array(bad)
        return content

    monkeypatch.setattr(fedavg_module.FedAvgClient, "train", poisoned)
    config = tiny(**{"run-name": "bad", "num-rounds": 2})
    summary, _ = run_inprocess(config, num_nodes=3)
    server = records(run_dir_of(config), "server")
    assert [r["num_rejected"] for r in server] == [1, 1]
    assert "NaN/Inf" in server[0]["rejected"][0]
    arrays = load_file(str(run_dir_of(config) / "checkpoint" / "arrays.safetensors"))
    assert all(np.isfinite(v).all() for v in arrays.values())
    assert summary["communication"]["rejected_replies"] == 2


def test_node_that_fails_or_drops_is_skipped(tiny, monkeypatch):
    original = fedavg_module.FedAvgClient.train

    def broken(self, message):
        if self.rt.partition_id == 0 and self.rt.round == 1:
            raise RuntimeError("disk full at site 0")
        return original(self, message)

    monkeypatch.setattr(fedavg_module.FedAvgClient, "train", broken)
    drop = lambda node_id, msg: node_id == 3 and msg.metadata.message_type == "train" and msg.metadata.group_id == "2"
    config = tiny(**{"run-name": "drop", "num-rounds": 3, "round-timeout": 5.0})
    summary, _ = run_inprocess(config, num_nodes=3, drop=drop)
    server = records(run_dir_of(config), "server")
    assert [r["num_failed"] for r in server] == [1, 1, 0]
    assert "disk full at site 0" in server[0]["failed"][0]
    assert "no reply" in server[1]["failed"][0]
    trained = [r["client"] for r in records(run_dir_of(config), "train") if r["round"] == 3]
    assert len(trained) == 3, "dropped nodes take part again"
    assert summary["rounds"] == 3


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "local"])
def test_resume_equals_uninterrupted(tiny, strategy):
    full = tiny(strategy=strategy, **{"run-name": f"{strategy}-full", "num-rounds": 3, "fraction-train": 0.67})
    run_inprocess(full, num_nodes=3)
    part = tiny(strategy=strategy, **{"run-name": f"{strategy}-part", "num-rounds": 2, "fraction-train": 0.67})
    run_inprocess(part, num_nodes=3)
    resumed = tiny(strategy=strategy, **{"num-rounds": 3, "fraction-train": 0.67,
                                         "resume-from": str(run_dir_of(part))})
    summary, _ = run_inprocess(resumed, num_nodes=3)  # fresh nodes: nothing in memory survives
    assert summary["rounds"] == 3
    a, meta_a = Checkpointer(run_dir_of(full) / "checkpoint").load()
    b, meta_b = Checkpointer(run_dir_of(part) / "checkpoint").load()
    assert meta_b["completed_rounds"] == 3
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    ev = lambda d: [(r["round"], r["client"], r["auc"], r["loss"]) for r in records(d, "eval")]
    assert ev(run_dir_of(full)) == ev(run_dir_of(part))
    if strategy == "local":  # personal models live on the sites
        for pid in range(3):
            fa = sorted((run_dir_of(full) / "client-state" / f"partition-{pid}" / "personal").glob("*.safetensors"))
            fb = sorted((run_dir_of(part) / "client-state" / f"partition-{pid}" / "personal").glob("*.safetensors"))
            assert [p.name for p in fa] == [p.name for p in fb]
            if not fa:  # this site was never sampled
                continue
            x, y = load_file(str(fa[-1])), load_file(str(fb[-1]))
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])


def test_resume_refuses_a_changed_config(tiny):
    part = tiny(**{"run-name": "p", "num-rounds": 1})
    run_inprocess(part, num_nodes=2)
    with pytest.raises(ValueError, match="run-config 'lr'"):
        run_inprocess(tiny(**{"num-rounds": 2, "lr": 0.5, "resume-from": str(run_dir_of(part))}), num_nodes=2)


def test_local_sends_no_arrays_and_sites_differ(tiny):
    config = tiny(strategy="local", **{"run-name": "loc", "num-rounds": 2})
    summary, _ = run_inprocess(config, num_nodes=2)
    assert summary["communication"]["bytes_up"] == 0 and summary["communication"]["bytes_down"] == 0
    states = [load_file(str(sorted((run_dir_of(config) / "client-state" / f"partition-{p}" / "personal").glob("*"))[-1]))
              for p in range(2)]
    assert any(not np.array_equal(states[0][k], states[1][k]) for k in states[0])


def test_a_new_run_in_an_existing_folder_starts_over(tiny):
    config = tiny(**{"run-name": "again", "num-rounds": 1})
    run_inprocess(config, num_nodes=2)
    summary, _ = run_inprocess(config, num_nodes=2)
    assert summary["rounds"] == 1
    assert len(records(run_dir_of(config), "server")) == 1
