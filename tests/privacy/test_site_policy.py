"""A site's own privacy policy (privacy/policy.py): node-config limits checked at the site before it trains, and the
site's own ledger of what it released."""

import pytest
from helpers import records, run_dir_of

from medflower.config import ExperimentConfig, defaults
from medflower.inprocess import run_inprocess
from medflower.privacy.accounting import SENSITIVITY, ClientLevelAccountant
from medflower.privacy.policy import PolicyError, SitePolicy, planned_epsilon, spent_epsilon


def config(**values):
    return ExperimentConfig.from_run_config({**defaults(), **values})


def test_the_policy_reads_the_node_config_and_refuses_bad_values():
    assert not SitePolicy.from_node_config({}).active
    policy = SitePolicy.from_node_config({"dp-required": "true", "dp-min-noise-multiplier": 1.5, "dp-max-epsilon": 8})
    assert policy.required and policy.min_noise_multiplier == 1.5 and policy.max_epsilon == 8.0
    with pytest.raises(PolicyError, match="dp-min-noise-multiplier = -1: a number > 0"):
        SitePolicy.from_node_config({"dp-min-noise-multiplier": -1})
    with pytest.raises(PolicyError, match="dp-required = 'perhaps': true or false"):
        SitePolicy.from_node_config({"dp-required": "perhaps"})


def test_each_limit_names_the_run_config_value_that_breaks_it():
    policy = SitePolicy(required=True, min_noise_multiplier=1.0, max_clipping_norm=2.0)
    assert policy.violations(config(dp="none"))[0].startswith("the site requires noise added on the site")
    assert policy.violations(config(dp="server"))  # the server's noise is added after it saw the update
    assert policy.violations(config(dp="site", **{"dp-noise-multiplier": 0.5, "dp-clipping-norm": 3.0})) == [
        "dp-noise-multiplier = 0.5 is below the site's dp-min-noise-multiplier 1",
        "dp-clipping-norm = 3 is above the site's dp-max-clipping-norm 2",
    ]
    assert policy.violations(config(dp="site", **{"dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0})) == []
    sgd = config(**{"dp-sgd": True, "dp-sgd-noise-multiplier": 0.8, "dp-sgd-max-grad-norm": 1.0})
    assert policy.violations(sgd) == ["dp-sgd-noise-multiplier = 0.8 is below the site's dp-min-noise-multiplier 1"]


def test_the_planned_and_spent_epsilon_are_the_accountants():
    cfg = config(dp="site", **{"num-rounds": 4, "dp-noise-multiplier": 2.0})
    accountant = ClientLevelAccountant(2.0, cfg.dp_delta, sensitivity=SENSITIVITY["site"])
    accountant.compose_round(4)
    assert planned_epsilon(cfg, 100) == pytest.approx(accountant.epsilon())
    assert spent_epsilon(cfg, 4, 0.0) == pytest.approx(accountant.epsilon())
    assert spent_epsilon(cfg, 0, 0.0) == 0.0
    policy = SitePolicy(max_epsilon=accountant.epsilon() - 0.1)
    assert "the run's plan spends" in policy.epsilon_violation(planned_epsilon(cfg, 100), 0.0)
    assert "has spent" in policy.epsilon_violation(0.0, accountant.epsilon())


def test_a_site_refuses_a_run_below_its_policy_and_the_others_train(tiny):
    run = tiny(**{"run-name": "policy", "num-rounds": 2})
    run_inprocess(run, 2, node_configs=[{"dp-required": True}, {}])
    trained = {r["client"] for r in records(run_dir_of(run), "train")}
    assert trained == {"site-1"}
    server = records(run_dir_of(run), "server")
    assert all(r["num_failed"] == 1 for r in server)


def test_a_site_within_its_policy_trains_and_keeps_its_own_ledger(tiny, tmp_path, caplog):
    """dp='site' at z = 2 for 3 rounds: a site whose dp-max-epsilon covers the plan trains every round and logs the
    replace-one ε of its releases; one whose limit is below the plan is refused from its first round."""
    cfg_values = {"dp": "site", "dp-noise-multiplier": 2.0, "num-rounds": 3}
    planned = planned_epsilon(config(**cfg_values), 100)
    run = tiny(**{"run-name": "ledger", **cfg_values})
    caplog.set_level("INFO")
    node = [{"dp-max-epsilon": planned + 0.5, "state-dir": str(tmp_path / "a")}, {"dp-max-epsilon": planned / 2}]
    run_inprocess(run, 2, node_configs=node)
    trained = [r["client"] for r in records(run_dir_of(run), "train")]
    assert trained == ["site-0"] * 3
    spent = [line for line in caplog.messages if "site-0 has spent" in line]
    assert len(spent) == 3 and f"ε = {planned:.3g}" in spent[-1]
