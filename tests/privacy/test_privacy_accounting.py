"""What medflower reports as ε, and what it refuses (docs/privacy.md#accounting): dp='site' accounted as local DP
over any two datasets of a site (sensitivity 2C), a site's DP-SGD ε that never decreases in the ledger, the DP-SGD
plan from the training loader's own length and the stop at the target, the noise-only step of an empty Poisson
batch, client-level DP refused for exchanged BatchNorm statistics, and an impossible DP-SGD report rejected."""

import logging

import numpy as np
import pytest
import torch
from helpers import records, run_dir_of

from medflower.config import ConfigError, ExperimentConfig
from medflower.inprocess import run_inprocess
from medflower.privacy import PrivacyLedger, PrivateTraining, dp_sgd_epsilon
from medflower.privacy.accounting import planned_epsilon
from medflower.privacy.dp_sgd import batches_per_epoch, planned_dp_sgd_epsilon
from medflower.results import privacy_lines


def _cfg(**overrides):
    return ExperimentConfig.from_run_config(overrides, check_paths=False)


# ----------------------------------------------------------------------------- dp='site': replace-one, 2C
@pytest.mark.parametrize("rounds, expected", [(1, 10.73), (20, 81.1)])
def test_site_mode_is_accounted_over_any_two_datasets_of_a_site(rounds, expected):
    """Each site's noised update is released, so two datasets of one site give clipped updates up to 2C apart
    against noise z·C: the Gaussian mechanism at noise multiplier z/2 (at z = 1, δ = 1e-5: 10.73 after one round,
    not the 4.73 of sensitivity C)."""
    from opacus.accountants import RDPAccountant

    ledger = PrivacyLedger(_cfg(dp="site", **{"dp-noise-multiplier": 1.0}))
    for _ in range(rounds):
        out = ledger.after_round({})
    assert out["dp_epsilon"] == pytest.approx(expected, rel=2e-3)
    independent = RDPAccountant()  # Opacus's accountant, an independent implementation, at sensitivity 2C
    independent.history = [(1.0 / 2, 1.0, rounds)]
    assert out["dp_epsilon"] == pytest.approx(independent.get_epsilon(1e-5), rel=1e-3)
    # the classic RDP bound of a Gaussian with sensitivity 2C and std z·C: R·α·(2C)²/(2(zC)²) + log(1/δ)/(α−1)
    alphas = np.linspace(1.01, 400, 200_000)
    classic = np.min(rounds * alphas * 4 / 2 + np.log(1e5) / (alphas - 1))
    assert 0.5 * classic <= out["dp_epsilon"] <= classic + 1e-9
    level = ledger.summary()["privacy"]["client_level"]
    assert level["neighbouring"].startswith("replace-one") and "2C" in level["accountant"]


def test_server_mode_stays_add_or_remove_one_site():
    ledger = PrivacyLedger(_cfg(dp="server", **{"dp-noise-multiplier": 1.0}))
    assert ledger.after_round({})["dp_epsilon"] == pytest.approx(4.73, rel=2e-3)
    assert ledger.summary()["privacy"]["client_level"]["neighbouring"].startswith("add-or-remove-one site")


def test_site_mode_target_is_checked_at_sensitivity_2c():
    # 5 rounds at z = 1: 12.3 with sensitivity C, 30.1 with 2C
    assert planned_epsilon(1.0, 5, 1e-5) < 20 < planned_epsilon(1.0, 5, 1e-5, 2.0)
    _cfg(dp="server", **{"dp-target-epsilon": 20.0, "num-rounds": 5})
    with pytest.raises(ConfigError, match=r"'dp-target-epsilon' = 20.0 is invalid: the plan spends ε = 30.1"):
        _cfg(dp="site", **{"dp-target-epsilon": 20.0, "num-rounds": 5})


# ----------------------------------------------------------------------------- DP-SGD ε never decreases
def test_a_sites_dp_sgd_epsilon_never_decreases_and_a_lower_report_is_flagged(caplog):
    cfg = _cfg(**{"dp-sgd": True})
    ledger = PrivacyLedger(cfg)
    ledger.after_round({"a": {"dp_sgd_epsilon": 6.0}, "b": {"dp_sgd_epsilon": 1.0}})
    with caplog.at_level(logging.WARNING):
        out = ledger.after_round({"a": {"dp_sgd_epsilon": 1.2}, "b": {"dp_sgd_epsilon": 1.5}})
    assert out["dp_sgd_epsilon"] == 6.0 and out["dp_sgd_epsilon_decreased"] == ["a"]
    assert ledger.site_epsilon == {"a": 6.0, "b": 1.5}
    assert "site a reported dp-sgd epsilon 1.2, below its earlier 6" in caplog.text
    sgd = ledger.summary()["privacy"]["dp_sgd"]
    assert sgd["epsilon"] == 6.0 and sgd["epsilon_per_site"] == {"a": 6.0, "b": 1.5}
    assert sgd["epsilon_decreases"] == [{"client": "a", "round": 2, "reported": 1.2, "kept": 6.0}]
    md = "\n".join(privacy_lines(ledger.summary()["privacy"]))
    assert "a 6.000" in md and "**Flag**: site a reported DP-SGD ε = 1.200 in round 2" in md
    resumed = PrivacyLedger(cfg)  # the checkpointed state keeps the maximum and the flag
    resumed.load_state_dict(ledger.state_dict())
    assert resumed.site_epsilon == {"a": 6.0, "b": 1.5} and resumed.decreases == ledger.decreases
    assert resumed.rounds == 2


# ----------------------------------------------------------------------------- DP-SGD plan and stop
def test_dp_sgd_plan_uses_the_training_loaders_length():
    """n = 65, B = 32: the training loader drops a last batch of one image, so a site takes 2 steps per epoch at
    sample rate 1/2 (ε 16.6 after 10 rounds at z = 1), not 3 at 1/3 (14.2)."""
    from medflower.data.transforms import make_loader

    x, y = torch.zeros(65, 4, 4, 3, dtype=torch.uint8), torch.zeros(65, dtype=torch.long)  # HxWx3 images
    loader = make_loader(torch.utils.data.TensorDataset(x, y), 32, shuffle=True, seed=0)
    assert batches_per_epoch(65, 32) == len(loader) == 2
    private = PrivateTraining(1.0, 1.0)
    private.attach(torch.nn.Linear(4, 2), torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1), loader, "cpu")
    private.close()
    cfg = _cfg(**{"dp-sgd": True, "batch-size": 32, "num-rounds": 10})
    reported = dp_sgd_epsilon(1.0, private.sample_rate, 10 * len(loader), 1e-5)  # what the site reports
    assert planned_dp_sgd_epsilon(cfg, 65, 10) == pytest.approx(reported)
    assert reported == pytest.approx(16.6, abs=0.05)


def test_dp_sgd_run_stops_before_a_round_that_would_pass_the_target():
    sizes = {"a": 65, "b": 300}
    base = _cfg(**{"dp-sgd": True, "batch-size": 32})
    target = (planned_dp_sgd_epsilon(base, 65, 3) + planned_dp_sgd_epsilon(base, 65, 4)) / 2
    ledger = PrivacyLedger(_cfg(**{"dp-sgd": True, "batch-size": 32, "dp-target-epsilon": target, "num-rounds": 3}))
    ledger.check_sites(sizes, 3)  # the plan of 3 rounds fits
    for rnd in range(1, 4):
        assert ledger.allows_next_round()
        ledger.after_round(
            {site: {"dp_sgd_epsilon": planned_dp_sgd_epsilon(base, n, rnd)} for site, n in sizes.items()}
        )
    assert not ledger.allows_next_round()  # round 4 would take site a past the target
    resumed = PrivacyLedger(ledger.cfg)
    resumed.load_state_dict(ledger.state_dict())
    assert not resumed.allows_next_round()


# ----------------------------------------------------------------------------- empty Poisson batch
def test_an_empty_poisson_batch_is_a_noise_only_step(monkeypatch):
    """Opacus adds noise on an empty batch (the sum of no clipped gradients is zero): the parameters move."""
    from medflower.training.loops import OptimizerSpec, train_epochs

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    attach = PrivateTraining.attach

    def empty_batches(self, model, optimizer, loader, device):
        net, opt, _ = attach(self, model, optimizer, loader, device)
        return net, opt, [(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))]

    monkeypatch.setattr(PrivateTraining, "attach", empty_batches)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8).long()), 4)
    private = PrivateTraining(noise_multiplier=1.0, max_grad_norm=1.0)
    out = train_epochs(
        model, loader, epochs=1, optimizer=OptimizerSpec("sgd", lr=1.0, momentum=0.0), device=torch.device("cpu"),
        private=private, precision="fp32",
    )  # fmt: skip
    assert private.steps == 1 and out["train_steps"] == 1.0
    moved = [(p.detach() - b) for p, b in zip(model.parameters(), before)]
    assert all(torch.all(m != 0) for m in moved)  # every entry got noise N(0, (z·C)²) / expected batch size 4
    assert 0.05 < float(torch.cat([m.ravel() for m in moved]).std()) < 1.0  # ≈ 0.25
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


# ----------------------------------------------------------------------------- BatchNorm statistics
@pytest.mark.parametrize("mode", ["site", "server"])
def test_client_dp_is_refused_for_exchanged_batchnorm_statistics(tiny, mode):
    config = tiny(**{"run-name": f"dp-bn-{mode}", "dp": mode, "backbone": "resnet18", "adapter": "full"})
    with pytest.raises(ConfigError, match=rf"'dp' = '{mode}' is invalid: client-level DP would noise the BatchNorm "):
        run_inprocess(config, num_nodes=2)
    assert not (run_dir_of(config) / "metrics.jsonl").exists()  # refused before round 1


def test_client_dp_is_allowed_for_a_frozen_batchnorm_backbone_and_a_full_vit():
    from medflower.models import build_model
    from medflower.privacy.ledger import check_client_dp_model

    for overrides in ({"backbone": "resnet18", "adapter": "lora"}, {"adapter": "full"}):
        cfg = _cfg(dp="site", **{"img-size": 16, "patch-size": 8, "backbone-weights": "none", **overrides})
        try:
            model = build_model(cfg.model_spec(["a", "b"]), 2)
        except Exception as exc:  # an adapter the backbone does not take is not what this test is about
            pytest.skip(f"{overrides}: {exc}")
        check_client_dp_model(cfg, model)


# ----------------------------------------------------------------------------- impossible reports
def test_an_impossible_dp_sgd_epsilon_is_refused():
    cfg = _cfg(**{"dp-sgd": True, "batch-size": 32})
    ledger = PrivacyLedger(cfg)
    floor = planned_dp_sgd_epsilon(cfg, 65, 1)
    assert ledger.check_train_reply("a", 65, {"dp_sgd_epsilon": floor}) is None
    assert ledger.check_train_reply("a", 65, {"dp_sgd_epsilon": 2 * floor}) is None
    assert "below" in ledger.check_train_reply("a", 65, {"dp_sgd_epsilon": 0.0})
    assert "finite" in ledger.check_train_reply("a", 65, {"dp_sgd_epsilon": float("nan")})


def test_a_site_reporting_dp_sgd_epsilon_0_is_rejected_as_a_bad_reply(tiny, monkeypatch):
    from medflower.contract.client import ClientRuntime

    honest = ClientRuntime.account_dp_sgd

    def lying(self, private):
        epsilon = honest(self, private)
        return 0.0 if self.partition_id == 0 else epsilon

    monkeypatch.setattr(ClientRuntime, "account_dp_sgd", lying)
    config = tiny(**{"run-name": "dp-sgd-liar", "dp-sgd": True, "num-rounds": 1, "synthetic-size": 160})
    summary, _ = run_inprocess(config, num_nodes=2)
    server = records(run_dir_of(config), "server")[-1]
    assert server["num_rejected"] == 1 and "dp_sgd_epsilon = 0 is below" in server["rejected"][0]
    per_site = summary["privacy"]["dp_sgd"]["epsilon_per_site"]
    assert len(per_site) == 1 and min(per_site.values()) > 0


# ----------------------------------------------------------------------------- redone rounds
def test_a_round_redone_after_a_crash_counts_both_releases(tiny, monkeypatch):
    """Round 2's noised updates went out, then the server died before its checkpoint: the resumed run releases
    round 2 again, and the client-level ε composes 3 releases, not 2; resume-from an earlier round counts the
    rounds after it the same way."""
    from medflower.contract.server import FederatedStrategy

    class Crash(Exception):
        pass

    original = FederatedStrategy.run_round
    crash_in: list[int] = []

    def run_round(self, grid, rnd):
        original(self, grid, rnd)  # the sites trained and released their noised updates
        if rnd in crash_in:
            raise Crash

    monkeypatch.setattr(FederatedStrategy, "run_round", run_round)
    z, delta = 2.0, 1e-5
    config = tiny(**{"run-name": "dp-crash", "dp": "site", "dp-noise-multiplier": z, "num-rounds": 2})
    crash_in.append(2)
    with pytest.raises(Crash):
        run_inprocess(config, num_nodes=2)
    crash_in.clear()
    summary, _ = run_inprocess({**config, "resume-from": str(run_dir_of(config))}, num_nodes=2)
    level = summary["privacy"]["client_level"]
    assert level["releases"] == 3 and level["redone_releases"] == 1
    assert level["epsilon"] == pytest.approx(planned_epsilon(z, 3, delta, 2.0))
    assert level["epsilon"] > planned_epsilon(z, 2, delta, 2.0)
    # From round 1's checkpoint: round 2 was released twice already and is released a third time.
    again, _ = run_inprocess(
        {**config, "resume-from": str(run_dir_of(config) / "checkpoint" / "round-000001")}, num_nodes=2
    )
    assert again["privacy"]["client_level"]["releases"] == 4
    assert again["privacy"]["client_level"]["epsilon"] == pytest.approx(planned_epsilon(z, 4, delta, 2.0))
