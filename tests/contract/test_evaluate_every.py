"""run-config evaluate-every: the evaluate phase every few rounds and after the last.

Skipping an evaluation must change what is measured when, never what is trained: the sparse run logs the full
run's evaluations of the rounds it evaluates (the same values), trains the same models, and sends no evaluate
message in the other rounds. It is refused where a protocol evaluates on its own schedule, with evaluate-in-train
and with a privacy budget that may stop the run early.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import records, run_dir_of
from test_evaluate_in_train import evaluations, final_arrays, sent_types

from medflower.config import ExperimentConfig, defaults
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [
        ("fedavg", {}),
        ("sgca", {"sgca-solver": "closed-form"}),
        ("sift", {"sift-variant": "trainable-head", "sift-batch-size": 32, "sift-lr-first": 0.05, "sift-lr": 0.01}),
    ],
)
def test_a_run_evaluated_every_second_round_trains_what_the_full_run_does(tiny, strategy, extra):
    rounds, nodes = 5, 3
    base = tiny(strategy=strategy, **{"num-rounds": rounds}, **extra)
    full, full_grid = run_inprocess({**base, "run-name": "full"}, nodes)
    sparse, sparse_grid = run_inprocess({**base, "run-name": "sparse", "evaluate-every": 2}, nodes)
    a, b = run_dir_of({**base, "run-name": "full"}), run_dir_of({**base, "run-name": "sparse"})

    assert sorted({r["round"] for r in records(b, "eval")}) == [2, 4, 5]
    kept = Counter({k: v for k, v in evaluations(a).items() if any(f"('round', {r})" in k for r in (2, 4, 5))})
    assert evaluations(b) == kept and len(records(b, "eval")) == 3 * nodes
    assert [r["round"] for r in records(b, "train")] == [r["round"] for r in records(a, "train")]
    for k, v in final_arrays(a).items():
        np.testing.assert_array_equal(v, final_arrays(b)[k], err_msg=k)
    assert sparse["final"] == full["final"]
    evaluate = {rnd for (rnd, kind), n in sent_types(sparse_grid).items() if kind == "evaluate" and n}
    assert evaluate == {2, 4, 5}
    assert {rnd for (rnd, kind) in sent_types(full_grid) if kind == "evaluate"} == set(range(1, rounds + 1))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "fedkei"}, "strategy 'fedkei' evaluates in its own protocol (per task or phase); it works with"),
        ({"evaluate-in-train": True}, "evaluate-in-train carries every round's evaluation"),
        ({"dp": "site", "dp-target-epsilon": 100.0}, "would leave the last round trained without its evaluation"),
        ({"evaluate-every": 0}, "evaluate-every"),
    ],
)
def test_evaluate_every_is_refused_where_a_skipped_evaluation_would_be_lost(overrides, message):
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_run_config({**defaults(), "evaluate-every": 3, **overrides}, check_paths=False)
    assert "evaluate-every" in str(err.value) and message in str(err.value)


def test_the_strategies_that_take_evaluate_every_are_the_default_rounds_and_sift():
    from medflower.contract.server import FederatedStrategy
    from medflower.strategies import STRATEGIES

    for name, cls in STRATEGIES.items():
        takes = cls.run_round is FederatedStrategy.run_round or cls.sparse_evaluation
        config = {**defaults(), "strategy": name, "evaluate-every": 2}
        if takes:
            assert name == "sift" or cls.run_round is FederatedStrategy.run_round
        else:
            with pytest.raises(ConfigError, match="evaluates in its own protocol"):
                ExperimentConfig.from_run_config(config, check_paths=False)
