"""The server's side of the privacy layer: the run config's checks before round 1 and the account of ε after each
round (docs/privacy.md#accounting).

- Client-level DP (``dp``): one release per round, ε from Flower's RDP accountant (``accounting.py``).
- DP-SGD (``dp-sgd``): each site accounts its own steps with Opacus's RDP accountant and reports its ε with its
  training metrics; the round's record carries the largest. Before round 1 the server plans each site's ε from the
  training size it declared and refuses a plan beyond ``dp-target-epsilon``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..options import ConfigError, bad


def check_privacy_config(
    cfg, strategy_name: str, modes: tuple[str, ...], dp_sgd: bool, supported: Mapping[str, list[str]], rounds: int
) -> None:
    """Refuse a dp mode or DP-SGD the strategy cannot use, and a client-level plan whose ε exceeds the target."""
    if cfg.dp == "none" and not cfg.dp_sgd:
        if cfg.dp_target_epsilon > 0:
            raise bad(
                "dp-target-epsilon", cfg.dp_target_epsilon, "a target ε needs dp='site', dp='server' or dp-sgd=true"
            )
        return
    where = "docs/privacy.md#which-strategies-can-use-it"
    if cfg.dp != "none" and cfg.dp not in modes:
        able = "; ".join(f"dp={m!r} works with {', '.join(supported[m])}" for m in ("site", "server") if supported[m])
        raise bad("dp", cfg.dp, f"strategy {strategy_name!r} cannot use it ({where}); {able}")
    if cfg.dp_sgd and not dp_sgd:
        raise bad(
            "dp-sgd",
            True,
            f"strategy {strategy_name!r} cannot use it ({where}); dp-sgd works with {', '.join(supported['dp-sgd'])}",
        )
    if cfg.dp != "none" and cfg.dp_target_epsilon > 0:
        from .accounting import max_rounds_within, min_noise_within, planned_epsilon

        epsilon = planned_epsilon(cfg.dp_noise_multiplier, rounds, cfg.dp_delta)
        if epsilon > cfg.dp_target_epsilon:
            raise bad(
                "dp-target-epsilon",
                cfg.dp_target_epsilon,
                f"the plan spends ε = {epsilon:.3g} at dp-delta = {cfg.dp_delta:g} ({rounds} rounds at "
                f"dp-noise-multiplier = {cfg.dp_noise_multiplier:g}); within the target: dp-noise-multiplier >= "
                f"{min_noise_within(cfg.dp_target_epsilon, rounds, cfg.dp_delta):g}, or num-rounds <= "
                f"{max_rounds_within(cfg.dp_target_epsilon, cfg.dp_noise_multiplier, cfg.dp_delta)}",
            )


def check_dp_sgd_model(cfg, model) -> None:
    """Refuse DP-SGD for a model with a trainable layer Opacus computes no per-sample gradient for."""
    if not cfg.dp_sgd:
        return
    from .dp_sgd import unsupported_layers

    problems = unsupported_layers(model, cfg.img_size)
    if problems:
        raise bad(
            "dp-sgd",
            True,
            f"Opacus computes no per-sample gradient for {'; '.join(problems[:3])}"
            f"{f' and {len(problems) - 3} more' if len(problems) > 3 else ''}: use a ViT backbone with "
            "adapter='lora', 'bottleneck' or 'full' (docs/privacy.md#sample-level-dp-sgd)",
        )


class PrivacyLedger:
    """The server's account of a run with ``dp`` or ``dp-sgd``: ε after each round, the stop at the target, the
    checkpointed state (so a resumed run goes on counting where it stopped)."""

    def __init__(self, cfg):
        from .accounting import ClientLevelAccountant  # the server only: the sites never import it

        self.cfg = cfg
        target = cfg.dp_target_epsilon if cfg.dp_target_epsilon > 0 else None
        self.accountant = (
            ClientLevelAccountant(cfg.dp_noise_multiplier, cfg.dp_delta, target) if cfg.dp != "none" else None
        )
        self.site_epsilon: dict[str, float] = {}  # DP-SGD: the latest ε each site reported

    def allows_next_round(self) -> bool:
        return self.accountant is None or not self.accountant.next_round_exceeds()

    def check_sites(self, num_train: Mapping[str, int], rounds: int) -> None:
        """DP-SGD with a target: refuse, before round 1, a site whose plan (its declared training size, every round
        trained) spends more than the target."""
        cfg = self.cfg
        if not (cfg.dp_sgd and cfg.dp_target_epsilon > 0):
            return
        from .dp_sgd import planned_dp_sgd_epsilon

        for site, n in sorted(num_train.items()):
            epsilon = planned_dp_sgd_epsilon(cfg, n, rounds)
            if epsilon > cfg.dp_target_epsilon:
                raise ConfigError(
                    f"run-config 'dp-target-epsilon' = {cfg.dp_target_epsilon!r} is invalid: with DP-SGD, site "
                    f"{site!r} ({n} training images, batch-size {cfg.batch_size}, {rounds} rounds of "
                    f"{cfg.local_epochs} epochs) spends ε = {epsilon:.3g} at dp-delta = {cfg.dp_delta:g}; raise "
                    f"dp-sgd-noise-multiplier (now {cfg.dp_sgd_noise_multiplier:g}) or lower num-rounds or local-epochs"
                )

    def after_round(self, train_metrics: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
        """Count the round and give its record the ε so far: ``dp_epsilon`` (client level: every site that trained
        released its update once) and ``dp_sgd_epsilon`` (the largest a site reported)."""
        out: dict[str, float] = {}
        if self.accountant is not None:
            self.accountant.compose_round()
            out["dp_epsilon"] = self.accountant.epsilon()
        for site, metrics in train_metrics.items():
            if isinstance(metrics.get("dp_sgd_epsilon"), (int, float)):
                self.site_epsilon[site] = float(metrics["dp_sgd_epsilon"])
        if self.cfg.dp_sgd and self.site_epsilon:
            out["dp_sgd_epsilon"] = max(self.site_epsilon.values())
        if out:
            out["dp_delta"] = self.cfg.dp_delta
        return out

    def summary(self) -> dict[str, dict]:
        cfg = self.cfg
        privacy: dict[str, Any] = {"delta": cfg.dp_delta, "target_epsilon": cfg.dp_target_epsilon or None}
        if self.accountant is not None:
            privacy["client_level"] = {
                "dp": cfg.dp,
                "noise_multiplier": cfg.dp_noise_multiplier,
                "clipping_norm": cfg.dp_clipping_norm,
                "epsilon": self.accountant.epsilon(),
                "rounds": self.accountant.rounds,
                "accountant": "RDP (Flower's RdpAccountant over dp-accounting), no amplification by sampling",
            }
        if cfg.dp_sgd:
            privacy["dp_sgd"] = {
                "noise_multiplier": cfg.dp_sgd_noise_multiplier,
                "max_grad_norm": cfg.dp_sgd_max_grad_norm,
                "epsilon": max(self.site_epsilon.values(), default=0.0),
                "epsilon_per_site": dict(sorted(self.site_epsilon.items())),
                "accountant": "RDP (Opacus), Poisson-sampled batches, each site its own",
            }
        return {"privacy": privacy}

    def state_dict(self) -> dict:
        return {
            "client_level": self.accountant.state_dict() if self.accountant is not None else None,
            "dp_sgd_epsilon": self.site_epsilon,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.accountant is not None and state.get("client_level"):
            self.accountant.load_state_dict(state["client_level"])
        self.site_epsilon = {str(k): float(v) for k, v in (state.get("dp_sgd_epsilon") or {}).items()}
