"""Flower's simulation engine on an existing Ray cluster: a head and a worker node on loopback.

flwr 1.41's simulation init args carry no cluster address, but Ray's ``ray.init()`` joins the
cluster named by ``RAY_ADDRESS``; a SuperLink started with it runs its simulation there.
"""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REAL_PROCESSES

from medflower.loopback import LoopbackFederation, free_port, stop_process_group, wait_for_port

pytestmark = pytest.mark.e2e

if shutil.which("ray") is None or shutil.which("flower-superlink") is None:  # pragma: no cover
    pytest.skip("ray / flwr CLI not installed", allow_module_level=True)


def start_ray(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    # --block keeps `ray start` in the foreground, so the node's processes stay in our process group.
    return subprocess.Popen(
        ["ray", "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1", "--num-cpus=1", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def test_simulation_runs_on_an_existing_two_node_ray_cluster(tmp_path):
    port = free_port()
    temp_dir = Path("/tmp") / f"mfray{port}"  # Ray needs a short path for its sockets
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    head = start_ray(
        ["--head", f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=false"],
        tmp_path / "ray-head.log",
        env,
    )
    worker = None
    try:
        wait_for_port(port, timeout=120)
        worker = start_ray([f"--address=127.0.0.1:{port}"], tmp_path / "ray-worker.log", env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = subprocess.run(["ray", "status", f"--address=127.0.0.1:{port}"], capture_output=True, text=True)
            if status.stdout.count("node_") >= 2:
                break
            time.sleep(2)
        assert status.stdout.count("node_") >= 2, status.stdout + status.stderr
        out = tmp_path / "outputs"
        with LoopbackFederation(
            num_supernodes=2,
            simulation=True,
            workdir=tmp_path / "fed",
            extra_env={"RAY_ADDRESS": f"127.0.0.1:{port}"},
            federation_config={"client-resources-num-cpus": 1},
        ) as fed:
            proc = fed.run_app(
                {
                    **REAL_PROCESSES,
                    "num-rounds": 1,
                    "output-dir": str(out),
                    "run-name": "ray",
                }
            )
        assert (out / "ray" / "summary.json").is_file(), proc.stdout[-3000:]
        summary = json.loads((out / "ray" / "summary.json").read_text())
        assert summary["rounds"] == 1 and len(summary["per_client"]) == 2
        # The ClientApp actors ran in our cluster (their logs are in its session folder).
        logs = list(temp_dir.glob("session_*/logs/*"))
        assert any(
            "ClientAppActor" in p.read_text(errors="ignore") for p in logs if p.is_file() and p.stat().st_size < 5e6
        )
    finally:
        for proc in (worker, head):
            stop_process_group(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)
