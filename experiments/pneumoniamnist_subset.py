"""Write a seeded, class-stratified subset of a MedMNIST ``.npz`` in the same layout.

Used by ``experiments/sift-pneumoniamnist-litemedsam.yaml``: LiteMedSAM's encoder costs 3-6 s per 256-px image on
one CPU thread, so all 5,030 PneumoniaMNIST images are 4-8 h of encoding. The subset keeps every official split
(train/val/test) and, within it, each class in its own proportion, so the pooled class balance and the split shares
are those of the full file. The kept rows are a seeded choice; their pixels are untouched, so the frozen-encoder
cache (named by pixels) built for the subset is reused by a later run on the full file.

    python experiments/pneumoniamnist_subset.py data/pneumoniamnist.npz \
        data/pneumoniamnist-600/pneumoniamnist.npz --total 600
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SPLITS = ("train", "val", "test")


def apportion(counts: np.ndarray, total: int) -> np.ndarray:
    """``total`` split in proportion to ``counts``, whole numbers summing to ``total`` (largest remainders)."""
    exact = counts * total / counts.sum()
    take = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - take))[: total - take.sum()]:
        take[i] += 1
    return take


def stratified_rows(labels: np.ndarray, keep: int, rng: np.random.Generator) -> np.ndarray:
    """Row indices, ``keep`` in all, each class's count in proportion to its share."""
    classes, counts = np.unique(labels, return_counts=True)
    take = apportion(counts, keep)
    rows = [rng.choice(np.flatnonzero(labels == c), size=n, replace=False) for c, n in zip(classes, take)]
    return np.sort(np.concatenate(rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a MedMNIST .npz (train/val/test images and labels)")
    parser.add_argument("out", type=Path, help="the subset's .npz (its folder is created)")
    parser.add_argument("--total", type=int, required=True, help="images to keep, over the three splits")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    with np.load(args.source, allow_pickle=False) as npz:
        data = {k: npz[k] for k in npz.files}
    sizes = np.array([len(data[f"{s}_labels"]) for s in SPLITS])
    if not 0 < args.total <= sizes.sum():
        parser.error(f"--total must be between 1 and {sizes.sum()} (the file's images)")
    per_split = apportion(sizes, args.total)
    out = {}
    for split, keep in zip(SPLITS, per_split):
        labels = data[f"{split}_labels"].reshape(-1)
        rows = stratified_rows(labels, int(keep), rng)
        out[f"{split}_images"] = data[f"{split}_images"][rows]
        out[f"{split}_labels"] = data[f"{split}_labels"][rows]
        print(f"{split}: {len(rows)} of {len(labels)} rows, classes {np.bincount(labels[rows]).tolist()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)


if __name__ == "__main__":
    main()
