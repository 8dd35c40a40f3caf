"""The hospital-facing port serves the Fleet API only (docs/deployment.md, "Attacks on the control port").

Flower 1.41 serves the Fleet, Control and Runtime APIs on one HTTPS port and, without account
authentication, allows every Control request. The deployment puts the SuperLink on loopback and nginx with
docker/nginx.conf in front of it. Here, all real processes: flower-superlink on 127.0.0.1 (the operator's
side), Debian's nginx running the shipped config (the hospitals' side), two flower-supernode processes with
registered keys that join and train through nginx, and the real `flwr` CLI aimed at each side. An outsider
holding ca.crt and its own key pair, using the hospital-facing address, can neither register its key nor
start, list or stop a run; the registered sites train normally.
"""

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REAL_PROCESSES

from medflower.loopback import APP_DIR, LoopbackFederation, find_nginx, run_config_arg

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]

if shutil.which("flower-superlink") is None:  # pragma: no cover
    pytest.skip("flwr CLI not installed", allow_module_level=True)
if find_nginx() is None:  # pragma: no cover
    pytest.skip("nginx is not installed (CI installs Debian's nginx in .ci/run)", allow_module_level=True)

SMALL = {**REAL_PROCESSES, "synthetic-size": 160}


def flower_routes() -> list[str]:
    """Every Control and Runtime route of the installed SuperLink, and its other HTTP pages."""
    from flwr.supercore.routers.runtime.responses import router as responses
    from flwr.supercore.routers.runtime.router import router as runtime
    from flwr.superlink.routers.control.router import router as control

    paths = sorted({r.path for router in (control, runtime, responses) for r in router.routes})
    assert sum(p.startswith("/v1/control/") for p in paths) > 30 and any(p.startswith("/v1/runtime/") for p in paths)
    return [*paths, "/docs", "/openapi.json", "/health"]


def raw_request(port: int, ca: Path, method: str, target: str) -> tuple[int, str]:
    """(status, body) of one request sent exactly as written (no client-side path cleaning)."""
    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(
            f"{method} {target} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/protobuf\r\n"
            "Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    head, _, body = data.decode(errors="replace").partition("\r\n\r\n")
    return int(head.split()[1]), body


def runs_of(fed: LoopbackFederation) -> list[dict]:
    return json.loads(fed.flwr("ls", "loopback", "--format", "json", timeout=60).stdout)["runs"]


def test_hospital_port_refuses_control_and_runtime_while_sites_train(tmp_path):
    certs = tmp_path / "certs"
    subprocess.run(
        [sys.executable, str(ROOT / "docker" / "make_certs.py"), "--out", str(certs), "--sites", "site-0", "site-1"],
        check=True,
        capture_output=True,
    )
    # The outsider makes its own key pair, as a site would; it holds ca.crt, which every site gets.
    subprocess.run(
        [sys.executable, str(ROOT / "docker" / "make_certs.py"), "site-key", "--out", str(tmp_path / "outsider")],
        check=True,
        capture_output=True,
    )
    outsider_pub, ca = tmp_path / "outsider" / "site.pub", certs / "ca.crt"
    keys = {i: certs / "supernodes" / f"site-{i}.key" for i in range(2)}
    out = tmp_path / "outputs"
    with LoopbackFederation(
        num_supernodes=2, workdir=tmp_path / "fed", tls_dir=certs, auth_keys=keys, fleet_proxy=True
    ) as fed:
        assert fed.fleet_port != fed.port
        with (fed.flwr_home / "config.toml").open("a") as config:  # the outsider's connection: the public address
            config.write(f'\n[superlink.outside]\naddress = "127.0.0.1:{fed.fleet_port}"\nroot-certificates = "{ca}"\n')
        run = fed.start_run({**SMALL, "num-rounds": 1, "min-nodes": 2, "output-dir": str(out), "run-name": "proxied"})
        deadline = time.monotonic() + 120
        while not (runs := runs_of(fed)) and time.monotonic() < deadline:
            time.sleep(1)
        assert runs, fed.logs()
        run_id = runs[0]["run-id"]

        attempts = {
            "register a key": ("supernode", "register", str(outsider_pub), "outside"),
            "list runs": ("ls", "outside"),
            "list nodes": ("supernode", "ls", "outside"),
            "stop the run": ("stop", run_id, "outside"),
            "start a run": ("run", str(APP_DIR), "outside", "--run-config", run_config_arg(SMALL)),
        }
        for what, args in attempts.items():
            proc = fed.flwr(*args, check=False, timeout=120)
            assert proc.returncode != 0, f"{what} through the hospital-facing port succeeded:\n{proc.stdout}"

        # Every Control and Runtime route, Flower's own pages and path tricks: nginx answers, Flower never sees them.
        routes = flower_routes()
        tricks = [
            "/v1/fleet/../control/list-runs",
            "/v1/fleet/%2e%2e/control/list-runs",
            "/v1/fleet/pull-messages/..%2f..%2fcontrol/list-runs",
            "//v1/control/list-runs",
            "/v1/fleet//pull-messages",
            "/v1/fleet/pull-messages?x=/v1/control/list-runs",
            "/V1/CONTROL/LIST-RUNS",
            "/v1/fleet/",
        ]
        for target in routes + tricks:  # nginx's own refusals (its HTML page), never a Flower (JSON) answer
            status, body = raw_request(fed.fleet_port, ca, "POST", target)
            assert status in (400, 404) and "<center>nginx</center>" in body, f"POST {target}: {status} {body}"
        status, body = raw_request(fed.fleet_port, ca, "GET", "/v1/fleet/get-run")
        assert status == 403 and "<center>nginx</center>" in body
        # A Fleet route does reach the SuperLink, which still wants a registered SuperNode's signature.
        status, body = raw_request(fed.fleet_port, ca, "POST", "/v1/fleet/get-run")
        assert status == 401 and "Invalid SuperNode authentication" in body, (status, body)

        assert run.wait(timeout=600) == 0, fed.logs()
        runs = runs_of(fed)
        nodes = json.loads(fed.flwr("supernode", "ls", "loopback", "--format", "json", timeout=60).stdout)["nodes"]
        access_log = (fed.workdir / "nginx.log").read_text()
        logs = fed.logs()
    assert len(runs) == 1 and runs[0]["status"] == "finished:completed", f"{runs}\n{logs}"  # not stopped, no 2nd run
    assert len(nodes) == 2, nodes  # the outsider's key was not registered
    summary = json.loads((out / "proxied" / "summary.json").read_text())
    assert sorted(summary["per_client"]) == ["site-0", "site-1"] and summary["rounds"] == 1
    assert summary["communication"]["failed_replies"] == 0
    assert '"POST /v1/fleet/pull-messages HTTP/1.1" 200' in access_log  # the sites trained through nginx
    assert '"POST /v1/control/list-runs HTTP/1.1" 404' in access_log
