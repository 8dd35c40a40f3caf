"""The LoRA baselines' merge maths (docs/methods/pfedmxf.md, "The LoRA baselines").

``fedavg-lora`` averages A and B separately (Eq. 5; ``records.weighted_mean``), so B̄Ā carries the interference
term of Eq. 6, and merges ``lora_product`` into the frozen weights at the end of each task. ``fedstack`` (FLoRA)
stacks p_k-scaled B_k and A_k on the rank axis (``stack_lora``, Eq. 7), so B A = Σ_k p_k B_k A_k exactly (Eq. 8).
The strategies are ``fedavg_lora.py`` and ``fedstack.py``; the protocol is ``protocol.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def stack_lora(
    a: Sequence[np.ndarray], b: Sequence[np.ndarray], weights: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """FLoRA's stacking (Eq. 7): A = [A_1; ..; A_K] on the rank axis, B = [p_1 B_1, .., p_K B_K].

    ``a``: [2, r_k, d_in] per site, ``b``: [2, d_out, r_k]; then B @ A = Σ_k p_k B_k A_k (Eq. 8), exactly.
    """
    p = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    return (
        np.concatenate([x.astype(np.float64) for x in a], axis=1),
        np.concatenate([pk * x.astype(np.float64) for pk, x in zip(p, b)], axis=2),
    )


def lora_product(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """scale · B @ A for q and k: [2, d_out, d_in] float32."""
    return (scale * np.matmul(b.astype(np.float64), a.astype(np.float64))).astype(np.float32)
