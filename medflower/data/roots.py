"""Where a site may read because of the run config: the folders its operator lists in node-config ``data-roots``.

In partition mode the run config (chosen by whoever starts the run) names the data: ``csv:<manifest>``,
``segfolder:<root>``, ``medmnist:<flag>`` with ``data-dir``. A site opens such a path only when it resolves
(``os.path.realpath``: symlinks followed, '..' removed) below one of the folders of its node-config
``data-roots`` (comma-separated; else the environment variable ``MEDFLOWER_DATA_ROOTS``), and so does every file
a manifest lists or a segmentation folder holds. The check runs before the path is opened, so a refused path is
never read and no file content reaches an error message.

With no data-roots, a site in a deployment refuses such datasets; in Flower's simulation engine and in medflower's
in-process grid (``medflower/inprocess.py``), where one operator owns every simulated site, they are read as
before. A site's own node-config ``data-path`` is the operator's choice and needs no data-roots; synthetic
datasets name no path. See docs/data.md#data-roots.

The same holds for the other files a run config names: ``backbone-weights`` (a file or a Hugging Face cache folder;
'none' and 'auto' name no path, and 'auto' for LiteMedSAM reads the installed package's own file),
``class-embeddings`` and ``text-encoder`` (``check_model_paths``). The listing check of a dataset is cached, so while a
site handles a message (``site_reads``) every image, mask, volume and npz file is also checked when it is opened
(``readers.opened_path``: its real path at that moment), and no decoded array may exceed node-config
``max-image-bytes`` (docs/data.md#input-limits).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import medflower.data.segfolder as segfolder

from ..engine import SIMULATION_CALLERS, in_simulation  # noqa: F401 (re-exported)
from .readers import max_image_bytes, read_policy, set_read_policy
from .sources import medmnist_path, open_source_by_key, source_key
from .spec import ARGLESS_KINDS, DataError, DataSpec, list_rows

ROOTS_KEY = "data-roots"
ROOTS_ENV = "MEDFLOWER_DATA_ROOTS"
# run-config keys naming files a site's model reads (ModelSpec attribute), besides the dataset's
MODEL_PATH_KEYS = (
    ("backbone-weights", "weights"),
    ("class-embeddings", "class_embeddings"),
    ("text-encoder", "text_encoder"),
)
NOT_PATHS = ("", "none", "auto")  # backbone-weights values that name no file


def data_roots(node_config: Mapping) -> tuple[str, ...] | None:
    """The real paths of node-config ``data-roots`` (else of ``$MEDFLOWER_DATA_ROOTS``); None when neither is set."""
    raw = str(node_config.get(ROOTS_KEY) or "").strip() or os.environ.get(ROOTS_ENV, "")
    roots = tuple(dict.fromkeys(os.path.realpath(os.path.expanduser(r.strip())) for r in raw.split(",") if r.strip()))
    return roots or None


def is_below(path: str | Path, roots: Iterable[str]) -> bool:
    """``path`` resolves (symlinks followed) to one of ``roots`` (real paths) or below one."""
    real = os.path.realpath(os.path.expanduser(str(path)))
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


@contextmanager
def site_reads(node_config: Mapping, own_data: bool = False) -> Iterator[None]:
    """While a site handles a message: every file the data layer opens is checked at open time against node-config
    data-roots (not for a site's own ``data-path``, the operator's choice; not without data-roots, where
    ``check_data_roots`` decides), and every decoded array against node-config max-image-bytes."""
    previous = read_policy()
    set_read_policy(None if own_data else data_roots(node_config), max_image_bytes(node_config))
    try:
        yield
    finally:
        set_read_policy(previous.roots, previous.max_bytes)


def check_model_paths(spec, node_config: Mapping) -> None:
    """Refuse, before the model is built, a run-config ``backbone-weights``, ``class-embeddings`` or ``text-encoder``
    path that resolves outside node-config data-roots (a folder: any file below it); the rules of
    ``check_data_roots``. ``spec``: the site's ModelSpec."""
    named = [(key, str(getattr(spec, attr, "") or "")) for key, attr in MODEL_PATH_KEYS]
    named = [(key, value) for key, value in named if value.strip().lower() not in NOT_PATHS]
    if not named:
        return
    roots = data_roots(node_config)
    if roots is None:
        if in_simulation():
            return
        key, value = named[0]
        raise _no_roots(f"run-config {key} {value!r} names a file")
    for key, value in named:
        path = Path(value).expanduser()
        _require_below(f"run-config {key} {value!r}", path, roots)
        if path.is_dir():
            outside = [str(p) for p in _below_folder(path) if not is_below(p, roots)]
            if outside:
                raise DataError(
                    f"run-config {key} {value!r}: {len(outside)} file(s) below it resolve (symlinks followed) "
                    f"outside this site's node-config {ROOTS_KEY}: {list_rows(outside, 5)}"
                )


def _no_roots(what: str) -> DataError:
    return DataError(
        f"{what} on this site, but this SuperNode sets no node-config {ROOTS_KEY}: a site reads run-config paths only "
        f"below the folders its operator lists, e.g. flower-supernode ... --node-config \"{ROOTS_KEY}='/data/shared'\" "
        f"(or the environment variable {ROOTS_ENV}); see docs/data.md#data-roots"
    )


def _below_folder(folder: Path) -> Iterator[Path]:
    """Every file and link below ``folder`` (links not followed into folders)."""
    for top, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            yield Path(top) / name


def check_data_roots(spec: DataSpec, node_config: Mapping) -> None:
    """Refuse, before anything is opened, a run-config dataset that would make this site read outside the folders
    its node-config ``data-roots`` allows (module docstring); DataError naming node-config data-roots."""
    if spec.source_kind in ARGLESS_KINDS:
        return
    roots = data_roots(node_config)
    if roots is None:
        if in_simulation():
            return
        raise _no_roots(f"run-config dataset {spec.dataset!r} names files")
    confine(spec, roots)


def confine(spec: DataSpec, roots: tuple[str, ...]) -> None:
    """DataError unless every file ``spec`` reads resolves below ``roots``: the path the run config names first
    (nothing opened), then the files a manifest lists or a segmentation folder holds (manifest read, folders
    listed, no image or mask opened)."""
    kind, arg = spec.source_kind, spec.source_arg
    roots = tuple(os.path.realpath(os.path.expanduser(r)) for r in roots)
    if kind == "medmnist":
        folder = Path(spec.data_dir).expanduser()
        _require_below(f"run-config data-dir {spec.data_dir!r}", folder, roots)
        _require_below(f"run-config dataset {spec.dataset!r}", folder / f"{arg}.npz", roots)
        _require_below(f"run-config dataset {spec.dataset!r}", medmnist_path(arg, spec.data_dir, spec.img_size), roots)
        return
    _require_below(f"run-config dataset {spec.dataset!r}", Path(arg).expanduser(), roots)
    outside = _files_outside(source_key(spec), roots)
    if outside:
        raise DataError(
            f"run-config dataset {spec.dataset!r}: {len(outside)} file(s) it reads resolve (symlinks followed) "
            f"outside this site's node-config {ROOTS_KEY}: {list_rows(list(outside), 5)}"
        )


def _require_below(what: str, path: Path, roots: tuple[str, ...]) -> None:
    if not is_below(path, roots):
        raise DataError(
            f"{what} resolves (symlinks followed) outside this site's node-config {ROOTS_KEY}; the site "
            f"operator allows a folder by adding it to {ROOTS_KEY}"
        )


@lru_cache(maxsize=16)
def _files_outside(key: tuple, roots: tuple[str, ...]) -> tuple[str, ...]:
    """The files of the source ``key`` (a csv manifest's images, a segfolder's images and masks, a volume folder's
    volumes, series and case table) that resolve outside
    ``roots``, as the source names them; cached per source identity (path and mtime, or folder fingerprint)."""
    if key[0] == "csv":
        source = open_source_by_key(key)  # reads the manifest only; images are read lazily
        named = [(f"line {line} ({path})", path) for line, path in zip(source.lines, source.paths)]
    elif key[0] == "volumes":
        from .volumes import list_files  # imports sources

        named = [(str(p), p) for p in list_files(Path(key[2]))]
    else:
        folder = segfolder.scan_folder(Path(key[2]))  # lists the folders; masks are read when the source opens
        named = [(str(p), p) for p in folder.images + folder.masks]
    return tuple(name for name, path in named if not is_below(path, roots))
