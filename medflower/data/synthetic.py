"""Synthetic image pool: oriented gratings per class, rendered in a per-site acquisition style.

Class ``c`` is a sine grating with a class-specific orientation and spatial frequency
(4 orientations x 2 frequencies for 8 classes). Every sample jitters angle, frequency,
phase and contrast and carries a random distractor blob, so the task is learnable but not
trivial. How a sample *looks* depends on the partition that holds it: brightness,
contrast, gamma, blur, colour tint and noise level are drawn from ``(seed, partition_id)``,
which gives feature shift between sites on top of any label skew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.ndimage import gaussian_filter

MAX_RENDER_SIZE = 64  # larger img_size is reached by resizing in the batch transform
_POOL_TAG, _STYLE_TAG, _NOISE_TAG = 1701, 1702, 1703  # keep the random streams apart
_RENDER_CHUNK = 512


@dataclass(frozen=True)
class SyntheticPool:
    """Per-sample parameters of the synthetic pool (images are rendered per client)."""

    labels: np.ndarray  # int64 (N,)
    angle: np.ndarray  # radians, class angle + jitter
    cycles: np.ndarray  # grating cycles per image width
    phase: np.ndarray
    amplitude: np.ndarray
    blob_xy: np.ndarray  # (N, 2) centre in [0, 1]
    blob_radius: np.ndarray
    blob_strength: np.ndarray  # signed
    class_names: tuple[str, ...]


@dataclass(frozen=True)
class SiteStyle:
    """Acquisition style of one site (partition)."""

    brightness: float
    contrast: float
    gamma: float
    blur_sigma: float  # in pixels at 32 px, scaled with the render size
    noise_std: float
    tint: tuple[float, float, float]


def class_patterns(num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(angle in radians, cycles per image) of each class's grating."""
    num_freqs = math.ceil(num_classes / 4)
    num_angles = math.ceil(num_classes / num_freqs)  # <= 4
    freqs = np.geomspace(2.0, 6.0, num_freqs) if num_freqs > 1 else np.array([3.0])
    cls = np.arange(num_classes)
    return (cls % num_angles) * (np.pi / num_angles), freqs[cls // num_angles]


@lru_cache(maxsize=8)
def synthetic_pool(seed: int, size: int, num_classes: int) -> SyntheticPool:
    """Balanced pool of ``size`` samples; deterministic from ``seed``."""
    rng = np.random.default_rng([_POOL_TAG, seed])
    labels = rng.permutation(np.arange(size) % num_classes).astype(np.int64)
    class_angle, class_cycles = class_patterns(num_classes)
    max_jitter = np.deg2rad(6.0)  # orientations are >= 45 degrees apart
    pool = SyntheticPool(
        labels=labels,
        angle=class_angle[labels] + rng.uniform(-max_jitter, max_jitter, size),
        cycles=class_cycles[labels] * rng.uniform(0.9, 1.1, size),
        phase=rng.uniform(0, 2 * np.pi, size),
        amplitude=rng.uniform(0.5, 1.0, size),
        blob_xy=rng.uniform(0.15, 0.85, (size, 2)),
        blob_radius=rng.uniform(0.08, 0.18, size),
        blob_strength=rng.choice([-1.0, 1.0], size) * rng.uniform(0.15, 0.4, size),
        class_names=tuple(f"class-{c}" for c in range(num_classes)),
    )
    for array in (
        pool.labels,
        pool.angle,
        pool.cycles,
        pool.phase,
        pool.amplitude,
        pool.blob_xy,
        pool.blob_radius,
        pool.blob_strength,
    ):
        array.setflags(write=False)
    return pool


def site_style(seed: int, partition_id: int) -> SiteStyle:
    """Acquisition style of partition ``partition_id``; deterministic from ``seed``."""
    rng = np.random.default_rng([_STYLE_TAG, seed, partition_id])
    return SiteStyle(
        brightness=float(rng.uniform(-0.15, 0.15)),
        contrast=float(rng.uniform(0.6, 1.1)),
        gamma=float(np.exp(rng.uniform(np.log(0.7), np.log(1.4)))),
        blur_sigma=float(rng.uniform(0.0, 1.2)),
        noise_std=float(rng.uniform(0.02, 0.10)),
        tint=tuple(float(t) for t in 1.0 + rng.uniform(-0.15, 0.15, 3)),
    )


def render(
    pool: SyntheticPool, rows: np.ndarray, style: SiteStyle, size: int, noise_key: tuple[int, ...]
) -> np.ndarray:
    """Images of pool ``rows`` in ``style`` as uint8 (n, size, size, 3); noise seeded by ``noise_key``."""
    rng = np.random.default_rng([_NOISE_TAG, *noise_key])
    out = np.empty((len(rows), size, size, 3), dtype=np.uint8)
    for start in range(0, len(rows), _RENDER_CHUNK):
        chunk = rows[start : start + _RENDER_CHUNK]
        out[start : start + len(chunk)] = _render_chunk(pool, chunk, style, size, rng)
    return out


def _render_chunk(
    pool: SyntheticPool, rows: np.ndarray, style: SiteStyle, size: int, rng: np.random.Generator
) -> np.ndarray:
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size
    x, y = coords[None, None, :], coords[None, :, None]

    def per_sample(values: np.ndarray) -> np.ndarray:
        return values[rows].astype(np.float32)[:, None, None]

    angle = per_sample(pool.angle)
    along = x * np.cos(angle) + y * np.sin(angle)
    gray = 0.5 + 0.4 * per_sample(pool.amplitude) * np.sin(
        2 * np.pi * per_sample(pool.cycles) * along + per_sample(pool.phase)
    )
    blob_x, blob_y = (pool.blob_xy[rows, i].astype(np.float32)[:, None, None] for i in (0, 1))
    dist2 = (x - blob_x) ** 2 + (y - blob_y) ** 2
    gray += per_sample(pool.blob_strength) * np.exp(-dist2 / (2 * per_sample(pool.blob_radius) ** 2))
    return apply_style(gray, style, size, rng)


def apply_style(gray: np.ndarray, style: SiteStyle, size: int, rng: np.random.Generator) -> np.ndarray:
    """Grey images (n, size, size), about [0, 1], in a site's ``style`` -> uint8 (n, size, size, 3)."""
    if style.blur_sigma > 0:
        sigma = style.blur_sigma * size / 32
        gray = gaussian_filter(gray, sigma=(0, sigma, sigma), mode="reflect")
    gray = np.clip(0.5 + style.contrast * (gray - 0.5) + style.brightness, 0.0, 1.0) ** style.gamma
    rgb = gray[..., None] * np.asarray(style.tint, dtype=np.float32)
    rgb += rng.normal(0.0, style.noise_std, gray.shape + (1,)).astype(np.float32)
    return np.rint(np.clip(rgb, 0.0, 1.0) * 255).astype(np.uint8)
