"""The server's side of the privacy layer: the run config's checks before round 1 and the account of ε after each
round (docs/privacy.md#accounting).

- Client-level DP (``dp``): one release per round, ε from Flower's RDP accountant (``accounting.py``).
- DP-SGD (``dp-sgd``): each site accounts its own steps with Opacus's RDP accountant and reports its ε with its
  training metrics; the round's record carries the largest. Before round 1 the server plans each site's ε from the
  training size it declared and refuses a plan beyond ``dp-target-epsilon``; before every later round it stops the
  run if the next round's plan would pass the target. A site's ε in the ledger never decreases: a lower report (a
  site restarted without its state) is flagged and the higher value kept; a report below what the site's declared
  plan implies for one round's training is rejected as a bad reply (``check_train_reply``). The server cannot see
  the noise a site adds: the reported ε is the site's own claim.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from .. import run_folder
from ..options import ConfigError, bad

RELEASES_FILE = run_folder.PRIVACY_RELEASES  # in the run folder: one line per round whose training was sent


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
        from .accounting import SENSITIVITY, max_rounds_within, min_noise_within, planned_epsilon

        k = SENSITIVITY[cfg.dp]
        epsilon = planned_epsilon(cfg.dp_noise_multiplier, rounds, cfg.dp_delta, k)
        if epsilon > cfg.dp_target_epsilon:
            fit = max_rounds_within(cfg.dp_target_epsilon, cfg.dp_noise_multiplier, cfg.dp_delta, sensitivity=k)
            raise bad(
                "dp-target-epsilon",
                cfg.dp_target_epsilon,
                f"the plan spends ε = {epsilon:.3g} at dp-delta = {cfg.dp_delta:g} ({rounds} rounds at "
                f"dp-noise-multiplier = {cfg.dp_noise_multiplier:g}, dp={cfg.dp!r}: sensitivity {k:g}·C); within the "
                f"target: dp-noise-multiplier >= {min_noise_within(cfg.dp_target_epsilon, rounds, cfg.dp_delta, k):g}"
                + (f", or num-rounds <= {fit}" if fit else " (not one round fits at this noise multiplier)"),
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


def check_client_dp_model(cfg, model) -> None:
    """Refuse client-level DP for a model whose exchanged arrays include BatchNorm running statistics (a BatchNorm
    backbone trained whole): noise on a running variance makes it negative and the model's outputs NaN, and the
    statistics have no gradient to clip meaningfully with the parameters."""
    if cfg.dp == "none":
        return
    from ..models.arrays import is_running_statistic

    names = list(model.trainable_names()) if hasattr(model, "trainable_names") else list(model.get_trainable())
    statistics = [n for n in names if is_running_statistic(n)]
    if statistics:
        raise bad(
            "dp",
            cfg.dp,
            f"client-level DP would noise the BatchNorm running statistics the model exchanges ({len(statistics)} "
            f"arrays, e.g. {statistics[0]}; backbone={cfg.backbone!r}, adapter={cfg.adapter!r}): a noised running "
            "variance goes negative and the model's outputs become NaN. Use adapter='lora' or 'bottleneck' (the "
            "backbone and its statistics stay frozen), a ViT backbone with adapter='full' (LayerNorm, no running "
            "statistics), or dp='none' (docs/privacy.md#which-models-can-use-it)",
        )


def training_length(cfg) -> str:
    """How long a site trains a round, as the run config says it (for the refusals' messages)."""
    return f"local-steps {cfg.local_steps}" if cfg.local_steps > 0 else f"local-epochs {cfg.local_epochs}"


def _finite_number(value: Any) -> bool:
    """A reported metric that is a finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class PrivacyLedger:
    """The server's account of a run with ``dp`` or ``dp-sgd``: ε after each round, the stop at the target, the
    checkpointed state (so a resumed run goes on counting where it stopped)."""

    def __init__(self, cfg):
        from .accounting import SENSITIVITY, ClientLevelAccountant  # the server only: the sites never import it

        self.cfg = cfg
        target = cfg.dp_target_epsilon if cfg.dp_target_epsilon > 0 else None
        self.accountant = (
            ClientLevelAccountant(cfg.dp_noise_multiplier, cfg.dp_delta, target, SENSITIVITY[cfg.dp])
            if cfg.dp != "none"
            else None
        )
        self.site_epsilon: dict[str, float] = {}  # DP-SGD: the largest ε each site reported
        self.site_sizes: dict[str, int] = {}  # DP-SGD: the training size each site declared (its plan)
        self.decreases: list[dict[str, Any]] = []  # DP-SGD: reports lower than the site's earlier ones
        self.rounds = 0  # rounds accounted so far
        self.redone = 0  # client level: releases of rounds that a crash or resume-from made the run do again

    def mark_release(self, run_dir: Path, rnd: int) -> None:
        """Note on disk, durably and before any of round ``rnd``'s training messages is sent, that the round's
        updates are about to be released; ``count_unfinished`` reads these marks on resume."""
        if self.accountant is None:
            return  # DP-SGD: each site counts every step it takes, a redone round's included
        with open(Path(run_dir) / RELEASES_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"round": int(rnd), "time": round(time.time(), 3)}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def count_unfinished(self, run_dir: Path) -> int:
        """On resume: compose the releases of rounds whose training went out but which the checkpoint does not
        hold (the round a crash interrupted; with resume-from an earlier round, the rounds after it). The run does
        them again and releases them again, so each counts twice: the accountant never understates. A mark
        written just before a crash that came before any message was sent over-counts that round, never under.
        Returns how many releases were added."""
        if self.accountant is None:
            return 0
        path = Path(run_dir) / RELEASES_FILE
        marked = 0
        if path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    marked += isinstance(json.loads(line).get("round"), int)
                except (ValueError, AttributeError):
                    continue  # a line torn by the crash: its round's messages were not sent yet
        extra = marked - self.accountant.rounds
        if extra > 0:
            self.accountant.compose_round(extra)
            self.redone += extra
            log(
                WARNING,
                "[medflower] privacy: %d round(s) released updates that the checkpoint does not hold; they are "
                "redone and each release counts (client-level ε now %.4g)",
                extra,
                self.accountant.epsilon(),
            )
        return max(extra, 0)

    def allows_next_round(self) -> bool:
        """Whether the next round stays within dp-target-epsilon: the client-level accountant's next release, and
        with DP-SGD each known site's planned ε after one more round (its declared size, every round trained)."""
        if self.accountant is not None and self.accountant.next_round_exceeds():
            return False
        cfg = self.cfg
        if cfg.dp_sgd and cfg.dp_target_epsilon > 0:
            from .dp_sgd import planned_dp_sgd_epsilon

            for site, n in self.site_sizes.items():
                if max(planned_dp_sgd_epsilon(cfg, n, self.rounds + 1), self.site_epsilon.get(site, 0.0)) > (
                    cfg.dp_target_epsilon
                ):
                    return False
        return True

    def check_train_reply(self, client: str, num_train: int, metrics: Mapping[str, Any]) -> str | None:
        """DP-SGD: why a training reply's ``dp_sgd_epsilon`` is impossible, or None. A site that trained in this
        round took at least ``local-epochs`` epochs of steps at its declared size, so its ε is at least that plan's
        ε for one round; a lower report (0, say) is refused as a bad reply. The declared size is kept for the
        run's stop at the target."""
        if not self.cfg.dp_sgd or "dp_sgd_epsilon" not in metrics:
            return None
        from .dp_sgd import planned_dp_sgd_epsilon

        self.site_sizes[client] = int(num_train)
        reported = metrics["dp_sgd_epsilon"]
        if not _finite_number(reported):
            return f"dp_sgd_epsilon must be a finite number, got {reported!r}"
        floor = planned_dp_sgd_epsilon(self.cfg, int(num_train), 1)
        if reported < floor * (1 - 1e-6):
            return (
                f"dp_sgd_epsilon = {reported:g} is below {floor:.4g}, the ε of one round of DP-SGD at its declared "
                f"training size {num_train} (batch-size {self.cfg.batch_size}, {training_length(self.cfg)}, "
                f"dp-sgd-noise-multiplier {self.cfg.dp_sgd_noise_multiplier:g})"
            )
        return None

    def check_sites(self, num_train: Mapping[str, int], rounds: int) -> None:
        """DP-SGD with a target: refuse, before round 1, a site whose plan (its declared training size, every round
        trained) spends more than the target."""
        cfg = self.cfg
        if not cfg.dp_sgd:
            return
        self.site_sizes.update({str(k): int(v) for k, v in num_train.items()})
        if not cfg.dp_target_epsilon > 0:
            return
        from .dp_sgd import planned_dp_sgd_epsilon

        for site, n in sorted(num_train.items()):
            epsilon = planned_dp_sgd_epsilon(cfg, n, rounds)
            if epsilon > cfg.dp_target_epsilon:
                raise ConfigError(
                    f"run-config 'dp-target-epsilon' = {cfg.dp_target_epsilon!r} is invalid: with DP-SGD, site "
                    f"{site!r} ({n} training images, batch-size {cfg.batch_size}, {rounds} rounds of "
                    f"{training_length(cfg)}) spends ε = {epsilon:.3g} at dp-delta = {cfg.dp_delta:g}; raise "
                    f"dp-sgd-noise-multiplier (now {cfg.dp_sgd_noise_multiplier:g}) or lower num-rounds or "
                    f"{'local-steps' if cfg.local_steps > 0 else 'local-epochs'}"
                )

    def after_round(self, train_metrics: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Count the round and give its record the ε so far: ``dp_epsilon`` (client level: every site that trained
        released its update once), ``dp_sgd_epsilon`` (the largest any site reported, each site's never lowered)
        and ``dp_sgd_epsilon_decreased`` (the sites whose report was below their earlier one, if any)."""
        out: dict[str, Any] = {}
        self.rounds += 1
        if self.accountant is not None:
            self.accountant.compose_round()
            out["dp_epsilon"] = self.accountant.epsilon()
        decreased = []
        for site, metrics in sorted(train_metrics.items()):
            reported = metrics.get("dp_sgd_epsilon")
            if not _finite_number(reported):
                continue
            before = self.site_epsilon.get(site)
            if before is not None and reported < before:  # never lower a site's ε: keep the largest and flag it
                self.decreases.append({"client": site, "round": self.rounds, "reported": reported, "kept": before})
                decreased.append(site)
                log(
                    WARNING,
                    "[medflower] site %s reported dp-sgd epsilon %.4g, below its earlier %.4g (a site restarted "
                    "without its state folder counts its steps from 0 again); the ledger keeps %.4g",
                    site,
                    reported,
                    before,
                    before,
                )
                continue
            self.site_epsilon[site] = float(reported)
        if decreased:
            out["dp_sgd_epsilon_decreased"] = decreased
        if self.cfg.dp_sgd and self.site_epsilon:
            out["dp_sgd_epsilon"] = max(self.site_epsilon.values())
        if out:
            out["dp_delta"] = self.cfg.dp_delta
        return out

    def summary(self) -> dict[str, dict]:
        cfg = self.cfg
        privacy: dict[str, Any] = {"delta": cfg.dp_delta, "target_epsilon": cfg.dp_target_epsilon or None}
        if self.accountant is not None:
            from .accounting import RELATION

            privacy["client_level"] = {
                "dp": cfg.dp,
                "neighbouring": RELATION[cfg.dp],
                "noise_multiplier": cfg.dp_noise_multiplier,
                "clipping_norm": cfg.dp_clipping_norm,
                "epsilon": self.accountant.epsilon(),
                "rounds": self.accountant.rounds,
                "accountant": "RDP (Flower's RdpAccountant over dp-accounting), no amplification by sampling, "
                f"neighbouring datasets: {RELATION[cfg.dp]}",
                "releases": self.accountant.rounds,
                "redone_releases": self.redone,
            }
        if cfg.dp_sgd:
            privacy["dp_sgd"] = {
                "noise_multiplier": cfg.dp_sgd_noise_multiplier,
                "max_grad_norm": cfg.dp_sgd_max_grad_norm,
                "epsilon": max(self.site_epsilon.values(), default=0.0),
                "epsilon_per_site": dict(sorted(self.site_epsilon.items())),
                "accountant": "RDP (Opacus), Poisson-sampled batches, each site its own, as the site reports it",
                "epsilon_decreases": list(self.decreases),
            }
        return {"privacy": privacy}

    def state_dict(self) -> dict:
        return {
            "client_level": self.accountant.state_dict() if self.accountant is not None else None,
            "dp_sgd_epsilon": self.site_epsilon,
            "dp_sgd_sizes": self.site_sizes,
            "dp_sgd_decreases": self.decreases,
            "rounds": self.rounds,
            "redone": self.redone,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.accountant is not None and state.get("client_level"):
            self.accountant.load_state_dict(state["client_level"])
        self.site_epsilon = {str(k): float(v) for k, v in (state.get("dp_sgd_epsilon") or {}).items()}
        self.site_sizes = {str(k): int(v) for k, v in (state.get("dp_sgd_sizes") or {}).items()}
        self.decreases = list(state.get("dp_sgd_decreases") or [])
        fallback = self.accountant.rounds if self.accountant is not None else 0
        self.rounds = int(state.get("rounds", fallback))
        self.redone = int(state.get("redone", 0))
