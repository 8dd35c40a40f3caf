"""A site's long-lived worker process: the site's imports, model and decoded data kept between messages.

Flower 1.41 handles every message of a deployment in a fresh ``flwr-clientapp`` process (its SuperExec launches one
per task, and the process exits after its reply; no isolation mode keeps one alive). Importing torch, timm and peft
alone takes seconds, and a round pays it once per message on every site. So the ClientApp that Flower starts
(``medflower/client_app.py``, which imports nothing heavy) hands the message to this worker, one per SuperNode and
run, over a Unix socket, and returns the worker's reply. The first message of a run starts the worker; it exits
when its SuperNode's SuperExec is gone or after node-config ``site-worker-idle`` seconds without a message.
docs/deployment.md#site-worker.

The socket and its key live in a folder only this user can enter (``$MEDFLOWER_WORKER_DIR``, else
``<tmp>/medflower-workers-<uid>``, mode 0700, refused if another user owns it or others may enter it); every
connection proves the key (``multiprocessing.connection``'s HMAC challenge). What crosses the socket is the message
and context Flower gave this site's ClientApp, and the reply it sends back: nothing new leaves the site.

Run by hand (``python -m medflower.site_worker --help``) only for debugging: the ClientApp starts it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import secrets
import stat
import subprocess
import sys
import tempfile
import threading
import time
from logging import INFO
from multiprocessing.connection import AuthenticationError, Client, Listener
from pathlib import Path

from flwr.app import Context, Message

from . import profiling

WORKER_KEY = "site-worker"  # node-config: true (default) / false
IDLE_KEY = "site-worker-idle"  # node-config: seconds without a message before the worker exits
DEFAULT_IDLE_S = 900.0
START_TIMEOUT_S = 300.0  # a worker's imports on a busy machine: tens of seconds at worst
DIR_ENV = "MEDFLOWER_WORKER_DIR"


class SiteError(RuntimeError):
    """What the server learns of a failure on a site (its message is all that leaves the site)."""


class WorkerError(RuntimeError):
    """The site's worker could not be started or reached, or exited while handling a message."""


def uses_worker(context: Context) -> bool:
    """node-config ``site-worker`` (default true): hand messages to the site's long-lived worker."""
    value = str(context.node_config.get(WORKER_KEY, "true")).strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"node-config {WORKER_KEY} = {value!r}: use true or false")
    return value in ("true", "1", "yes")


def idle_seconds(context: Context) -> float:
    raw = context.node_config.get(IDLE_KEY, DEFAULT_IDLE_S)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"node-config {IDLE_KEY} = {raw!r}: a positive number of seconds, e.g. {DEFAULT_IDLE_S:g}")
    return value


def worker_dir() -> Path:
    """The private folder of this user's worker sockets (created 0700; refused when it is not private)."""
    folder = Path(os.environ.get(DIR_ENV) or Path(tempfile.gettempdir()) / f"medflower-workers-{os.getuid()}")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise WorkerError(
            f"{folder} must be a folder of this user's that no one else may enter (mode 0700); "
            f"set {DIR_ENV} to another folder, or node-config {WORKER_KEY}=false"
        )
    return folder


def worker_paths(context: Context) -> dict[str, Path]:
    """Socket, key and lock files of this SuperNode's worker for this run."""
    stem = worker_dir() / f"n{context.node_id}-r{context.run_id}"
    return {kind: stem.with_suffix(f".{kind}") for kind in ("sock", "key", "lock")}


# ---------------------------------------------------------------------------------------------- ClientApp side
def forward(message: Message, context: Context) -> Message:
    """Hand ``message`` to the site's worker (starting it if none runs) and return its reply; ``context.state``
    takes the worker's updated state (Flower's SecAgg+ mod keeps its protocol state there)."""
    from flwr.supercore.task_identity import TaskIdentity

    started = time.time()
    paths = worker_paths(context)
    conn, spawn_s = _connect_or_spawn(paths, idle_seconds(context))
    identity = (TaskIdentity._task_id, context.run_id, context.node_id)
    try:
        with conn:
            conn.send(("handle", message, context, identity))
            outcome = conn.recv()
    except (EOFError, OSError) as err:
        raise WorkerError(
            f"the site's worker exited while handling {message.metadata.message_type} "
            f"({type(err).__name__}); the next message starts a new one (see this SuperNode's log)"
        ) from None
    kind, payload, state, timings = outcome
    if profiling.enabled():
        profiling.write(
            message_record(
                message,
                context,
                "worker",
                started,
                time.time(),
                timings,
                worker_spawn_s=round(spawn_s, 4),
                worker_pid=timings.get("worker_pid"),
            )
        )
    if kind == "raise":
        raise SiteError(payload)
    context.state = state
    content, error = payload
    return Message(error, reply_to=message) if error is not None else Message(content, reply_to=message)


def _connect_or_spawn(paths: dict[str, Path], idle: float):
    """A connection to the running worker, or to a new one started here; and the seconds spent starting it."""
    with open(paths["lock"], "a") as lock:  # one ClientApp at a time checks and starts the worker
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _try_connect(paths)
        if conn is not None:
            return conn, 0.0
        for kind in ("sock", "key"):
            paths[kind].unlink(missing_ok=True)  # a worker that is gone (idle exit, crash, reboot)
        _stop_other_runs(paths["sock"])
        started = time.monotonic()
        key = secrets.token_bytes(32)
        fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        proc = _spawn(paths, idle)
        while time.monotonic() - started < START_TIMEOUT_S:
            if proc.poll() is not None:
                raise WorkerError(f"the site's worker exited with code {proc.returncode} while starting")
            conn = _try_connect(paths)
            if conn is not None:
                return conn, time.monotonic() - started
            time.sleep(0.05)
        proc.kill()
        raise WorkerError(f"the site's worker did not start within {START_TIMEOUT_S:.0f}s")


def _stop_other_runs(socket_path: Path) -> None:
    """One worker per SuperNode: a new run's worker replaces the workers of this node's earlier runs (a run that
    goes on after all starts its worker again at its next message)."""
    node_prefix = socket_path.name.split("-r")[0] + "-r"
    for other in socket_path.parent.glob(f"{node_prefix}*.sock"):
        if other != socket_path:
            _ask_to_stop({"sock": other, "key": other.with_suffix(".key")})


def stop_worker(context: Context) -> int | None:
    """Ask this SuperNode's worker for this run to exit now; its process id, or None when none was running."""
    return _ask_to_stop(worker_paths(context))


def _ask_to_stop(paths: dict[str, Path], wait_s: float = 5.0) -> int | None:
    """Send the worker at ``paths`` a stop request; its process id once it answers (within ``wait_s``), else None.
    A worker busy with a message answers after it."""
    conn = _try_connect(paths)
    if conn is None:
        return None
    with conn:
        conn.send(("stop",))
        try:
            return conn.recv()[1] if conn.poll(wait_s) else None
        except (EOFError, OSError):
            return None


def _try_connect(paths: dict[str, Path]):
    if not paths["sock"].exists() or not paths["key"].exists():
        return None
    try:
        return Client(str(paths["sock"]), family="AF_UNIX", authkey=paths["key"].read_bytes())
    except (OSError, EOFError, AuthenticationError):
        return None


def _spawn(paths: dict[str, Path], idle: float) -> subprocess.Popen:
    """``python -m medflower.site_worker`` with this process's medflower first on its path (the run's FAB), its own
    session (it outlives this process), and this process's stdout/stderr (the SuperNode's log)."""
    app_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (app_root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "medflower.site_worker", "--socket", str(paths["sock"]), "--key-file"]
    cmd += [str(paths["key"]), "--watch-pid", str(os.getppid()), "--idle", str(idle)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def message_record(
    message: Message, context: Context, mode: str, started: float, ended: float, timings: dict, **extra
) -> dict:
    """One line of ``$MEDFLOWER_PROFILE`` (medflower/profiling.py)."""
    config = message.content.config_records.get("config", {}) if message.has_content() else {}
    return {
        "mode": mode,
        "node_id": context.node_id,
        "message_type": message.metadata.message_type,
        "round": config.get("round"),
        "created_at": message.metadata.created_at,
        "process_start": profiling.process_start_time(),
        "handler_start": started,
        "handler_end": ended,
        "pid": os.getpid(),
        **{f"{name}_s": round(timings.get(name, 0.0), 4) for name in profiling.PHASES},
        **extra,
    }


# ---------------------------------------------------------------------------------------------- worker side
class _Watch:
    """Exit when the watched process (the SuperExec that launched the first ClientApp) is gone, or after
    ``idle`` seconds without a message; never while a message is being handled."""

    def __init__(self, paths: dict[str, Path], watch_pid: int | None, idle: float):
        self.paths, self.watch_pid, self.idle = paths, watch_pid, idle
        self.busy = threading.Lock()
        self.last = time.monotonic()

    def run(self) -> None:
        while True:
            time.sleep(0.5)
            gone = self.watch_pid is not None and not _alive(self.watch_pid)
            if (gone or time.monotonic() - self.last > self.idle) and self.busy.acquire(blocking=False):
                self.stop()

    def stop(self) -> None:
        for kind in ("sock", "key"):
            with contextlib.suppress(OSError):
                self.paths[kind].unlink()
        os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve(socket_path: Path, key_file: Path, watch_pid: int | None, idle: float) -> None:
    """Import the site's app, then answer one message per connection until the watch ends this process."""
    from flwr.common.logger import log
    from flwr.supercore.task_identity import TaskIdentity

    started = time.monotonic()
    with profiling.timed_message() as import_timings, profiling.phase("imports"):
        from .site_app import app

    log(  # the one line an operator sees of the worker in the SuperNode's log
        INFO,
        "[medflower] site worker %d ready for %s after %.1fs of imports; it exits with the SuperNode or after %.0fs "
        "idle",
        os.getpid(),
        socket_path.stem,
        time.monotonic() - started,
        idle,
    )
    key = key_file.read_bytes()
    paths = {"sock": socket_path, "key": key_file}
    watch = _Watch(paths, watch_pid, idle)
    listener = Listener(str(socket_path), family="AF_UNIX", authkey=key)
    threading.Thread(target=watch.run, daemon=True).start()
    first = True
    while True:
        try:
            conn = listener.accept()
        except (AuthenticationError, OSError, EOFError):
            continue
        with conn, watch.busy:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                continue
            if request == ("stop",):
                conn.send(("stopped", os.getpid()))
                watch.stop()
            _, message, context, (task_id, run_id, node_id) = request
            TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = task_id, run_id, node_id
            with profiling.timed_message() as timings:
                if first:  # the one-off import belongs to the message that started the worker
                    timings.update(import_timings)
                    first = False
                try:
                    reply = app(message, context)
                    payload = (None, reply.error) if reply.has_error() else (reply.content, None)
                    outcome = ("reply", payload, context.state, {**timings, "worker_pid": os.getpid()})
                except Exception as err:  # the site app's SiteError is already redacted; Flower reports the rest
                    text = str(err) if isinstance(err, SiteError) else f"{type(err).__name__}: {err}"
                    outcome = ("raise", text, None, {**timings, "worker_pid": os.getpid()})
            with contextlib.suppress(OSError, EOFError):
                conn.send(outcome)
            watch.last = time.monotonic()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--key-file", required=True, type=Path)
    parser.add_argument("--watch-pid", type=int, default=None)
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE_S)
    args = parser.parse_args(argv)
    serve(args.socket, args.key_file, args.watch_pid, args.idle)


if __name__ == "__main__":
    main()
