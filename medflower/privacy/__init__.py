"""The privacy layer (docs/privacy.md): client-level differential privacy of what a site sends (``client_dp``),
sample-level DP-SGD of its local training (``dp_sgd``), and the server's checks and account of ε (``ledger``).
A strategy declares what its exchange allows (``FederatedStrategy.client_dp``, ``dp_sgd``); its own code does not
change."""

from .client_dp import (
    DP_OPTIONS,
    clipped,
    noised_mean,
    privatise_train_reply,
    privatise_update,
    update_norm,
    withhold_training_metrics,
)
from .dp_sgd import DP_SGD_OPTIONS, PrivateTraining, dp_sgd_epsilon
from .ledger import PrivacyLedger, check_dp_sgd_model, check_privacy_config

__all__ = [
    "DP_OPTIONS",
    "DP_SGD_OPTIONS",
    "PrivacyLedger",
    "PrivateTraining",
    "check_dp_sgd_model",
    "check_privacy_config",
    "clipped",
    "dp_sgd_epsilon",
    "noised_mean",
    "privatise_train_reply",
    "withhold_training_metrics",
    "privatise_update",
    "update_norm",
]
