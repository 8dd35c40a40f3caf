"""Static checks of docker/ (no Docker engine here): compose parses, flags exist, mounts line up."""

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[1] / "docker"


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@cache
def cli_flags(program: str) -> set[str]:
    out = subprocess.run([program, "--help"], capture_output=True, text=True, timeout=120).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out))


def command_of(service: dict) -> list[str]:
    cmd = service["command"]
    return cmd if isinstance(cmd, list) else cmd.split()


def test_every_flower_flag_exists_in_the_installed_flwr(compose):
    checked = 0
    for name, service in compose["services"].items():
        cmd = command_of(service)
        if cmd[0] in ("flower-superlink", "flower-supernode"):
            for arg in cmd[1:]:
                flag = arg.split("=", 1)[0]
                assert flag in cli_flags(cmd[0]), f"{name}: {cmd[0]} has no flag {flag}"
                checked += 1
    assert checked > 20


def test_tls_and_auth_are_on(compose):
    link = command_of(compose["services"]["superlink"])
    assert "--enable-supernode-auth" in link and not any("--insecure" in a for a in link)
    assert {"--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"} <= {a.split("=")[0] for a in link}
    hospitals = [n for n in compose["services"] if n.startswith("hospital-")]
    assert len(hospitals) == 3
    for name in hospitals:
        cmd = command_of(compose["services"][name])
        assert "--root-certificates=/certs/ca.crt" in cmd and not any("--insecure" in a for a in cmd)
        assert "--auth-supernode-private-key=/certs/site.key" in cmd


def test_ports_and_volumes_line_up(compose):
    services, volumes = compose["services"], set(compose.get("volumes") or {})
    link_port = next(a.split("=")[1] for a in command_of(services["superlink"]) if a.startswith("--port="))
    assert f"{link_port}:{link_port}" in services["superlink"]["ports"]
    for name, service in services.items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name}: volume {source} is not declared"
        cmd = command_of(service)
        if cmd[0] == "flower-supernode":
            assert f"--superlink=superlink:{link_port}" in cmd
            site = name
            mounts = service["volumes"]
            # Only its own data and its own key: no other site's folder or key is mounted.
            assert f"./data/{site}:/data:ro" in mounts
            assert f"./certs/supernodes/{site}.key:/certs/site.key:ro" in mounts
            others = [m for m in mounts if "hospital-" in m and site not in m]
            assert not others, f"{name} mounts another site's files: {others}"
            assert f"site-name='{site}'" in " ".join(cmd)


def test_one_shot_services_make_and_register_keys(compose):
    certs = command_of(compose["services"]["certs"])
    assert "docker/make_certs.py" in certs and {"hospital-a", "hospital-b", "hospital-c"} <= set(certs)
    assert "register_supernodes.sh" in " ".join(command_of(compose["services"]["register"]))
    text = (DOCKER / "register_supernodes.sh").read_text()
    assert "flwr supernode register" in text and "root-certificates" in text


def test_dockerfile_takes_a_base_image_and_installs_the_app():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M) and "FROM ${BASE_IMAGE}" in text
    assert "pip install ." in text and "USER flwr" in text
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        assert (DOCKER.parent / copied).exists(), f"Dockerfile copies missing {copied}"


def test_make_certs_makes_a_verifiable_chain(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    subprocess.run(
        ["python", str(DOCKER / "make_certs.py"), "--out", str(tmp_path), "--sites", "a", "--san", "link.example"],
        check=True,
        capture_output=True,
    )
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "superlink.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "superlink", "link.example"} <= set(sans.get_values_for_type(x509.DNSName))
    serialization.load_ssh_private_key((tmp_path / "supernodes" / "a.key").read_bytes(), password=None)
    assert (tmp_path / "supernodes" / "a.key").stat().st_mode & 0o077 == 0
    before = (tmp_path / "supernodes" / "a.key").read_bytes()
    subprocess.run(["python", str(DOCKER / "make_certs.py"), "--out", str(tmp_path), "--sites", "a", "b"], check=True)
    assert (tmp_path / "supernodes" / "a.key").read_bytes() == before, "re-running must not rotate existing keys"
    assert (tmp_path / "supernodes" / "b.pub").is_file()
