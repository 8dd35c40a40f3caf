#!/usr/bin/env python3
"""Write a small synthetic two-class image set per hospital for the compose demo (docker/compose.yaml).

    python docker/make_demo_data.py --out docker/data hospital-a hospital-b hospital-c

Each site gets <out>/<site>/demo.npz in the MedMNIST layout (train/val/test images and labels, 28x28
grey): label 1 images carry a bright square. Real sites put their own .npz or manifest.csv there instead.
Files are world-readable, so the containers' unprivileged user can read them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np


def write_site(path: Path, seed: int, sizes=(120, 24, 48)) -> Path:
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, size in zip(("train", "val", "test"), sizes):
        labels = rng.integers(0, 2, size)
        images = rng.integers(0, 60 + 20 * seed, (size, 28, 28)).astype(np.uint8)
        images[labels == 1, 8:20, 8:20] = 220
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels.reshape(-1, 1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    os.chmod(path.parent, 0o755)
    os.chmod(path, 0o644)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docker/data"))
    parser.add_argument("sites", nargs="*", default=["hospital-a", "hospital-b", "hospital-c"])
    args = parser.parse_args(argv)
    for seed, site in enumerate(args.sites):
        print(f"wrote {write_site(args.out / site / 'demo.npz', seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
