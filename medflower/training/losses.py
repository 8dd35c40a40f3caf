"""Task losses: cross-entropy for classification, BCE + soft Dice for segmentation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DICE_EPS = 1.0  # smoothing of the soft Dice loss (per image and class), the usual +1


def one_hot_masks(masks: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Float targets ``[B, K, H, W]``, one binary plane per structure, ``K = num_classes`` (the model's outputs).

    Class-index masks ``[B, H, W]`` (0 = background) give the planes of classes 1..K; masks that already are
    planes ``[B, K, H, W]`` (structures that may overlap or nest, docs/data.md#masks) pass through as float.
    ValueError when the planes are not ``num_classes``.
    """
    if masks.ndim == 4:
        if masks.shape[1] != num_classes:
            raise ValueError(
                f"the masks hold {masks.shape[1]} structure planes but the model has {num_classes} "
                f"outputs (masks {tuple(masks.shape)}); run-config num-classes must be the number of "
                "structures"
            )
        return masks.float()
    if masks.ndim != 3:
        raise ValueError(f"masks must be [B, H, W] class indices or [B, K, H, W] planes, got {tuple(masks.shape)}")
    classes = torch.arange(1, num_classes + 1, device=masks.device).view(1, -1, 1, 1)
    return (masks.unsqueeze(1) == classes).float()


def bce_dice_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Mean per-pixel BCE plus (1 - soft Dice) averaged over images and foreground classes."""
    target = one_hot_masks(masks, logits.shape[1])
    bce = F.binary_cross_entropy_with_logits(logits, target)
    probs = torch.sigmoid(logits)
    inter = (probs * target).sum(dim=(2, 3))
    total = probs.sum(dim=(2, 3)) + target.sum(dim=(2, 3))
    dice = (2 * inter + DICE_EPS) / (total + DICE_EPS)
    return bce + (1 - dice).mean()


def task_loss(task: str, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss of ``task`` (``classification`` or ``segmentation``)."""
    if task == "segmentation":
        return bce_dice_loss(logits.float(), targets)
    return F.cross_entropy(logits.float(), targets)
