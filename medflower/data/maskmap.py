"""Mask value maps: which structures each pixel value of a mask stands for (run-config ``mask-values``).

A map is written ``<value>=<structure>[+<structure>...],...``, every value the masks hold listed once, an empty
right-hand side for background. Structures may overlap or nest, so a mask becomes one binary plane per
structure, ``uint8 [K, H, W]``, in the order the structures first appear in the map:

- REFUGE-style optic disc and cup, 0 = cup, 128 = disc rim, 255 = background: ``0=disc+cup,128=disc,255=``
  gives the planes (disc, cup), the disc plane being the full disc (rim and cup), as the papers score it;
- a NIfTI label map of prostate zones: ``0=,1=peripheral,2=transition``; the whole gland instead:
  ``0=,1=prostate,2=prostate``.

A pixel value the map does not list is an error naming the file and the values found (docs/data.md#mask-values).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .errors import DataError

NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class MaskValueMap:
    """Structures (output channels, in map order) and, per mask value, the structures it belongs to."""

    structures: tuple[str, ...]
    values: tuple[float, ...]
    members: tuple[frozenset[int], ...]  # structure indices of each value, aligned with ``values``

    def planes(self, pixels: np.ndarray, where: str) -> np.ndarray:
        """``uint8 [K, H, W]`` binary planes of a ``[H, W]`` mask; DataError naming ``where`` for a value the map
        does not list."""
        pixels = np.asarray(pixels)
        found = np.unique(pixels)
        listed = np.isin(found, self.values)
        if not listed.all():
            unexpected = ", ".join(_show(v) for v in found[~listed][:8])
            raise DataError(
                f"{where}: mask value(s) {{{unexpected}}} are not in run-config mask-values "
                f"({self.text()}); values found: {{{', '.join(_show(v) for v in found[:12])}}}"
            )
        out = np.zeros((len(self.structures), *pixels.shape), dtype=np.uint8)
        for value, members in zip(self.values, self.members):
            if members:
                hit = pixels == value
                for k in members:
                    out[k] |= hit
        return out

    def text(self) -> str:
        """The map as written in the run config."""
        return ",".join(
            f"{_show(v)}={'+'.join(self.structures[k] for k in sorted(m))}" for v, m in zip(self.values, self.members)
        )


def _show(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def parse_mask_values(text: str) -> MaskValueMap | None:
    """The map of a ``mask-values`` setting; None for ''. ValueError says what is malformed."""
    if not text.strip():
        return None
    structures: list[str] = []
    values: list[float] = []
    members: list[frozenset[int]] = []
    for item in (p.strip() for p in text.split(",")):
        value_text, eq, names = item.partition("=")
        try:
            value = float(value_text)
        except ValueError:
            value = float("nan")
        if not eq or not np.isfinite(value):
            raise ValueError(
                f"{item!r} is not <value>=<structure>[+<structure>...] (an empty structure list for background)"
            )
        if value in values:
            raise ValueError(f"value {_show(value)} is listed twice")
        indices = set()
        for name in (n.strip() for n in names.split("+")) if names.strip() else ():
            if not NAME.fullmatch(name):
                raise ValueError(f"structure name {name!r} must be letters, digits, '_', '.' or '-'")
            if name not in structures:
                structures.append(name)
            indices.add(structures.index(name))
        values.append(value)
        members.append(frozenset(indices))
    if not structures:
        raise ValueError("no structure is named (every value maps to background)")
    return MaskValueMap(tuple(structures), tuple(values), tuple(members))
