"""Decode once per site: a dataset whose images are read lazily from files, materialised into uint8 arrays.

``decoded(dataset, cache_dir, key)`` wraps a dataset (``ImageFileDataset``, ``SegFileDataset``, anything whose items
are ``(uint8 image, int label)`` or ``(uint8 image, uint8 mask)`` and which has ``labels``, ``img_size``, ``task`` and
``take``). The first access decodes every item once, in order, into one array per kind (images; masks for
segmentation; labels). With a ``cache_dir`` they are written there as ``<digest>-images.npy``, ``<digest>-masks.npy``
and ``<digest>-labels.npy`` (``<digest>`` = a digest of ``key``), each to a temporary file first and then renamed
(``os.replace``), so a reader never sees half a file; later processes memory-map them and never call the reader.
A cache file that is missing, truncated, unreadable or whose shape, dtype, length or labels do not match the dataset
is ignored and rebuilt. ``cache_dir=''`` keeps the arrays in this process's memory only.

The key must name everything that changes the decoded pixels: the files (``file_identity``: path, size, mtime),
``img_size``, ``intensity`` and ``mask_values`` (``cache_key`` builds it for the file datasets). See
docs/data.md#decoded-image-cache.

``ArraySet`` is the storage underneath, for any named set of arrays under a digest (``entry_digest``): the volume
source (``volumes.VolumeSource``) keeps its decoded slices with it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
import warnings
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from .spec import DataSpec

FORMAT = 1  # bump when the layout of the cached arrays changes


def file_identity(paths) -> str:
    """Digest of each path's resolved name, size and modification time (in order): a changed or replaced file changes
    it. A missing file counts as size -1."""
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        paths_here = path if isinstance(path, (tuple, list)) else (path,)
        for one in paths_here:
            try:
                stat = os.stat(one)
                size, mtime = stat.st_size, stat.st_mtime_ns
            except OSError:
                size, mtime = -1, 0
            digest.update(f"{os.path.realpath(one)}\0{size}\0{mtime}\n".encode())
        digest.update(b"\1")
    return digest.hexdigest()


def cache_key(dataset: Dataset, spec: DataSpec) -> tuple | None:
    """The cache key of a file-backed dataset (its files' identity and the settings that change pixels), or None for
    a dataset already held in memory (nothing to cache)."""
    files = [getattr(dataset, name) for name in ("paths", "image_paths", "mask_paths") if hasattr(dataset, name)]
    if not files:
        return None
    return (
        type(dataset).__name__,
        tuple(file_identity(f) for f in files),
        spec.img_size,
        spec.intensity,
        spec.mask_values,
    )


def entry_digest(*identity) -> str:
    """The digest that names a cache entry: of ``FORMAT`` and ``identity`` (its repr, so keep it to plain values)."""
    return hashlib.blake2b(repr((FORMAT, *identity)).encode(), digest_size=20).hexdigest()


class ArraySet:
    """A named set of arrays cached under a digest: ``<folder>/<digest>-<name>.npy`` for each name.

    ``store`` writes each array to a temporary file in the folder and renames it into place (``os.replace``), so a
    reader never sees half a file; ``load`` memory-maps them all, or gives None when one is missing, truncated,
    unreadable or fails the caller's ``check`` (then the caller decodes again and stores over it)."""

    def __init__(self, folder: Path, digest: str, names) -> None:
        self.folder = folder
        self.paths = {name: folder / f"{digest}-{name}.npy" for name in names}

    def load(self, check=None) -> dict[str, np.ndarray] | None:
        """{name: memory-mapped array}, or None when one is not there or ``check(arrays)`` is false."""
        arrays = {}
        for name, path in self.paths.items():
            try:
                arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError, EOFError):
                return None
        return arrays if check is None or check(arrays) else None

    def store(self, arrays: dict[str, np.ndarray]) -> None:
        """Write every array of the set, each atomically; OSError when the folder cannot be written (read-only,
        full), with no temporary file left behind."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, path in self.paths.items():
            write_atomic(path, np.asarray(arrays[name]))


def decoded(dataset: Dataset, cache_dir: str, key: tuple) -> DecodedDataset:
    """``dataset`` decoded once (module docstring); with ``cache_dir`` stored there and memory-mapped later."""
    return DecodedDataset(_Store(dataset, cache_dir, key), None)


class _Store:
    """The decoded arrays of one dataset: loaded from the cache folder, else decoded on first use."""

    def __init__(self, dataset: Dataset, cache_dir: str, key: tuple) -> None:
        self.source = dataset
        self.task = getattr(dataset, "task", "classification")
        self.img_size = getattr(dataset, "img_size", None)
        self.labels = np.asarray(dataset.labels, dtype=np.int64)
        self.folder = Path(cache_dir) if cache_dir else None
        self.digest = entry_digest(key, len(self.labels), self.task, self.img_size, type(dataset).__name__)
        kinds = ("images", "masks", "labels") if self.task == "segmentation" else ("images", "labels")
        self.entry = ArraySet(self.folder, self.digest, kinds) if self.folder is not None else None
        self.images: np.ndarray | None = None
        self.masks: np.ndarray | None = None
        self.lock = threading.Lock()
        self.from_disk = self.folder is not None and self._load()

    def __getstate__(self) -> dict:
        """What a DataLoader worker started by spawn or forkserver receives (the start method of a process that was
        itself spawned, as ``--parallel`` runs are, and Python 3.14's default): no lock, and no copy of arrays that
        are memory-mapped from the cache folder, which the worker maps again (``__setstate__``)."""
        state = self.__dict__.copy()
        del state["lock"]
        state["mapped"] = isinstance(self.images, np.memmap)
        if state["mapped"]:
            state["images"] = state["masks"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        mapped = state.pop("mapped", False)
        self.__dict__.update(state)
        self.lock = threading.Lock()
        if mapped and not self._load():
            raise RuntimeError(f"{self.folder}: the decoded-image cache changed while a loader worker started")

    def names(self) -> dict[str, Path]:
        return self.entry.paths

    def _load(self) -> bool:
        """Memory-map the cached arrays when all are present and match the dataset; False otherwise."""
        arrays = self.entry.load(self._matches)
        if arrays is None:
            return False
        self.images, self.masks = arrays["images"], arrays.get("masks")
        return True

    def _matches(self, arrays: dict[str, np.ndarray]) -> bool:
        """The arrays have the dataset's length, labels, dtypes and (when it resizes) image size."""
        n = len(self.labels)
        for kind, array in arrays.items():
            if array.shape[:1] != (n,):
                return False
            if kind == "labels":
                if array.dtype != np.int64 or not np.array_equal(array, self.labels):
                    return False
            elif array.dtype != np.uint8 or array.ndim not in (3, 4) or not self._sized(array):
                return False
        return True

    def _sized(self, array: np.ndarray) -> bool:
        """Images (N, S, S[, C]) and masks (N, S, S) or (N, K, S, S) of the dataset's img_size (when it resizes)."""
        if self.img_size is None or not hasattr(self.source, "img_size"):
            return True
        size = (self.img_size, self.img_size)
        return array.shape[1:3] == size or array.shape[-2:] == size

    def ready(self) -> None:
        """Decode every item (once) unless the arrays are there."""
        if self.images is not None:
            return
        with self.lock:
            if self.images is None:
                self._decode()

    def _decode(self) -> None:
        """Decode into memory-mapped temporary files renamed into the cache folder; in memory without a folder, or
        when the folder cannot be written (read-only, full)."""
        if self.folder is not None:
            temporaries: list[Path] = []
            try:
                arrays = self._decode_items(lambda kind, shape: self._temporary_array(kind, shape, temporaries))
                for array in arrays.values():
                    array.flush()
                write_atomic(self.names()["labels"], self.labels)
                for kind, array in arrays.items():
                    os.replace(array.filename, self.names()[kind])
                if self._load():
                    return
                self.images, self.masks = arrays["images"], arrays.get("masks")
                return
            except OSError as exc:
                warnings.warn(
                    f"{self.folder}: decoded-image cache not written ({exc}); decoding in memory", stacklevel=3
                )
            finally:
                for path in temporaries:
                    path.unlink(missing_ok=True)
        arrays = self._decode_items(lambda kind, shape: np.empty(shape, dtype=np.uint8))
        self.images, self.masks = arrays["images"], arrays.get("masks")

    def _decode_items(self, allocate) -> dict[str, np.ndarray]:
        """{'images': uint8 (N, ...), 'masks': uint8 (N, ...) for segmentation}: every item of the dataset, in order."""
        n = len(self.labels)
        if n == 0:
            raise ValueError("nothing to decode: the dataset is empty")
        first_image, first_target = self.source[0]
        segmentation = self.task == "segmentation"
        image_shape = np.asarray(first_image).shape
        mask_shape = np.asarray(first_target).shape if segmentation else None
        arrays = {"images": allocate("images", (n, *image_shape))}
        if segmentation:
            arrays["masks"] = allocate("masks", (n, *mask_shape))
        for i in range(n):
            image, target = (first_image, first_target) if i == 0 else self.source[i]
            arrays["images"][i] = _checked(image, image_shape, i, "image")
            if segmentation:
                arrays["masks"][i] = _checked(target, mask_shape, i, "mask")
            elif int(target) != self.labels[i]:
                raise ValueError(f"item {i} has label {int(target)} but the dataset's labels say {self.labels[i]}")
        return arrays

    def _temporary_array(self, kind: str, shape: tuple, temporaries: list[Path]) -> np.memmap:
        """A memory-mapped temporary .npy in the cache folder, its space reserved (a full disk is an OSError here,
        not a crash while writing through the map)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = _temporary_name(self.names()[kind])
        temporaries.append(path)
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)
        if hasattr(os, "posix_fallocate"):
            with open(path, "r+b") as handle:
                os.posix_fallocate(handle.fileno(), 0, os.path.getsize(path))
        return array


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def _checked(array, shape: tuple, i: int, what: str) -> np.ndarray:
    array = np.asarray(array)
    if array.shape != shape or array.dtype != np.uint8:
        raise ValueError(
            f"item {i}: {what} of shape {array.shape} and dtype {array.dtype}; every item must be uint8 "
            f"of shape {shape} to be cached"
        )
    return array


def write_atomic(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` through a temporary file renamed into place: a reader never sees half a file."""
    temporary = _temporary_name(path)
    try:
        with open(temporary, "wb") as handle:
            np.save(handle, array, allow_pickle=False)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


class DecodedDataset(Dataset):
    """Items of a ``_Store`` (all of them, or those at ``index``); same items, labels, task and img_size as the
    wrapped dataset."""

    def __init__(self, store: _Store, index: np.ndarray | None) -> None:
        self.store, self.index = store, index
        self.labels = store.labels if index is None else store.labels[index]
        self.task, self.img_size = store.task, store.img_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        self.store.ready()
        row = int(i) if self.index is None else int(self.index[i])
        image = np.array(self.store.images[row])  # a copy: items never change with the file behind the map
        if self.store.masks is not None:
            return image, np.array(self.store.masks[row])
        return image, int(self.store.labels[row])

    def take(self, positions: np.ndarray) -> DecodedDataset:
        """Subset at ``positions`` (shares the decoded arrays; decoding, if not done yet, covers all rows)."""
        positions = np.asarray(positions, dtype=np.int64)
        return DecodedDataset(self.store, positions if self.index is None else self.index[positions])

    def __getattr__(self, name: str):
        """What the wrapped file-backed dataset knows about these rows (``paths``, ``image_paths``, ...); decodes
        nothing."""
        if name.startswith("_") or name in ("store", "index"):
            raise AttributeError(name)
        source = self.store.source
        return getattr(source if self.index is None else source.take(self.index), name)

    @property
    def cached_on_disk(self) -> bool:
        """The arrays came from the cache folder (no item was decoded in this process)."""
        return self.store.from_disk
