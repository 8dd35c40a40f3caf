"""Local training and evaluation shared by every method."""

from .loops import (
    PRECISIONS,
    DeviceError,
    ExtraLoss,
    OptimizerSpec,
    Step,
    StepLoss,
    autocast,
    available_devices,
    evaluate,
    evaluate_segmentation,
    pick_device,
    predict,
    task_step,
    train_epochs,
)
from .losses import bce_dice_loss, one_hot_masks, task_loss
from .metrics import auc_score, classification_metrics, segmentation_metrics, segmentation_scores

__all__ = [
    "PRECISIONS",
    "DeviceError",
    "ExtraLoss",
    "available_devices",
    "OptimizerSpec",
    "Step",
    "StepLoss",
    "autocast",
    "bce_dice_loss",
    "evaluate",
    "evaluate_segmentation",
    "one_hot_masks",
    "pick_device",
    "predict",
    "task_loss",
    "task_step",
    "train_epochs",
    "auc_score",
    "classification_metrics",
    "segmentation_metrics",
    "segmentation_scores",
]
