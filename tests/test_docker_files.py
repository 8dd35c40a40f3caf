"""Static checks of docker/: compose parses, flags exist, the topology keeps Control off the hospital port,
containers are hardened, mounts line up, keys are private from birth. docs/deployment.md records the real
compose run; tests/test_control_port.py runs nginx.conf for real on loopback."""

import importlib.util
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
from functools import cache
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from medflower.config import ExperimentConfig, defaults

DOCKER = Path(__file__).resolve().parents[1] / "docker"
HOSPITALS = ["hospital-a", "hospital-b", "hospital-c"]


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@cache
def cli_flags(program: str) -> set[str]:
    out = subprocess.run([program, "--help"], capture_output=True, text=True, timeout=120).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out))


def command_of(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return cmd if isinstance(cmd, list) else cmd.split()


def flag(cmd: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in cmd if a.startswith(f"{name}=")), None)


def make_certs(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(DOCKER / "make_certs.py"), *args], check=check, capture_output=True, text=True
    )


def test_every_flower_flag_exists_in_the_installed_flwr(compose):
    checked = 0
    for name, service in compose["services"].items():
        cmd = command_of(service)
        if cmd and cmd[0] in ("flower-superlink", "flower-supernode"):
            for arg in cmd[1:]:
                assert arg.split("=", 1)[0] in cli_flags(cmd[0]), f"{name}: {cmd[0]} has no flag {arg}"
                checked += 1
    assert checked > 20


def test_tls_and_auth_are_on(compose):
    link = command_of(compose["services"]["superlink"])
    assert "--enable-supernode-auth" in link and not any("--insecure" in a for a in link)
    assert {"--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"} <= {a.split("=")[0] for a in link}
    hospitals = [n for n in compose["services"] if re.fullmatch(r"hospital-.", n)]
    assert hospitals == HOSPITALS
    for name in hospitals:
        cmd = command_of(compose["services"][name])
        assert "--root-certificates=/public/ca.crt" in cmd and not any("--insecure" in a for a in cmd)
        assert f"--auth-supernode-private-key=/keys/{name}.key" in cmd


def test_control_is_reachable_only_inside_the_superlink_network_namespace(compose):
    """The SuperLink (Fleet + Control + Runtime on one port) listens on loopback; only the proxy's port is
    published; hospitals dial the proxy; the operator's services share the SuperLink's namespace."""
    services = compose["services"]
    link = command_of(services["superlink"])
    link_port = flag(link, "--port")
    assert flag(link, "--host") == "127.0.0.1" and link_port
    assert services["superlink"]["ports"] == ["9200:9200"] and link_port != "9200"
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"superlink"}, f"only the proxy's port may be published, not {published}"
    for name in ("proxy", "register", "operator"):
        assert services[name]["network_mode"] == "service:superlink", name
    conf = (DOCKER / "nginx.conf").read_text()
    assert re.search(r"^\s*listen 9200 ssl;", conf, re.M)
    assert f"server 127.0.0.1:{link_port};" in conf
    for name in HOSPITALS:
        assert flag(command_of(services[name]), "--superlink") == "superlink:9200"
    text = (DOCKER / "compose.yaml").read_text()
    assert "0.0.0.0" not in text and "--host=0.0.0.0" not in text


def test_supernodes_keep_their_clientapp_api_on_loopback(compose):
    for name in HOSPITALS:
        cmd = command_of(compose["services"][name])
        assert flag(cmd, "--host") == "127.0.0.1", f"{name}: the ClientApp API must stay on loopback"


def test_the_proxy_forwards_exactly_the_installed_fleet_routes():
    from flwr.superlink.routers.fleet.router import router as fleet

    conf = (DOCKER / "nginx.conf").read_text()
    locations = re.findall(r"^\s*location\s+(.+?)\s*\{", conf, re.M)
    assert len(locations) == 2 and locations[1] == "/", locations
    routes = set(re.fullmatch(r"~ \^/v1/fleet/\((.+)\)\$", locations[0]).group(1).split("|"))
    assert {"/v1/fleet/" + r for r in routes} == {r.path for r in fleet.routes}
    catch_all = conf[conf.index("location / {") :]
    assert "return 404;" in catch_all.split("}")[0]
    assert "limit_except POST" in conf and "proxy_ssl_verify on;" in conf


def test_every_container_is_hardened(compose):
    for name, service in compose["services"].items():
        assert service.get("read_only") is True, f"{name}: root filesystem must be read-only"
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert "/tmp" in service.get("tmpfs", []), name
        assert not service.get("privileged") and service.get("user") in (None,), f"{name}: runs as the image's user"
    for dockerfile in ("Dockerfile", "proxy.Dockerfile"):
        text = (DOCKER / dockerfile).read_text()
        user = re.findall(r"^USER (\S+)", text, re.M)
        assert user and user[-1] not in ("root", "0"), dockerfile


def test_keys_live_in_named_volumes_and_each_site_mounts_only_its_own(compose):
    services, volumes = compose["services"], set(compose.get("volumes") or {})
    for name, service in services.items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name}: volume {source} is not declared"
            # No host folder holds a key: ownership does not depend on the host user.
            assert not (source.startswith((".", "/")) and "cert" in source), f"{name}: keys in a host folder"

    def holders(volume: str) -> set[str]:
        return {name for name, s in services.items() if any(m.startswith(f"{volume}:") for m in s.get("volumes", []))}

    assert holders("link-certs") == {"certs", "superlink", "proxy"}
    assert holders("ca") == {"certs"}, "the CA key stays off the SuperLink"
    for site in HOSPITALS:
        mounts = services[site]["volumes"]
        assert f"./data/{site}:/data:ro" in mounts and f"{site}-key:/keys:ro" in mounts
        others = [m for m in mounts if "hospital-" in m and site not in m]
        assert not others, f"{site} mounts another site's files: {others}"
        assert f"site-name='{site}'" in " ".join(command_of(services[site]))
        key_service = services[f"{site}-key"]
        assert f"site-key --out /keys --name {site}" in " ".join(command_of(key_service))
        assert sorted(m.split(":")[0] for m in key_service["volumes"]) == sorted([f"{site}-key", "public"])


def test_one_shot_services_make_and_register_keys(compose):
    services = compose["services"]
    certs = " ".join(command_of(services["certs"]))
    assert "docker/make_certs.py link --out /certs --ca-dir /ca" in certs
    assert "hospital-" not in certs, "the operator makes no site key"
    assert "register_supernodes.sh" in " ".join(command_of(services["register"]))
    assert services["register"]["volumes"] == ["public:/public:ro"], "registration reads public keys only"
    text = (DOCKER / "register_supernodes.sh").read_text()
    assert "flwr supernode register" in text and "make_certs.py accept" in text
    assert "127.0.0.1:9100" in (DOCKER / "operator.sh").read_text()


def test_the_run_config_named_in_the_compose_header_exists_and_is_valid():
    named = re.findall(r"--run-config (\S+)", (DOCKER / "compose.yaml").read_text())
    assert named == ["docker/compose-run.toml"]
    run_config = tomllib.loads((DOCKER / "compose-run.toml").read_text())
    ExperimentConfig.from_run_config({**defaults(), **run_config}, check_paths=False)
    assert run_config["dataset"] == "site" and run_config["output-dir"] == "/outputs"


def test_compose_works_without_the_v2_only_top_level_name(compose):
    assert "name" not in compose, "Debian's docker-compose 1.29 rejects a top-level name"
    assert "COMPOSE_PROJECT_NAME=medflower" in (DOCKER / ".env").read_text()


def test_dockerfiles_take_a_base_image_and_install_the_app():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M) and "FROM ${BASE_IMAGE}" in text
    assert "pip install ." in text and "USER flwr" in text
    for line in re.findall(r"^COPY ((?:.|\\\n)+?)(?<!\\)$", text, re.M):
        for copied in line.replace("\\\n", " ").split()[:-1]:
            assert (DOCKER.parent / copied).exists(), f"Dockerfile copies missing {copied}"
    assert "chown flwr /state /ca /certs /keys /public /outputs" in text
    proxy = (DOCKER / "proxy.Dockerfile").read_text()
    assert "FROM ${BASE_IMAGE}" in proxy and "apt-get install" in proxy and "nginx" in proxy
    assert "COPY nginx.conf" in proxy


def strict_handshake(certs: Path) -> str:
    """A TLS handshake with the SuperLink certificate, verified like Python 3.13's default context does."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(certs / "superlink.crt", certs / "superlink.key")
    client = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    client.verify_flags |= ssl.VERIFY_X509_STRICT
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve():
            conn, _ = listener.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with (
            socket.create_connection(listener.getsockname(), timeout=10) as raw,
            client.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            got = tls.recv(2).decode()
        thread.join(timeout=10)
    return got


def test_make_certs_makes_a_chain_that_strict_verifiers_accept(tmp_path):
    from cryptography import x509

    make_certs("link", "--out", str(tmp_path), "--san", "link.example")
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "superlink.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "superlink", "link.example"} <= set(sans.get_values_for_type(x509.DNSName))
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == ca_ski.digest
    assert cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    assert strict_handshake(tmp_path) == "ok"
    assert not (tmp_path / "supernodes").exists(), "the operator's step makes no site key"
    make_certs("link", "--out", str(tmp_path / "link"), "--ca-dir", str(tmp_path / "offline"))
    assert sorted(p.name for p in (tmp_path / "link").iterdir()) == ["ca.crt", "superlink.crt", "superlink.key"]
    assert (tmp_path / "offline" / "ca.key").is_file()
    assert strict_handshake(tmp_path / "link") == "ok"


def test_a_site_makes_its_own_key_and_the_operator_takes_only_public_keys(tmp_path):
    from cryptography.hazmat.primitives import serialization

    site = make_certs("site-key", "--out", str(tmp_path / "site"), "--name", "hospital-a")
    key, pub = tmp_path / "site" / "hospital-a.key", tmp_path / "site" / "hospital-a.pub"
    serialization.load_ssh_private_key(key.read_bytes(), password=None)
    assert key.stat().st_mode & 0o077 == 0 and (key.parent.stat().st_mode & 0o077) == 0
    fingerprint = re.search(r"SHA256:\S+", site.stdout).group(0)
    accepted = make_certs("accept", "--out", str(tmp_path / "link"), str(pub))
    assert fingerprint in accepted.stdout and (tmp_path / "link" / "supernodes" / "hospital-a.pub").is_file()
    refused = make_certs("accept", "--out", str(tmp_path / "link"), str(key), check=False)
    assert refused.returncode == 2 and "PRIVATE key" in refused.stderr
    before = key.read_bytes()
    make_certs("site-key", "--out", str(tmp_path / "site"), "--name", "hospital-a")
    assert key.read_bytes() == before, "re-running must not rotate an existing key"
    make_certs("site-key", "--out", str(tmp_path / "other"), "--name", "hospital-a")
    other = make_certs(
        "accept", "--out", str(tmp_path / "link"), str(tmp_path / "other" / "hospital-a.pub"), check=False
    )
    assert other.returncode == 2 and "another key" in other.stderr, "a site's key is replaced only on purpose"


def test_private_keys_are_never_readable_by_others_even_before_they_are_in_place(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_certs", DOCKER / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen: dict[str, int] = {}
    real_replace = os.replace

    def replace(src, dst):
        seen[Path(dst).name] = os.stat(src).st_mode & 0o777  # the file as written, before it gets its name
        real_replace(src, dst)

    monkeypatch.setattr(module.os, "replace", replace)
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        module.main(["link", "--out", str(tmp_path)])
        module.main(["site-key", "--out", str(tmp_path / "site"), "--name", "a"])
    finally:
        os.umask(old_umask)
    assert seen["ca.key"] == seen["superlink.key"] == seen["a.key"] == 0o600, seen
    assert seen["ca.crt"] == seen["a.pub"] == 0o644


def test_the_single_machine_shortcut_still_makes_everything_for_tests(tmp_path):
    make_certs("--out", str(tmp_path), "--sites", "a")
    assert (tmp_path / "supernodes" / "a.key").stat().st_mode & 0o077 == 0
    before = (tmp_path / "supernodes" / "a.key").read_bytes()
    make_certs("--out", str(tmp_path), "--sites", "a", "b")
    assert (tmp_path / "supernodes" / "a.key").read_bytes() == before, "re-running must not rotate existing keys"
    assert (tmp_path / "supernodes" / "b.pub").is_file()
