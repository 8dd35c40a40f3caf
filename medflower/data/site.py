"""A deployed site's own data, named by its SuperNode's node-config ``data-path``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .spec import DataError, DataSpec


def site_data_spec(base: DataSpec, data_path: str) -> DataSpec:
    """The spec of a site whose data lives at ``data_path``; the site uses all of it (one partition).

    ``data_path`` is a MedMNIST-layout ``.npz`` file, a ``.csv`` manifest, or a folder holding
    exactly one of them (``manifest.csv`` is preferred when both kinds are present). A folder
    with ``images/`` and ``masks/`` (or site sub-folders that have them) is a segmentation
    folder, ``segfolder:<path>``, and wins over files next to it; its sites are pooled into the
    site's one partition.
    """
    path = Path(data_path).expanduser()
    if path.is_dir() and is_segfolder(path):
        return dataclasses.replace(base, dataset=f"segfolder:{path}", partition="iid")
    if path.is_dir():
        manifests = [path / "manifest.csv"] if (path / "manifest.csv").is_file() else sorted(path.glob("*.csv"))
        npz = sorted(path.glob("*.npz"))
        candidates = manifests or npz
        if len(candidates) != 1:
            found = ", ".join(p.name for p in manifests + npz) or "nothing"
            raise DataError(f"node-config data-path {path}: expected one manifest .csv or one .npz in the folder, "
                            f"found {found}")
        path = candidates[0]
    if not path.is_file():
        raise DataError(f"node-config data-path {path} does not exist")
    if path.suffix == ".npz":
        dataset, data_dir = f"medmnist:{path.stem}", str(path.parent)
    elif path.suffix == ".csv":
        dataset, data_dir = f"csv:{path}", base.data_dir
    else:
        raise DataError(f"node-config data-path {path}: expected a .npz (MedMNIST layout) or a .csv manifest")
    # A site holds its own data: no further partitioning ("iid" over a single partition).
    return dataclasses.replace(base, dataset=dataset, data_dir=data_dir, partition="iid")


def is_segfolder(path: Path) -> bool:
    """``path`` holds images/ and masks/, or a sub-folder does (the segfolder layout)."""
    def has_pair(folder: Path) -> bool:
        return (folder / "images").is_dir() and (folder / "masks").is_dir()

    return has_pair(path) or any(has_pair(p) for p in path.iterdir()
                                 if p.is_dir() and not p.name.startswith((".", "_")))
