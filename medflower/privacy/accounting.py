"""Client-level privacy accounting: ε after each round for a chosen δ (docs/privacy.md#accounting).

The accountant is Flower's ``RdpAccountant`` (``flwr[dp]``, backed by Google's ``dp-accounting``): Rényi DP of the
Gaussian mechanism composed once per round, converted to (ε, δ). No amplification by sampling is claimed: the
sites are few and the server knows which ones trained, so every round counts in full for a site that took part.
Only the server imports this module (the sites never account).

Neighbouring relation. ``dp='server'`` protects the released mean against adding or removing one site: one site moves
the fixed-denominator sum by at most C, the noise is z·C (on the sum; z·C/m on the mean), so each round is the
Gaussian mechanism with noise multiplier z. ``dp='site'`` releases every site's own noised update, so its guarantee
is local: any two datasets of one site (replace-one) give clipped updates up to 2C apart against noise z·C, i.e. the
Gaussian mechanism with noise multiplier z/2. That replace-one ε is the one reported (``SENSITIVITY``).
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

# One site's release per round: the Gaussian mechanism on its clipped update (noise z·C).
_RELEASE = dict(sample_size=1, population_size=1)

# The sensitivity of a round's release in units of C, by dp mode: 'site' releases each site's noised update, and two
# datasets of a site give clipped updates up to 2C apart (replace-one); 'server' releases the noised mean, which one
# site added or removed moves by C/m against noise z·C/m (add-or-remove-one site).
SENSITIVITY = {"site": 2.0, "server": 1.0}
RELATION = {
    "site": "replace-one: any two datasets of one site (clipped updates up to 2C apart, noise z·C)",
    "server": "add-or-remove-one site (the mean moves by at most C/m, noise z·C/m)",
}


class ClientLevelAccountant:
    """ε of a site's whole contribution after the rounds composed so far (one release per round). ``sensitivity`` is
    the release's L2 sensitivity in units of C (``SENSITIVITY``): the Gaussian mechanism composed has noise
    multiplier ``noise_multiplier / sensitivity``."""

    def __init__(
        self, noise_multiplier: float, delta: float, target_epsilon: float | None = None, sensitivity: float = 1.0
    ):
        self.noise_multiplier = noise_multiplier
        self.sensitivity = sensitivity
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
        self._event = GaussianPrivacyEvent(noise_multiplier / sensitivity, **_RELEASE)

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


def planned_epsilon(noise_multiplier: float, rounds: int, delta: float, sensitivity: float = 1.0) -> float:
    """ε after ``rounds`` releases of the Gaussian mechanism with noise z·C and sensitivity ``sensitivity``·C."""
    accountant = ClientLevelAccountant(noise_multiplier, delta, sensitivity=sensitivity)
    accountant.compose_round(rounds)
    return accountant.epsilon()


def max_rounds_within(
    target_epsilon: float, noise_multiplier: float, delta: float, limit: int = 100_000, sensitivity: float = 1.0
) -> int:
    """The most rounds whose ε stays within the target (0 when even one round exceeds it)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if planned_epsilon(noise_multiplier, mid, delta, sensitivity) <= target_epsilon:
            lo = mid
        else:
            hi = mid - 1
    return lo


def min_noise_within(target_epsilon: float, rounds: int, delta: float, sensitivity: float = 1.0) -> float:
    """The smallest noise multiplier (to 3 significant digits, rounded up) whose ε after ``rounds`` meets the
    target."""
    lo, hi = 1e-3, 1.0
    while planned_epsilon(hi, rounds, delta, sensitivity) > target_epsilon:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if planned_epsilon(mid, rounds, delta, sensitivity) > target_epsilon else (lo, mid)
    digits = 2 - math.floor(math.log10(hi))
    return math.ceil(hi * 10**digits) / 10**digits
