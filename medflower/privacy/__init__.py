"""The privacy layer: client-level differential privacy of what a site sends, and its accounting
(docs/privacy.md). A strategy declares the modes its exchange allows (``FederatedStrategy.client_dp``); the
strategy's own code does not change."""

from .client_dp import (
    DP_OPTIONS,
    PrivacyLedger,
    check_privacy_config,
    clipped,
    noised_mean,
    privatise_train_reply,
    privatise_update,
    update_norm,
)

__all__ = [
    "DP_OPTIONS",
    "PrivacyLedger",
    "check_privacy_config",
    "clipped",
    "noised_mean",
    "privatise_train_reply",
    "privatise_update",
    "update_norm",
]
