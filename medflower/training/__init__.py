"""Local training and evaluation shared by every method."""

from .loops import (
    ExtraLoss,
    OptimizerSpec,
    autocast,
    evaluate,
    evaluate_segmentation,
    pick_device,
    predict,
    train_epochs,
)
from .losses import bce_dice_loss, one_hot_masks, task_loss
from .metrics import auc_score, classification_metrics, segmentation_metrics, segmentation_scores

__all__ = [
    "ExtraLoss",
    "OptimizerSpec",
    "autocast",
    "bce_dice_loss",
    "evaluate",
    "evaluate_segmentation",
    "one_hot_masks",
    "pick_device",
    "predict",
    "task_loss",
    "train_epochs",
    "auc_score",
    "classification_metrics",
    "segmentation_metrics",
    "segmentation_scores",
]
