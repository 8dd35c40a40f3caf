"""Frozen-encoder mode: each site computes its images' encoder outputs once and keeps them beside the decode cache.

When nothing inside the encoder trains (``adapter='none'``: only the head or the segmentation decoder trains), the
encoder's output for an image never changes during a run, so training and evaluation need only the task module:
``encoded(dataset, encode, ...)`` runs ``encode`` over a split once, batch by batch, and gives a dataset of
``(encoder output, target)`` items. A round then costs what trains (docs/models.md#frozen-encoder-mode).

With a ``cache_dir`` the outputs are written there as ``<digest>-encoded.npy`` (float16, to temporary files renamed
into place, as the decode cache writes, ``cache.ArraySet``) and memory-mapped by later processes. ``<digest>``
names everything that changes the outputs: a digest of the encoder's tensors (``module_digest``: its weights,
whatever file they came from), the input normalisation, the image size, the images (for a site's decoded data the
decode cache's digest of its files and decode settings, so all its splits and seeds share one entry; for data held
in memory a digest of the decoded pixels) and the storage format. Augmentation never applies (the
mode is off when the run augments). A cache file that is missing, truncated or of the wrong shape is rebuilt.

Float16 storage halves the disk and page cache (LiteMedSAM's 256×64×64 embedding: 2 MiB an image); the decoder reads
them back as float32. The rounding (relative 2^-11) is far below what training changes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .cache import ArraySet, entry_digest

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the layout of the stored outputs changes
DTYPE = np.float16


def module_digest(module: torch.nn.Module) -> str:
    """Digest of a module's parameters and buffers (names, shapes, dtypes, values): the encoder's identity."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in module.state_dict().items():
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{tuple(value.shape)}\0{value.dtype}\n".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def pixels_digest(dataset: Dataset) -> str:
    """Digest of every item's decoded image, in order (what the encoder reads)."""
    digest = hashlib.blake2b(digest_size=16)
    for i in range(len(dataset)):
        image = np.ascontiguousarray(dataset[i][0])
        digest.update(f"{image.shape}\0{image.dtype}\n".encode())
        digest.update(image.tobytes())
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
    encoded once and named by the decode cache's digest (its files and decode settings): every split, seed and
    strategy of that site shares them."""
    whole, positions, content = _whole(dataset)
    digest = entry_digest("encoded", FORMAT, identity, content, len(whole))
    outputs = None if cache_dir else _MEMORY.get(digest)
    if outputs is None:
        outputs = _outputs(whole, encode, digest, cache_dir, batch_size, device, what)
    if not cache_dir:
        if len(_MEMORY) >= 8:
            _MEMORY.pop(next(iter(_MEMORY)))
        _MEMORY[digest] = outputs
    return EncodedDataset(dataset, outputs, positions)


# Without a cache folder: digest -> outputs in this process's memory, so a site's three splits (and its later
# messages) encode its rows once. With one, each call memory-maps the checked file instead.
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


def _outputs(
    whole: Dataset,
    encode: Callable[[torch.Tensor], torch.Tensor],
    digest: str,
    cache_dir: str,
    batch_size: int,
    device: torch.device,
    what: str,
) -> np.ndarray:
    """The stored outputs of ``whole`` when the cache folder has them, else encoded now (and stored)."""
    entry = ArraySet(Path(cache_dir), digest, ("encoded",)) if cache_dir else None
    if entry is not None:
        arrays = entry.load(lambda a: a["encoded"].shape[:1] == (len(whole),) and a["encoded"].dtype == DTYPE)
        if arrays is not None:
            return arrays["encoded"]
    start = time.perf_counter()
    outputs = run_encoder(whole, encode, batch_size, device)
    seconds = time.perf_counter() - start
    logger.info(
        "frozen-encoder mode: encoded %d images%s in %.1f s (%.2f s each)%s",
        len(whole), f" of {what}" if what else "", seconds, seconds / max(len(whole), 1),
        f", kept in {cache_dir}" if entry else "",
    )  # fmt: skip
    if entry is not None:
        try:
            entry.store({"encoded": outputs})
            stored = entry.load()
            if stored is not None:
                return stored["encoded"]
        except OSError as exc:
            logger.warning("%s: encoder outputs not cached (%s); kept in memory", cache_dir, exc)
    return outputs


@torch.no_grad()
def run_encoder(
    dataset: Dataset, encode: Callable[[torch.Tensor], torch.Tensor], batch_size: int, device: torch.device
) -> np.ndarray:
    """float16 encoder outputs of every image of ``dataset``, in order (no augmentation, fp32 compute)."""
    from .transforms import image_batch, normalise, target_img_size

    size = target_img_size(dataset)
    chunks = []
    for start in range(0, len(dataset), batch_size):
        images = [dataset[i][0] for i in range(start, min(start + batch_size, len(dataset)))]
        x = normalise(image_batch(images, size)).to(device)
        chunks.append(encode(x).float().cpu().numpy().astype(DTYPE))
    return np.concatenate(chunks)


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
