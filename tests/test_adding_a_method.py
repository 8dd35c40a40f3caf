"""docs/adding-a-method.md's worked example, run as written: a new method touches only its own module."""

import importlib.util
import re
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from helpers import run_dir_of

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import Checkpointer
from medflower.inprocess import run_inprocess
from medflower.strategies import STRATEGIES

PAGE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-method.md"
MODULE = "medflower.strategies.fedavgm"


@pytest.fixture
def fedavgm(tmp_path):
    """The page's code block imported as medflower.strategies.fedavgm; unregistered afterwards."""
    example = PAGE.read_text().split("## A worked example", 1)[1]
    code = re.search(r"```python\n(.*?)```", example, re.S).group(1)
    path = tmp_path / "fedavgm.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
        yield module.FedAvgM
    finally:
        STRATEGIES.pop("fedavgm", None)
        sys.modules.pop(MODULE, None)


def test_the_example_registers_and_the_run_config_knows_its_key(fedavgm):
    assert STRATEGIES["fedavgm"] is fedavgm and "Leaves a site:" in fedavgm.__doc__
    cfg = ExperimentConfig.from_run_config({**defaults(), "strategy": "fedavgm", "server-momentum": 0.5})
    assert cfg.server_momentum == 0.5 and cfg.strategy_class is fedavgm
    with pytest.raises(ConfigError, match="'server-momentum' = 1.5 is invalid: must be in \\[0, 1\\)"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "fedavgm", "server-momentum": 1.5})


def test_the_example_follows_its_equations_and_resumes(fedavgm, tiny, monkeypatch):
    seen = []  # (global arrays before, replies' arrays and sizes) per round
    original = fedavgm.aggregate_train

    def spy(self, rnd, replies):
        seen.append(
            ({k: v.copy() for k, v in self.global_arrays.items()}, [(r.arrays, r.num_examples) for r in replies])
        )
        original(self, rnd, replies)

    monkeypatch.setattr(fedavgm, "aggregate_train", spy)
    common = {"strategy": "fedavgm", "server-momentum": 0.5}
    whole = tiny(**common, **{"run-name": "whole", "num-rounds": 2})
    run_inprocess(whole, num_nodes=2)
    velocity, theta = None, None
    for before, replies in seen:
        sizes = np.array([n for _, n in replies])
        mean = {k: sum(w * a[k].astype(np.float64) for (a, _), w in zip(replies, sizes / sizes.sum())) for k in before}
        step = {k: mean[k] - before[k] for k in before}
        velocity = step if velocity is None else {k: 0.5 * velocity[k] + step[k] for k in before}
        theta = {k: before[k] + velocity[k] for k in before}
    final, _ = Checkpointer(run_dir_of(whole) / "checkpoint").load()
    for k in theta:
        np.testing.assert_allclose(final[k], theta[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(final[f"velocity/{k}"], velocity[k], rtol=1e-5, atol=1e-6)
    assert any(np.abs(v).max() > 0 for v in velocity.values())

    part = tiny(**common, **{"run-name": "part", "num-rounds": 1})
    run_inprocess(part, num_nodes=2)
    run_inprocess(tiny(**common, **{"num-rounds": 2, "resume-from": str(run_dir_of(part))}), num_nodes=2)
    resumed, _ = Checkpointer(run_dir_of(part) / "checkpoint").load()
    assert list(resumed) == list(final)
    for k in final:
        np.testing.assert_array_equal(resumed[k], final[k])
    assert isinstance(final, OrderedDict)
