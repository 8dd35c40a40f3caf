"""The ClientApp's light entry point and the site's long-lived worker (medflower/client_app.py,
medflower/site_worker.py): same replies as the site app computed in place, one worker kept across messages, errors
passed on, a worker that is gone replaced, and a socket folder that others can enter refused.

tests/test_deployment.py runs the worker for real behind SuperNodes (it is the default in a deployment).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from helpers import TINY

from medflower import client_app, site_worker
from medflower.inprocess import run_inprocess
from medflower.records import from_record
from medflower.strategies import STRATEGIES


@pytest.fixture
def worker_env(tmp_path, monkeypatch):
    """A private worker folder and a profile file for this test; every worker it started is stopped after."""
    folder = tmp_path / "workers"
    monkeypatch.setenv(site_worker.DIR_ENV, str(folder))
    monkeypatch.setenv("MEDFLOWER_PROFILE", str(tmp_path / "profile.jsonl"))
    contexts: list[Context] = []
    yield contexts
    for context in contexts:
        site_worker.stop_worker(context)


@pytest.fixture(scope="module")
def sent(tmp_path_factory):
    """The messages a one-round fedavg run sent to two sites, and their run config."""
    out = tmp_path_factory.mktemp("run")
    config = {**TINY, "num-rounds": 1, "output-dir": str(out), "run-name": "r"}
    _, grid = run_inprocess(config, num_nodes=2)
    return grid.sent, grid.contexts


def fresh(context: Context, **node_config) -> Context:
    """A deployment site's context: the run's, with its own state and node config (short idle for tests)."""
    node = {**context.node_config, site_worker.IDLE_KEY: 60, **node_config}
    return Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=node,
        state=RecordDict(),
        run_config=context.run_config,
    )


def delivered(message):
    copied = copy.copy(message)
    copied.content = copy.deepcopy(message.content)
    return copied


def profile(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]


def test_the_entry_point_imports_nothing_heavy():
    """Flower starts a process per message in a deployment: the entry point must not import torch and the rest."""
    heavy = ("torch", "timm", "peft", "transformers", "sklearn", "cvxpy", "scipy", "medflower.site_app")
    code = f"import sys, medflower.client_app; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_entry_point_registers_every_strategy_action():
    assert set(client_app.EXTRA_ACTIONS) == {a for s in STRATEGIES.values() for a in s.extra_actions}
    registered = set(client_app.app._registered_funcs)
    assert {f"{c}.{a}" for c, a in client_app.EXTRA_ACTIONS} <= registered


def test_a_worker_answers_as_the_site_app_does_and_lives_on(sent, worker_env, tmp_path):
    messages, contexts = sent
    train = next(m for m in messages if m.metadata.message_type == "train" and m.metadata.dst_node_id == 2)
    here = client_app.handle_here(delivered(train), fresh(contexts[2]))
    context = fresh(contexts[2])
    worker_env.append(context)
    first = site_worker.forward(delivered(train), context)
    second = site_worker.forward(delivered(train), context)
    for reply in (first, second):
        assert reply.metadata.reply_to_message_id == train.metadata.message_id
        assert dict(reply.content["metrics"]) == dict(here.content["metrics"])
        for name, value in from_record(here.content["arrays"]).items():
            np.testing.assert_array_equal(from_record(reply.content["arrays"])[name], value)
    records = [r for r in profile(tmp_path) if r["mode"] == "worker"]
    assert len(records) == 2 and records[0]["worker_pid"] == records[1]["worker_pid"] != os.getpid()
    assert records[0]["worker_spawn_s"] > 0 and records[0]["imports_s"] > 0  # the first message starts it
    assert records[1]["worker_spawn_s"] == 0 and records[1]["imports_s"] == 0 and records[1]["data_s"] < 0.5
    assert records[1]["train_s"] > 0 and records[0]["created_at"] == train.metadata.created_at


def test_a_site_error_comes_back_and_the_worker_goes_on(sent, worker_env):
    messages, contexts = sent
    query = next(m for m in messages if m.metadata.message_type == "train" and m.metadata.dst_node_id == 1)
    context = fresh(contexts[1], device="cuda:7")
    worker_env.append(context)
    with pytest.raises(site_worker.SiteError) as err:
        site_worker.forward(delivered(query), context)
    # A missing device is named with the devices the site has, and the node (not redacted: it names devices only).
    assert "DeviceError: node 1 (partition 0): device 'cuda:7' does not exist here; this site has cpu" in str(err.value)
    context.node_config.pop("device")
    assert site_worker.forward(delivered(query), context).has_content()


def test_a_worker_that_is_gone_is_replaced_and_an_idle_one_exits(sent, worker_env, tmp_path):
    messages, contexts = sent
    train = next(m for m in messages if m.metadata.message_type == "train" and m.metadata.dst_node_id == 1)
    context = fresh(contexts[1])
    worker_env.append(context)
    site_worker.forward(delivered(train), context)
    pid = site_worker.stop_worker(context)
    assert pid is not None and site_worker.stop_worker(context) is None
    assert not site_worker.worker_paths(context)["sock"].exists()
    idle = fresh(contexts[1], **{site_worker.IDLE_KEY: 1})
    assert site_worker.forward(delivered(train), idle).has_content()  # a new worker
    new_pid = profile(tmp_path)[-1]["worker_pid"]
    assert new_pid != pid
    deadline = time.monotonic() + 30
    while site_worker.worker_paths(context)["sock"].exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not site_worker.worker_paths(context)["sock"].exists()  # idle for a second: it exited


def test_a_worker_folder_others_may_enter_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    monkeypatch.setenv(site_worker.DIR_ENV, str(folder))
    with pytest.raises(site_worker.WorkerError, match="no one else may enter"):
        site_worker.worker_dir()


@pytest.mark.parametrize(("key", "value"), [(site_worker.WORKER_KEY, "maybe"), (site_worker.IDLE_KEY, "-1")])
def test_bad_worker_node_config_is_refused(key, value):
    context = Context(run_id=1, node_id=1, node_config={key: value}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match=f"node-config {key}"):
        site_worker.uses_worker(context) and site_worker.idle_seconds(context)


def test_two_runs_on_one_node_keep_a_worker_each(sent, worker_env, tmp_path):
    """Runs that take turns on one SuperNode do not stop each other's worker: one start per run, not per switch."""
    messages, contexts = sent
    train = next(m for m in messages if m.metadata.message_type == "train" and m.metadata.dst_node_id == 1)
    earlier, later = fresh(contexts[1]), fresh(contexts[1])
    later.run_id = earlier.run_id + 1
    worker_env.extend([earlier, later])
    for context in (earlier, later, earlier, later):
        assert site_worker.forward(delivered(train), context).has_content()
    records = [r for r in profile(tmp_path) if r["mode"] == "worker"]
    assert [r["worker_spawn_s"] > 0 for r in records] == [True, True, False, False]
    assert records[0]["worker_pid"] == records[2]["worker_pid"] != records[1]["worker_pid"] == records[3]["worker_pid"]


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "zombie" in state:
            return True
        time.sleep(0.1)
    return False


def test_a_wedged_worker_is_stopped_and_replaced(sent, worker_env, tmp_path, monkeypatch):
    """A worker that cannot even accept a connection (here: stopped with SIGSTOP) is killed after the connect
    timeout, and the message goes to a new worker."""
    messages, contexts = sent
    train = next(m for m in messages if m.metadata.message_type == "train" and m.metadata.dst_node_id == 1)
    context = fresh(contexts[1])
    worker_env.append(context)
    site_worker.forward(delivered(train), context)
    wedged = int(site_worker.worker_paths(context)["pid"].read_text())
    os.kill(wedged, signal.SIGSTOP)
    monkeypatch.setattr(site_worker, "CONNECT_TIMEOUT_S", 2.0)
    try:
        assert site_worker.forward(delivered(train), context).has_content()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(wedged, signal.SIGCONT)
    assert _gone(wedged)
    assert profile(tmp_path)[-1]["worker_pid"] != wedged


def test_a_worker_that_does_not_reply_in_time_is_stopped(sent, worker_env, tmp_path, monkeypatch):
    """The ClientApp waits site-worker-timeout seconds for a reply, then stops the worker (it would hold every later
    message) and fails this message; the next message starts a new worker."""
    messages, contexts = sent
    train = next(m for m in messages if m.metadata.message_type == "train" and m.metadata.dst_node_id == 1)
    context = fresh(contexts[1], **{site_worker.TIMEOUT_KEY: 1})
    worker_env.append(context)
    site_worker.forward(delivered(train), fresh(contexts[1]))  # started, imports done
    paths = site_worker.worker_paths(context)
    stuck = int(paths["pid"].read_text())
    connect = site_worker._connect_or_spawn

    def connect_then_hang(*args):
        conn, spawn_s = connect(*args)
        os.kill(stuck, signal.SIGSTOP)  # stuck in the message from here on
        return conn, spawn_s

    monkeypatch.setattr(site_worker, "_connect_or_spawn", connect_then_hang)
    started = time.monotonic()
    with pytest.raises(site_worker.WorkerError, match="gave no reply to train within 1s"):
        site_worker.forward(delivered(train), context)
    assert time.monotonic() - started < 30
    assert _gone(stuck) and not paths["sock"].exists()
    monkeypatch.setattr(site_worker, "_connect_or_spawn", connect)
    assert site_worker.forward(delivered(train), fresh(contexts[1])).has_content()
    assert profile(tmp_path)[-1]["worker_pid"] != stuck


def test_the_worker_exits_when_its_supernode_is_gone_even_while_busy(tmp_path):
    """The watch does not wait for the message lock: a busy worker whose SuperExec is gone, or whose message ran
    past its ClientApp's deadline, exits."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    paths = {kind: tmp_path / f"w.{kind}" for kind in ("sock", "key", "pid")}
    watch = site_worker._Watch(paths, done.pid, idle=900)
    watch.busy.acquire()
    watch.deadline = time.time() + 600
    assert "is gone" in watch.check()
    alive = site_worker._Watch(paths, os.getpid(), idle=900)
    alive.busy.acquire()
    alive.deadline = time.time() + 600
    assert alive.check() is None
    alive.deadline = time.time() - site_worker.STOP_GRACE_S - 1
    assert "past the deadline" in alive.check()
    idle = site_worker._Watch(paths, os.getpid(), idle=0.01)
    time.sleep(0.05)
    assert "without a message" in idle.check()


def test_the_message_timeout_follows_the_servers_wait():
    def context(node=None, run=None):
        return Context(run_id=1, node_id=1, node_config=node or {}, state=RecordDict(), run_config=run or {})

    assert site_worker.message_timeout(context(run={"round-timeout": 600.0, "node-wait-timeout": 120.0})) == 660.0
    assert site_worker.message_timeout(context(run={"round-timeout": 40.0, "node-wait-timeout": 900.0})) == 960.0
    assert site_worker.message_timeout(context({site_worker.TIMEOUT_KEY: 7}, {"round-timeout": 600.0})) == 7.0
    with pytest.raises(ValueError, match="node-config site-worker-timeout"):
        site_worker.message_timeout(context({site_worker.TIMEOUT_KEY: "0"}))


def test_the_default_worker_folder_cannot_be_squatted(tmp_path, monkeypatch):
    """Without MEDFLOWER_WORKER_DIR the folder is in the user's runtime or cache folder, which another user cannot
    create first; a shared tmp that another user took is not used."""
    monkeypatch.delenv(site_worker.DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shared_tmp = tmp_path / "tmp"
    squatted = shared_tmp / f"medflower-workers-{os.getuid()}"
    squatted.mkdir(parents=True, mode=0o777)
    squatted.chmod(0o777)
    monkeypatch.setattr(site_worker.tempfile, "gettempdir", lambda: str(shared_tmp))
    folder = site_worker.worker_dir()
    assert folder == tmp_path / "cache" / "medflower" / "workers"
    assert os.stat(folder).st_mode & 0o777 == 0o700
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert site_worker.worker_dir() == runtime / "medflower-workers"
    # Where no home folder can be written (the compose images' read-only root), tmp is the last resort, checked.
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setattr(site_worker, "_home_candidates", lambda: [])
    with pytest.raises(site_worker.WorkerError, match="no one else may enter"):
        site_worker.worker_dir()


def test_a_socket_path_too_long_for_unix_sockets_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(site_worker.DIR_ENV, str(tmp_path / ("x" * 90)))
    context = Context(run_id=2**63, node_id=2**63, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(site_worker.WorkerError, match="longer than a Unix socket allows"):
        site_worker.worker_paths(context)
