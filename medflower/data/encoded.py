"""Frozen-encoder mode: each site computes its images' encoder outputs once and keeps them beside the decode cache.

When nothing inside the encoder trains (``adapter='none'``: only the head or the segmentation decoder trains), the
encoder's output for an image never changes during a run, so training and evaluation need only the task module:
``encoded(dataset, encode, ...)`` runs ``encode`` over a split once, batch by batch (each batch stored as it is
made), and gives a dataset of ``(encoder output, target)`` items. A round then costs what trains
(docs/models.md#frozen-encoder-mode).

With a ``cache_dir`` each image's output is one file, ``encoded-<encoder>/<image>.npy`` (float16, written to a
temporary file renamed into place, as the decode cache writes, ``cache.ArraySet``), named by content:
``<encoder>`` is a digest of everything about the encoder that changes its outputs (``module_digest`` of its tensors,
whatever file they came from, the input normalisation, the image size, the storage format) and ``<image>`` a digest
of the image's decoded pixels (``image_digest``: the file's content after resizing, intensity and mask settings).
So an image is encoded once per encoder however it reaches a site: another seed's partition that moves rows
between sites, a copy of the data with new file dates, a folder with images added (only the new ones encode), two
sites holding the same image. A site's rows are listed in ``<digest>-encoded-index.npy`` (the image digests in row
order) under the digest that names its decoded data (for a site's decoded data the decode cache's digest, so all its
splits share one list), so a later process finds them without hashing pixels. A missing, truncated or mis-shaped
file is encoded again; the rest are read as they are. Augmentation never applies (the mode is off when the run
augments).

Float16 storage halves the disk and page cache (LiteMedSAM's 256×64×64 embedding: 2 MiB an image); the decoder reads
them back as float32. The rounding (relative 2^-11) is far below what training changes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .cache import ArraySet, entry_digest, write_atomic

logger = logging.getLogger(__name__)

FORMAT = 2  # bump when the layout of the stored outputs changes (1: one file per site)
DTYPE = np.float16
PROGRESS_SECONDS = 60.0  # a long encode logs how far it is at most this often


def module_digest(module: torch.nn.Module) -> str:
    """Digest of a module's parameters and buffers (names, shapes, dtypes, values): the encoder's identity."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in module.state_dict().items():
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{tuple(value.shape)}\0{value.dtype}\n".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def _hash_image(digest, image: np.ndarray) -> None:
    image = np.ascontiguousarray(image)
    digest.update(f"{image.shape}\0{image.dtype}\n".encode())
    digest.update(image.tobytes())


def image_digest(image: np.ndarray) -> str:
    """Digest of one decoded image (its shape, dtype and pixels): the name of its encoder output."""
    digest = hashlib.blake2b(digest_size=20)
    _hash_image(digest, image)
    return digest.hexdigest()


def pixels_digest(dataset: Dataset) -> str:
    """Digest of every item's decoded image, in order (what the encoder reads)."""
    digest = hashlib.blake2b(digest_size=16)
    for i in range(len(dataset)):
        _hash_image(digest, dataset[i][0])
    return digest.hexdigest()


def encoded(
    dataset: Dataset,
    encode: Callable[[torch.Tensor], torch.Tensor],
    *,
    identity: tuple,
    cache_dir: str,
    batch_size: int,
    device: torch.device,
    what: str = "",
) -> EncodedDataset:
    """``dataset`` with each image replaced by ``encode``'s output for it (module docstring). ``identity`` names the
    encoder and its input (``module_digest``, normalisation, image size); ``what`` names the data in the log.

    A split of a site's decoded data (``cache.DecodedDataset``) is served from the outputs of all the site's rows,
    listed once under the decode cache's digest (its files and decode settings): every split of that site shares the
    list, and every image's output is shared by whatever site, seed or copy of the data holds the same pixels."""
    whole, positions, content = _whole(dataset)
    digest = entry_digest("encoded", FORMAT, identity, content, len(whole))
    if cache_dir:
        outputs = _stored_outputs(whole, encode, identity, digest, Path(cache_dir), batch_size, device, what)
    else:
        outputs = _MEMORY.get(digest)
        if outputs is None:
            outputs = _encode_logged(whole, encode, batch_size, device, what, "")
        if len(_MEMORY) >= 8:
            _MEMORY.pop(next(iter(_MEMORY)))
        _MEMORY[digest] = outputs
    return EncodedDataset(dataset, outputs, positions)


# Without a cache folder: digest -> outputs in this process's memory, so a site's three splits (and its later
# messages) encode its rows once. With one, each call reads the site's list and the images' files instead.
_MEMORY: dict[str, np.ndarray] = {}


def _whole(dataset: Dataset) -> tuple[Dataset, np.ndarray, str]:
    """(what to encode, the positions of ``dataset``'s items in it, its content's identity)."""
    store = getattr(dataset, "store", None)
    digest = getattr(store, "digest", None)
    if isinstance(digest, str) and hasattr(dataset, "index"):
        from .cache import DecodedDataset

        whole = DecodedDataset(store, None)
        index = dataset.index
        positions = np.arange(len(whole)) if index is None else np.asarray(index, dtype=np.int64)
        return whole, positions, f"decoded:{digest}"
    return dataset, np.arange(len(dataset)), f"pixels:{pixels_digest(dataset)}"


class StoredOutputs:
    """The encoder outputs of a list of images, one float16 file each (``<folder>/<image digest>.npy``), read when an
    item is asked for: ``outputs[i]`` is row i's array."""

    def __init__(self, folder: Path, keys: list[str]) -> None:
        self.folder, self.keys = folder, list(keys)

    def __len__(self) -> int:
        return len(self.keys)

    def path(self, i: int) -> Path:
        return self.folder / f"{self.keys[i]}.npy"

    def __getitem__(self, i: int) -> np.ndarray:
        return np.load(self.path(int(i)), allow_pickle=False)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        stacked = np.stack([self[i] for i in range(len(self))]) if len(self) else np.zeros((0,), DTYPE)
        return stacked if dtype is None else stacked.astype(dtype)

    def unusable(self) -> list[int]:
        """Rows whose file is missing, truncated, not float16, or of another shape than most rows'."""
        shapes: dict[int, tuple] = {}
        for i in range(len(self)):
            try:
                array = np.load(self.path(i), mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError, EOFError):
                continue
            if array.dtype == DTYPE:
                shapes[i] = array.shape
        if not shapes:
            return list(range(len(self)))
        common = max(set(shapes.values()), key=list(shapes.values()).count)
        return [i for i in range(len(self)) if shapes.get(i) != common]


def _stored_outputs(
    whole: Dataset,
    encode: Callable[[torch.Tensor], torch.Tensor],
    identity: tuple,
    digest: str,
    cache_dir: Path,
    batch_size: int,
    device: torch.device,
    what: str,
) -> StoredOutputs | np.ndarray:
    """``whole``'s outputs from the cache folder: its list of image digests (made now when it is not there), each
    image's file, and the encoder run on the images whose file is not usable (then stored). In memory when the folder
    cannot be written."""
    folder = cache_dir / f"encoded-{entry_digest('encoder', FORMAT, identity)}"
    index = ArraySet(cache_dir, digest, ("encoded-index",))
    listed = index.load(lambda a: a["encoded-index"].shape == (len(whole),) and a["encoded-index"].dtype.kind == "S")
    if listed is not None:
        outputs = StoredOutputs(folder, [key.decode() for key in listed["encoded-index"]])
        if not outputs.unusable():
            return outputs
    else:
        outputs = StoredOutputs(folder, [image_digest(whole[i][0]) for i in range(len(whole))])
    missing = outputs.unusable()
    first = {}  # one row per missing image: a repeated image is encoded once
    for i in missing:
        first.setdefault(outputs.keys[i], i)
    rows = sorted(first.values())
    unstored: dict[str, np.ndarray] = {}  # outputs whose file could not be written, kept in memory instead
    problem: list[OSError] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem.append(exc)

    def keep(first_row: int, batch: np.ndarray) -> None:
        """Store a batch's outputs as soon as they exist, so an interrupted encode loses at most one batch."""
        for row, output in zip(rows[first_row : first_row + len(batch)], batch):
            if not problem:
                try:
                    write_atomic(outputs.path(row), output)
                    continue
                except OSError as exc:
                    problem.append(exc)
            unstored[outputs.keys[row]] = output

    if rows:
        found = f" ({len(whole) - len(missing)} of the {len(whole)} found in {folder})"
        _encode_logged(_Rows(whole, rows), encode, batch_size, device, what, found, keep)
    if not problem:
        try:
            index.store({"encoded-index": np.array(outputs.keys, dtype="S")})
        except OSError as exc:
            problem.append(exc)
    if problem:
        logger.warning("%s: encoder outputs not cached (%s); kept in memory", cache_dir, problem[0])
        return np.stack([unstored[key] if key in unstored else outputs[i] for i, key in enumerate(outputs.keys)])
    return outputs


class _Rows(Dataset):
    """The items of ``dataset`` at ``rows`` (its image size and task looked up through ``dataset``)."""

    def __init__(self, dataset: Dataset, rows: list[int]) -> None:
        self.dataset, self.rows = dataset, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.dataset[self.rows[i]]


def _encode_logged(
    dataset: Dataset,
    encode: Callable[[torch.Tensor], torch.Tensor],
    batch_size: int,
    device,
    what: str,
    found: str,
    keep: Callable[[int, np.ndarray], None] | None = None,
) -> np.ndarray | None:
    """``encode`` over ``dataset`` batch by batch: how far it is in the log at most every ``PROGRESS_SECONDS`` (an
    hour of encoding a large site is not silent), its total time at the end. ``keep(first row, outputs)`` takes each
    batch as it is made (then nothing is returned); without it the outputs are returned, in order."""
    named = f" of {what}" if what else ""
    start = last = time.perf_counter()
    chunks, done = [], 0
    for first_row, batch in encode_batches(dataset, encode, batch_size, device):
        if keep is None:
            chunks.append(batch)
        else:
            keep(first_row, batch)
        done += len(batch)
        now = time.perf_counter()
        if now - last >= PROGRESS_SECONDS and done < len(dataset):
            each = (now - start) / done
            logger.info(
                "frozen-encoder mode: %d of %d images%s encoded (%.2f s each, about %.0f min left)",
                done, len(dataset), named, each, each * (len(dataset) - done) / 60,
            )  # fmt: skip
            last = now
    seconds = time.perf_counter() - start
    logger.info(
        "frozen-encoder mode: encoded %d images%s in %.1f s (%.2f s each)%s",
        len(dataset), named, seconds, seconds / max(len(dataset), 1), found,
    )  # fmt: skip
    if keep is not None:
        return None
    return np.concatenate(chunks) if chunks else np.zeros((0,), DTYPE)


def encode_batches(
    dataset: Dataset, encode: Callable[[torch.Tensor], torch.Tensor], batch_size: int, device: torch.device
) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float16 encoder outputs) of each batch of ``dataset``, in order (no augmentation, fp32 compute)."""
    from .transforms import image_batch, normalise, target_img_size

    size = target_img_size(dataset)
    for start in range(0, len(dataset), batch_size):
        images = [dataset[i][0] for i in range(start, min(start + batch_size, len(dataset)))]
        x = normalise(image_batch(images, size)).to(device)
        with torch.no_grad():  # per batch: grad mode is not left off in the caller between batches
            out = encode(x).float().cpu().numpy().astype(DTYPE)
        yield start, out


class SplitView(Dataset):
    """A view of a site's split that the loader reads differently: the split's items, labels, task and image size
    (``transforms.target_*`` look through ``dataset`` for anything else)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.labels = getattr(dataset, "labels", None)
        self.task = getattr(dataset, "task", "classification")
        self.img_size = getattr(dataset, "img_size", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]


class EncodedDataset(SplitView):
    """Items ``(encoder output (float16), target)``: item i's output is ``outputs[positions[i]]``."""

    encoded = True
    augment = ""

    def __init__(self, dataset: Dataset, outputs: np.ndarray, positions: np.ndarray | None = None) -> None:
        super().__init__(dataset)
        self.outputs = outputs
        self.positions = np.arange(len(dataset)) if positions is None else np.asarray(positions, dtype=np.int64)

    def __getitem__(self, i: int):
        return np.array(self.outputs[int(self.positions[i])]), self.dataset[int(i)][1]


class BoxPrompts(SplitView):
    """A segmentation split whose batches carry their masks' boxes: the loader appends ``box_prompts`` box planes to
    x (``transforms.box_planes``), the prompts of LiteMedSAM's ``sam-prompt='box'``. Items are the wrapped split's."""

    def __init__(self, dataset: Dataset, structures: int) -> None:
        super().__init__(dataset)
        self.box_prompts = structures
