"""Pictures of a run (docs/experiments.md#outputs): what a site's model predicts on a few of its own test images,
each site's final metrics as bars beside summary.md's curves, and the experiment runner's per-site table.

A site's pictures hold its images, so only the site writes them, into its own folder (``ClientRuntime.figures_dir``):
they never travel in a reply. Everything here draws with matplotlib's Agg backend and reads nothing but its
arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_PREFIX = "predictions-round-"


def sample_figure_name(rnd: int) -> str:
    """A site's picture of round ``rnd``: ``predictions-round-001.png``."""
    return f"{SAMPLE_PREFIX}{rnd:03d}.png"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def display_image(image: np.ndarray) -> np.ndarray:
    """A float [C, H, W] image in 0..255 (the model's input before normalisation) as matplotlib shows it: [H, W]
    grey or [H, W, 3] colour in 0..1."""
    image = np.clip(np.asarray(image, dtype=np.float32) / 255.0, 0.0, 1.0)
    if image.shape[0] == 3:
        return image.transpose(1, 2, 0)
    return image[0]


def image_dice(truth: np.ndarray, predicted: np.ndarray) -> float | None:
    """The mean Dice over the structures ([K, H, W] booleans) present in the ground truth or the prediction of one
    image; None when neither has any."""
    scores = []
    for t, p in zip(truth, predicted):
        total = int(t.sum()) + int(p.sum())
        if total:
            scores.append(2.0 * int(np.logical_and(t, p).sum()) / total)
    return float(np.mean(scores)) if scores else None


def plot_segmentation_samples(
    images: np.ndarray,
    truth: np.ndarray,
    predicted: np.ndarray,
    structures: Sequence[str],
    path: Path,
    title: str,
) -> None:
    """One panel per image ([N, C, H, W], 0..255): the ground truth's contour of every structure (solid) and the
    prediction's (dashed), one colour per structure ([N, K, H, W] booleans each), and the image's Dice."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    n, k = len(images), truth.shape[1]
    colours = plt.cm.tab10.colors
    fig, axes = plt.subplots(1, n, figsize=(2.6 * n, 3.2), squeeze=False)
    for i, ax in enumerate(axes[0]):
        image = display_image(images[i])
        ax.imshow(image, cmap="gray" if image.ndim == 2 else None, vmin=0.0, vmax=1.0, interpolation="nearest")
        for s in range(k):
            colour = colours[s % len(colours)]
            for mask, style in ((truth[i, s], "solid"), (predicted[i, s], "dashed")):
                if mask.any() and not mask.all():
                    ax.contour(mask.astype(float), levels=[0.5], colors=[colour], linestyles=style, linewidths=1.4)
        dice = image_dice(truth[i], predicted[i])
        ax.set_title(f"test image {i + 1}" + ("" if dice is None else f"\nDice {dice:.3f}"), fontsize=8)
        ax.set_axis_off()
    handles = [
        Line2D([], [], color=colours[s % len(colours)], lw=1.6, label=structures[s] if s < len(structures) else s)
        for s in range(k)
    ]
    handles += [
        Line2D([], [], color="black", lw=1.2, ls="solid", label="ground truth"),
        Line2D([], [], color="black", lw=1.2, ls="dashed", label="predicted"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_classification_samples(
    images: np.ndarray, labels: np.ndarray, probs: np.ndarray, class_names: Sequence[str], path: Path, title: str
) -> None:
    """One panel per image ([N, C, H, W], 0..255), titled with its true class, the predicted class and that
    class's probability (green when right, red when wrong)."""
    plt = _pyplot()

    def name(c: int) -> str:
        return str(class_names[c]) if 0 <= c < len(class_names) else f"class {c}"

    n = len(images)
    fig, axes = plt.subplots(1, n, figsize=(2.4 * n, 2.9), squeeze=False)
    for i, ax in enumerate(axes[0]):
        image = display_image(images[i])
        ax.imshow(image, cmap="gray" if image.ndim == 2 else None, vmin=0.0, vmax=1.0, interpolation="nearest")
        guess = int(np.argmax(probs[i]))
        ax.set_title(
            f"true: {name(int(labels[i]))}\npredicted: {name(guess)} ({probs[i][guess]:.2f})",
            fontsize=8,
            color="tab:green" if guess == int(labels[i]) else "tab:red",
        )
        ax.set_axis_off()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plot_site_bars(per_client: Mapping[str, Mapping[str, Any]], metrics: Sequence[str], path: Path, title: str) -> bool:
    """One panel per metric: each site's final value as a bar and the mean over sites as a dashed line. Metrics
    no site has a value of (pooled metrics) are left out; False (nothing written) when none is left."""
    metrics = [m for m in metrics if any(_number(v.get(m)) for v in per_client.values())]
    if not metrics:
        return False
    plt = _pyplot()
    sites = list(per_client)
    labelled = len(sites) <= 40  # beyond, the bars still show the spread; the names would not be readable
    width = min(max(3.2, 0.28 * len(sites) + 1.5), 12.0)
    fig, axes = plt.subplots(1, len(metrics), figsize=(width * len(metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        values = [per_client[s].get(metric) for s in sites]
        heights = [v if _number(v) else 0.0 for v in values]
        xs = np.arange(len(sites))
        ax.bar(xs, heights, color=["tab:blue" if _number(v) else "lightgrey" for v in values])
        present = [v for v in values if _number(v)]
        ax.axhline(float(np.mean(present)), color="black", ls="--", lw=1.2, label=f"mean {np.mean(present):.3f}")
        if labelled:
            ax.set_xticks(xs, sites, rotation=60 if len(sites) > 4 else 0, ha="right" if len(sites) > 4 else "center")
            ax.tick_params(axis="x", labelsize=7)
        else:
            ax.set_xticks([])
            ax.set_xlabel(f"{len(sites)} sites")
        ax.set_title(metric)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_per_site_table(
    per_client: Mapping[str, Mapping[str, Mapping[str, float | None]]], metrics: Sequence[str], path: Path, title: str
) -> bool:
    """The experiment runner's per-site table as heat maps, one per metric: a row per run, a column per site and
    the mean over sites, values written in the cells while they fit. ``per_client`` is comparison.json's:
    {run: {metric: {site: mean over seeds}}}. False (nothing written) when no metric has per-site values."""
    metrics = [m for m in metrics if any(row.get(m) for row in per_client.values())]
    if not metrics:
        return False
    plt = _pyplot()
    runs = list(per_client)
    fig_rows = []
    for metric in metrics:
        sites = sorted({s for row in per_client.values() for s in row.get(metric, {})})
        grid = np.full((len(runs), len(sites) + 1), np.nan)
        for r, run in enumerate(runs):
            values = [per_client[run].get(metric, {}).get(s) for s in sites]
            grid[r, : len(sites)] = [v if _number(v) else np.nan for v in values]
            present = [v for v in values if _number(v)]
            grid[r, -1] = np.mean(present) if present else np.nan
        fig_rows.append((metric, sites, grid))
    columns = max(len(sites) + 1 for _, sites, _ in fig_rows)
    width = min(max(5.0, 0.6 * columns + 2.5), 24.0)
    height = sum(max(1.6, 0.35 * len(runs) + 1.2) for _ in fig_rows)
    fig, axes = plt.subplots(len(fig_rows), 1, figsize=(width, height), squeeze=False)
    for ax, (metric, sites, grid) in zip(axes[:, 0], fig_rows):
        image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis")
        fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01)
        ax.axvline(len(sites) - 0.5, color="white", lw=2)
        labelled = len(sites) <= 40
        if labelled:
            ax.set_xticks(range(len(sites) + 1), [*sites, "mean"], rotation=60, ha="right", fontsize=7)
        else:
            ax.set_xticks([len(sites)], ["mean"], fontsize=7)
            ax.set_xlabel(f"{len(sites)} sites")
        ax.set_yticks(range(len(runs)), runs, fontsize=7)
        if grid.size <= 300:
            finite = grid[np.isfinite(grid)]
            middle = (finite.min() + finite.max()) / 2 if finite.size else 0.0
            for (r, c), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    colour = "black" if value > middle else "white"
                    ax.text(c, r, f"{value:.3f}", ha="center", va="center", fontsize=6, color=colour)
        ax.set_title(f"{metric} per site")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_site_figure(
    model,
    raw_split,
    loader,
    device,
    precision: str,
    class_names: Sequence[str],
    path: Path,
    title: str,
) -> None:
    """``model``'s predictions on the first batch of ``loader`` (a site's unshuffled test loader of a few images),
    drawn over the same images as ``raw_split`` holds them (before any encoder, resized to the run's size): the
    contours of each structure for a segmentation model, the class and its probability for a classifier."""
    import torch
    import torch.nn.functional as F

    from .data.transforms import image_batch, target_img_size
    from .training import one_hot_masks
    from .training.loops import autocast

    x, y = next(iter(loader))
    images = image_batch([raw_split[i][0] for i in range(len(y))], target_img_size(raw_split)).numpy()
    model.to(device).eval()
    with torch.no_grad(), autocast(device, precision):
        logits = model(x.to(device))
    logits = logits.float().cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    if getattr(model, "task", "classification") == "segmentation":
        if tuple(logits.shape[-2:]) != tuple(y.shape[-2:]):
            logits = F.interpolate(logits, size=tuple(y.shape[-2:]), mode="bilinear", align_corners=False)
        truth = one_hot_masks(y, logits.shape[1]).bool().numpy()
        if tuple(images.shape[-2:]) != tuple(truth.shape[-2:]):
            images = F.interpolate(torch.from_numpy(images), size=tuple(truth.shape[-2:]), mode="bilinear").numpy()
        plot_segmentation_samples(images, truth, (logits > 0).numpy(), class_names, path, title)
    else:
        probs = torch.softmax(logits, dim=1).numpy()
        plot_classification_samples(images, y.numpy(), probs, class_names, path, title)
