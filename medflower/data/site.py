"""A deployed site's own data, named by its SuperNode's node-config ``data-path``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .spec import DataError, DataSpec


def site_data_spec(base: DataSpec, data_path: str) -> DataSpec:
    """The spec of a site whose data lives at ``data_path``; the site uses all of it (one partition).

    ``data_path`` is a MedMNIST-layout ``.npz`` file, a ``.csv`` manifest, or a folder holding
    exactly one of them (``manifest.csv`` is preferred when both kinds are present).
    """
    path = Path(data_path).expanduser()
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
