"""Segmentation metrics per structure (Dice, IoU, HD95 from MONAI), the empty-mask policy, multi-label targets, and
one short training + evaluation on a folder of nested masks (docs/data.md#segmentation-metrics)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import ndimage

from medflower.data import DataSpec, load_client_data, make_loader
from medflower.models import ModelSpec, build_model
from medflower.training import bce_dice_loss, evaluate, one_hot_masks
from medflower.training.loops import OptimizerSpec, train_epochs
from medflower.training.metrics import SegmentationScores, segmentation_scores


def square(size: int, top: int, left: int, side: int) -> np.ndarray:
    mask = np.zeros((size, size), bool)
    mask[top : top + side, left : left + side] = True
    return mask


def scipy_hd95(a: np.ndarray, b: np.ndarray) -> float:
    """Symmetric 95th-percentile distance between the edge pixels of two masks (scipy, independent of MONAI)."""
    edge_a, edge_b = a & ~ndimage.binary_erosion(a), b & ~ndimage.binary_erosion(b)
    a_to_b = ndimage.distance_transform_edt(~edge_b)[edge_a]
    b_to_a = ndimage.distance_transform_edt(~edge_a)[edge_b]
    return max(np.percentile(a_to_b, 95), np.percentile(b_to_a, 95))


def all_finite(metrics: dict) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


def test_per_structure_dice_and_iou_match_a_hand_computation():
    """Structure 0 (disc): 4x4 truth, prediction shifted 1 column (12 shared of 16 + 16): Dice 24/32, IoU 12/20.
    Structure 1 (cup): 2x2 truth, prediction 2x1 inside it: Dice 2*2/6, IoU 2/4."""
    target = np.stack([square(8, 2, 2, 4), square(8, 3, 3, 2)])[None]
    pred = np.stack([square(8, 2, 3, 4), square(8, 3, 3, 2) & (np.arange(8) == 3)[None, :]])[None]
    scores = segmentation_scores(pred, target)
    np.testing.assert_allclose(scores.dice[0], [24 / 32, 4 / 6], rtol=1e-6)
    np.testing.assert_allclose(scores.iou[0], [12 / 20, 2 / 4], rtol=1e-6)
    metrics = scores.metrics(["disc", "optic cup"])
    assert metrics["dice_disc"] == pytest.approx(0.75) and metrics["iou_optic_cup"] == pytest.approx(0.5)
    assert metrics["dice"] == pytest.approx((0.75 + 4 / 6) / 2)  # macro: mean over structures
    assert metrics["hd95_missed"] == 0.0 and "empty_fp" not in metrics  # every image has both structures
    assert all_finite(metrics)


def test_hd95_of_two_offset_squares_is_the_offset_and_matches_scipy():
    truth = square(24, 6, 6, 10)
    for d in (1, 2, 4):
        scores = segmentation_scores(np.roll(truth, d, axis=1)[None, None], truth[None, None])
        assert scores.hd95[0, 0] == pytest.approx(d)
    rng = np.random.default_rng(0)
    blobs = [ndimage.gaussian_filter(rng.random((40, 40)), 3) > 0.5 for _ in range(6)]
    pred, target = np.stack(blobs[:3])[:, None], np.stack(blobs[3:])[:, None]
    scores = segmentation_scores(pred, target)
    expected = [scipy_hd95(p[0], t[0]) for p, t in zip(pred, target)]
    np.testing.assert_allclose(scores.hd95[:, 0], expected, rtol=1e-5)
    assert scores.metrics()["hd95"] == pytest.approx(np.mean(expected), rel=1e-5)


def test_empty_ground_truth_skip_versus_one():
    """Image 0 has the lesion and finds half of it; image 1 has none but predicts some (a false positive);
    image 2 has none and predicts none."""
    lesion = square(8, 2, 2, 4)
    target = np.stack([lesion, np.zeros_like(lesion), np.zeros_like(lesion)])[:, None]
    pred = np.stack([lesion & (np.arange(8) < 4)[None, :], square(8, 0, 0, 2), np.zeros_like(lesion)])[:, None]
    skip = segmentation_scores(pred, target, "skip").metrics()
    one = segmentation_scores(pred, target, "one").metrics()
    assert skip["dice"] == pytest.approx(2 * 8 / 24)  # only image 0 is scored: no inflation by image 2
    assert one["dice"] == pytest.approx((2 * 8 / 24 + 0 + 1) / 3)
    assert skip["empty_fp"] == one["empty_fp"] == 0.5  # 1 of the 2 images without a lesion has a prediction
    assert skip["hd95"] == one["hd95"] == pytest.approx(2.0)  # HD95 only where both have foreground
    assert all_finite(skip) and all_finite(one)
    with pytest.raises(ValueError, match="empty_masks must be one of skip, one"):
        segmentation_scores(pred, target, "zero")


def test_a_metric_with_nothing_to_average_is_left_out_never_nan():
    """The cup is in no ground truth and a missed disc has no HD95: those means are left out."""
    target = np.zeros((2, 2, 8, 8), bool)
    target[:, 0, 2:6, 2:6] = True
    pred = np.zeros_like(target)
    pred[0, 0, 2:6, 2:6] = True  # image 1's disc is missed
    scores = segmentation_scores(pred, target)
    assert np.isnan(scores.hd95[1, 0]) and np.isnan(scores.dice[:, 1]).all()
    metrics = scores.metrics(["disc", "cup"])
    assert {"dice_cup", "iou_cup", "hd95_cup"}.isdisjoint(metrics)
    assert metrics["dice"] == metrics["dice_disc"] == 0.5 and metrics["hd95"] == metrics["hd95_disc"] == 0.0
    assert metrics["hd95_missed"] == 0.5 and metrics["empty_fp"] == 0.0
    assert all_finite(metrics)
    nothing = SegmentationScores.concat([segmentation_scores(np.zeros((1, 1, 4, 4)), np.zeros((1, 1, 4, 4)))])
    assert nothing.metrics() == {"empty_fp": 0.0}


def test_loss_takes_structure_planes_and_checks_their_number():
    planes = torch.zeros(2, 2, 8, 8, dtype=torch.int64)
    planes[:, 1, 1:7, 1:7] = 1  # disc
    planes[:, 0, 3:5, 3:5] = 1  # cup, inside the disc
    target = one_hot_masks(planes, 2)
    assert target.dtype == torch.float32 and torch.equal(target, planes.float())
    right = (target * 2 - 1) * 20.0
    assert bce_dice_loss(right, planes).item() < 1e-3
    logits = torch.zeros(2, 2, 8, 8, requires_grad=True)
    bce_dice_loss(logits, planes).backward()
    assert logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="the masks hold 2 structure planes but the model has 3 outputs"):
        one_hot_masks(planes, 3)


def nested_folder(root: Path, count: int = 10, size: int = 32) -> Path:
    """images/, masks-disc/, masks-cup/: a bright disc with a brighter cup inside; no cup on every fourth image."""
    rng = np.random.default_rng(1)
    for sub in ("images", "masks-disc", "masks-cup"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        top, left = rng.integers(2, 14, size=2)
        disc = square(size, top, left, 14)
        cup = square(size, top + 4, left + 4, 6) if i % 4 else np.zeros_like(disc)
        image = np.full((size, size), 30, np.uint8) + 100 * disc + 100 * cup + rng.integers(0, 20, (size, size))
        Image.fromarray(np.stack([image.astype(np.uint8)] * 3, axis=-1)).save(root / "images" / f"{i}.png")
        Image.fromarray(disc.astype(np.uint8) * 255).save(root / "masks-disc" / f"{i}.png")
        Image.fromarray(cup.astype(np.uint8) * 255).save(root / "masks-cup" / f"{i}.png")
    return root


def test_training_and_evaluation_on_nested_structures_report_per_structure_metrics(tmp_path):
    root = nested_folder(tmp_path / "drishti")
    spec = DataSpec(dataset=f"segfolder:{root}", partition="iid", img_size=32, val_fraction=0.1, test_fraction=0.3)
    data = load_client_data(spec, 0, 1)
    assert data.class_names == ["cup", "disc"]
    model = build_model(
        ModelSpec(adapter="bottleneck", img_size=32, patch_size=8, weights="none", task="segmentation"),
        data.num_classes,
    )
    x, y = next(iter(make_loader(data.train, batch_size=4, shuffle=True, seed=0)))
    assert y.shape == (4, 2, 32, 32)
    device = torch.device("cpu")
    train_epochs(
        model, make_loader(data.train, 4, True, 0), epochs=2, optimizer=OptimizerSpec("adamw", 3e-3), device=device
    )
    loader = make_loader(data.train, 8, False, 0)
    metrics = evaluate(model, loader, device, data.class_names)
    assert {"dice", "iou", "dice_cup", "dice_disc", "iou_cup", "iou_disc", "loss", "n"} <= set(metrics)
    assert all_finite(metrics) and 0 <= metrics["dice"] <= 1
    assert "empty_fp" in metrics  # some training images have no cup
    one = evaluate(model, loader, device, data.class_names, empty_masks="one")
    assert one["dice_disc"] == pytest.approx(metrics["dice_disc"])  # every image has a disc: no difference
    assert all_finite(one)
