"""Local training and evaluation shared by every method."""

from .loops import ExtraLoss, OptimizerSpec, autocast, evaluate, pick_device, predict, train_epochs
from .metrics import auc_score, classification_metrics

__all__ = [
    "ExtraLoss", "OptimizerSpec", "autocast", "evaluate", "pick_device", "predict", "train_epochs",
    "auc_score", "classification_metrics",
]
