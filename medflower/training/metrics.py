"""Classification metrics from labels and predicted probabilities (scikit-learn)."""

from __future__ import annotations

import warnings

import numpy as np
from sklearn.metrics import accuracy_score, balanced_accuracy_score, roc_auc_score


def auc_score(y_true: np.ndarray, probs: np.ndarray) -> float:
    """Binary AUC, or macro one-vs-rest AUC over the classes present in ``y_true``.

    A client's test split often lacks some classes under label skew; sklearn's multi-class
    ``roc_auc_score`` then refuses, so each present class is scored one-vs-rest against
    the rest and the scores are averaged. NaN when fewer than two classes are present.
    """
    y_true = np.asarray(y_true)
    present = np.unique(y_true)
    if present.size < 2:
        return float("nan")
    if probs.shape[1] == 2:
        return float(roc_auc_score(y_true, probs[:, 1]))
    scores = [roc_auc_score(y_true == c, probs[:, c]) for c in present]
    return float(np.mean(scores))


def classification_metrics(y_true: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """accuracy, balanced accuracy and AUC of probability rows ``probs`` [N, C]."""
    pred = probs.argmax(axis=1)
    with warnings.catch_warnings():  # predicted classes absent from a small split are expected
        warnings.simplefilter("ignore", UserWarning)
        balanced = float(balanced_accuracy_score(y_true, pred))
    return {
        "accuracy": float(accuracy_score(y_true, pred)),
        "balanced_accuracy": balanced,
        "auc": auc_score(y_true, probs),
    }


def dice_iou_per_image(pred: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hard Dice and IoU of boolean masks ``[N, K, H, W]`` -> two ``[N, K]`` arrays.

    An image where a class is absent from both prediction and target scores 1 (nothing to find,
    nothing found), the convention of per-image Dice in Fed-Prostate/Fed-Polyp style evaluations.
    """
    pred, target = pred.astype(bool), target.astype(bool)
    inter = (pred & target).sum(axis=(2, 3)).astype(np.float64)
    p, t = pred.sum(axis=(2, 3)).astype(np.float64), target.sum(axis=(2, 3)).astype(np.float64)
    union = p + t - inter
    empty = (p + t) == 0
    dice = np.where(empty, 1.0, 2 * inter / np.maximum(p + t, 1))
    iou = np.where(empty, 1.0, inter / np.maximum(union, 1))
    return dice, iou


def segmentation_metrics(dice: np.ndarray, iou: np.ndarray, class_names: list[str] | None = None) -> dict[str, float]:
    """Mean Dice/IoU over images and classes; per class too when there is more than one class."""
    out = {"dice": float(dice.mean()), "iou": float(iou.mean())}
    if dice.shape[1] > 1:
        names = class_names or [f"class{c + 1}" for c in range(dice.shape[1])]
        for c, name in enumerate(names):
            key = name.replace(" ", "_")
            out[f"dice_{key}"] = float(dice[:, c].mean())
            out[f"iou_{key}"] = float(iou[:, c].mean())
    return out
