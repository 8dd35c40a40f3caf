"""Video-sequence groups for frame folders that name none (docs/data.md#splits-without-leakage).

Polyp datasets such as CVC-ClinicDB (Bernal et al., "WM-DOVA maps for accurate polyp highlighting in
colonoscopy", Comput. Med. Imaging Graph. 2015: 612 frames from 29 sequences) number their frames 1..N in video
order, and neighbouring frames are near-duplicates: splitting them row by row puts almost the same image in
train and test. This tool guesses the sequences and writes ``groups.csv`` (``stem,group``) for a segmentation
folder, so that partitions and splits keep each sequence whole::

    python -m medflower.data.groups <images folder> --out groups.csv [--threshold 3] [--window 4] [--min-length 2]

It is a heuristic: frames are ordered by the natural sort of their stems (``2`` before ``10``), each frame is
reduced to a small grayscale thumbnail, and the order is cut between frames i and i + 1 where the difference
across that point exceeds ``threshold`` times the median difference (the usual change between neighbouring
frames of one video). The difference across a point is the smallest mean absolute difference between any of
the ``window`` frames up to i and any of the ``window`` frames from i + 1 (``window`` 1: consecutive frames
only), so one jumpy frame inside a video does not cut it while a change of video, after which no frame
resembles the ones before, does. Cuts closer than ``min-length`` frames are thinned, keeping the stronger.

Its errors are not symmetric. Two videos joined into one group (a video that starts where the previous one
ended) only make the groups coarser, which leaks nothing. A cut inside a video (a fast camera move) makes two
groups of one video, which may land in different splits: near-duplicates leak again. So keep the threshold high
rather than low, check the number of groups it prints against the dataset's documentation, and prefer the
authors' sequence list where there is one.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from .segfolder import IMAGE_EXTENSIONS, file_extension, file_stem
from .spec import DataError

DEFAULT_THRESHOLD = 3.0
DEFAULT_WINDOW = 4
DEFAULT_MIN_LENGTH = 2
THUMBNAIL = 32


def natural_key(stem: str) -> tuple:
    """Sort key that orders the digit runs of ``stem`` by value: '2' < '10', 'a2' < 'a10'."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", stem) if part)


def frame_paths(folder: Path) -> list[Path]:
    """The image files of ``folder`` in natural order of their stems; DataError when there is none."""
    if not folder.is_dir():
        raise DataError(f"{folder}: images folder not found (or not a folder)")
    paths = [p for p in folder.iterdir() if p.is_file() and file_extension(p) in IMAGE_EXTENSIONS]
    if not paths:
        raise DataError(f"{folder}: no image files ({', '.join(IMAGE_EXTENSIONS)})")
    return sorted(paths, key=lambda p: (natural_key(file_stem(p)), p.name))


def thumbnail(path: Path, size: int = THUMBNAIL) -> np.ndarray:
    """float32 size x size grayscale thumbnail of an image file (0..255)."""
    try:
        with Image.open(path) as image:
            small = image.convert("L").resize((size, size), Image.Resampling.BILINEAR)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{path}: cannot open image: {exc}") from exc
    return np.asarray(small, dtype=np.float32)


def frame_differences(thumbnails: np.ndarray, window: int = 1) -> np.ndarray:
    """Difference across each point between consecutive frames of thumbnails [N, h, w] -> (N - 1,): entry i is the
    smallest mean absolute difference between one of the ``window`` frames up to i and one of the ``window``
    frames from i + 1 (``window`` 1: between frames i and i + 1)."""
    flat = np.asarray(thumbnails, dtype=np.float32).reshape(len(thumbnails), -1)
    out = np.empty(max(len(flat) - 1, 0))
    for i in range(len(out)):
        before, after = flat[max(0, i + 1 - window) : i + 1], flat[i + 1 : i + 1 + window]
        out[i] = np.abs(before[:, None] - after[None]).mean(axis=-1).min()
    return out


def sequence_starts(
    differences: np.ndarray, threshold: float = DEFAULT_THRESHOLD, min_length: int = DEFAULT_MIN_LENGTH
) -> list[int]:
    """Frame indices where a new sequence starts (0 first): frame i + 1 starts one when ``differences[i]`` exceeds
    ``threshold`` times the median difference. Strongest cuts first, a cut is kept only if every sequence it makes
    has at least ``min_length`` frames."""
    differences = np.asarray(differences, dtype=np.float64)
    num_frames = len(differences) + 1
    scale = float(np.median(differences)) if differences.size else 0.0
    limit = threshold * scale if scale > 0 else 0.0
    candidates = np.flatnonzero(differences > limit) + 1
    kept = [0, num_frames]
    for start in sorted(candidates.tolist(), key=lambda s: (-differences[s - 1], s)):
        position = np.searchsorted(kept, start)
        if start - kept[position - 1] >= min_length and kept[position] - start >= min_length:
            kept.insert(position, start)
    return kept[:-1]


def sequence_groups(
    folder: Path,
    threshold: float = DEFAULT_THRESHOLD,
    min_length: int = DEFAULT_MIN_LENGTH,
    window: int = DEFAULT_WINDOW,
    size: int = THUMBNAIL,
) -> list[tuple[str, str]]:
    """(stem, group) of every frame of ``folder`` in natural order; groups are named ``seq-<n>`` in frame order,
    ``n`` zero-padded to the width of the number of groups (``seq-01`` .. ``seq-14``)."""
    if threshold <= 0 or min_length < 1 or window < 1 or size < 2:
        raise ValueError("threshold must be > 0, min_length >= 1, window >= 1 and size >= 2")
    paths = frame_paths(folder)
    stems = [file_stem(p) for p in paths]
    if len(set(stems)) != len(stems):
        doubled = sorted({s for s in stems if stems.count(s) > 1})
        raise DataError(f"{folder}: several images share a stem (a group is written per stem): {', '.join(doubled)}")
    differences = frame_differences(np.stack([thumbnail(p, size) for p in paths]), window)
    starts = sequence_starts(differences, threshold, min_length)
    width = len(str(len(starts)))
    index = np.cumsum(np.isin(np.arange(len(paths)), starts))
    return [(stem, f"seq-{i:0{width}d}") for stem, i in zip(stems, index.tolist())]


def write_groups(rows: list[tuple[str, str]], out: Path) -> None:
    """Write ``stem,group`` rows to ``out``."""
    with open(out, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["stem", "group"])
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m medflower.data.groups",
        description="Guess the video sequences of a folder of numbered frames (CVC-ClinicDB style) by cutting the "
        "frame order where consecutive frames differ strongly, and write groups.csv (stem,group). "
        "A heuristic: check the number of groups it prints.",
    )
    parser.add_argument("images", type=Path, help="folder of frames named in video order (1.png, 2.png, ...)")
    parser.add_argument("--out", type=Path, required=True, help="groups.csv to write (stem,group)")
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="cut where a difference exceeds this many median differences (default %(default)s)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help="frames compared on each side of a cut (default %(default)s; 1 = consecutive frames)",
    )
    parser.add_argument(
        "--min-length", type=int, default=DEFAULT_MIN_LENGTH, help="fewest frames of a sequence (default %(default)s)"
    )
    parser.add_argument("--size", type=int, default=THUMBNAIL, help="thumbnail side in pixels (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        rows = sequence_groups(args.images, args.threshold, args.min_length, args.window, args.size)
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_groups(rows, args.out)
    num_groups = len({group for _, group in rows})
    print(
        f"{num_groups} group(s) found in {len(rows)} frame(s) of {args.images} (a heuristic: threshold "
        f"{args.threshold} x median difference, window {args.window}, min length {args.min_length}); "
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
