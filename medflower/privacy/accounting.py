"""Client-level privacy accounting: ε after each round for a chosen δ (docs/privacy.md#accounting).

The accountant is Flower's ``RdpAccountant`` (``flwr[dp]``, backed by Google's ``dp-accounting``): Rényi DP of the
Gaussian mechanism composed once per round, converted to (ε, δ). No amplification by sampling is claimed: the
sites are few and the server knows which ones trained, so every round counts in full for a site that took part.
Only the server imports this module (the sites never account).
"""

from __future__ import annotations

import math
from typing import Any

from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

# One site's release per round: the Gaussian mechanism on its clipped update (sensitivity C, noise z·C).
_RELEASE = dict(sample_size=1, population_size=1)


class ClientLevelAccountant:
    """ε of a site's whole contribution after the rounds composed so far (one release per round)."""

    def __init__(self, noise_multiplier: float, delta: float, target_epsilon: float | None = None):
        self.noise_multiplier = noise_multiplier
        self.delta = delta
        self.target_epsilon = target_epsilon
        self._rdp = RdpAccountant(
            PrivacyConfig(
                target_delta=delta,
                population_size=1,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                sampling_method=SamplingMethod.NO_AMPLIFICATION,
                max_epsilon=target_epsilon,
            )
        )
        self._event = GaussianPrivacyEvent(noise_multiplier, **_RELEASE)

    @property
    def rounds(self) -> int:
        return self._rdp.num_releases

    def compose_round(self, count: int = 1) -> None:
        self._rdp.compose(self._event, count)

    def epsilon(self) -> float:
        """ε spent so far at ``delta`` (0 before the first round)."""
        return self._rdp.get_epsilon(self.delta) if self.rounds else 0.0

    def next_round_exceeds(self) -> bool:
        """Whether one more round would spend more than the target ε (False without a target)."""
        return self.target_epsilon is not None and self._rdp.would_exceed(self._event)

    def state_dict(self) -> dict[str, Any]:
        return self._rdp.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rdp.load_state_dict(state)


def planned_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """ε after ``rounds`` releases of the Gaussian mechanism with this noise multiplier."""
    accountant = ClientLevelAccountant(noise_multiplier, delta)
    accountant.compose_round(rounds)
    return accountant.epsilon()


def max_rounds_within(target_epsilon: float, noise_multiplier: float, delta: float, limit: int = 100_000) -> int:
    """The most rounds whose ε stays within the target (0 when even one round exceeds it)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if planned_epsilon(noise_multiplier, mid, delta) <= target_epsilon:
            lo = mid
        else:
            hi = mid - 1
    return lo


def min_noise_within(target_epsilon: float, rounds: int, delta: float) -> float:
    """The smallest noise multiplier (to 3 significant digits, rounded up) whose ε after ``rounds`` meets the
    target."""
    lo, hi = 1e-3, 1.0
    while planned_epsilon(hi, rounds, delta) > target_epsilon:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if planned_epsilon(mid, rounds, delta) > target_epsilon else (lo, mid)
    digits = 2 - math.floor(math.log10(hi))
    return math.ceil(hi * 10**digits) / 10**digits
