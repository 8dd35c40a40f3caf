"""Tests of the decoded-image cache (medflower/data/cache.py): decode once, memory-map later, never serve bad files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import Dataset

from medflower.data import DataSpec, make_loader
from medflower.data import image_datasets as image_datasets_module
from medflower.data.cache import cache_key, decoded, file_identity
from medflower.data.sources import open_source


def manifest_of_16bit_images(folder: Path, count: int = 6) -> DataSpec:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["path,label"]
    for i in range(count):
        Image.fromarray(rng.integers(0, 4096, (24, 20), dtype=np.uint16)).save(folder / f"x{i}.png")
        lines.append(f"x{i}.png,{i % 2}")
    (folder / "manifest.csv").write_text("\n".join(lines) + "\n")
    return DataSpec(dataset=f"csv:{folder / 'manifest.csv'}", partition="iid", img_size=16)


def file_dataset(spec: DataSpec):
    source = open_source(spec)
    return source.dataset(np.arange(len(source)), 0, spec)


def items(dataset) -> list:
    return [dataset[i] for i in range(len(dataset))]


def same_items(a: list, b: list) -> bool:
    return all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b)) and len(a) == len(b)


def forbid_reading(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the image reader was called")

    monkeypatch.setattr(image_datasets_module, "read_rgb", refuse)


def test_second_load_reads_the_cache_not_the_files(tmp_path, monkeypatch):
    spec = manifest_of_16bit_images(tmp_path / "data")
    dataset = file_dataset(spec)
    key = cache_key(dataset, spec)
    first = decoded(dataset, str(tmp_path / "cache"), key)
    assert not first.cached_on_disk
    expected = items(dataset)
    assert same_items(items(first), expected)
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "cache").iterdir()) == ["images.npy", "labels.npy"]

    forbid_reading(monkeypatch)
    second = decoded(file_dataset(spec), str(tmp_path / "cache"), key)  # a later process: memory-mapped
    assert second.cached_on_disk and isinstance(second.store.images, np.memmap)
    assert same_items(items(second), expected)
    part = second.take(np.array([4, 1]))
    assert part.labels.tolist() == [0, 1] and np.array_equal(part[0][0], expected[4][0]) and part[1][1] == 1
    assert np.array_equal(part.take(np.array([1]))[0][0], expected[1][0])
    x, y = next(iter(make_loader(part, batch_size=2, shuffle=False, seed=0)))
    assert tuple(x.shape) == (2, 3, 16, 16) and y.tolist() == [0, 1]


def test_corrupt_or_foreign_cache_files_are_rebuilt(tmp_path, monkeypatch):
    spec = manifest_of_16bit_images(tmp_path / "data")
    dataset = file_dataset(spec)
    key, cache = cache_key(dataset, spec), tmp_path / "cache"
    expected = items(decoded(dataset, str(cache), key))
    images = next(cache.glob("*-images.npy"))
    labels = next(cache.glob("*-labels.npy"))

    images.write_bytes(images.read_bytes()[:-100])  # truncated
    rebuilt = decoded(file_dataset(spec), str(cache), key)
    assert not rebuilt.cached_on_disk and same_items(items(rebuilt), expected)
    assert decoded(file_dataset(spec), str(cache), key).cached_on_disk  # written again, whole

    images.write_bytes(b"garbage, not an npy file")
    assert not decoded(file_dataset(spec), str(cache), key).cached_on_disk

    np.save(labels, np.zeros(6, np.int64))  # the right length, other labels: not this dataset's rows
    assert not decoded(file_dataset(spec), str(cache), key).cached_on_disk
    np.save(images, np.zeros((6, 8, 8, 3), np.uint8))  # another image size
    np.save(labels, dataset.labels)
    assert not decoded(file_dataset(spec), str(cache), key).cached_on_disk

    rebuilt = decoded(file_dataset(spec), str(cache), key)
    assert same_items(items(rebuilt), expected)
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]  # temporary files renamed or removed
    forbid_reading(monkeypatch)
    assert same_items(items(decoded(file_dataset(spec), str(cache), key)), expected)


def test_key_follows_files_and_settings(tmp_path):
    spec = manifest_of_16bit_images(tmp_path / "data")
    dataset = file_dataset(spec)
    key = cache_key(dataset, spec)
    assert cache_key(dataset, DataSpec(**{**spec.__dict__, "intensity": "minmax"})) != key
    assert cache_key(dataset, DataSpec(**{**spec.__dict__, "img_size": 8})) != key
    path = tmp_path / "data" / "x0.png"
    before = file_identity([path])
    os.utime(path, ns=(1, 1))  # another modification time: the file may have changed
    assert file_identity([path]) != before and cache_key(dataset, spec) != key
    assert cache_key(open_source(DataSpec(synthetic_size=40)).dataset(np.arange(4), 0, DataSpec()), spec) is None


def test_without_a_folder_the_arrays_stay_in_memory(tmp_path, monkeypatch):
    spec = manifest_of_16bit_images(tmp_path / "data", count=4)
    dataset = file_dataset(spec)
    cached = decoded(dataset, "", cache_key(dataset, spec))
    expected = items(dataset)
    assert same_items(items(cached), expected)
    forbid_reading(monkeypatch)
    assert same_items(items(cached.take(np.arange(4))), expected)  # decoded once, shared by subsets
    assert not any(tmp_path.glob("**/*.npy"))


def test_an_unwritable_cache_folder_falls_back_to_memory(tmp_path):
    spec = manifest_of_16bit_images(tmp_path / "data", count=2)
    dataset = file_dataset(spec)
    (tmp_path / "taken").write_text("a file where the cache folder should be")
    cached = decoded(dataset, str(tmp_path / "taken"), cache_key(dataset, spec))
    with pytest.warns(UserWarning, match="cache not written"):
        assert same_items(items(cached), items(dataset))


class PlaneMasks(Dataset):
    """A lazily 'decoded' segmentation dataset with [K, S, S] plane masks that counts its reads."""

    task = "segmentation"

    def __init__(self, n: int = 5, img_size: int = 8) -> None:
        self.labels = np.arange(n) % 2
        self.img_size = img_size
        self.reads = 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        self.reads += 1
        image = np.full((self.img_size, self.img_size, 3), 10 * i, np.uint8)
        masks = np.zeros((2, self.img_size, self.img_size), np.uint8)
        masks[0, : i + 1] = 1
        masks[1, :i] = 1
        return image, masks

    def take(self, positions):
        raise AssertionError("the cache takes subsets itself")


def test_segmentation_masks_are_cached_too(tmp_path):
    source = PlaneMasks()
    first = decoded(source, str(tmp_path), ("planes", 1))
    expected = items(PlaneMasks())
    assert same_items(items(first), expected) and source.reads == 5
    again = PlaneMasks()
    second = decoded(again, str(tmp_path), ("planes", 1))
    assert second.cached_on_disk and second.task == "segmentation" and second.img_size == 8
    assert same_items(items(second.take(np.array([3, 0]))), [expected[3], expected[0]]) and again.reads == 0
    assert len(list(tmp_path.glob("*-masks.npy"))) == 1
    assert not decoded(PlaneMasks(), str(tmp_path), ("planes", 2)).cached_on_disk  # another key, another entry


@pytest.mark.parametrize("cache", ["folder", "memory"])
def test_loader_workers_started_by_spawn_serve_the_same_batches(tmp_path, cache):
    """A DataLoader worker of a spawned process is spawned too (``--parallel`` runs; forkserver is Python 3.14's
    default): it receives the dataset pickled. The store's lock made that a TypeError, and every site of a run on a
    GPU failed. A worker now maps the cache files again instead of receiving a copy of their pixels."""
    import pickle

    import torch

    spec = manifest_of_16bit_images(tmp_path / "data")
    dataset = file_dataset(spec)
    ready = decoded(dataset, str(tmp_path / "cache") if cache == "folder" else "", cache_key(dataset, spec))
    expected = items(ready)
    pickled = pickle.dumps(ready)
    assert same_items(items(pickle.loads(pickled)), expected)
    assert (len(pickled) < 4000) == (cache == "folder")  # six 16x16x3 images: 4.6 kB of pixels when copied
    batches = torch.utils.data.DataLoader(ready, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    plain = torch.utils.data.DataLoader(ready, batch_size=2)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, plain, strict=True))
