"""Multi-site deployment on loopback: TLS, authenticated SuperNodes, faults survived, resume.

Real flower-superlink / flower-supernode processes, own ports, a temporary FLWR_HOME; each test
stops only what it started (medflower.loopback.LoopbackFederation).
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import REAL_PROCESSES

from medflower.contract import Checkpointer
from medflower.inprocess import run_inprocess
from medflower.loopback import LoopbackFederation

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]

if shutil.which("flower-superlink") is None:  # pragma: no cover
    pytest.skip("flwr CLI not installed", allow_module_level=True)


def make_keys(folder: Path, sites: list[str]) -> Path:
    subprocess.run(
        [sys.executable, str(ROOT / "docker" / "make_certs.py"), "--out", str(folder), "--sites", *sites],
        check=True,
        capture_output=True,
    )
    return folder


def wait_for(predicate, timeout: float, what: str, fed: LoopbackFederation | None = None) -> None:
    """Poll ``predicate``; with ``fed``, stop early when its latest run has ended, and show the federation's logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if fed is not None and fed.runs and fed.runs[-1].poll() is not None:
            if predicate():
                return
            raise AssertionError(f"the run ended before {what}:\n{fed.logs()}")
        time.sleep(1)
    raise TimeoutError(f"waited {timeout:.0f}s for {what}" + (f":\n{fed.logs()}" if fed is not None else ""))


def server_rounds(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["round"] for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "server"]


def test_over_tls_an_unregistered_key_never_joins_and_a_killed_site_returns(tmp_path):
    """3 SuperNodes authenticated over TLS and a 4th with an unregistered key, which never takes part. With
    evaluate-in-train (docs/deployment.md#fewer-messages-per-round), supernode-2 is killed after round 1 and started
    again with its key: rounds 2 and 3 go on without it, it takes part again, and it loses only the evaluation its
    training message carried. (One federation for both: each start costs minutes of process imports on 2 cores.)"""
    certs = make_keys(tmp_path / "certs", ["site-0", "site-1", "site-2", "intruder"])
    keys = {i: certs / "supernodes" / f"site-{i}.key" for i in range(3)}
    out = tmp_path / "outputs"
    run_dir = out / "kill"
    with LoopbackFederation(num_supernodes=3, workdir=tmp_path / "fed", tls_dir=certs, auth_keys=keys) as fed:
        fed.start_supernode(2, key=certs / "supernodes" / "intruder.key", name="intruder")
        fed.start_run(
            {
                **REAL_PROCESSES,
                "num-rounds": 4,
                "min-nodes": 3,
                # how soon rounds 2 and 3 go on without the killed site; a live site's training message took over
                # 40 s when other work shared the 2 cores
                "round-timeout": 90.0,
                "node-wait-timeout": 600.0,  # the first answers: worker starts and imports on 2 shared cores
                "evaluate-in-train": True,  # one message per site and round, through the site workers
                "output-dir": str(out),
                "run-name": "kill",
            }
        )
        # round 1 includes three SuperNodes starting and their site workers importing torch: on 2 shared cores
        # (CI runs two test workers) that alone took longer than a 40-s round-timeout, and the run ended with
        # "no node answered" until the first answers waited node-wait-timeout
        wait_for(lambda: 1 in server_rounds(run_dir), 900, "round 1", fed)
        fed.stop(fed.supernodes["supernode-2"], signal.SIGKILL)
        wait_for(lambda: 2 in server_rounds(run_dir), 300, "round 2 without site 2", fed)
        fed.start_supernode(2)
        wait_for(lambda: (run_dir / "summary.json").is_file(), 600, "the run to finish", fed)
        stream = (fed.workdir / "flwr-run-0.log").read_text()
        intruder_log = (fed.workdir / "intruder.log").read_text()
        pids = [p.pid for p in fed.supernodes.values()] + [fed.superlink.pid]
    # progress streamed by `flwr run --stream`. Not round 4's line: flwr 1.42's ServerApp process gives its last log
    # upload at most a few seconds before it reports the run finished, and the SuperLink then ends the stream, so on
    # loaded cores a run's last lines can miss it (docs/deployment.md#by-hand-on-one-machine-loopback-insecure);
    # round 3's went up during round 4
    assert "round 3/4 done" in stream
    assert "no site-registry: a site name is bound to its node only while" in stream
    # Only our own processes were started and they are gone now.
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    # The intruder never got a node id: no record and no failure names it.
    assert "Failed to activate SuperNode" in intruder_log
    assert "intruder" not in (run_dir / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = {
        rnd: {r["client"] for r in records if r["kind"] == "train" and r["round"] == rnd} for rnd in (1, 2, 3, 4)
    }
    assert trained[1] == {"site-0", "site-1", "site-2"}
    assert "site-2" not in trained[2]
    assert trained[4] == {"site-0", "site-1", "site-2"}, "the returning site takes part again"
    evaluated = {
        rnd: {r["client"] for r in records if r["kind"] == "eval" and r["round"] == rnd} for rnd in (1, 2, 3, 4)
    }
    assert "site-2" not in evaluated[1], "round 1's evaluation came with round 2's training, which site 2 missed"
    assert evaluated[4] == {"site-0", "site-1", "site-2"}
    assert sorted(r["round"] for r in records if "evaluated_in" in r) == [1, 2, 3]
    phases = [r["phase_s"] for r in records if r["kind"] == "server" and "phase_s" in r]
    assert ["evaluate" in p for p in phases] == [False, False, False, True]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "fedavg" and summary["rounds"] == 4 and summary["communication"]["bytes_up"] > 0
    assert sorted(summary["per_client"]) == ["site-0", "site-1", "site-2"]
    assert summary["communication"]["failed_replies"] >= 1


def test_insecure_connection_to_tls_superlink_is_refused(tmp_path):
    certs = make_keys(tmp_path / "certs", [])
    with LoopbackFederation(num_supernodes=0, workdir=tmp_path / "fed", tls_dir=certs) as fed:
        fed.write_connection()
        config = fed.flwr_home / "config.toml"
        config.write_text(config.read_text().replace(f'root-certificates = "{certs / "ca.crt"}"', "insecure = true"))
        proc = fed.flwr("ls", "loopback", check=False, timeout=60)
    assert proc.returncode != 0


def test_superlink_killed_after_round_resumes_to_the_same_arrays(tmp_path):
    out = tmp_path / "outputs"
    config = {**REAL_PROCESSES, "num-rounds": 2, "min-nodes": 2, "output-dir": str(out)}
    # The uninterrupted reference runs the same ServerApp/ClientApp code in process (bit-identical to
    # a deployment, and two minutes cheaper than a third deployed run).
    run_inprocess({**config, "run-name": "reference"}, num_nodes=2)
    profile = tmp_path / "profile.jsonl"
    env = {"MEDFLOWER_PROFILE": str(profile)}
    with LoopbackFederation(num_supernodes=2, workdir=tmp_path / "fed", extra_env=env) as fed:
        fed.start_run({**config, "run-name": "crashed"})
        wait_for(lambda: 1 in server_rounds(out / "crashed"), 300, "round 1 of the crashed run", fed)
        fed.stop(fed.runs[-1], signal.SIGKILL)
        fed.stop(fed.superlink, signal.SIGKILL)  # the SuperLink and the ServerApp it runs
        assert Checkpointer(out / "crashed" / "checkpoint").load()[1]["completed_rounds"] >= 1
        fed.start_superlink()
        fed.run_app({**config, "resume-from": str(out / "crashed")})
    ref, _ = Checkpointer(out / "reference" / "checkpoint").load()
    got, meta = Checkpointer(out / "crashed" / "checkpoint").load()
    assert meta["completed_rounds"] == 2
    # Seen once in CI, not reproduced since: one SuperNode never answered the resumed run's query (its 600-s wait
    # ran out), so round 2 trained on one site. Should it happen again, the failure shows the rounds' server records
    # and every process's log.
    differ = [name for name in ref if not np.array_equal(ref[name], got[name])]
    rounds = list(map(json.loads, (out / "crashed" / "metrics.jsonl").read_text().splitlines()))
    assert not differ, (
        f"{len(differ)} of {len(ref)} arrays differ from the uninterrupted run's; server records:\n"
        + "\n".join(json.dumps(r) for r in rounds if r["kind"] == "server")
        + f"\n{fed.logs(tail=150)}"
    )
    # Every message went through a site worker (the default); each worker imported the site's app once, for the
    # message that started it: one per SuperNode and run (the resumed run is a new run).
    records = [json.loads(line) for line in profile.read_text().splitlines()]
    assert records and {r["mode"] for r in records} == {"worker"}
    workers = {r["worker_pid"] for r in records}
    assert len(workers) >= 4 and sum(r["imports_s"] > 0 for r in records) == len(workers)


def test_secagg_survives_a_supernode_killed_in_the_middle_of_the_protocol(tmp_path):
    """SecAgg+ with real SuperNodes: supernode-2 is killed when the masked-vector stage of round 1 reaches it (its
    4th message: the query, then SecAgg+'s setup, key-share and masked-vector stages), after it shared its key
    shares. The other two sites' shares unmask the sum, the round trains on two sites and the run finishes. (One
    round: a second round of three sites would only repeat, minutes of process starts later, what the in-process
    tests of tests/privacy/test_secagg.py check.)"""
    out = tmp_path / "outputs"
    run_dir = out / "secagg"
    with LoopbackFederation(num_supernodes=3, workdir=tmp_path / "fed") as fed:
        fed.start_run(
            {
                **REAL_PROCESSES,
                "num-rounds": 1,
                "min-nodes": 3,
                # each SecAgg+ stage starts a ClientApp process per site (~6 s of imports each, 3 at once on 2
                # cores); 25 s halted every round when other work shared the cores
                "round-timeout": 60.0,
                "secagg": True,
                "output-dir": str(out),
                "run-name": "secagg",
            }
        )
        received = fed.workdir / "supernode-2.log"
        wait_for(lambda: received.read_text().count("Received successfully") >= 4, 400, "the masked stage", fed)
        fed.stop(fed.supernodes["supernode-2"], signal.SIGKILL)
        wait_for(lambda: (run_dir / "summary.json").is_file(), 400, "the run to finish", fed)
    server = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    secure = {r["round"]: r["secagg_sites"] for r in server if r["kind"] == "server"}
    assert secure == {1: 2}, secure
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 1
