"""The segmentation model (encoder + adapters + light decoder), its loss and its Dice/IoU metrics."""

import numpy as np
import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from medflower.models import (
    AdaptedSegmenter,
    Bottleneck,
    ModelError,
    ModelSpec,
    adapter_modules,
    build_model,
    lowest_adapter_names,
)
from medflower.training import bce_dice_loss, evaluate, one_hot_masks, segmentation_metrics, segmentation_scores
from medflower.training.loops import OptimizerSpec, train_epochs

SEG = dict(img_size=32, patch_size=8, weights="none", task="segmentation")


def test_segmenter_predicts_full_resolution_masks_and_trains_only_adapters_and_decoder():
    model = build_model(ModelSpec(adapter="bottleneck", **SEG), 2)
    assert isinstance(model, AdaptedSegmenter)
    out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 2, 32, 32)
    names = model.trainable_names()
    assert all(n.startswith("backbone.") and ".adapter_" in n or n.startswith("decoder.") for n in names)
    assert any(n.startswith("decoder.") for n in names)
    trainable = {id(p) for p in model.trainable_parameters().values()}
    for name, p in model.named_parameters():
        assert p.requires_grad == (id(p) in trainable), name
    assert not list(model.decoder.buffers()), "no running statistics outside the exchanged arrays"
    assert model.features(torch.randn(2, 3, 32, 32)).shape == (2, 192)


def test_segmenter_build_is_deterministic_and_arrays_round_trip():
    a, b = (build_model(ModelSpec(adapter="lora", **SEG), 1) for _ in range(2))
    for (ka, va), (kb, vb) in zip(a.get_trainable().items(), b.get_trainable().items()):
        assert ka == kb
        np.testing.assert_array_equal(va, vb)
    new = {k: np.full_like(v, 0.01) for k, v in a.get_trainable().items()}
    a.set_trainable(new)
    x = torch.randn(1, 3, 32, 32)
    assert not torch.allclose(a(x), b(x))
    b.set_trainable(new)
    torch.testing.assert_close(a(x), b(x))


def test_segmentation_needs_a_vit_or_swin_encoder():
    with pytest.raises(ModelError, match="ViT or Swin encoder"):
        build_model(ModelSpec(backbone="resnet18", adapter="lora", img_size=32, weights="none", task="segmentation"), 1)
    with pytest.raises(ModelError, match="task"):
        ModelSpec(task="detection")


@pytest.mark.parametrize(
    "adapter, unit", [("bottleneck", Bottleneck), ("lora", BaseTunerLayer), ("ia3", BaseTunerLayer)]
)
def test_grouping_by_name_matches_the_adapter_modules(adapter, unit):
    """LAT selects adapters by name; the groups must be exactly the parameters of each adapter module."""
    model = build_model(ModelSpec(adapter=adapter, **SEG), 1)
    by_module = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, unit):
            params = {
                f"{mod_name}.{n}".replace(".default", "") for n, p in module.named_parameters() if p.requires_grad
            }
            if params:
                by_module[mod_name] = params
    groups = adapter_modules(model.trainable_names())
    assert {k: set(v) for k, v in groups.items()} == by_module
    # forward order: block 0 first; inside a block the attention-side adapter first
    assert list(groups)[0].startswith("backbone.blocks.0.")
    assert set(lowest_adapter_names(model.trainable_names(), 1)) == set(next(iter(groups.values())))


def test_dice_and_iou_per_image():
    pred = np.zeros((3, 1, 4, 4), bool)
    target = np.zeros((3, 1, 4, 4), bool)
    pred[0, 0, 0, :2] = True  # 2 predicted pixels
    target[0, 0, 0, 1:4] = True  # 3 true pixels, 1 shared
    pred[1, 0] = target[1, 0] = True  # perfect
    # image 2: empty prediction and empty target, scored 1 under empty-masks='one' and left out under 'skip'
    scores = segmentation_scores(pred, target, "one")
    dice, iou = scores.dice, scores.iou
    assert np.isnan(segmentation_scores(pred, target, "skip").dice[2, 0])
    np.testing.assert_allclose(dice[:, 0], [2 * 1 / 5, 1.0, 1.0])
    np.testing.assert_allclose(iou[:, 0], [1 / 4, 1.0, 1.0])
    metrics = segmentation_metrics(np.array([[0.5, 1.0]]), np.array([[0.25, 1.0]]), ["disc", "optic cup"])
    assert metrics == {
        "dice": 0.75,
        "iou": 0.625,
        "dice_disc": 0.5,
        "iou_disc": 0.25,
        "dice_optic_cup": 1.0,
        "iou_optic_cup": 1.0,
    }


def test_bce_dice_loss_is_small_for_a_confident_right_answer_and_has_gradients():
    masks = torch.zeros(2, 8, 8, dtype=torch.int64)
    masks[:, 2:5, 2:5] = 1
    masks[1, 6:, 6:] = 2
    target = one_hot_masks(masks, 2)
    assert target.shape == (2, 2, 8, 8) and target[1, 1].sum() == 4 and target[0, 1].sum() == 0
    right = (target * 2 - 1) * 20.0
    assert bce_dice_loss(right, masks).item() < 1e-3
    logits = torch.zeros(2, 2, 8, 8, requires_grad=True)
    loss = bce_dice_loss(logits, masks)
    assert loss.item() > 0.5
    loss.backward()
    assert logits.grad.abs().sum() > 0


class _Oracle(nn.Module):
    """Outputs logits that reproduce the mask it is given inside the batch (channel 0 of x)."""

    task = "segmentation"

    def forward(self, x):
        mask = x[:, 0].round().long()
        return (one_hot_masks(mask, 2) * 2 - 1) * 10


def test_evaluate_reports_dice_iou_per_class():
    masks = torch.zeros(4, 8, 8, dtype=torch.int64)
    masks[:, :4] = 1
    masks[:2, 6:, :] = 2
    x = masks[:, None].float().expand(-1, 3, -1, -1)
    loader = [(x, masks)]
    metrics = evaluate(_Oracle(), loader, torch.device("cpu"), ["ellipse", "rectangle"])
    assert metrics["dice"] == 1.0 and metrics["iou"] == 1.0 and metrics["dice_rectangle"] == 1.0
    assert metrics["n"] == 4


class _Shifted(nn.Module):
    """Predicts the mask given in channel 0 of x moved two columns right: half of each 4-wide object is hit."""

    task = "segmentation"

    def forward(self, x):
        mask = torch.roll(x[:, 0].round().long(), shifts=2, dims=2)
        return (one_hot_masks(mask, 2) * 2 - 1) * 10


def test_evaluate_gives_the_hand_computed_dice_and_iou():
    """Image 0: class 1 is a 4x4 square, predicted half right (Dice 2*8/32 = 0.5, IoU 8/24); class 2 absent
    in target and prediction (1 with empty-masks 'one'). Image 1: class 1 the same; class 2 a 2x2 bar, shifted
    off by two columns (Dice 0, IoU 0). Means with 'one': class 1 0.5, class 2 0.5; IoU 1/3 and 0.5. With
    'skip' (the default) image 0 does not score class 2: its Dice and IoU are image 1's, 0."""
    masks = torch.zeros(2, 8, 8, dtype=torch.int64)
    masks[:, 0:4, 0:4] = 1
    masks[1, 6:8, 4:6] = 2
    x = masks[:, None].float().expand(-1, 3, -1, -1)
    metrics = evaluate(_Shifted(), [(x, masks)], torch.device("cpu"), ["square", "bar"], empty_masks="one")
    assert metrics["dice_square"] == pytest.approx(0.5) and metrics["iou_square"] == pytest.approx(1 / 3)
    assert metrics["dice_bar"] == pytest.approx(0.5) and metrics["iou_bar"] == pytest.approx(0.5)
    assert metrics["dice"] == pytest.approx(0.5) and metrics["iou"] == pytest.approx((1 / 3 + 0.5) / 2)
    skip = evaluate(_Shifted(), [(x, masks)], torch.device("cpu"), ["square", "bar"])
    assert skip["dice_square"] == pytest.approx(0.5) and skip["dice_bar"] == 0.0 and skip["iou_bar"] == 0.0
    assert skip["dice"] == pytest.approx(0.25) and skip["empty_fp"] == 0.0


def test_segmenter_learns_a_fixed_mask():
    """A few steps on one batch: the training loop uses BCE + Dice for segmentation models."""
    model = build_model(ModelSpec(adapter="bottleneck", **SEG), 1)
    x = torch.randn(8, 3, 32, 32)
    masks = torch.zeros(8, 32, 32, dtype=torch.int64)
    masks[:, 8:24, 8:24] = 1
    before = evaluate(model, [(x, masks)], torch.device("cpu"))["dice"]
    train_epochs(model, [(x, masks)] * 30, epochs=1, optimizer=OptimizerSpec("adamw", 3e-3), device=torch.device("cpu"))
    after = evaluate(model, [(x, masks)], torch.device("cpu"))
    assert after["dice"] > max(before, 0.8), (before, after)
