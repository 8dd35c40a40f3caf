"""Classification metrics from labels and predicted probabilities (scikit-learn); segmentation scores per image
and structure (Dice, IoU and HD95 from MONAI) and their means."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
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
    # One call over the present classes' indicator columns (sklearn's multilabel form, ``average=None``): the same
    # per-class scores as one call per class, with the input checks done once.
    scores = roc_auc_score(y_true[:, None] == present[None, :], probs[:, present], average=None)
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


def segmentation_metrics(
    dice: np.ndarray, iou: np.ndarray, class_names: list[str] | None = None, hd95: np.ndarray | None = None
) -> dict[str, float]:
    """Means of per-image scores ``[N, K]`` (NaN = not scored): per structure the mean over its scored images,
    overall ('dice', 'iou', 'hd95') the mean over structures of those means (macro); per structure too
    ('dice_<name>', ...) when there is more than one. A mean with nothing to average is left out, never NaN."""
    out: dict[str, float] = {}
    names = [metric_key(n) for n in class_names] if class_names else [f"class{c + 1}" for c in range(dice.shape[1])]
    for metric, scores in (("dice", dice), ("iou", iou), ("hd95", hd95)):
        if scores is None:
            continue
        per_structure = _column_means(scores)
        if np.isfinite(per_structure).any():
            out[metric] = float(np.nanmean(per_structure))
        if scores.shape[1] > 1:
            out.update({f"{metric}_{name}": float(m) for name, m in zip(names, per_structure) if np.isfinite(m)})
    return out


MAX_KEY_NAME = 40  # characters of a structure's name in a metric key (a reply's metric names are at most 64)


def metric_key(name: str) -> str:
    """A class or structure name as it appears in metric keys: spaces -> '_', at most ``MAX_KEY_NAME`` characters."""
    return name.replace(" ", "_")[:MAX_KEY_NAME]


def _column_means(scores: np.ndarray) -> np.ndarray:
    """Mean of each column over its finite entries; NaN for a column without one (no warning)."""
    scores = np.asarray(scores, dtype=np.float64)
    finite = np.isfinite(scores)
    counts = finite.sum(axis=0)
    sums = np.where(finite, scores, 0.0).sum(axis=0)
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


# ----------------------------------------------------------------------------- segmentation (MONAI)
EMPTY_MASK_POLICIES = ("skip", "one")


@dataclass
class SegmentationScores:
    """Per-image scores of binary structure masks, each ``[N, K]`` (image, structure); NaN = not scored.

    ``target_present`` / ``pred_present``: the ground truth / the prediction has foreground of the structure.
    """

    dice: np.ndarray
    iou: np.ndarray
    hd95: np.ndarray
    target_present: np.ndarray
    pred_present: np.ndarray

    @classmethod
    def concat(cls, parts: list[SegmentationScores]) -> SegmentationScores:
        """The scores of several batches, one after the other."""
        return cls(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("dice", "iou", "hd95", "target_present", "pred_present")
            )
        )

    def metrics(self, class_names: list[str] | None = None) -> dict[str, float]:
        """Dice, IoU, HD95 (``segmentation_metrics``) plus ``empty_fp``: of the images whose ground truth lacks a
        structure, the share where the prediction has some (mean over structures), and ``hd95_missed``: of the
        images whose ground truth has a structure, the share where the prediction has none (these have no HD95).
        Shares with no image to count are left out."""
        out = segmentation_metrics(self.dice, self.iou, class_names, self.hd95)
        absent = ~self.target_present
        for key, among, hit in (
            ("empty_fp", absent, self.pred_present & absent),
            ("hd95_missed", self.target_present, self.target_present & ~self.pred_present),
        ):
            counted = among.sum(axis=0)
            if counted.any():
                shares = hit.sum(axis=0)[counted > 0] / counted[counted > 0]
                out[key] = float(shares.mean())
        return out


def segmentation_scores(pred: np.ndarray, target: np.ndarray, empty_masks: str = "skip") -> SegmentationScores:
    """Per-image Dice, IoU and HD95 of boolean masks ``[N, K, H, W]`` (one binary plane per structure), computed by
    MONAI (``compute_dice``, ``compute_iou``, ``compute_hausdorff_distance`` with ``percentile=95``).

    HD95 is the symmetric 95th-percentile Hausdorff distance between the two masks' edge pixels, in pixels of the
    arrays given (the evaluated ``img-size``, not millimetres). It is scored only where prediction and ground truth
    both have foreground: with one of them empty it is undefined (MONAI gives inf or NaN); an empty prediction of a
    present structure is counted by ``hd95_missed`` instead (``SegmentationScores.metrics``).

    ``empty_masks`` says what an image whose ground truth lacks a structure scores for it:

    - ``'skip'``: nothing, it is left out of that structure's Dice and IoU (MONAI's ``ignore_empty=True``), so
      images without the structure do not inflate the mean; a false positive on them is counted in ``empty_fp``;
    - ``'one'``: Dice and IoU 1 when the prediction is empty too, 0 when it is not (MONAI's ``ignore_empty=False``;
      medflower's convention before the policy existed).
    """
    if empty_masks not in EMPTY_MASK_POLICIES:
        raise ValueError(f"empty_masks must be one of {', '.join(EMPTY_MASK_POLICIES)}, got {empty_masks!r}")
    import torch
    from monai.metrics import compute_dice, compute_hausdorff_distance, compute_iou

    pred, target = np.asarray(pred, dtype=bool), np.asarray(target, dtype=bool)
    if pred.shape != target.shape or pred.ndim != 4:
        raise ValueError(f"prediction {pred.shape} and ground truth {target.shape} must both be [N, K, H, W]")
    y_pred, y = torch.from_numpy(pred).float(), torch.from_numpy(target).float()
    ignore = empty_masks == "skip"
    dice = compute_dice(y_pred, y, include_background=True, ignore_empty=ignore).numpy().astype(np.float64)
    iou = compute_iou(y_pred, y, include_background=True, ignore_empty=ignore).numpy().astype(np.float64)
    target_present, pred_present = target.any(axis=(2, 3)), pred.any(axis=(2, 3))
    hd95 = np.full(dice.shape, np.nan)
    both = target_present & pred_present
    for k in np.flatnonzero(both.any(axis=0)):
        rows = np.flatnonzero(both[:, k])
        with warnings.catch_warnings():  # MONAI's deprecation notices about its own internals
            warnings.simplefilter("ignore", FutureWarning)
            distances = compute_hausdorff_distance(
                y_pred[rows, k : k + 1], y[rows, k : k + 1], include_background=True, percentile=95
            )
        hd95[rows, k] = distances[:, 0].numpy()
    return SegmentationScores(dice, iou, hd95, target_present, pred_present)
