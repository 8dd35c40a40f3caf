"""Training-only augmentation (docs/data.md#augmentation): off by default and then byte-identical to the batches
before it existed, seeded, the same geometric transform for image and mask (class indices or K binary planes),
intensity jitter on the image only, never in an unshuffled (evaluation) loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from medflower.data import DataSpec, load_client_data, make_loader
from medflower.data.augment import Augmenter
from medflower.data.image_datasets import ArrayImageDataset, SegArrayDataset
from medflower.data.tasks import binary_task
from medflower.data.transforms import IMAGENET_MEAN, IMAGENET_STD, is_mask, masks_to_tensor, target_augment

MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def old_batch(batch, img_size):
    """The batch transform as it was before augmentation existed (a copy of its code), the reference for 'off'."""
    images, targets = zip(*batch)
    x = torch.from_numpy(np.stack([np.asarray(image) for image in images]))
    if x.ndim == 3:
        x = x.unsqueeze(-1)
    x = x.permute(0, 3, 1, 2).float()
    if tuple(x.shape[-2:]) != (img_size, img_size):
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", antialias=True, align_corners=False)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = (x / 255.0 - MEAN) / STD
    if isinstance(targets[0], np.ndarray) and targets[0].ndim >= 2:
        y = torch.from_numpy(np.stack(targets)).to(torch.int64)
        if tuple(y.shape[-2:]) != (img_size, img_size):
            y = F.interpolate(y[:, None].float(), size=(img_size, img_size), mode="nearest-exact")[:, 0]
        return x, y.to(torch.int64)
    return x, torch.as_tensor(targets, dtype=torch.int64)


def pixels(x: torch.Tensor) -> torch.Tensor:
    """Normalised batch -> 0..255 values of its first channel."""
    return ((x * STD + MEAN) * 255)[:, 0]


def blob_images(n=12, size=32, seed=0) -> np.ndarray:
    """uint8 (n, size, size) grayscale images of a few bright discs on a dark background (smooth shapes, so a
    threshold of the image is a mask with clean edges)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    images = np.full((n, size, size), 30, np.uint8)
    for image in images:
        for _ in range(3):
            cy, cx, r = rng.integers(4, size - 4, 2).tolist() + [int(rng.integers(3, 8))]
            image[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = 220
    return images


def seg_dataset(augment="", planes=False, size=32) -> SegArrayDataset:
    images = blob_images(size=size)
    masks = (images > 128).astype(np.uint8)
    if planes:  # two overlapping structures: the discs, and everything but the top-left quarter
        second = np.ones_like(masks)
        second[:, : size // 2, : size // 2] = 0
        masks = np.stack([masks, second], axis=1)
    dataset = SegArrayDataset(images, masks, np.zeros(len(images)), size)
    dataset.augment = augment
    return dataset


def batches(dataset, shuffle=True, seed=5, batch_size=4, epochs=1):
    loader = make_loader(dataset, batch_size, shuffle, seed)
    return [batch for _ in range(epochs) for batch in loader]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


# ---------------------------------------------------------------- off: exactly as before


@pytest.mark.parametrize("dataset", ["synthetic", "synthetic-seg"])
def test_off_by_default_and_identical_to_before(dataset):
    spec = DataSpec(dataset=dataset, synthetic_size=120, partition="iid", img_size=24, seed=3)
    assert spec.augment == ""
    train = load_client_data(spec, 0, 2).train
    for shuffle in (True, False):
        loader = make_loader(train, 8, shuffle, 5)
        raw = DataLoader(
            train,
            batch_size=8,
            shuffle=shuffle,
            drop_last=loader.drop_last,
            generator=torch.Generator().manual_seed(5),
            collate_fn=list,
        )  # the same items, uncollated
        got, items = list(loader), list(raw)
        assert len(got) == len(items)
        for (x, y), batch in zip(got, items):
            u, v = old_batch(batch, 24)
            assert torch.equal(x, u) and torch.equal(y, v)


def test_only_the_train_split_carries_the_setting():
    spec = DataSpec(dataset="synthetic", synthetic_size=120, partition="iid", img_size=16, augment="flip,rotate:10")
    data = load_client_data(spec, 0, 2)
    assert target_augment(data.train) == "flip,rotate:10"
    assert target_augment(data.val) == target_augment(data.test) == ""
    assert target_augment(binary_task(data.train, [0, 1], 1)) == "flip,rotate:10"  # through wrappers (.dataset)
    plain = load_client_data(DataSpec(dataset="synthetic", synthetic_size=120, partition="iid", img_size=16), 0, 2)
    assert same(batches(data.val, shuffle=True), batches(plain.val, shuffle=True))
    assert not same(batches(data.train), batches(plain.train))


# ---------------------------------------------------------------- seeded, per sample, training only


def test_same_seed_same_batches_other_seed_or_epoch_differs():
    dataset = seg_dataset("crop:0.7,flip,vflip,rotate:20,jitter:0.2")
    first = batches(dataset, seed=5)
    assert same(first, batches(dataset, seed=5))
    assert not same(first, batches(dataset, seed=6))
    plain = ArrayImageDataset(np.repeat(blob_images(1), 8, axis=0), np.arange(8), 32)  # 8 copies of one image
    plain.augment = "crop:0.7,rotate:30"
    (x1, y1), (x2, y2) = batches(plain, batch_size=8, epochs=2)
    x1, x2 = x1[torch.argsort(y1)], x2[torch.argsort(y2)]
    assert not torch.equal(x1, x2)  # the second epoch is augmented anew
    assert len({tuple(sample.flatten().tolist()) for sample in x1}) == 8  # every sample its own transform


def test_eval_loader_is_never_augmented():
    augmented, plain = seg_dataset("crop:0.6,flip,rotate:30,jitter:0.3"), seg_dataset("")
    assert same(batches(augmented, shuffle=False), batches(plain, shuffle=False))
    assert not same(batches(augmented), batches(plain))


# ---------------------------------------------------------------- image and mask stay aligned


def test_flips_move_image_and_mask_together_exactly():
    moved = 0
    for (x, y), (_, y0) in zip(batches(seg_dataset("flip,vflip")), batches(seg_dataset(""))):
        assert torch.equal((pixels(x) > 128).long(), y)
        moved += not torch.equal(y, y0)
    assert moved > 0


def test_crop_and_rotation_keep_the_mask_on_the_image():
    """A mask that is the thresholded image stays (up to the edge pixels where bilinear and nearest sampling
    differ) the thresholded augmented image; a mask moved by another transform would not."""
    agreement, unmoved = [], []
    for (x, y), (_, y0) in zip(batches(seg_dataset("crop:0.6,rotate:40")), batches(seg_dataset(""))):
        assert set(torch.unique(y).tolist()) <= {0, 1}
        agreement.append(((pixels(x) > 128).long() == y).float().mean().item())
        unmoved.append(((pixels(x) > 128).long() == y0).float().mean().item())
    assert min(agreement) > 0.95
    assert np.mean(agreement) > np.mean(unmoved) + 0.1  # the masks did move, with their images


def test_binary_planes_are_augmented_each_like_the_image():
    for (x, y), (_, y0) in zip(
        batches(seg_dataset("crop:0.7,flip,rotate:25", planes=True)), batches(seg_dataset("", planes=True))
    ):
        assert y.shape == y0.shape == (4, 2, 32, 32) and y.dtype == torch.int64
        assert ((pixels(x) > 128).long() == y[:, 0]).float().mean() > 0.95
        assert set(torch.unique(y).tolist()) <= {0, 1}
        assert ((y[:, 0] == 1) & (y[:, 1] == 1)).any()  # overlapping structures stay planes of their own
        assert not torch.equal(y[:, 1], y0[:, 1])  # the second plane moved too


def test_jitter_changes_the_image_only():
    for (x, y), (x0, y0) in zip(batches(seg_dataset("jitter:0.5")), batches(seg_dataset(""))):
        assert torch.equal(y, y0)
        assert not torch.equal(x, x0)
        assert pixels(x).min() >= -1e-3 and pixels(x).max() <= 255 + 1e-3  # clipped to 0..255


def test_augmenter_classification_batch_and_bad_masks():
    images = torch.from_numpy(blob_images(4)).float()[:, None]
    out, none = Augmenter("crop:0.5,vflip,jitter:0.1", 0)(images)
    assert out.shape == images.shape and none is None
    with pytest.raises(ValueError, match="masks of size"):
        Augmenter("flip", 0)(images, torch.zeros(4, 16, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown augmentation"):
        Augmenter("blur:1", 0)


# ---------------------------------------------------------------- masks as binary planes


def test_masks_to_tensor_and_is_mask_accept_planes():
    rng = np.random.default_rng(0)
    planes = [rng.integers(0, 2, (3, 8, 8), dtype=np.uint8) for _ in range(2)]
    y = masks_to_tensor(planes, 16)
    assert y.shape == (2, 3, 16, 16) and y.dtype == torch.int64
    for k in range(3):  # each plane resized on its own, like a class-index mask
        assert torch.equal(y[:, k], masks_to_tensor([p[k] for p in planes], 16))
    assert torch.equal(masks_to_tensor(planes, 8), torch.from_numpy(np.stack(planes)).long())
    assert is_mask(planes[0]) and is_mask(planes[0][0]) and not is_mask(np.int64(3))
