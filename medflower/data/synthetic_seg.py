"""Synthetic segmentation pool: an organ-like ellipse and a lesion-like rectangle on textured backgrounds.

Class 1 ("ellipse") is a large ellipse with random centre, axes and rotation. Class 2
("rectangle") is a smaller rotated rectangle drawn on top of it (it wins where they overlap),
present in ``RECTANGLE_PROBABILITY`` of the images and mostly inside the ellipse. The background
is a smooth random texture (a few low-frequency gratings and a faint blob per sample).

Geometry, and so the masks, depend only on ``seed`` and the row. How a site renders them
depends on its style id (the partition id unless chosen explicitly): the acquisition style of
``synthetic.site_style`` (brightness, contrast, gamma, blur, noise, tint) plus a ``SegLook``
drawn from its own stream keyed by ``(seed, style_id)``: the grey levels of background and
objects (polarity: a bright ellipse with a dark lesion or the reverse; neighbouring style ids
always have opposite polarity), object texture, background texture strength and edge softness.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from .synthetic import MAX_RENDER_SIZE, SiteStyle, apply_style, site_style

CLASS_NAMES = ("ellipse", "rectangle")  # foreground classes 1 and 2; 0 is background
RECTANGLE_PROBABILITY = 0.8
NUM_WAVES = 3  # background gratings per sample
_POOL_TAG, _LOOK_TAG, _NOISE_TAG = 1801, 1802, 1803  # keep the random streams apart
_RENDER_CHUNK = 256

__all__ = [
    "CLASS_NAMES",
    "MAX_RENDER_SIZE",
    "SegLook",
    "SegPool",
    "render",
    "render_site",
    "seg_look",
    "seg_pool",
    "write_segfolder",
]


@dataclass(frozen=True)
class SegPool:
    """Per-sample geometry and background texture of the synthetic segmentation pool."""

    labels: np.ndarray  # int64 (N,): 1 if the image has a rectangle (used for stratified splits)
    ellipse_xy: np.ndarray  # (N, 2) centre in [0, 1]
    ellipse_axes: np.ndarray  # (N, 2) semi-axes in image widths
    ellipse_angle: np.ndarray
    has_rectangle: np.ndarray  # bool (N,)
    rectangle_xy: np.ndarray  # (N, 2)
    rectangle_half: np.ndarray  # (N, 2) half side lengths
    rectangle_angle: np.ndarray
    wave_angle: np.ndarray  # (N, NUM_WAVES)
    wave_cycles: np.ndarray  # (N, NUM_WAVES) cycles per image width
    wave_phase: np.ndarray  # (N, NUM_WAVES)
    wave_amplitude: np.ndarray  # (N, NUM_WAVES), sums to 1 per sample
    blob_xy: np.ndarray  # (N, 2) distractor blob
    blob_strength: np.ndarray  # signed, relative to the background texture strength
    texture_phase: np.ndarray  # phase of the object texture


@dataclass(frozen=True)
class SegLook:
    """How a site draws the scene: grey levels, textures and edges (on top of its ``SiteStyle``)."""

    polarity: float  # +1: ellipse brighter than the background, rectangle darker; -1: the reverse
    background_level: float
    ellipse_level: float
    rectangle_level: float
    background_texture: float  # amplitude of the background gratings
    object_texture: float  # amplitude of the grating inside the objects
    texture_cycles: float
    texture_angle: float
    edge_softness: float  # edge width in pixels at 32 px


@lru_cache(maxsize=8)
def seg_pool(seed: int, size: int) -> SegPool:
    """Pool of ``size`` scenes; deterministic from ``seed``."""
    rng = np.random.default_rng([_POOL_TAG, seed])
    ellipse_xy = rng.uniform(0.3, 0.7, (size, 2))
    major = rng.uniform(0.16, 0.32, size)
    ellipse_axes = np.stack([major, major * rng.uniform(0.55, 1.0, size)], axis=1)
    ellipse_angle = rng.uniform(0, np.pi, size)
    has_rectangle = rng.random(size) < RECTANGLE_PROBABILITY
    # a lesion inside the organ (offset within half its axes) or anywhere in the image
    inside = rng.random(size) < 0.65
    offset = rng.uniform(-0.5, 0.5, (size, 2)) * ellipse_axes
    cos, sin = np.cos(ellipse_angle), np.sin(ellipse_angle)
    in_organ = ellipse_xy + np.stack(
        [offset[:, 0] * cos - offset[:, 1] * sin, offset[:, 0] * sin + offset[:, 1] * cos], axis=1
    )
    rectangle_xy = np.clip(np.where(inside[:, None], in_organ, rng.uniform(0.15, 0.85, (size, 2))), 0.1, 0.9)
    amplitude = rng.uniform(0.3, 1.0, (size, NUM_WAVES))
    pool = SegPool(
        labels=has_rectangle.astype(np.int64),
        ellipse_xy=ellipse_xy,
        ellipse_axes=ellipse_axes,
        ellipse_angle=ellipse_angle,
        has_rectangle=has_rectangle,
        rectangle_xy=rectangle_xy,
        rectangle_half=rng.uniform(0.09, 0.15, (size, 2)),
        rectangle_angle=rng.uniform(0, np.pi / 2, size),
        wave_angle=rng.uniform(0, np.pi, (size, NUM_WAVES)),
        wave_cycles=rng.uniform(0.5, 2.5, (size, NUM_WAVES)),
        wave_phase=rng.uniform(0, 2 * np.pi, (size, NUM_WAVES)),
        wave_amplitude=amplitude / amplitude.sum(axis=1, keepdims=True),
        blob_xy=rng.uniform(0.1, 0.9, (size, 2)),
        blob_strength=rng.uniform(-1.0, 1.0, size),
        texture_phase=rng.uniform(0, 2 * np.pi, size),
    )
    for array in vars(pool).values():
        array.setflags(write=False)
    return pool


def seg_look(seed: int, style_id: int) -> SegLook:
    """Scene look of style ``style_id`` (>= 0); deterministic from ``seed``."""
    if style_id < 0:
        raise ValueError(f"style_id must be >= 0, got {style_id}")
    offset = int(np.random.default_rng([_LOOK_TAG, seed]).integers(2))
    rng = np.random.default_rng([_LOOK_TAG, seed, style_id])
    polarity = 1.0 if (style_id + offset) % 2 == 0 else -1.0
    background = float(rng.uniform(0.42, 0.58))
    return SegLook(
        polarity=polarity,
        background_level=background,
        ellipse_level=background + polarity * float(rng.uniform(0.25, 0.35)),
        rectangle_level=background - polarity * float(rng.uniform(0.25, 0.35)),
        background_texture=float(rng.uniform(0.04, 0.15)),
        object_texture=float(rng.uniform(0.0, 0.1)),
        texture_cycles=float(rng.uniform(3.0, 7.0)),
        texture_angle=float(rng.uniform(0, np.pi)),
        edge_softness=float(rng.uniform(0.3, 1.5)),
    )


def render(
    pool: SegPool, rows: np.ndarray, style: SiteStyle, look: SegLook, size: int, noise_key: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images (n, size, size, 3), uint8 masks (n, size, size) with 0/1/2) of pool ``rows``."""
    rows = np.asarray(rows, dtype=np.int64)
    rng = np.random.default_rng([_NOISE_TAG, *noise_key])
    images = np.empty((len(rows), size, size, 3), dtype=np.uint8)
    masks = np.empty((len(rows), size, size), dtype=np.uint8)
    for start in range(0, len(rows), _RENDER_CHUNK):
        chunk = rows[start : start + _RENDER_CHUNK]
        images[start : start + len(chunk)], masks[start : start + len(chunk)] = _render_chunk(
            pool, chunk, style, look, size, rng
        )
    return images, masks


def render_site(
    seed: int, style_id: int, rows: np.ndarray, pool_size: int, size: int, noise_key: tuple[int, ...] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the ``(seed, pool_size)`` pool as drawn by a site of style ``style_id`` (at most 64 px)."""
    size = min(size, MAX_RENDER_SIZE)
    return render(
        seg_pool(seed, pool_size),
        rows,
        site_style(seed, style_id),
        seg_look(seed, style_id),
        size,
        noise_key if noise_key is not None else (seed, style_id),
    )


def _render_chunk(
    pool: SegPool, rows: np.ndarray, style: SiteStyle, look: SegLook, size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size
    x, y = coords[None, None, :], coords[None, :, None]

    def per_sample(values: np.ndarray) -> np.ndarray:
        return values[rows].astype(np.float32)[:, None, None]

    def along(angle: np.ndarray | float, x0=0.0, y0=0.0) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = np.cos(angle), np.sin(angle)
        return (x - x0) * cos + (y - y0) * sin, -(x - x0) * sin + (y - y0) * cos

    texture = np.zeros((len(rows), size, size), np.float32)
    for w in range(NUM_WAVES):
        u, _ = along(per_sample(pool.wave_angle[:, w]))
        texture += per_sample(pool.wave_amplitude[:, w]) * np.sin(
            2 * np.pi * per_sample(pool.wave_cycles[:, w]) * u + per_sample(pool.wave_phase[:, w])
        )
    blob2 = (x - per_sample(pool.blob_xy[:, 0])) ** 2 + (y - per_sample(pool.blob_xy[:, 1])) ** 2
    texture += 0.6 * per_sample(pool.blob_strength) * np.exp(-blob2 / (2 * 0.08**2))
    gray = look.background_level + look.background_texture * texture

    u, _ = along(look.texture_angle)
    object_texture = look.object_texture * np.sin(2 * np.pi * look.texture_cycles * u + per_sample(pool.texture_phase))
    softness = look.edge_softness / 32  # in image widths

    def coverage(depth: np.ndarray) -> np.ndarray:  # depth: about the distance inside the edge
        return 1 / (1 + np.exp(-np.clip(depth / softness, -30, 30)))

    u, v = along(per_sample(pool.ellipse_angle), per_sample(pool.ellipse_xy[:, 0]), per_sample(pool.ellipse_xy[:, 1]))
    a, b = per_sample(pool.ellipse_axes[:, 0]), per_sample(pool.ellipse_axes[:, 1])
    radius = np.sqrt((u / a) ** 2 + (v / b) ** 2)
    in_ellipse = radius < 1
    cover = coverage((1 - radius) * np.minimum(a, b))
    gray = gray + cover * (look.ellipse_level + object_texture - gray)

    u, v = along(
        per_sample(pool.rectangle_angle), per_sample(pool.rectangle_xy[:, 0]), per_sample(pool.rectangle_xy[:, 1])
    )
    hx, hy = per_sample(pool.rectangle_half[:, 0]), per_sample(pool.rectangle_half[:, 1])
    extent = np.maximum(np.abs(u) / hx, np.abs(v) / hy)
    present = per_sample(pool.has_rectangle)
    in_rectangle = (extent < 1) & (present > 0)
    cover = present * coverage((1 - extent) * np.minimum(hx, hy))
    gray = gray + cover * (look.rectangle_level + object_texture - gray)

    masks = np.where(in_rectangle, 2, np.where(in_ellipse, 1, 0)).astype(np.uint8)
    return apply_style(gray, style, size, rng), masks


def write_segfolder(root: str | Path, sites: dict[str, int], per_site: int, size: int, seed: int) -> Path:
    """Write ``<root>/<site>/images/*.png`` and ``masks/*.png`` (class indices 0/1/2) for a segfolder.

    ``sites`` maps each site name to its style id: sites with the same id look alike, but
    every site gets its own scenes (rows ``i*per_site .. (i+1)*per_site - 1`` of one pool).
    Images are rendered at ``min(size, 64)`` px. Returns ``root``.
    """
    root = Path(root)
    pool_size = per_site * len(sites)
    for i, (site, style_id) in enumerate(sites.items()):
        rows = np.arange(i * per_site, (i + 1) * per_site)
        images, masks = render_site(seed, style_id, rows, pool_size, size, noise_key=(seed, style_id, i))
        for folder in ("images", "masks"):
            (root / site / folder).mkdir(parents=True, exist_ok=True)
        for j, (image, mask) in enumerate(zip(images, masks)):
            name = f"{site}-{j:04d}.png"
            Image.fromarray(image).save(root / site / "images" / name)
            Image.fromarray(mask).save(root / site / "masks" / name)
    return root
