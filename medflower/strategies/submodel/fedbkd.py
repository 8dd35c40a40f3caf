"""FedBKD (docs/methods/fedbkd.md): top-ψ sub-encoders, CKA alignment to the global encoder and an
eigenvalue-weighted covered merge, on the sub-model protocol (``protocol.py``).

- Adaptive sub-model extraction (ASE): the site runs the received global encoder over its training data and keeps
  the top-ψ neurons of each FFN, ψ = mean² + variance of the GELU activation (Eqs. 2-3).
- Feature consistency (FCO): local training adds λ·(1 − CKA(f_k, f_g)) (Eq. 4 as a similarity, so 1 − CKA is the
  loss; λ = ``fedbkd-lambda``), f_g the frozen global encoder's pooled features on the same batch.
- Merge weights: w_k ∝ μ_k, the trace (or top eigenvalue, ``fedbkd-eigen``) of the covariance of the site's encoder
  features after training (Eqs. 6-7), in the protocol's covered merge.

Ablations (``fedbkd-variant``, the paper's Table 2): ``ase-only`` (top-ψ sub-models, no CKA, n_k weights),
``fco-only`` (prefix sub-models, CKA and eigenvalue weights).

What leaves a site: its sub-encoder's arrays (FFN slices narrowed), the kept neuron indices per FFN, n_k and μ_k;
never its decoder or head, never its data or features.
"""

from __future__ import annotations

import torch
from torch import nn

from ...contract import Reply, register_strategy
from ...models.ffn_slices import linear_cka
from ...options import Option, non_negative, one_of
from ...training import ExtraLoss
from .protocol import CAPACITIES, SubModelClient, SubModelStrategy

FEDBKD_OPTIONS = (
    Option(
        "fedbkd-lambda",
        1.0,
        "fedbkd: weight of the alignment loss lambda*(1 - CKA(sub-encoder, global encoder))",
        non_negative,
        "fedbkd",
    ),
    Option(
        "fedbkd-eigen",
        "trace",
        "fedbkd: mu_k of the merge weights, from the covariance of the site's features; "
        "none = weigh by n_k (a diagnostic, not the paper's)",
        one_of("trace", "top", "none"),
        "fedbkd",
    ),
    Option(
        "fedbkd-variant",
        "full",
        "fedbkd: full, ase-only (saliency sub-models, no CKA, n_k weights), fco-only "
        "(prefix sub-models with CKA and eigenvalue weights)",
        one_of("full", "ase-only", "fco-only"),
        "fedbkd",
    ),
)


def weighs_by_spread(cfg) -> bool:
    """FedBKD's w_k ∝ μ_k (Eq. 7), unless ``ase-only`` or ``fedbkd-eigen='none'`` (the diagnostic) weigh by n_k.

    Both halves ask it: the site computes μ_k only when the server weighs by it.
    """
    return cfg.fedbkd_variant != "ase-only" and cfg.fedbkd_eigen != "none"


class FeatureAligned(nn.Module):
    """The sub-model's forward that also keeps CKA(f_k, f_g) of the batch against the frozen global model.

    The global model is held outside the module tree, so the optimizer never sees its parameters.
    """

    def __init__(self, sub: nn.Module, reference: nn.Module):
        super().__init__()
        self.sub = sub
        self.task = sub.task
        self._reference = (reference,)
        self.alignment = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, features = self.sub.forward_with_features(x)
        with torch.no_grad():
            reference = self._reference[0].features(x)
        self.alignment = linear_cka(features, reference)
        return logits


class FedBKDClient(SubModelClient):
    """FedBKD's site: top-ψ neurons (ASE, Eqs. 2-3), λ·(1 − CKA(f_k, f_g)) beside the task loss (FCO, Eqs. 4-5),
    μ_k for the merge (Eqs. 6-7); ``fedbkd-variant`` ablates: ``ase-only`` (no CKA, no μ_k), ``fco-only`` (prefix)."""

    @property
    def selection(self) -> str:  # type: ignore[override]
        return "prefix" if self.rt.cfg.fedbkd_variant == "fco-only" else "saliency"

    @property
    def alignment_weight(self) -> float:
        """λ of the alignment loss: ``fedbkd-lambda``, 0 for ``ase-only``."""
        return 0.0 if self.rt.cfg.fedbkd_variant == "ase-only" else self.rt.cfg.fedbkd_lambda

    @property
    def computes_spread(self) -> bool:  # type: ignore[override]
        return weighs_by_spread(self.rt.cfg)

    def local_loss(self, sub: nn.Module, model: nn.Module) -> tuple[nn.Module, ExtraLoss | None]:
        weight = self.alignment_weight
        if weight == 0:
            return sub, None
        aligned = FeatureAligned(sub, model.eval())
        return aligned, lambda *_: weight * (1.0 - aligned.alignment)


@register_strategy
class FedBKD(SubModelStrategy):
    """FedBKD: top-ψ sub-encoders, CKA alignment to the global encoder, eigenvalue-weighted covered merge.

    Leaves a site: its sub-encoder's arrays, the kept neuron indices, n_k and μ_k.
    """

    name = "fedbkd"
    client_half = FedBKDClient
    options = (CAPACITIES, *FEDBKD_OPTIONS)

    @property
    def weighs_by_spread(self) -> bool:
        """w_k ∝ μ_k (Eq. 7), unless ``ase-only`` or ``fedbkd-eigen='none'`` (the diagnostic) weigh by n_k."""
        return weighs_by_spread(self.cfg)

    def merge_weight(self, reply: Reply) -> float:
        if not self.weighs_by_spread:
            return reply.num_examples
        return max(float(reply.metrics.get("feature-spread", 0.0)), 1e-12)
