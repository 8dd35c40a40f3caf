"""FedHEAL (Chen, Huang, Ye, CVPR 2024): the FPHL consistency mask and the FAEL fair weights against a hand
computation over two rounds, the server state across a checkpoint, the option checks, and a short run that learns."""

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import TINY, records, run_dir_of

from medflower.config import ExperimentConfig, defaults
from medflower.contract import spec_of
from medflower.contract.messaging import RoundStats
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies.fedheal import FedHEAL, consistency_mask


def server(threshold=0.3, beta=0.4, theta=(1.0, 2.0, 3.0)):
    """A FedHEAL server half without a run around it: only what aggregate_train reads."""
    strategy = object.__new__(FedHEAL)
    strategy.cfg = SimpleNamespace(
        fedheal_threshold=threshold, fedheal_beta=beta, max_client_share=1.0, max_weight_over_median=10.0
    )
    strategy.stats = RoundStats()
    strategy.global_arrays = OrderedDict(a=np.array(theta, np.float64))
    strategy.spec = spec_of(strategy.global_arrays)
    strategy.setup(strategy.global_arrays)
    return strategy


def reply(client, update, theta):
    """Site ``client``'s reply whose update u = θ − θ_k is ``update``."""
    return SimpleNamespace(client=client, arrays={"a": np.asarray(theta, np.float64) - np.array(update, np.float64)})


def test_the_mask_keeps_an_element_iff_its_sign_consistency_is_above_the_threshold():
    first, history = consistency_mask({"a": np.array([1.0, 0.0, -1.0])}, None, 0, 0.5)
    assert first["a"].tolist() == [1, 1, 1] and history["a"].tolist() == [1, 1, 0]  # u = 0 counts as u >= 0
    h = {"a": np.array([0.75, 0.5, 0.5, 0.2])}
    mask, history = consistency_mask({"a": np.array([1.0, 1.0, -1.0, -3.0])}, h, 4, 0.5)
    # consistency: 0.75, 0.5 (not > 0.5), 1 - 0.5, 1 - 0.2
    assert mask["a"].tolist() == [1, 0, 0, 1]
    np.testing.assert_allclose(history["a"], [(3 + 1) / 5, (2 + 1) / 5, 2 / 5, 0.8 / 5])


def test_two_rounds_follow_fphl_and_fael_by_hand():
    s = server()
    theta = np.array([1.0, 2.0, 3.0])
    # round 1: every element kept; d_k = ||u_k||
    u_a, u_b = np.array([1.0, 0.0, -1.0]), np.array([-0.5, 1.0, 0.0])
    s.aggregate_train(1, [reply("A", u_a, theta), reply("B", u_b, theta)])
    d_a, d_b = np.sqrt(2), np.sqrt(1.25)
    delta_a, delta_b = 0.4 * d_a / (d_a + d_b), 0.4 * d_b / (d_a + d_b)
    p_a, p_b = 0.5 + delta_a, 0.5 + delta_b
    w_a, w_b = p_a / (p_a + p_b), p_b / (p_a + p_b)
    theta = theta - (w_a * u_a + w_b * u_b)
    np.testing.assert_allclose(s.global_arrays["a"], theta)
    assert s.history["A"]["a"].tolist() == [1, 1, 0] and s.history["B"]["a"].tolist() == [0, 1, 1]
    # round 2: A drops element 1 (it grew before, it shrinks now), B drops element 2
    u_a, u_b = np.array([2.0, -1.0, -1.0]), np.array([-1.0, 1.0, -2.0])
    s.aggregate_train(2, [reply("A", u_a, theta), reply("B", u_b, theta)])
    m_a, m_b = np.array([1.0, 0.0, 1.0]), np.array([1.0, 1.0, 0.0])
    d_a, d_b = np.linalg.norm(u_a * m_a), np.linalg.norm(u_b * m_b)
    delta_a = 0.6 * delta_a + 0.4 * d_a / (d_a + d_b)
    delta_b = 0.6 * delta_b + 0.4 * d_b / (d_a + d_b)
    p_a, p_b = p_a + delta_a, p_b + delta_b
    w_a, w_b = p_a / (p_a + p_b), p_b / (p_a + p_b)
    step = np.array([w_a * 2.0 + w_b * -1.0, 1.0, -1.0])  # element 1: B alone (ŵ_B = 1); element 2: A alone
    np.testing.assert_allclose(s.global_arrays["a"], theta - step)
    np.testing.assert_allclose(s.history["A"]["a"], [1.0, 0.5, 0.0])
    assert s.counts == {"A": 2, "B": 2} and s.weights == pytest.approx({"A": p_a, "B": p_b})


def test_an_element_no_site_keeps_is_unchanged_and_a_new_site_starts_at_one_over_k():
    s = server()
    theta = np.array([1.0, 2.0, 3.0])
    s.aggregate_train(1, [reply("A", [1.0, 1.0, 1.0], theta)])
    theta = s.global_arrays["a"].copy()
    np.testing.assert_allclose(theta, [0.0, 1.0, 2.0])  # a single site: its whole update
    # A's history is [1, 1, 1]: a negative update is dropped everywhere; B's first update is kept whole
    s.aggregate_train(2, [reply("A", [-1.0, -1.0, -1.0], theta), reply("B", [0.0, 0.0, 0.0], theta)])
    np.testing.assert_allclose(s.global_arrays["a"], theta)
    # B's p started at 1/2; its d is 0 and d_A is 0 too: no increment from this round's distances
    assert s.weights["B"] == pytest.approx(0.5)


def test_the_state_survives_a_checkpoint():
    s = server()
    theta = np.array([1.0, 2.0, 3.0])
    s.aggregate_train(1, [reply("A", [1.0, 0.0, -1.0], theta), reply("B", [-0.5, 1.0, 0.0], theta)])
    arrays, meta = s.state()
    resumed = server(theta=(9.0, 9.0, 9.0))
    resumed.load_state(arrays, meta)
    for name in ("counts", "weights", "deltas", "distances"):
        assert getattr(resumed, name) == getattr(s, name), name
    histories = [{k: v["a"].tolist() for k, v in x.history.items()} for x in (resumed, s)]
    assert histories[0] == histories[1]
    theta = s.global_arrays["a"].copy()
    replies = [reply("A", [0.5, -1.0, -2.0], theta), reply("B", [-1.0, 1.0, -2.0], theta)]
    s.aggregate_train(2, replies)
    resumed.aggregate_train(2, replies)
    np.testing.assert_array_equal(resumed.global_arrays["a"], s.global_arrays["a"])


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("fedheal-threshold", 1.0, r"must be in \[0, 1\)"),
        ("fedheal-threshold", -0.1, r"must be in \[0, 1\)"),
        ("fedheal-beta", 0.0, r"must be in \(0, 1\]"),
        ("fedheal-beta", 1.5, r"must be in \(0, 1\]"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedheal", key: value})


def test_fedheal_learns_in_process(tiny):
    config = tiny(strategy="fedheal", **{"run-name": "heal", "num-rounds": 4})
    summary, _ = run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    first = np.mean([r["auc"] for r in records(run_dir, "eval") if r["round"] == 1])
    assert summary["final"]["auc"] > 0.7 and summary["final"]["auc"] > first, (first, summary["final"])
    kept = [r["fedheal_kept"] for r in records(run_dir, "server") if "fedheal_kept" in r]
    assert len(kept) == 4 and kept[0] == 1.0 and all(0 < k <= 1 for k in kept), kept
