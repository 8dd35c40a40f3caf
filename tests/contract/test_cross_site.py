"""run-config cross-site-evaluation: after the last round, the site x model matrix of the final models.

With one global model every site evaluates it once more and the matrix is one column (the same arrays as the last
round's evaluation, so the same values); with a personalised strategy each site's model never leaves it and the
matrix is its diagonal, from the last evaluation, with no message sent. Strategies with protocols of their own are
refused before any round, and the default (off) adds nothing to a run's outputs.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from helpers import TINY, records

from medflower.config import ExperimentConfig, defaults
from medflower.contract.evaluation import scalar_metrics
from medflower.contract.server import FederatedStrategy
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies import STRATEGIES

SMALL = {**TINY, "synthetic-size": 96, "num-rounds": 2, "batch-size": 16}
NODES = 2


def _run(tmp_path, name: str, **config):
    summary, grid = run_inprocess({**SMALL, "output-dir": str(tmp_path), "run-name": name, **config}, num_nodes=NODES)
    return summary, grid, tmp_path / name


def _evaluate_messages(grid) -> Counter:
    return Counter(int(m.metadata.group_id) for m in grid.sent if m.metadata.message_type == "evaluate")


def test_global_model_is_evaluated_by_every_site_and_written_to_the_summary(tmp_path):
    summary, grid, run_dir = _run(tmp_path, "fedavg", strategy="fedavg", **{"cross-site-evaluation": True})
    cross = summary["cross_site"]
    assert cross["models"] == ["global"] and cross["round"] == 2
    last = {r["client"]: scalar_metrics(r) for r in records(run_dir, "eval") if r["round"] == 2}
    assert sorted(cross["matrix"]) == sorted(last) and len(last) == NODES
    for site, models in cross["matrix"].items():  # the same arrays as the last evaluation: the same values
        assert list(models) == ["global"]
        assert models["global"] == pytest.approx(last[site], rel=1e-6)
        assert {"auc", "accuracy", "loss", "val_auc"} <= set(models["global"])
    assert json.loads((run_dir / "summary.json").read_text())["cross_site"] == cross
    # one more evaluate message per site after the last round, its bytes counted in the totals
    assert _evaluate_messages(grid)[2] == 2 * NODES
    server = records(run_dir, "server")
    (extra,) = [r for r in server if r.get("cross_site")]
    assert extra["round"] == 2 and extra["bytes_down"] > 0  # a reply of metrics only counts no array bytes
    assert summary["communication"]["bytes_down"] == sum(r["bytes_down"] for r in server)
    md = (run_dir / "summary.md").read_text()
    assert "## Cross-site evaluation" in md and "final global model" in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and "| global |" in line]
    assert sorted(line.split(" | ")[0][2:] for line in rows) == sorted(last)


@pytest.mark.parametrize("strategy", ["local"])
def test_personalised_strategy_gives_the_diagonal_and_says_why(tmp_path, strategy):
    summary, grid, run_dir = _run(tmp_path, strategy, strategy=strategy, **{"cross-site-evaluation": True})
    cross = summary["cross_site"]
    last = {r["client"]: scalar_metrics(r) for r in records(run_dir, "eval") if r["round"] == 2}
    assert cross["models"] == sorted(last) and len(last) == NODES
    for site, models in cross["matrix"].items():
        assert models == {site: last[site]}  # own model on own data only
    assert "never leaves" in cross["off_diagonal"]
    assert _evaluate_messages(grid)[2] == NODES  # nothing sent after the last round
    assert not any(r.get("cross_site") for r in records(run_dir, "server"))
    md = (run_dir / "summary.md").read_text()
    assert "## Cross-site evaluation" in md and "Off the diagonal: not available" in md
    assert sum("| own |" in line for line in md.splitlines()) == NODES


def test_default_off_changes_nothing_and_a_finished_run_may_be_resumed_with_it(tmp_path):
    summary, grid, run_dir = _run(tmp_path, "off", strategy="fedavg", **{"num-rounds": 1})
    assert "cross_site" not in summary
    assert "Cross-site" not in (run_dir / "summary.md").read_text()
    assert not any(r.get("cross_site") for r in records(run_dir, "server"))
    assert _evaluate_messages(grid)[1] == NODES
    # the option acts after the last round only: the finished run resumed with it evaluates its final model
    resumed, grid, _ = _run(
        tmp_path,
        "off",
        strategy="fedavg",
        **{"num-rounds": 1, "resume-from": str(run_dir), "cross-site-evaluation": True},
    )
    last = {r["client"]: scalar_metrics(r) for r in records(run_dir, "eval") if r["round"] == 1}
    assert sorted(resumed["cross_site"]["matrix"]) == sorted(last)
    for site, models in resumed["cross_site"]["matrix"].items():
        assert models["global"] == pytest.approx(last[site], rel=1e-6)
    assert not any(m.metadata.message_type == "train" for m in grid.sent)


def test_strategies_with_a_protocol_of_their_own_are_refused():
    own = [n for n, c in STRATEGIES.items() if c.run_round is not FederatedStrategy.run_round]
    assert "fedkei" in own
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_run_config(
            {**defaults(), "strategy": "fedcurv", "cross-site-evaluation": True}, check_paths=False
        )
    text = str(err.value)
    assert "cross-site-evaluation" in text and "protocol of its own" in text and "fedavg" in text
    assert not any(name in text.split("works with", 1)[1] for name in own)


def test_a_global_model_strategy_sends_every_site_the_same_arrays_as_received():
    """``global_model`` is claimed only where the default round and evaluate message are used as they are."""
    for name, cls in STRATEGIES.items():
        if cls.global_model:
            assert cls.run_round is FederatedStrategy.run_round, name
            assert cls.evaluate_content is FederatedStrategy.evaluate_content, name
