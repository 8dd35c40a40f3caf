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
