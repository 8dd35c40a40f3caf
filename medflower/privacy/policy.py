"""A site's own privacy policy: node-config limits its operator sets, checked at the site before it trains.

The run config (``dp``, the noise multipliers, the clipping norms) is the server operator's choice; a site that
simply complied would give whatever guarantee the server asked for, ``dp='none'`` included. These node-config keys
are the hospital's (its privacy officer's), read on the site and never sent:

- ``dp-required`` (default false): train only when the site itself noises what leaves it, ``dp='site'`` or
  ``dp-sgd=true``. ``dp='server'`` does not count: its noise is added by the server, after it has seen the update.
- ``dp-min-noise-multiplier``: the smallest noise multiplier accepted (``dp-noise-multiplier`` with ``dp='site'``,
  ``dp-sgd-noise-multiplier`` with DP-SGD).
- ``dp-max-clipping-norm``: the largest clipping norm accepted (``dp-clipping-norm`` / ``dp-sgd-max-grad-norm``).
- ``dp-max-epsilon``: the largest ε this site spends in the run, at the run's ``dp-delta``. Checked against the plan
  before the site's first training (all ``num-rounds`` rounds; for DP-SGD from the site's own number of training
  images and its loader's length) and against the site's own ledger before every training after it.

A message that violates the policy is refused before any data is read for training (``PolicyError``, whose message
names only the run-config values and the site's own limits, so it reaches the server as it is). Every training
logs the site's ε so far (``SiteLedger``, kept in the site's state). docs/privacy.md#the-sites-own-policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from logging import INFO
from typing import Any

from flwr.common.logger import log

POLICY_KEYS = ("dp-required", "dp-min-noise-multiplier", "dp-max-clipping-norm", "dp-max-epsilon")


class PolicyError(ValueError):
    """The run asks this site for less privacy than its node config allows."""

    shareable = True  # names run-config values and the site's own limits only


def _flag(value: Any, key: str) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise PolicyError(f"node-config {key} = {value!r}: true or false")


def _positive(value: Any, key: str) -> float | None:
    if value is None or str(value).strip() == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise PolicyError(f"node-config {key} = {value!r}: a number > 0")
    return number


@dataclass(frozen=True)
class SitePolicy:
    required: bool = False
    min_noise_multiplier: float | None = None
    max_clipping_norm: float | None = None
    max_epsilon: float | None = None

    @classmethod
    def from_node_config(cls, node_config) -> SitePolicy:
        return cls(
            required=_flag(node_config.get("dp-required", False), "dp-required"),
            min_noise_multiplier=_positive(node_config.get("dp-min-noise-multiplier"), "dp-min-noise-multiplier"),
            max_clipping_norm=_positive(node_config.get("dp-max-clipping-norm"), "dp-max-clipping-norm"),
            max_epsilon=_positive(node_config.get("dp-max-epsilon"), "dp-max-epsilon"),
        )

    @property
    def active(self) -> bool:
        return self.required or any(
            v is not None for v in (self.min_noise_multiplier, self.max_clipping_norm, self.max_epsilon)
        )

    def violations(self, cfg) -> list[str]:
        """What in the run config breaks this policy (empty: it complies), ε aside (``epsilon_violation``)."""
        found = []
        site_noise = cfg.dp == "site" or cfg.dp_sgd
        if (self.required or self.max_epsilon is not None) and not site_noise:
            found.append(
                f"the site requires noise added on the site (dp='site' or dp-sgd=true); the run has dp={cfg.dp!r}, "
                f"dp-sgd={str(cfg.dp_sgd).lower()}"
            )
        for key, noise, clip_key, clip in self._mechanisms(cfg):
            if self.min_noise_multiplier is not None and noise < self.min_noise_multiplier:
                found.append(
                    f"{key} = {noise:g} is below the site's dp-min-noise-multiplier {self.min_noise_multiplier:g}"
                )
            if self.max_clipping_norm is not None and clip > self.max_clipping_norm:
                found.append(
                    f"{clip_key} = {clip:g} is above the site's dp-max-clipping-norm {self.max_clipping_norm:g}"
                )
        return found

    @staticmethod
    def _mechanisms(cfg) -> list[tuple[str, float, str, float]]:
        out = []
        if cfg.dp == "site":
            out.append(("dp-noise-multiplier", cfg.dp_noise_multiplier, "dp-clipping-norm", cfg.dp_clipping_norm))
        if cfg.dp_sgd:
            out.append(
                (
                    "dp-sgd-noise-multiplier",
                    cfg.dp_sgd_noise_multiplier,
                    "dp-sgd-max-grad-norm",
                    cfg.dp_sgd_max_grad_norm,
                )
            )
        return out

    def epsilon_violation(self, planned: float, spent: float) -> str | None:
        """Why the run's ε breaks ``dp-max-epsilon`` (None: it does not): the plan before the first training, the
        ledger's spent ε before the later ones."""
        if self.max_epsilon is None:
            return None
        if spent >= self.max_epsilon:
            return f"this site has spent ε = {spent:.3g}, its dp-max-epsilon is {self.max_epsilon:g}"
        if planned > self.max_epsilon:
            return (
                f"the run's plan spends ε = {planned:.3g} on this site, above its dp-max-epsilon {self.max_epsilon:g}"
            )
        return None


def planned_epsilon(cfg, num_train: int) -> float:
    """ε a site with ``num_train`` training images spends over the whole run (``num-rounds``), at ``dp-delta``: the
    sum of what each site-side mechanism plans (basic composition of the two; each alone is accounted exactly)."""
    total = _site_dp_epsilon(cfg, cfg.num_rounds)
    if cfg.dp_sgd:
        from .dp_sgd import planned_dp_sgd_epsilon

        total += planned_dp_sgd_epsilon(cfg, num_train, cfg.num_rounds)
    return total


def spent_epsilon(cfg, rounds_trained: int, dp_sgd_epsilon: float) -> float:
    """ε this site has spent: ``rounds_trained`` releases under ``dp='site'`` plus its DP-SGD ε so far."""
    return _site_dp_epsilon(cfg, rounds_trained) + dp_sgd_epsilon


def _site_dp_epsilon(cfg, releases: int) -> float:
    """The replace-one ε of ``releases`` noised updates under ``dp='site'`` (0 without it, or before any)."""
    if cfg.dp != "site" or releases <= 0:
        return 0.0
    from .accounting import SENSITIVITY, planned_epsilon

    return planned_epsilon(cfg.dp_noise_multiplier, releases, cfg.dp_delta, SENSITIVITY["site"])


def log_spent(site: str, spent: float, policy: SitePolicy) -> None:
    limit = f" of its dp-max-epsilon {policy.max_epsilon:g}" if policy.max_epsilon is not None else ""
    log(INFO, "[medflower] privacy: %s has spent ε = %.3g%s", site, spent, limit)


class SiteLedger:
    """The site's own account of what it released: the number of noised updates it sent (every one, a round redone
    after a restart included) and its DP-SGD ε, in the site's state (``PersonalState``: node-config ``state-dir`` on
    disk, else the SuperNode's memory, lost when it restarts)."""

    KEY = "privacy-ledger"

    def __init__(self, runtime) -> None:
        self.state = runtime.personal_state(self.KEY)
        saved = self.state.load(before=2**62)
        self.releases = int(saved["releases"][0]) if saved is not None else 0
        self.dp_sgd_epsilon = float(saved["dp_sgd_epsilon"][0]) if saved is not None else 0.0

    def spent(self, cfg) -> float:
        return spent_epsilon(cfg, self.releases, self.dp_sgd_epsilon)

    def record(self, dp_sgd_epsilon: float | None) -> None:
        """One more release (and the site's DP-SGD ε after it, which never goes down here)."""
        import numpy as np

        self.releases += 1
        if dp_sgd_epsilon is not None and math.isfinite(dp_sgd_epsilon):
            self.dp_sgd_epsilon = max(self.dp_sgd_epsilon, float(dp_sgd_epsilon))
        self.state.save(
            self.releases,
            {
                "releases": np.array([self.releases], dtype=np.int64),
                "dp_sgd_epsilon": np.array([self.dp_sgd_epsilon], dtype=np.float64),
            },
        )


def check_before_training(runtime, cfg, policy: SitePolicy) -> None:
    """Refuse (PolicyError) a training message whose run breaks the site's policy."""
    found = policy.violations(cfg)
    if not found and policy.max_epsilon is not None:
        ledger = SiteLedger(runtime)
        planned = planned_epsilon(cfg, len(runtime.raw_data.train))
        why = policy.epsilon_violation(planned if ledger.releases == 0 else 0.0, ledger.spent(cfg))
        if why:
            found.append(why)
    if found:
        raise PolicyError("this site's privacy policy refuses the run: " + "; ".join(found))


def record_after_training(runtime, cfg, policy: SitePolicy, metrics) -> None:
    """Count the release in the site's ledger and log its ε so far (runs with a site-side mechanism only)."""
    if cfg.dp != "site" and not cfg.dp_sgd:
        return
    ledger = SiteLedger(runtime)
    value = metrics.get("dp_sgd_epsilon") if metrics is not None else None
    ledger.record(float(value) if value is not None else None)
    log_spent(runtime.client, ledger.spent(cfg), policy)
