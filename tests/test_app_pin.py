"""A site runs only the app it reviewed (medflower/app_pin.py): node-config app-hash / app-version, checked before any
message is handled; and what Flower's own --trusted-entities does with a locally built app."""

import json
import logging
import shutil
from pathlib import Path

import pytest
from helpers import REAL_PROCESSES, records, run_dir_of

from medflower import app_pin
from medflower.app_pin import AppIdentity, AppPinError, check_pin
from medflower.inprocess import run_inprocess

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pinapp"
version = "1.2.0"
dependencies = ["flwr>=1.41"]

[tool.flwr.app]
publisher = "hospital"

[tool.flwr.app.components]
serverapp = "pinapp.server_app:app"
clientapp = "pinapp.client_app:app"

[tool.flwr.app.config]
num-rounds = 3
lr = 0.01

[tool.flwr.federations]
default = "local"
"""


def make_app(folder: Path) -> Path:
    """A small Flower app: pyproject.toml, a package with a subpackage and a data file, and files that `flwr build`
    leaves out (bytecode, a .gitignored file, a file type it does not carry)."""
    pkg = folder / "pinapp"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (folder / "pyproject.toml").write_text(PYPROJECT)
    (folder / ".gitignore").write_text("__pycache__/\n*.pyc\nscratch.py\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "client_app.py").write_text("app = None\n")
    (pkg / "server_app.py").write_text("app = None\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "classes.json").write_text('["normal", "pneumonia"]\n')
    (pkg / "sub" / "__pycache__" / "classes.cpython-311.pyc").write_bytes(b"\0bytecode")
    (pkg / "scratch.py").write_text("print('not shipped')\n")
    (pkg / "notes.txt").write_text("not shipped either\n")
    return folder


def installed(fab: bytes, home: Path) -> Path:
    """The FAB installed as a SuperNode's ClientApp process installs it (Flower's install_from_fab)."""
    from flwr.cli.install import install_from_fab

    return install_from_fab(fab, install_dir=home, skip_prompt=True)


def test_the_source_folder_the_fab_and_the_installed_app_hash_the_same(tmp_path):
    app = make_app(tmp_path / "pinapp")
    fab = app_pin.build_fab(app)
    shipped, fab_sha256 = app_pin.identity_of(app)
    (tmp_path / "pinapp.fab").write_bytes(fab)
    assert app_pin.identity_of(tmp_path / "pinapp.fab") == (shipped, fab_sha256)
    install = installed(fab, tmp_path / "home")
    (install / "pinapp" / "__pycache__").mkdir()
    (install / "pinapp" / "__pycache__" / "client_app.cpython-311.pyc").write_bytes(b"written on import")
    assert app_pin.folder_identity(install / "pinapp") == shipped
    assert shipped.name == "hospital/pinapp" and shipped.version == "1.2.0"
    assert shipped.files == 5  # __init__, client_app, server_app, sub/__init__, sub/classes.json
    # The source folder as it is on disk also holds what `flwr build` leaves out: an in-process run from a checkout
    # hashes what it imports from there, so stray files count.
    assert app_pin.folder_identity(app / "pinapp").hash != shipped.hash
    (app / "pinapp" / "scratch.py").unlink()
    (app / "pinapp" / "notes.txt").unlink()
    assert app_pin.folder_identity(app / "pinapp") == shipped


def test_every_file_of_the_package_and_the_pyproject_count_the_federations_do_not(tmp_path):
    app = make_app(tmp_path / "pinapp")
    for junk in ("scratch.py", "notes.txt"):
        (app / "pinapp" / junk).unlink()
    base = app_pin.folder_identity(app / "pinapp").hash
    pyproject = app / "pyproject.toml"

    def changed(edit) -> str:
        saved = {p: p.read_bytes() for p in app.rglob("*") if p.is_file()}
        edit()
        try:
            return app_pin.folder_identity(app / "pinapp").hash
        finally:
            for p in app.rglob("*"):
                if p.is_file() and p not in saved:
                    p.unlink()
            for p, data in saved.items():
                p.write_bytes(data)

    assert changed(lambda: (app / "pinapp" / "client_app.py").write_text("app = 1\n")) != base
    assert changed(lambda: (app / "pinapp" / "sub" / "classes.json").write_text("[]\n")) != base
    assert changed(lambda: (app / "pinapp" / "sub" / "extra.py").write_text("")) != base
    assert changed(lambda: pyproject.write_text(PYPROJECT.replace("lr = 0.01", "lr = 0.1"))) != base
    assert changed(lambda: pyproject.write_text(PYPROJECT.replace('version = "1.2.0"', 'version = "1.2.1"'))) != base
    assert changed(lambda: (app / "pinapp" / "sub" / "__pycache__" / "x.pyc").write_bytes(b"x")) == base
    assert changed(lambda: pyproject.write_text(PYPROJECT.replace('"local"', '"hospitals"'))) == base
    assert changed(lambda: (app / "README.md").write_text("# docs are not hashed\n")) == base


APP = AppIdentity(hash="a" * 64, name="medflower/medflower", version="0.1.0", files=100)


def test_a_pin_is_checked_only_when_set_and_names_both_hashes():
    check_pin({}, APP)
    check_pin({"app-hash": "", "app-version": ""}, APP)
    check_pin({"app-hash": "A" * 64, "app-version": "0.1.0"}, APP)
    check_pin({"app-hash": f"{'b' * 64}, {'a' * 64}"}, APP)  # two reviewed versions accepted
    with pytest.raises(AppPinError) as err:
        check_pin({"app-hash": "b" * 64}, APP)
    assert str(err.value) == (
        "this site runs only the app it reviewed and refused the message before handling it: the run's app "
        f"medflower/medflower 0.1.0 hashes to {'a' * 64}, node-config app-hash is {'b' * 64}"
    )
    assert AppPinError.shareable
    with pytest.raises(AppPinError, match="app version is '0.1.0', node-config app-version is '0.2.0'"):
        check_pin({"app-version": "0.2.0"}, APP)
    with pytest.raises(AppPinError, match="app-hash = 'deadbeef': 64 hex digits"):
        check_pin({"app-hash": "deadbeef"}, APP)


def test_the_command_prints_the_node_config_pins(tmp_path, capsys):
    app = make_app(tmp_path / "pinapp")
    identity, fab_sha256 = app_pin.identity_of(app)
    assert app_pin.main([str(app)]) == 0
    out, err = capsys.readouterr()
    assert out == f"app-hash='{identity.hash}' app-version='1.2.0'\n"
    assert fab_sha256 in err and "5 files" in err
    assert app_pin.main(["--hash", str(app)]) == 0
    assert capsys.readouterr().out == identity.hash + "\n"


def test_the_running_app_is_the_one_its_folder_would_ship():
    """The ClientApp's own hash (medflower as imported here) is what the command prints for this app folder."""
    shipped, _ = app_pin.identity_of(app_pin.PACKAGE_DIR.parent)
    assert app_pin.running_app() == shipped


def test_a_site_whose_pin_differs_refuses_every_message_and_the_others_train(tiny, caplog):
    right = app_pin.running_app()
    wrong = "0" * 64
    run = tiny(**{"run-name": "pin", "num-rounds": 1})
    pins = [{"app-hash": wrong}, {"app-hash": right.hash, "app-version": right.version}]
    with caplog.at_level(logging.WARNING):
        run_inprocess(run, 2, node_configs=pins)
    assert {r["client"] for r in records(run_dir_of(run), "train")} == {"site-1"}
    refusals = [m for m in caplog.messages if "AppPinError" in m]
    assert refusals and all(right.hash in m and wrong in m for m in refusals)


# ------------------------------------------------------------------------------------------- real processes
def ed25519_public_key() -> str:
    """A public key in OpenSSH form, as --trusted-entities takes them (the key a hospital would trust)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("flower-superlink") is None, reason="flwr CLI not installed")
def test_on_loopback_a_pinned_site_refuses_another_app_and_trusted_entities_refuse_a_local_app(tmp_path):
    """Three real SuperNodes, one `flwr run` of a locally built app: the site pinning that app trains; the site
    pinning another hash refuses with both hashes named; the site started with Flower's --trusted-entities refuses
    the run ("App verification is not supported by the connected SuperLink": a local FAB has no Hub record)."""
    from medflower.loopback import LoopbackFederation

    # A snapshot of this app (the FAB `flwr run` would build, installed as a folder): the checkout may change
    # while the test runs, the snapshot does not.
    app = installed(app_pin.build_fab(app_pin.PACKAGE_DIR.parent), tmp_path / "snapshot")
    pin, _ = app_pin.identity_of(app)
    wrong = "f" * 64
    trusted = tmp_path / "trusted-entities.yaml"
    trusted.write_text(f"fpk_hospital_review: '{ed25519_public_key()} hospital-review'\n")
    out = tmp_path / "outputs"
    nodes = [{"app-hash": pin.hash, "app-version": pin.version}, {"app-hash": wrong}, {}]
    with LoopbackFederation(
        num_supernodes=3,
        workdir=tmp_path / "fed",
        node_configs=nodes,
        supernode_args={2: ["--trusted-entities", str(trusted)]},
    ) as fed:
        config = {
            **REAL_PROCESSES,
            "num-rounds": 1,
            "min-nodes": 3,
            "output-dir": str(out),
            "run-name": "pinned",
        }
        proc = fed.run_app(config, timeout=600, app_dir=app)
        untrusted_log = (fed.workdir / "supernode-2.log").read_text()
    summary = json.loads((out / "pinned" / "summary.json").read_text())
    assert sorted(summary["per_client"]) == ["site-0"]
    refusals = [line for line in proc.stdout.splitlines() if "AppPinError" in line]
    assert refusals and all(pin.hash in line and wrong in line for line in refusals), proc.stdout
    assert "The FAB could not be verified" in proc.stdout
    assert "App verification is not supported by the connected SuperLink" in untrusted_log
