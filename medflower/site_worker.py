"""A site's long-lived worker process: the site's imports, model and decoded data kept between messages.

Flower 1.41 handles every message of a deployment in a fresh ``flwr-clientapp`` process (its SuperExec launches one
per task, and the process exits after its reply; no isolation mode keeps one alive). Importing torch, timm and peft
alone takes seconds, and a round pays it once per message on every site. So the ClientApp that Flower starts
(``medflower/client_app.py``, which imports nothing heavy) hands the message to this worker, one per SuperNode and
run, over a Unix socket, and returns the worker's reply. The first message of a run starts the worker; it exits
when its SuperNode's SuperExec is gone (at once, even in the middle of a message), after node-config
``site-worker-idle`` seconds without a message, or when a message outlives the ClientApp's wait for it. Every wait
on either side has a timeout, and a worker that does not answer in time is stopped and replaced by the next
message. docs/deployment.md#the-site-worker.

The socket and its key live in a folder only this user can enter (``worker_dir``: mode 0700, refused if another
user owns it or others may enter it; by default in the user's runtime or cache folder, which no other user can
create first); every connection proves the key (``multiprocessing.connection``'s HMAC challenge). What crosses the
socket is the message and context Flower gave this site's ClientApp, and the reply it sends back: nothing new leaves
the site.

Run by hand (``python -m medflower.site_worker --help``) only for debugging: the ClientApp starts it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from logging import INFO, WARNING
from multiprocessing.connection import AuthenticationError, Client, Listener
from pathlib import Path

from flwr.app import Context, Message

from . import profiling
from .site_errors import SiteError

WORKER_KEY = "site-worker"  # node-config: true (default) / false
IDLE_KEY = "site-worker-idle"  # node-config: seconds without a message before the worker exits
TIMEOUT_KEY = "site-worker-timeout"  # node-config: seconds one message may take in the worker
DEFAULT_IDLE_S = 900.0
START_TIMEOUT_S = 300.0  # a worker's imports on a busy machine: tens of seconds at worst
CONNECT_TIMEOUT_S = 60.0  # a worker that cannot even accept a connection in this time is wedged
STOP_GRACE_S = 30.0  # a worker still busy this long after a message's deadline exits by itself
DIR_ENV = "MEDFLOWER_WORKER_DIR"
SOCKET_PATH_MAX = 107  # sun_path of an AF_UNIX address on Linux, less its final NUL


class WorkerError(RuntimeError):
    """The site's worker could not be started or reached, or exited while handling a message."""


def uses_worker(context: Context) -> bool:
    """node-config ``site-worker`` (default true): hand messages to the site's long-lived worker."""
    value = str(context.node_config.get(WORKER_KEY, "true")).strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"node-config {WORKER_KEY} = {value!r}: use true or false")
    return value in ("true", "1", "yes")


def _seconds(raw, key: str, example: float) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"node-config {key} = {raw!r}: a positive number of seconds, e.g. {example:g}")
    return value


def idle_seconds(context: Context) -> float:
    return _seconds(context.node_config.get(IDLE_KEY, DEFAULT_IDLE_S), IDLE_KEY, DEFAULT_IDLE_S)


def message_timeout(context: Context) -> float:
    """How long the ClientApp waits for the worker's reply to one message: node-config ``site-worker-timeout``, else
    the server's own wait for it (the run config's round-timeout, or node-wait-timeout for a first answer, when
    longer) plus a minute: after that the server has stopped waiting and the reply would be refused as late."""
    if TIMEOUT_KEY in context.node_config:
        return _seconds(context.node_config[TIMEOUT_KEY], TIMEOUT_KEY, 3600.0)
    waits = []
    for key in ("round-timeout", "node-wait-timeout"):
        try:
            waits.append(float(context.run_config.get(key, 0.0)))
        except (TypeError, ValueError):
            continue
    finite = [w for w in waits if 0 < w < float("inf")]
    return (max(finite) if finite else 3600.0) + 60.0


def worker_dir() -> Path:
    """The private folder of this user's worker sockets: ``$MEDFLOWER_WORKER_DIR``, else
    ``$XDG_RUNTIME_DIR/medflower-workers``, else ``$XDG_CACHE_HOME/medflower/workers`` (``~/.cache/...``) where it
    can be created, else ``<tmp>/medflower-workers-<uid>``; created 0700, refused when it is not a folder of this
    user's that no one else may enter. A home folder is the user's own, so another local user cannot create the
    folder first; a shared tmp is the last resort (a read-only home, as in the compose images, whose /tmp is
    private to the container)."""
    if os.environ.get(DIR_ENV):
        folder = Path(os.environ[DIR_ENV])
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    else:
        folder = _default_worker_dir()
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise WorkerError(
            f"{folder} must be a folder of this user's that no one else may enter (mode 0700); "
            f"set {DIR_ENV} to another folder, or node-config {WORKER_KEY}=false"
        )
    return folder


def _home_candidates() -> list[Path]:
    """The user's own folders for the sockets: its runtime folder (systemd's /run/user/<uid>), its cache folder."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [*([Path(runtime) / "medflower-workers"] if runtime else []), Path(cache) / "medflower" / "workers"]


def _default_worker_dir() -> Path:
    for folder in _home_candidates():
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            return folder
        except OSError:  # a read-only home (the compose images), a runtime folder that is gone
            continue
    folder = Path(tempfile.gettempdir()) / f"medflower-workers-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    return folder


def worker_paths(context: Context) -> dict[str, Path]:
    """Socket, key, process id and lock files of this SuperNode's worker for this run."""
    stem = worker_dir() / f"n{context.node_id}-r{context.run_id}"
    paths = {kind: stem.with_suffix(f".{kind}") for kind in ("sock", "key", "pid", "lock")}
    if len(os.fsencode(paths["sock"])) > SOCKET_PATH_MAX:
        raise WorkerError(
            f"the worker's socket path {paths['sock']} is longer than a Unix socket allows ({SOCKET_PATH_MAX} "
            f"bytes); set {DIR_ENV} to a shorter folder"
        )
    return paths


# ---------------------------------------------------------------------------------------------- ClientApp side
def forward(message: Message, context: Context) -> Message:
    """Hand ``message`` to the site's worker for this run (starting it if none runs) and return its reply;
    ``context.state`` takes the worker's updated state (Flower's SecAgg+ mod keeps its protocol state there).

    Every wait is bounded: starting the worker (START_TIMEOUT_S), connecting to it (CONNECT_TIMEOUT_S; a worker
    that cannot accept is stopped and replaced), and its reply (``message_timeout``: a worker that has not
    answered by then is stopped, so that it cannot hold the next message)."""
    from flwr.supercore.task_identity import TaskIdentity

    started = time.time()
    paths = worker_paths(context)
    timeout = message_timeout(context)
    conn, spawn_s = _connect_or_spawn(paths, idle_seconds(context))
    identity = (TaskIdentity._task_id, context.run_id, context.node_id)
    name = message.metadata.message_type
    no_reply = WorkerError(
        f"the site's worker gave no reply to {name} within {timeout:.0f}s (node-config {TIMEOUT_KEY}); it was "
        "stopped, and the next message starts a new one"
    )
    try:
        with conn:
            # A worker that does not read blocks the send once the socket's buffer is full: it runs in a thread,
            # bounded by the same deadline as the reply.
            request = ("handle", message, context, identity, started + timeout)
            sending = threading.Thread(target=_send_quietly, args=(conn, request), daemon=True)
            sending.start()
            sending.join(max(1.0, started + timeout - time.time()))
            if sending.is_alive() or not conn.poll(max(1.0, started + timeout - time.time())):
                _kill(paths)
                raise no_reply
            outcome = conn.recv()
    except (EOFError, OSError) as err:
        raise WorkerError(
            f"the site's worker exited while handling {name} ({type(err).__name__}); the next message starts a "
            "new one (see this SuperNode's log)"
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


def _send_quietly(conn, request) -> None:
    with contextlib.suppress(OSError, EOFError):  # the worker was stopped meanwhile: the reply wait says so
        conn.send(request)


@contextlib.contextmanager
def _locked(path: Path, timeout: float):
    """An exclusive lock on ``path`` (one ClientApp at a time checks and starts the worker), waited for at most
    ``timeout`` seconds."""
    with open(path, "a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise WorkerError(f"another message held {path} for over {timeout:.0f}s") from None
                time.sleep(0.1)
        yield


def _connect_or_spawn(paths: dict[str, Path], idle: float):
    """A connection to the running worker, or to a new one started here; and the seconds spent starting it."""
    with _locked(paths["lock"], START_TIMEOUT_S + CONNECT_TIMEOUT_S + 30):
        conn = _try_connect(paths, CONNECT_TIMEOUT_S)
        if conn is not None:
            return conn, 0.0
        _kill(paths)  # gone (idle exit, crash, reboot) or wedged: its files go, and a process that is left is stopped
        started = time.monotonic()
        key = secrets.token_bytes(32)
        fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        proc = _spawn(paths, idle)
        while time.monotonic() - started < START_TIMEOUT_S:
            if proc.poll() is not None:
                raise WorkerError(f"the site's worker exited with code {proc.returncode} while starting")
            conn = _try_connect(paths, CONNECT_TIMEOUT_S)
            if conn is not None:
                return conn, time.monotonic() - started
            time.sleep(0.05)
        proc.kill()
        raise WorkerError(f"the site's worker did not start within {START_TIMEOUT_S:.0f}s")


def stop_worker(context: Context) -> int | None:
    """Ask this SuperNode's worker for this run to exit now; its process id, or None when none was running."""
    return _ask_to_stop(worker_paths(context))


def _ask_to_stop(paths: dict[str, Path], wait_s: float = 5.0) -> int | None:
    """Send the worker at ``paths`` a stop request; its process id once it answers (within ``wait_s``), else None.
    The worker answers at once, even while it handles a message (which it then abandons)."""
    conn = _try_connect(paths, wait_s)
    if conn is None:
        return None
    with conn:
        conn.send(("stop",))
        try:
            return conn.recv()[1] if conn.poll(wait_s) else None
        except (EOFError, OSError):
            return None


def _kill(paths: dict[str, Path]) -> None:
    """Stop the worker at ``paths`` without asking (it is gone or wedged) and remove its files, so that the next
    message starts a new one. Only a process whose command line names this socket is signalled."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(paths["pid"].read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if os.fsencode(paths["sock"]) in cmdline:
            os.kill(pid, signal.SIGKILL)
    for kind in ("sock", "key", "pid"):
        paths[kind].unlink(missing_ok=True)


def _try_connect(paths: dict[str, Path], timeout: float):
    """An authenticated connection to the worker, or None when there is none or it does not complete in
    ``timeout`` seconds (``multiprocessing.connection.Client`` has no timeout of its own: it runs in a thread)."""
    if not paths["sock"].exists() or not paths["key"].exists():
        return None
    try:
        key = paths["key"].read_bytes()
    except OSError:
        return None
    result: list = []

    def connect() -> None:
        with contextlib.suppress(OSError, EOFError, AuthenticationError):
            result.append(Client(str(paths["sock"]), family="AF_UNIX", authkey=key))

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else None


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
    """Ends the worker: at once when the watched process (the SuperExec that launched the first ClientApp) is gone,
    even in the middle of a message (no one is left to receive its reply); when a message is still being handled
    STOP_GRACE_S after the deadline its ClientApp waits for (that ClientApp has given up and stops this worker
    too); and after ``idle`` seconds without a message."""

    def __init__(self, paths: dict[str, Path], watch_pid: int | None, idle: float):
        self.paths, self.watch_pid, self.idle = paths, watch_pid, idle
        self.busy = threading.Lock()  # one message at a time
        self.last = time.monotonic()
        self.deadline: float | None = None  # wall-clock deadline of the message being handled

    def check(self) -> str | None:
        """Why the worker must exit now, or None."""
        if self.watch_pid is not None and not _alive(self.watch_pid):
            return f"its SuperNode's process {self.watch_pid} is gone"
        deadline = self.deadline
        if deadline is not None and time.time() > deadline + STOP_GRACE_S:
            return f"a message ran {STOP_GRACE_S:.0f}s past the deadline its ClientApp waited for"
        if deadline is None and time.monotonic() - self.last > self.idle and self.busy.acquire(blocking=False):
            if time.monotonic() - self.last > self.idle:  # still idle now that no message can start
                return f"{self.idle:.0f}s without a message"
            self.busy.release()
        return None

    def run(self) -> None:
        while True:
            time.sleep(0.5)
            if (why := self.check()) is not None:
                self.stop(why)

    def stop(self, why: str, warn: bool = True) -> None:
        from flwr.common.logger import log

        if warn and not why.endswith("without a message"):
            log(WARNING, "[medflower] site worker %d for %s exits: %s", os.getpid(), self.paths["sock"].stem, why)
        for kind in ("sock", "key", "pid"):
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
    """Import the site's app, then serve connections: each in its own thread, so a stop request or a new
    connection is answered while a message is handled; messages are handled one at a time."""
    from flwr.common.logger import log

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
    paths = {"sock": socket_path, "key": key_file, "pid": socket_path.with_suffix(".pid")}
    watch = _Watch(paths, watch_pid, idle)
    listener = Listener(str(socket_path), family="AF_UNIX", authkey=key)
    paths["pid"].write_text(str(os.getpid()))
    threading.Thread(target=watch.run, daemon=True).start()
    first = [import_timings]  # the one-off import belongs to the message that started the worker
    while True:
        try:
            conn = listener.accept()
        except (AuthenticationError, OSError, EOFError):
            continue
        threading.Thread(target=_serve_connection, args=(conn, app, watch, first), daemon=True).start()


def _serve_connection(conn, app, watch: _Watch, first: list) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    with conn:
        try:
            if not conn.poll(CONNECT_TIMEOUT_S):
                return
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request == ("stop",):
            with contextlib.suppress(OSError):
                conn.send(("stopped", os.getpid()))
            watch.stop("asked to stop", warn=False)
        _, message, context, (task_id, run_id, node_id), deadline = request
        if not watch.busy.acquire(timeout=max(0.0, deadline - time.time())):
            return  # the ClientApp's wait is over: it has stopped this worker
        try:
            watch.deadline = deadline
            TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = task_id, run_id, node_id
            with profiling.timed_message() as timings:
                if first:
                    timings.update(first.pop())
                try:
                    reply = app(message, context)
                    payload = (None, reply.error) if reply.has_error() else (reply.content, None)
                    outcome = ("reply", payload, context.state, {**timings, "worker_pid": os.getpid()})
                except Exception as err:  # the site app's SiteError is already redacted; Flower reports the rest
                    text = str(err) if isinstance(err, SiteError) else f"{type(err).__name__}: {err}"
                    outcome = ("raise", text, None, {**timings, "worker_pid": os.getpid()})
            with contextlib.suppress(OSError, EOFError):
                conn.send(outcome)
        finally:
            watch.deadline = None
            watch.last = time.monotonic()
            watch.busy.release()


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
