"""Classification metrics from labels and predicted probabilities (scikit-learn)."""

from __future__ import annotations

import warnings
from typing import Any

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


# ----------------------------------------------------------------------------- pooled over sites
CONFUSION = "confusion"  # a site's evaluation metric: its test split's C×C counts, flattened row-major


def confusion_counts(y_true: np.ndarray, pred: np.ndarray, num_classes: int) -> list[int]:
    """What leaves a site for the pooled metrics: C×C counts (row = true class, column = predicted class),
    flattened row-major; counts only, no per-sample output."""
    flat = np.asarray(y_true, dtype=np.int64) * num_classes + np.asarray(pred, dtype=np.int64)
    return [int(c) for c in np.bincount(flat, minlength=num_classes * num_classes)]


def check_confusion(values: Any, num_classes: int, n: Any = None) -> tuple[np.ndarray | None, str | None]:
    """A node's confusion counts as a [C, C] int64 matrix, or (None, why not): they must be C×C non-negative
    finite integers adding up to the site's reported test size ``n`` (when it reports one)."""
    if not isinstance(values, (list, tuple)):
        return None, f"confusion counts are a {type(values).__name__}, not a list"
    if len(values) != num_classes * num_classes:
        return None, f"{len(values)} confusion counts, expected {num_classes}×{num_classes} = {num_classes**2}"
    if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
        return None, "confusion counts are not numbers"
    counts = np.asarray(values, dtype=np.float64)
    if (
        not np.isfinite(counts).all()
        or (counts < 0).any()
        or (counts >= 2**53).any()
        or (counts != np.round(counts)).any()
    ):
        return None, "confusion counts must be non-negative finite integers (below 2^53)"
    if isinstance(n, (int, float)) and counts.sum() != n:
        return None, f"confusion counts add up to {counts.sum():.0f}, but the site reports n = {n}"
    return counts.astype(np.int64).reshape(num_classes, num_classes), None


def pooled_metrics(confusion: np.ndarray) -> dict[str, float]:
    """Accuracy and balanced accuracy on the union of the sites' test splits from their summed [C, C] counts
    (SiFT's evaluation metric): trace / total, and the mean over classes with test samples of recall
    TP_c / support_c (sklearn's ``balanced_accuracy_score`` on the concatenated predictions)."""
    support = confusion.sum(axis=1)
    present = support > 0
    recall = np.diag(confusion)[present] / support[present]
    return {
        "pooled_balanced_accuracy": float(recall.mean()),
        "pooled_accuracy": float(np.trace(confusion) / support.sum()),
        "pooled_n": float(support.sum()),
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
