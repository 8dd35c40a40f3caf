"""End to end through real Flower processes: `flwr run` in simulation and on a loopback deployment."""

import json
import shutil
from pathlib import Path

import pytest

from medflower.loopback import LoopbackFederation

pytestmark = pytest.mark.e2e

if shutil.which("flower-superlink") is None:  # pragma: no cover
    pytest.skip("flwr CLI not installed", allow_module_level=True)

SMALL = {
    "synthetic-size": 240,
    "img-size": 16,
    "patch-size": 8,
    "backbone-weights": "none",
    "batch-size": 32,
    "partition": "iid",
}


def test_deployment_on_loopback_two_supernodes(tmp_path):
    """A real flower-superlink + 2 flower-supernode processes (insecure, loopback), fedavg, 2 rounds."""
    out = tmp_path / "outputs"
    with LoopbackFederation(num_supernodes=2, workdir=tmp_path / "fed") as fed:
        proc = fed.run_app({**SMALL, "strategy": "fedavg", "num-rounds": 2, "min-nodes": 2,
                            "output-dir": str(out), "run-name": "deploy"})
        summary_path = out / "deploy" / "summary.json"
        assert summary_path.is_file(), proc.stdout + fed.logs()
        pids = [p.pid for p in fed.supernodes.values()] + [fed.superlink.pid]
    summary = json.loads(summary_path.read_text())
    assert summary["strategy"] == "fedavg" and summary["rounds"] == 2
    assert sorted(summary["per_client"]) == ["site-0", "site-1"]
    assert summary["communication"]["bytes_up"] > 0
    assert "round 2/2 done" in proc.stdout
    # Only our own processes were started and they are gone now.
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_flwr_run_simulation(tmp_path):
    """`flwr run <app> --stream --run-config "strategy='sgca'"` (the cvxpy solver) against a SuperLink in
    simulation mode with 3 simulated SuperNodes."""
    out = tmp_path / "outputs"
    with LoopbackFederation(num_supernodes=3, simulation=True, workdir=tmp_path / "fed") as fed:
        proc = fed.run_app({**SMALL, "strategy": "sgca", "num-rounds": 2,
                            "output-dir": str(out), "run-name": "sim"})
    summary_path = out / "sim" / "summary.json"
    assert summary_path.is_file(), proc.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["rounds"] == 2 and len(summary["per_client"]) == 3
    for name in ("metrics.jsonl", "summary.md", "curves.png", "checkpoint/state.json"):
        assert (out / "sim" / name).is_file()
    servers = [json.loads(line) for line in (out / "sim" / "metrics.jsonl").read_text().splitlines()
               if '"server"' in line]
    assert [len(r["sgca_W"]) for r in servers] == [3, 3]
