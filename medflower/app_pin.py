"""A site runs only the app version it reviewed: node-config ``app-hash`` / ``app-version``, checked before any message.

A Flower run brings the operator's app (a FAB) to every SuperNode, which installs it under ``$FLWR_HOME/apps`` and
runs its ClientApp there. A hospital that reviewed one version pins it in its SuperNode's node config:

- ``app-hash``: the app hash this module computes (``python -m medflower.app_pin <app folder or .fab>`` prints it);
  several may be given, separated by commas (e.g. while a site moves from one reviewed version to the next).
- ``app-version``: the ``[project] version`` of the app's ``pyproject.toml``.

``medflower/client_app.py`` calls ``check_pin`` first for every message; a run whose app differs is refused with
``AppPinError``, whose message names both hashes (or versions) and nothing of the site's, so the server logs it as
that site's failed reply. Without either key nothing is checked.

**What is hashed.** Flower does not hand its FAB hash to the ClientApp (its ClientApp process keeps the run's
``Fab`` to itself; the install folder's name carries 8 hex digits of it), so the app hashes itself: the SHA-256 of
the text

    medflower-app-hash-v1
    pyproject.toml <sha256 of the pyproject as canonical JSON>
    <path> <sha256 of the file's bytes>          (one line per file, sorted by path)

over every file in the folder of the package the ClientApp imports (``medflower/``, recursively, ``__pycache__``
folders left out; symlinks are read through) and the app's ``pyproject.toml`` parsed and written as JSON with
sorted keys, without ``[tool.flwr.federations]`` (``flwr build`` drops that table and rewrites the file, so its
bytes differ between a source folder and the FAB). Paths are POSIX paths relative to the app folder. The running
ClientApp hashes its installed copy (the FAB's files); the command hashes a ``.fab`` from its entries and a
source folder from the FAB ``flwr build`` / ``flwr run`` would make of it (Flower's own file selection: its
include patterns and the folder's ``.gitignore``), so all three give the same hash for the same app. Files
outside the package (docs, tests, docker/, experiments/) are not hashed: the ClientApp does not import them.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PIN_KEYS = ("app-hash", "app-version")
LABEL = "medflower-app-hash-v1"
PACKAGE_DIR = Path(__file__).resolve().parent  # the package this ClientApp imports (the run's installed FAB)


class AppPinError(RuntimeError):
    """The run's app is not the one this site pinned (or the pin itself is malformed)."""

    shareable = True  # names hashes, versions and node-config keys only


@dataclass(frozen=True)
class AppIdentity:
    hash: str
    name: str  # "<publisher>/<project name>", Flower's FAB id
    version: str
    files: int  # files hashed under the package folder


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical_pyproject(config: dict[str, Any]) -> bytes:
    flwr = dict(config.get("tool", {}).get("flwr", {}))
    flwr.pop("federations", None)
    config = {**config, "tool": {**config.get("tool", {}), "flwr": flwr}}
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def app_hash(pyproject: dict[str, Any], files: Mapping[str, bytes]) -> str:
    """The app hash of a parsed ``pyproject`` and the package's ``files`` (relative POSIX path -> bytes)."""
    lines = [LABEL, f"pyproject.toml {_sha256(_canonical_pyproject(pyproject))}"]
    lines += [f"{path} {_sha256(files[path])}" for path in sorted(files)]
    return _sha256(("\n".join(lines) + "\n").encode())


def _identity(pyproject: dict[str, Any], files: Mapping[str, bytes]) -> AppIdentity:
    project = pyproject.get("project", {})
    publisher = pyproject.get("tool", {}).get("flwr", {}).get("app", {}).get("publisher", "")
    return AppIdentity(
        app_hash(pyproject, files),
        f"{publisher}/{project.get('name', '')}",
        str(project.get("version", "")),
        len(files),
    )


def package_name(pyproject: dict[str, Any]) -> str:
    """The top-level package of the app's ClientApp (``medflower`` for ``medflower.client_app:app``)."""
    ref = pyproject.get("tool", {}).get("flwr", {}).get("app", {}).get("components", {}).get("clientapp", "")
    name = ref.split(":")[0].split(".")[0]
    if not name:
        raise ValueError("pyproject.toml names no [tool.flwr.app.components] clientapp")
    return name


def _package_files(package_dir: Path, prefix: str) -> dict[str, bytes]:
    files = {}
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for filename in filenames:
            path = Path(dirpath) / filename
            files[f"{prefix}/{path.relative_to(package_dir).as_posix()}"] = path.read_bytes()
    return files


def folder_identity(package_dir: Path) -> AppIdentity:
    """The identity of the app whose package is ``package_dir`` (its ``pyproject.toml`` beside it), files as they
    are on disk: what a ClientApp imports."""
    package_dir = Path(package_dir)
    pyproject_path = package_dir.parent / "pyproject.toml"
    if not pyproject_path.is_file():
        raise AppPinError(f"no pyproject.toml beside the app's package {package_dir.name}/: cannot hash the app")
    pyproject = tomllib.loads(pyproject_path.read_text(encoding="utf-8"))
    return _identity(pyproject, _package_files(package_dir, package_dir.name))


def fab_identity(fab: bytes) -> AppIdentity:
    """The identity of the app in a FAB (its bytes), from the FAB's own entries."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        pyproject = tomllib.loads(archive.read("pyproject.toml").decode("utf-8"))
        prefix = package_name(pyproject) + "/"
        files = {
            name: archive.read(name)
            for name in archive.namelist()
            if name.startswith(prefix) and not name.endswith("/") and "__pycache__" not in name.split("/")
        }
    return _identity(pyproject, files)


def build_fab(app_dir: Path) -> bytes:
    """The FAB ``flwr build`` / ``flwr run`` make of ``app_dir`` (Flower's file selection and layout)."""
    from flwr.cli.build import build_fab_from_disk

    return build_fab_from_disk(Path(app_dir))


@functools.cache
def running_app() -> AppIdentity:
    """This process's app, hashed once (the files a process imported do not change under it)."""
    return folder_identity(PACKAGE_DIR)


def pinned(node_config: Mapping[str, Any]) -> tuple[list[str], str]:
    """The site's pins: accepted app hashes (lower case) and the app version ('' = not pinned)."""
    hashes = [h.strip().lower() for h in str(node_config.get("app-hash", "") or "").split(",") if h.strip()]
    for value in hashes:
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise AppPinError(
                f"node-config app-hash = {value!r}: 64 hex digits, as `python -m medflower.app_pin <app>` prints"
            )
    return hashes, str(node_config.get("app-version", "") or "").strip()


def check_pin(node_config: Mapping[str, Any], app: AppIdentity | None = None) -> None:
    """Refuse (``AppPinError``) when node-config ``app-hash``/``app-version`` are set and the running app differs."""
    hashes, version = pinned(node_config)
    if not hashes and not version:
        return
    app = app or running_app()
    found = []
    if hashes and app.hash not in hashes:
        found.append(
            f"the run's app {app.name} {app.version} hashes to {app.hash}, node-config app-hash is {', '.join(hashes)}"
        )
    if version and app.version != version:
        found.append(f"the run's app version is {app.version!r}, node-config app-version is {version!r}")
    if found:
        raise AppPinError(
            "this site runs only the app it reviewed and refused the message before handling it: " + "; ".join(found)
        )


def identity_of(path: Path) -> tuple[AppIdentity, str]:
    """The app identity of ``path`` (an app folder or a .fab file) and the SHA-256 of its FAB (Flower's FAB hash)."""
    path = Path(path)
    fab = path.read_bytes() if path.is_file() else build_fab(path)
    return fab_identity(fab), _sha256(fab)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m medflower.app_pin",
        description="Print the node-config pins (app-hash, app-version) of a reviewed medflower app.",
    )
    parser.add_argument("app", nargs="?", default=".", help="the app's folder (with pyproject.toml) or a .fab file")
    parser.add_argument("--hash", action="store_true", help="print the app hash only")
    args = parser.parse_args(None if argv is None else list(argv))
    app, fab_sha256 = identity_of(Path(args.app))
    if args.hash:
        print(app.hash)
    else:
        print(f"app-hash='{app.hash}' app-version='{app.version}'")
        print(
            f"# {app.name} {app.version}: pyproject.toml and {app.files} files of its package; "
            f"Flower FAB sha256 {fab_sha256}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
