"""The pooled (centralised) reference, ``strategy='pooled'``: one model trained on the union of the simulated sites'
training splits, evaluated on each site's own splits (docs/baselines-fedavg-like.md#pooled).

It is not a federation (the first site reads every partition's data), so the registry-wide contract tests, whose
faults hit other partitions' training replies, leave it out (its ``contract_case`` says so); this file checks what
it promises instead: who trains on what, that every site evaluates, that a real site refuses it, and that a resumed
run equals an uninterrupted one.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import TINY, records, run_dir_of, write_tiny_litemedsam
from safetensors.numpy import load_file

from medflower.data.errors import DataError
from medflower.inprocess import run_inprocess
from medflower.strategies.pooled import pooled_training_split

NODES = 3


def tiny(tmp_path, **extra) -> dict:
    return {**TINY, "output-dir": str(tmp_path), "strategy": "pooled", "run-name": "pooled", **extra}


def final_arrays(run_dir) -> dict[str, np.ndarray]:
    newest = sorted((run_dir / "checkpoint").glob("round-*"))[-1]
    return load_file(str(newest / "arrays.safetensors"))


def test_the_first_site_trains_on_every_sites_training_split_and_every_site_evaluates(tmp_path):
    config = tiny(tmp_path, **{"num-rounds": 2})
    run_inprocess(config, NODES)
    local = tiny(tmp_path, strategy="local", **{"num-rounds": 1, "run-name": "local"})
    run_inprocess(local, NODES)
    own = {r["client"]: r["num-examples"] for r in records(run_dir_of(local), "train")}
    assert len(own) == NODES

    trained = records(run_dir_of(config), "train")
    assert [(r["round"], r["client"]) for r in trained] == [(1, "site-0"), (2, "site-0")]
    for r in trained:
        assert r["num-examples"] == own["site-0"]  # what the site declared when it joined: the server checks it
        assert r["pooled-examples"] == sum(own.values())
        assert r["train_steps"] == math.ceil(sum(own.values()) / TINY["batch-size"])  # one epoch of the union
    evaluated = {(r["round"], r["client"]) for r in records(run_dir_of(config), "eval")}
    assert evaluated == {(rnd, f"site-{p}") for rnd in (1, 2) for p in range(NODES)}


def test_with_local_steps_the_trainer_takes_as_many_steps_as_every_site_together(tmp_path):
    config = tiny(tmp_path, **{"num-rounds": 1, "local-steps": 3, "batch-size": 4})
    run_inprocess(config, NODES)
    fedavg = tiny(tmp_path, strategy="fedavg", **{"num-rounds": 1, "local-steps": 3, "batch-size": 4, "run-name": "f"})
    run_inprocess(fedavg, NODES)
    (trained,) = records(run_dir_of(config), "train")
    assert trained["train_steps"] == 3 * NODES == sum(r["train_steps"] for r in records(run_dir_of(fedavg), "train"))


def test_the_model_learns_from_the_union(tmp_path):
    config = tiny(tmp_path, **{"num-rounds": 3})
    summary, _ = run_inprocess(config, NODES)
    losses = [r["train_loss"] for r in records(run_dir_of(config), "train")]
    assert losses[-1] < losses[0]
    assert summary["final"]["accuracy"] > 1.5 / 10  # ten synthetic classes: well above chance after 3 epochs


def test_a_site_with_its_own_data_refuses_it():
    for rt in (
        SimpleNamespace(data_path="/hospital/data", num_partitions=1),
        SimpleNamespace(data_path=None, num_partitions=1),
    ):
        with pytest.raises(DataError, match="reference for simulations, not a way to run a federation"):
            pooled_training_split(rt)


def test_resume_equals_uninterrupted(tmp_path):
    full = tiny(tmp_path, **{"run-name": "full", "num-rounds": 3})
    run_inprocess(full, NODES)
    part = tiny(tmp_path, **{"run-name": "part", "num-rounds": 2})
    run_inprocess(part, NODES)
    _, grid = run_inprocess({**part, "num-rounds": 3, "resume-from": str(run_dir_of(part))}, NODES)
    assert [m.metadata.group_id for m in grid.sent if m.metadata.message_type == "train"] == ["3"]
    resumed, uninterrupted = final_arrays(run_dir_of(part)), final_arrays(run_dir_of(full))
    assert resumed.keys() == uninterrupted.keys()
    for k in resumed:
        np.testing.assert_array_equal(resumed[k], uninterrupted[k], err_msg=k)


def test_it_trains_on_the_sites_cached_encoder_outputs(tmp_path, monkeypatch):
    """In the frozen-encoder mode each site's training split holds encoder outputs, which the loaders batch without
    the image transforms: the union must say so too, or the first site's training fails and the model never moves."""
    monkeypatch.setenv("MEDFLOWER_CACHE_DIR", str(tmp_path / "cache"))
    weights = write_tiny_litemedsam(tmp_path / "tiny_lite_medsam.pth")
    config = tiny(
        tmp_path,
        **{"dataset": "synthetic-seg", "backbone": "litemedsam", "backbone-weights": str(weights), "img-size": 32},
        **{"synthetic-size": 64, "adapter": "none", "frozen-encoder": "on", "num-rounds": 2, "lr": 0.05},
    )
    run_inprocess(config, 2)
    server = records(run_dir_of(config), "server")
    assert [r["num_failed"] for r in server] == [0, 0]
    trained = records(run_dir_of(config), "train")
    assert [r["round"] for r in trained] == [1, 2] and all(r["pooled-examples"] > r["num-examples"] for r in trained)
    first, last = (records(run_dir_of(config), "eval")[i]["loss"] for i in (0, -1))
    assert last != first  # the model moved
