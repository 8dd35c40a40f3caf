"""End to end through `flwr run` in simulation (deployments on loopback: tests/test_deployment.py)."""

import json
import shutil

import numpy as np
import pytest
from helpers import REAL_PROCESSES

from medflower.loopback import LoopbackFederation

pytestmark = pytest.mark.e2e

if shutil.which("flower-superlink") is None:  # pragma: no cover
    pytest.skip("flwr CLI not installed", allow_module_level=True)


def test_flwr_run_simulation(tmp_path):
    """`flwr run <app> --stream --run-config "strategy='sgca'"` (the cvxpy solver) against a SuperLink in
    simulation mode with 3 simulated SuperNodes; then FedKEI on the same SuperLink, whose bi-level phase
    is the custom message action ``train.fedkei_inner``, and SiFT, whose pair is relayed site to site."""
    out = tmp_path / "outputs"
    np.save(tmp_path / "classes.npy", np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32))
    with LoopbackFederation(num_supernodes=3, simulation=True, workdir=tmp_path / "fed") as fed:
        proc = fed.run_app(
            {**REAL_PROCESSES, "strategy": "sgca", "num-rounds": 2, "output-dir": str(out), "run-name": "sim"}
        )
        fedkei = fed.run_app(
            {
                **REAL_PROCESSES,
                "strategy": "fedkei",
                "num-tasks": 2,
                "task-epochs": 1,
                "output-dir": str(out),
                "run-name": "kei",
            }
        )
        sift = fed.run_app(
            {
                **REAL_PROCESSES,
                "strategy": "sift",
                "num-rounds": 1,
                "class-embeddings": str(tmp_path / "classes.npy"),
                "output-dir": str(out),
                "run-name": "sift",
            }
        )
    assert (out / "sift" / "summary.json").is_file(), sift.stdout
    sift_records = [json.loads(line) for line in (out / "sift" / "metrics.jsonl").read_text().splitlines()]
    hops = [r for r in sift_records if r["kind"] == "train"]
    assert [r["position"] for r in hops] == [0, 1, 2] and len({r["client"] for r in hops}) == 3
    assert len([r for r in sift_records if r["kind"] == "eval"]) == 3
    assert (out / "kei" / "summary.json").is_file(), fedkei.stdout
    kei = json.loads((out / "kei" / "summary.json").read_text())
    assert set(kei["tasks"]) == {"1", "2"} and len(kei["tasks"]["2"]["per_client"]) == 3
    kei_server = [
        json.loads(line) for line in (out / "kei" / "metrics.jsonl").read_text().splitlines() if '"server"' in line
    ]
    assert kei_server[1]["bytes"]["bilevel_gradients"]["replies"] == 3 and kei_server[1]["num_failed"] == 0
    summary_path = out / "sim" / "summary.json"
    assert summary_path.is_file(), proc.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["rounds"] == 2 and len(summary["per_client"]) == 3
    for name in ("metrics.jsonl", "summary.md", "curves.png", "checkpoint/round-000002/state.json"):
        assert (out / "sim" / name).is_file()
    servers = [
        json.loads(line) for line in (out / "sim" / "metrics.jsonl").read_text().splitlines() if '"server"' in line
    ]
    assert [len(r["sgca_W"]) for r in servers] == [3, 3]
