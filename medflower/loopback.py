"""Start a real SuperLink and SuperNodes on loopback, run the app through ``flwr run``, stop them.

Used by the end-to-end tests and the benchmark; it is also the scripted form of docs/deployment.md's
"deployment by hand" steps. Every process gets its own ports and a private ``FLWR_HOME``, and
only the processes started here are stopped (each in its own process group).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from contextlib import closing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

APP_DIR = Path(__file__).resolve().parents[1]
FLEET_PROXY_CONF = APP_DIR / "docker" / "nginx.conf"  # the hospital-facing nginx front of the SuperLink


def find_nginx() -> str | None:
    """The nginx binary (Debian puts it in /usr/sbin, which a non-root PATH may lack), or None."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/sbin")


def render_fleet_proxy_conf(template: str, listen_port: int, superlink_port: int, certs: Path, workdir: Path) -> str:
    """docker/nginx.conf for loopback: its compose ports and paths replaced, every rule kept as shipped."""
    replacements = {
        "listen 9200 ssl;": f"listen 127.0.0.1:{listen_port} ssl;",
        "server 127.0.0.1:9100;": f"server 127.0.0.1:{superlink_port};",
        "/certs/": f"{Path(certs).resolve()}/",
        "/tmp/nginx": f"{workdir}/nginx",
    }
    for old, new in replacements.items():
        if old not in template:
            raise ValueError(f"the fleet proxy config has no {old!r} to replace")
        template = template.replace(old, new)
    return template


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f}s")


def stop_process_group(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    """Signal the process group of ``proc`` (started with start_new_session), SIGKILL if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


def toml_value(value: Any) -> str:
    """A run-config value as TOML for ``--run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("'", "") + "'"


def run_config_arg(config: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={toml_value(v)}" for k, v in config.items())


@dataclass
class LoopbackFederation:
    """One SuperLink (deployment or simulation mode) and N SuperNodes on 127.0.0.1."""

    num_supernodes: int = 2
    simulation: bool = False
    workdir: Path | None = None
    node_configs: list[dict[str, Any]] = field(default_factory=list)
    tls_dir: Path | None = None  # made by docker/make_certs.py: ca.crt, superlink.crt/.key
    auth_keys: dict[int, Path] = field(default_factory=dict)  # supernode index -> private key (.pub beside it)
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. RAY_ADDRESS to use an existing Ray cluster
    federation_config: dict[str, Any] = field(default_factory=dict)  # simulation, e.g. client-resources-num-cpus
    # With fleet_proxy (needs tls_dir and the nginx binary), SuperNodes reach the SuperLink only through
    # docker/nginx.conf on its own port (fleet_port), as in the compose demo; `flwr` uses the SuperLink port.
    fleet_proxy: bool = False
    supernode_args: dict[int, list[str]] = field(default_factory=dict)  # index -> extra flower-supernode flags

    def __post_init__(self) -> None:
        self._tmp = None
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="medflower-loopback-")
            self.workdir = Path(self._tmp.name)
        self.workdir = Path(self.workdir).resolve()
        self.flwr_home = self.workdir / "flwr-home"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        # Flower 1.41 serves the Fleet, Control and Runtime APIs on one HTTP port.
        self.port, self.health_port = free_port(), free_port()
        self.fleet_port = free_port() if self.fleet_proxy else self.port
        if self.fleet_proxy and not self.tls_dir:
            raise ValueError("fleet_proxy needs tls_dir (the proxy serves the SuperLink certificate)")
        self.proxy: subprocess.Popen | None = None
        self.superlink: subprocess.Popen | None = None
        self.supernodes: dict[str, subprocess.Popen] = {}
        self.runs: list[subprocess.Popen] = []
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the process writes to it after we return)
        return subprocess.Popen(
            cmd, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_superlink(self) -> None:
        cmd = [
            "flower-superlink",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--health-server-address",
            f"127.0.0.1:{self.health_port}",
            "--database",
            str(self.workdir / "superlink.db"),
            "--disable-runtime-dependency-installation",
        ]
        cmd += ["--simulation"] if self.simulation else []
        if self.tls_dir:
            t = Path(self.tls_dir)
            cmd += [
                "--ssl-ca-certfile",
                str(t / "ca.crt"),
                "--ssl-certfile",
                str(t / "superlink.crt"),
                "--ssl-keyfile",
                str(t / "superlink.key"),
            ]
        else:
            cmd += ["--insecure"]
        if self.auth_keys:
            cmd += ["--enable-supernode-auth"]
        self.superlink = self._spawn("superlink", cmd)
        wait_for_port(self.port)

    def start_fleet_proxy(self) -> None:
        """nginx with docker/nginx.conf in front of the SuperLink: Fleet routes only, on fleet_port."""
        nginx = find_nginx()
        if nginx is None:
            raise FileNotFoundError("fleet_proxy needs nginx (Debian: apt-get install nginx)")
        conf = self.workdir / "nginx.conf"
        conf.write_text(
            render_fleet_proxy_conf(
                FLEET_PROXY_CONF.read_text(), self.fleet_port, self.port, Path(self.tls_dir), self.workdir
            )
        )
        self.proxy = self._spawn("nginx", [nginx, "-e", "stderr", "-c", str(conf)])
        wait_for_port(self.fleet_port, timeout=20)

    def register(self, public_key: Path) -> subprocess.CompletedProcess:
        """``flwr supernode register <key.pub> loopback`` (SuperNode authentication)."""
        return self.flwr("supernode", "register", str(public_key), "loopback", timeout=60)

    def start_supernode(self, index: int, key: Path | None = None, name: str | None = None) -> subprocess.Popen:
        """Start SuperNode ``index`` (data partition ``index``) as ``name`` (default supernode-<index>);
        ``key`` overrides its authentication key (e.g. an unregistered one)."""
        name = name or f"supernode-{index}"
        node_config = {
            "partition-id": index,
            "num-partitions": self.num_supernodes,
            **(self.node_configs[index] if index < len(self.node_configs) else {}),
        }
        node_config_arg = " ".join(f"{k}={toml_value(v)}" for k, v in node_config.items())
        cmd = [
            "flower-supernode",
            "--superlink",
            f"127.0.0.1:{self.fleet_port}",
            "--port",
            str(free_port()),
            "--node-config",
            node_config_arg,
            "--health-server-address",
            f"127.0.0.1:{free_port()}",
        ]
        cmd += ["--root-certificates", str(Path(self.tls_dir) / "ca.crt")] if self.tls_dir else ["--insecure"]
        key = key or self.auth_keys.get(index)
        if key is not None:
            cmd += ["--auth-supernode-private-key", str(key)]  # flwr 1.41 derives the public key
        cmd += self.supernode_args.get(index, [])
        self.supernodes[name] = self._spawn(name, cmd)
        return self.supernodes[name]

    def write_connection(self) -> str:
        lines = [
            "[superlink]",
            'default = "loopback"',
            "",
            "[superlink.loopback]",
            f'address = "127.0.0.1:{self.port}"',
        ]
        extra: dict[str, Any] = (
            {"root-certificates": str(Path(self.tls_dir) / "ca.crt")} if self.tls_dir else {"insecure": True}
        )
        if self.simulation:
            extra.setdefault("options.num-supernodes", self.num_supernodes)
        lines += [f"{k} = {toml_value(v).replace(chr(39), chr(34))}" for k, v in extra.items()]
        (self.flwr_home / "config.toml").write_text("\n".join(lines) + "\n")
        return "loopback"

    def __enter__(self) -> LoopbackFederation:
        try:
            self.write_connection()
            self.start_superlink()
            if self.fleet_proxy:
                self.start_fleet_proxy()
            for _index, key in sorted(self.auth_keys.items()):
                self.register(Path(key).with_suffix(".pub"))
            if not self.simulation:
                for i in range(self.num_supernodes):
                    self.start_supernode(i)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def stop(self, proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
        stop_process_group(proc, sig)

    def _leftovers(self) -> list[int]:
        """Processes of ours that left our process groups (flwr-simulation, ServerApp, ClientApp
        processes started by the SuperLink/SuperNodes name our port or work folder)."""
        marks = (f"127.0.0.1:{self.port}", str(self.workdir))
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(mark in cmdline for mark in marks):
                found.append(int(entry.name))
        return found

    def __exit__(self, *exc) -> None:
        for proc in [*self.runs, *self.supernodes.values()]:
            self.stop(proc)
        self.stop(self.superlink)
        self.stop(self.proxy)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            leftovers = self._leftovers()
            for pid in leftovers:
                with suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if leftovers and sig == signal.SIGTERM:
                time.sleep(3)
        if self._tmp is not None:
            self._tmp.cleanup()

    # ------------------------------------------------------------------ runs
    def flwr(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["flwr", *args]
        proc = subprocess.run(cmd, cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n{self.logs()}"
            )
        return proc

    def run_args(self, run_config: Mapping[str, Any], app_dir: Path = APP_DIR) -> list[str]:
        args = ["flwr", "run", str(app_dir), "loopback", "--stream", "--run-config", run_config_arg(run_config)]
        if self.simulation:
            fed = {"num-supernodes": self.num_supernodes, **self.federation_config}
            args += ["--federation-config", " ".join(f"{k}={toml_value(v)}" for k, v in fed.items())]
        return args

    def run_app(
        self, run_config: Mapping[str, Any], timeout: float = 900, app_dir: Path = APP_DIR
    ) -> subprocess.CompletedProcess:
        """``flwr run <app> loopback --stream --run-config ...`` and wait for the run to end."""
        return self.flwr(*self.run_args(run_config, app_dir)[1:], timeout=timeout)

    def start_run(self, run_config: Mapping[str, Any], app_dir: Path = APP_DIR) -> subprocess.Popen:
        """The same in the background (to kill things while it runs); output in flwr-run.log."""
        proc = self._spawn(f"flwr-run-{len(self.runs)}", self.run_args(run_config, app_dir))
        self.runs.append(proc)
        return proc

    def logs(self, tail: int = 60) -> str:
        out = []
        for path in sorted(self.workdir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover - manual smoke run
    with LoopbackFederation(num_supernodes=2) as fed:
        print(fed.run_app({"num-rounds": 1, "synthetic-size": 200}).stdout)
        sys.exit(0)
