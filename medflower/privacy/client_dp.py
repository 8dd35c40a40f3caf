"""Client-level differential privacy: each site's whole contribution to a round is clipped and noised
(docs/privacy.md).

- ``dp='site'``: the site clips its update (the arrays it sends minus the ones it received under the same names)
  to L2 norm C = ``dp-clipping-norm`` and adds N(0, (z·C)²), z = ``dp-noise-multiplier``, to every entry before the
  reply leaves it. The server, and everything it computes (SGCA's W, FedDyn's h, the next site of SiFT's relay),
  sees only the noised update: post-processing, so the guarantee holds against the server too.
- ``dp='server'``: the site clips; the server clips again (a reply is untrusted), takes the uniform mean of the
  clipped updates over the m sites it asked (a fixed denominator: a site that drops out shortens the step and leaves
  the noise's calibration intact) and adds N(0, (z·C/m)²) to it. This is DP-FedAvg (McMahan et al. 2018, the
  fixed-denominator estimator) and Flower's central DP with client-side fixed clipping; the sites trust the server
  with their clipped updates, and the released model is protected.

Flower ships the same steps as ``fixedclipping_mod`` and the ``DifferentialPrivacyClientSideFixedClipping`` strategy
wrapper. Those need messages with exactly one ArrayRecord and one ConfigRecord and a Flower ``Strategy`` to wrap;
medflower's strategies are Message API loops with per-site messages (SGCA sends each site its own aggregate, SiFT
relays a pair from site to site), so the steps are applied here, at the one place each side passes: the ClientApp's
handler after a ``train`` message, and the server's aggregation. Flower's clipping helper also divides by a zero
norm (a site whose arrays did not move) and its noise draws from numpy's global generator; here the noise comes
from the operating system's entropy, never from the run's seed, which the server knows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
from flwr.app import RecordDict

from ..options import Option, non_negative, one_of, positive
from ..records import update_norm

MODES = ("none", "site", "server")


def _open_unit(v: float) -> str | None:
    return None if 0 < v < 1 else "must be in (0, 1)"


DP_OPTIONS: tuple[Option, ...] = (
    Option(
        "dp",
        "none",
        "client-level differential privacy of each site's update per round: none; site (the site clips it to "
        "dp-clipping-norm and adds the noise); server (the site clips, the server clips again and adds the noise to "
        "the mean); docs/privacy.md",
        one_of(*MODES),
        "privacy",
    ),
    Option(
        "dp-noise-multiplier",
        1.0,
        "z: the noise's standard deviation is z·dp-clipping-norm on each site's update (dp='site'), or "
        "z·dp-clipping-norm/m on the mean over the m sites asked (dp='server')",
        positive,
        "privacy",
    ),
    Option(
        "dp-clipping-norm",
        1.0,
        "C: L2 bound of one site's update in one round (all arrays it sends)",
        positive,
        "privacy",
    ),
    Option(
        "dp-delta", 1e-5, "δ at which ε is reported (choose it below 1 / the number of sites)", _open_unit, "privacy"
    ),
    Option(
        "dp-target-epsilon",
        0.0,
        "the ε (at dp-delta) the run may spend; a plan beyond it is refused before round 1, and a run stops before a "
        "round that would exceed it. 0 = no limit",
        non_negative,
        "privacy",
    ),
)


# ----------------------------------------------------------------------------- the math
def clipped(update: Mapping[str, np.ndarray], clipping_norm: float) -> OrderedDict[str, np.ndarray]:
    """Δ · min(1, C / ‖Δ‖) in float64 (a zero update stays zero)."""
    norm = update_norm(update)
    scale = 1.0 if norm <= clipping_norm else clipping_norm / norm
    return OrderedDict((k, np.asarray(u, dtype=np.float64) * scale) for k, u in update.items())


def noise_rng() -> np.random.Generator:
    """A generator seeded from the operating system's entropy: nobody who knows the run config can replay it."""
    return np.random.default_rng()


def update_of(received: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """sent − received per array; every sent array must update a received one of the same name and shape."""
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, value in sent.items():
        if name not in received:
            raise ValueError(
                f"dp: the reply's array {name!r} updates nothing the site received, so it cannot be clipped"
            )
        if np.shape(value) != np.shape(received[name]):
            raise ValueError(
                f"dp: the reply's array {name!r} has shape {np.shape(value)}, it came as {np.shape(received[name])}"
            )
        out[name] = np.asarray(value, dtype=np.float64) - np.asarray(received[name], dtype=np.float64)
    return out


def privatise_update(
    received: Mapping[str, np.ndarray],
    sent: Mapping[str, np.ndarray],
    clipping_norm: float,
    noise_std: float,
    rng: np.random.Generator | None = None,
) -> OrderedDict[str, np.ndarray]:
    """received + clip_C(sent − received) + N(0, noise_std²), in the sent arrays' dtypes."""
    rng = rng or noise_rng()
    delta = clipped(update_of(received, sent), clipping_norm)
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, d in delta.items():
        noise = rng.normal(0.0, noise_std, size=d.shape) if noise_std > 0 else 0.0
        out[name] = np.asarray(
            np.asarray(received[name], dtype=np.float64) + d + noise, dtype=np.asarray(sent[name]).dtype
        )
    return out


def noised_mean(
    sent: Mapping[str, np.ndarray],
    replies: list[Mapping[str, np.ndarray]],
    num_asked: int,
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator | None = None,
) -> OrderedDict[str, np.ndarray]:
    """dp='server': sent + Σ_k clip_C(θ_k − sent) / m + N(0, (z·C/m)²), m = ``num_asked`` (DP-FedAvg's fixed
    denominator; its sensitivity to one site is C/m)."""
    rng = rng or noise_rng()
    m = max(num_asked, len(replies), 1)
    total = OrderedDict((k, np.zeros(np.shape(v), dtype=np.float64)) for k, v in sent.items())
    for arrays in replies:
        for name, d in clipped(update_of(sent, arrays), clipping_norm).items():
            total[name] += d
    std = noise_multiplier * clipping_norm / m
    return OrderedDict(
        (
            name,
            np.asarray(
                np.asarray(sent[name], dtype=np.float64)
                + total[name] / m
                + rng.normal(0.0, std, size=total[name].shape),
                dtype=np.asarray(sent[name]).dtype,
            ),
        )
        for name in sent
    )


# ----------------------------------------------------------------------------- the site's half
def privatise_train_reply(
    received: RecordDict, content: RecordDict, cfg, rng: np.random.Generator | None = None
) -> RecordDict:
    """The site's step of ``dp`` on a training reply ``content``, before it leaves: clip (and, for dp='site', noise)
    the update of the arrays it ``received``. A reply without arrays (metrics only) is left as it is."""
    if cfg.dp == "none" or "arrays" not in content.array_records:
        return content
    from ..records import from_record, to_record  # the strategies import this module

    if "arrays" not in received.array_records:
        raise ValueError("dp: the training message carried no arrays, so the reply's update has no reference")
    noise_std = cfg.dp_noise_multiplier * cfg.dp_clipping_norm if cfg.dp == "site" else 0.0
    content["arrays"] = to_record(
        privatise_update(
            from_record(received["arrays"]), from_record(content["arrays"]), cfg.dp_clipping_norm, noise_std, rng
        )
    )
    return content


# What a training reply may carry beside its (noised or secure-summed) update when the run has dp, dp-sgd or secagg:
# the weight n_k, the number of optimizer steps (a function of n_k, batch-size and local-epochs) and the DP-SGD ε
# (a function of the steps). Everything else a site computes from its training images (its loss, a method's
# statistics) would travel in the clear beside the protected arrays.
PRIVATE_TRAIN_METRICS = frozenset({"num-examples", "train_steps", "dp_sgd_epsilon"})


def withhold_training_metrics(content: RecordDict, cfg) -> RecordDict:
    """With dp, dp-sgd or secagg: drop every training metric outside ``PRIVATE_TRAIN_METRICS`` from the reply
    before it leaves the site (the carried evaluation of evaluate-in-train is the validation and test images'
    metrics, which an evaluation reply sends anyway: docs/privacy.md#what-the-guarantee-covers)."""
    if cfg.dp == "none" and not cfg.dp_sgd and not cfg.secagg:
        return content
    if "metrics" in content.metric_records:
        metrics = content["metrics"]
        for key in [k for k in metrics if k not in PRIVATE_TRAIN_METRICS]:
            del metrics[key]
    return content
