"""FedHCA² (Lu et al., CVPR 2024) on the sub-model federation: the conflict-averse direction against cvxpy, a
hand-solved case and CAGrad's primal; its reduction to the mean update; the cross-attention and the hyper-weight
SGD by hand; a mixed segmentation/classification run whose aggregation is recomputed from the replies; resume
with partial participation; config errors."""

from collections import OrderedDict
from types import SimpleNamespace

import cvxpy as cp
import numpy as np
import pytest
from helpers import MIXED_TASKS, TINY_MLP, TINY_WIDTH, records, run_dir_of

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import Checkpointer
from medflower.inprocess import InProcessGrid, run_inprocess
from medflower.models.ffn_slices import kept_count
from medflower.strategies.submodel import fedhca2
from medflower.strategies.submodel.fedhca2 import (
    FedHCA2,
    SiteModel,
    conflict_averse_weights,
    cross_attention,
    decoder_body,
    gram_matrix,
)

MIXED = {
    "strategy": "fedhca2",
    **MIXED_TASKS,
    "num-rounds": 2,
}
FFN = "backbone.blocks.0.mlp"


def pad(name: str, value: np.ndarray) -> np.ndarray:
    """A sub-encoder array in the full encoder's shape (d_ffn = TINY_MLP), zeros for the neurons the site lacks."""
    if name.endswith((".mlp.fc1.weight", ".mlp.fc1.bias")):
        full = np.zeros((TINY_MLP, *value.shape[1:]))
        full[: value.shape[0]] = value
        return full
    if name.endswith(".mlp.fc2.weight"):
        full = np.zeros((value.shape[0], TINY_MLP))
        full[:, : value.shape[1]] = value
        return full
    return value


def direction(deltas: np.ndarray, c: float) -> np.ndarray:
    _, gamma = conflict_averse_weights(deltas @ deltas.T, c)
    return gamma @ deltas


# ----------------------------------------------------------------------------- the conflict-averse direction
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_conflict_averse_dual_matches_cvxpy_and_solves_cagrads_primal(seed):
    rng = np.random.default_rng(seed)
    deltas = rng.normal(size=(4, 12)) + np.array([[2.0] * 12, [-1.5] * 12, [0.0] * 12, [0.5] * 12])  # conflicting
    c = 0.4
    w, gamma = conflict_averse_weights(deltas @ deltas.T, c)
    g0 = deltas.mean(0)
    k = c * np.linalg.norm(g0)
    x = cp.Variable(4)
    problem = cp.Problem(cp.Minimize((deltas.T @ x) @ g0 + k * cp.norm(deltas.T @ x)), [x >= 0, cp.sum(x) == 1])
    problem.solve()
    ours = (deltas.T @ w) @ g0 + k * np.linalg.norm(deltas.T @ w)
    assert ours == pytest.approx(problem.value, rel=1e-6, abs=1e-8)
    d = gamma @ deltas * (1 + c * c)  # before the authors' rescaling
    g_x = deltas.T @ x.value
    np.testing.assert_allclose(d, g0 + k / np.linalg.norm(g_x) * g_x, rtol=1e-3, atol=1e-4)
    # CAGrad's primal: d maximises min_i <Δ_i, d> over the ball ||d − g0|| <= c||g0||
    assert np.linalg.norm(d - g0) == pytest.approx(k, rel=1e-6)
    worst = (deltas @ d).min()
    assert worst > (deltas @ g0).min()
    ball = g0 + k * (lambda u: u / np.linalg.norm(u, axis=1, keepdims=True))(rng.normal(size=(2000, 12)))
    assert worst >= (deltas @ ball.T).min(0).max() - 1e-6


def test_a_hand_solved_pair():
    """Δ₁ = (2, 0), Δ₂ = (0, 1), c = 0.4: on the simplex f(t) = ½ + 3t/2 + c‖g₀‖√(5t² − 2t + 1) with t = w₁,
    f'(0) = 3/2 − c‖g₀‖ > 0 and f convex, so w* = (0, 1), g_w = Δ₂ and d* = (g₀ + c‖g₀‖Δ₂)/(1 + c²)."""
    deltas = np.array([[2.0, 0.0], [0.0, 1.0]])
    w, _ = conflict_averse_weights(deltas @ deltas.T, 0.4)
    np.testing.assert_allclose(w, [0.0, 1.0], atol=1e-8)
    k = 0.4 * np.sqrt(1.25)
    np.testing.assert_allclose(direction(deltas, 0.4), (np.array([1.0, 0.5]) + k * np.array([0.0, 1.0])) / 1.16)


def test_without_conflict_the_direction_is_the_mean_update():
    rng = np.random.default_rng(3)
    same = np.tile(rng.normal(size=7), (3, 1))
    np.testing.assert_allclose(direction(same, 0.4), (1.4 / 1.16) * same[0], rtol=1e-9)  # FedAvg's, scaled
    deltas = rng.normal(size=(3, 7))
    w, gamma = conflict_averse_weights(deltas @ deltas.T, 0.0)
    np.testing.assert_array_equal(gamma, np.full(3, 1 / 3))  # c = 0: exactly the mean update
    np.testing.assert_allclose(direction(deltas, 0.0), deltas.mean(0))
    np.testing.assert_allclose(conflict_averse_weights(np.zeros((2, 2)), 0.4)[1], np.full(2, 0.5 / 1.16))


def test_the_gram_matrix_sums_over_arrays():
    a = [
        OrderedDict(x=np.array([1.0, 2.0]), y=np.array([[3.0]])),
        OrderedDict(x=np.array([0.0, 1.0]), y=np.array([[-1.0]])),
    ]
    np.testing.assert_allclose(gram_matrix(a), [[14.0, -1.0], [-1.0, 2.0]])


def test_cross_attention_and_the_decoder_body_by_hand():
    deltas = np.array([[1.0, 0.0, 2.0, 1.0], [0.5, -1.0, 0.0, 3.0], [0.0, 0.0, 1.0, 0.0]])
    scores = deltas @ deltas.T / np.sqrt(4)
    attention = np.exp(scores) / np.exp(scores).sum(1, keepdims=True)
    np.testing.assert_allclose(cross_attention(deltas), attention @ deltas, rtol=1e-12)
    names = [
        "backbone.x",
        "decoder.proj.weight",
        "decoder.proj.bias",
        "decoder.stages.0.1.weight",
        "decoder.out.weight",
    ]
    assert decoder_body(names + ["decoder.out.bias"]) == names[1:4]  # the output layer is the task head
    assert decoder_body(["backbone.x", "head.weight", "head.bias"]) == []  # a classifier's head is all head


def test_the_hyper_weights_take_sgd_steps_on_the_next_update():
    """grad α = −<Δ^{t+1}, d*^t>, SGD with momentum 0.9 and weight decay 1e-4; a weight outside [0, 1] gets no
    gradient (the clamp is flat there), only the decay; β per layer from the attention output."""
    server = SimpleNamespace(cfg=SimpleNamespace(fedhca2_hyper_lr=0.01))
    site = SiteModel(
        OrderedDict(e=np.zeros(2)),
        OrderedDict([("dec.l.weight", np.zeros(2)), ("dec.l.bias", np.zeros(1))]),
        0.1,
        {"dec.l": 0.2},
        encoder_direction=OrderedDict(e=np.array([1.0, 2.0])),
        decoder_direction=OrderedDict([("dec.l.weight", np.array([1.0, 1.0])), ("dec.l.bias", np.array([2.0]))]),
    )
    clamped = SiteModel(OrderedDict(e=np.zeros(2)), OrderedDict(), 1.5, {}, encoder_direction=OrderedDict(e=np.ones(2)))
    fresh = SiteModel(OrderedDict(e=np.zeros(2)), OrderedDict(), 0.1, {})  # no aggregation yet: nothing to learn
    update = [OrderedDict(e=np.array([0.5, 0.25])), OrderedDict(e=np.ones(2)), OrderedDict(e=np.ones(2))]
    dec = [OrderedDict([("dec.l.weight", np.array([1.0, -3.0])), ("dec.l.bias", np.array([0.5]))]), {}, {}]
    FedHCA2.update_hyper_weights(server, [site, clamped, fresh], update, dec)
    grad_alpha, grad_beta = -(0.5 + 0.5), -(1.0 - 3.0 + 1.0)
    assert site.alpha == pytest.approx(0.1 - 0.01 * (grad_alpha + 1e-4 * 0.1))
    assert site.beta["dec.l"] == pytest.approx(0.2 - 0.01 * (grad_beta + 1e-4 * 0.2))
    assert clamped.alpha == pytest.approx(1.5 - 0.01 * 1e-4 * 1.5)
    assert fresh.alpha == 0.1 and fresh.momentum == {}
    buffer = site.momentum["alpha"]
    before = site.alpha
    zero_dec = OrderedDict([("dec.l.weight", np.zeros(2)), ("dec.l.bias", np.zeros(1))])
    FedHCA2.update_hyper_weights(server, [site], [OrderedDict(e=np.zeros(2))], [zero_dec])
    assert site.alpha == pytest.approx(before - 0.01 * (0.9 * buffer + 1e-4 * before))  # momentum carries on


# ----------------------------------------------------------------------------- in the protocol
def capture(monkeypatch):
    captured = {}
    original = FedHCA2.aggregate_train

    def spy(self, rnd, replies):
        def copy(site):
            return SiteModel(
                OrderedDict((k, v.copy()) for k, v in site.encoder.items()),
                OrderedDict((k, v.copy()) for k, v in site.decoder.items()),
                site.alpha,
                dict(site.beta),
            )

        before = {c: copy(s) for c, s in self.sites.items()}
        original(self, rnd, replies)
        captured[rnd] = (replies, before, {c: copy(s) for c, s in self.sites.items()})

    monkeypatch.setattr(FedHCA2, "aggregate_train", spy)
    return captured


def test_a_mixed_run_aggregates_encoders_conflict_averse_and_seg_decoders_by_cross_attention(tiny, monkeypatch):
    captured = capture(monkeypatch)
    config = tiny(**MIXED, **{"run-name": "mixed"})
    summary, _ = run_inprocess(config, num_nodes=3)
    assert "dice" in summary["per_client"]["client-0"] and "accuracy" in summary["per_client"]["client-2"]
    for rnd in (1, 2):
        replies, before, after = captured[rnd]
        by_client = {r.client: r for r in replies}
        for client, capacity in (("client-0", 0.5), ("client-1", 0.125), ("client-2", 0.25)):
            arrays = by_client[client].arrays
            assert arrays[FFN + ".fc1.weight"].shape == (kept_count(TINY_MLP, capacity), TINY_WIDTH)
            assert not any(k.startswith(("decoder.out.", "head.")) for k in arrays)  # task heads stay home
        assert any(k.startswith("decoder.proj") for k in by_client["client-1"].arrays)  # seg decoder body goes up
        assert not any(k.startswith("decoder.") for k in by_client["client-2"].arrays)  # the classifier has none
        # encoders: θ_i + Δ_i + α_i·d*, d* from the updates zero-padded to the full encoder, α after its SGD step
        clients = list(by_client)
        deltas = {
            c: OrderedDict((k, by_client[c].arrays[k].astype(np.float64) - v) for k, v in before[c].encoder.items())
            for c in clients
        }
        full = {c: OrderedDict((k, pad(k, v)) for k, v in deltas[c].items()) for c in clients}
        flat = np.stack([np.concatenate([v.reshape(-1) for v in full[c].values()]) for c in clients])
        _, gamma = conflict_averse_weights(flat @ flat.T, 0.4)
        for name in ("backbone.blocks.0.attn.qkv.weight", FFN + ".fc1.weight", "backbone.blocks.1.mlp.fc2.weight"):
            d = sum(g * full[c][name] for g, c in zip(gamma, clients))
            for c in clients:
                mine = deltas[c][name]
                share = d[tuple(slice(0, n) for n in mine.shape)]  # the site's prefix of d*
                expected = before[c].encoder[name] + mine + min(max(after[c].alpha, 0), 1) * share
                np.testing.assert_allclose(after[c].encoder[name], expected, rtol=1e-4, atol=1e-6)
        # decoder bodies: φ_i + Δφ_i + β_i^l·softmax(Δφ_i ΔΦᵀ/√D)ΔΦ over the two segmentation sites
        name = "decoder.proj.weight"
        seg = ["client-0", "client-1"]
        stacked = np.stack([(by_client[c].arrays[name] - before[c].decoder[name]).reshape(-1) for c in seg])
        scores = stacked @ stacked.T / np.sqrt(stacked.shape[1])
        attention = np.exp(scores - scores.max(1, keepdims=True))
        attention = attention / attention.sum(1, keepdims=True) @ stacked
        for row, c in enumerate(seg):
            beta = min(max(after[c].beta["decoder.proj"], 0), 1)
            expected = by_client[c].arrays[name] + beta * attention[row].reshape(before[c].decoder[name].shape)
            np.testing.assert_allclose(after[c].decoder[name], expected, rtol=1e-4, atol=1e-6)
        assert not after["client-2"].decoder
    assert captured[2][2]["client-0"].alpha != 0.1  # learnt in round 2, from round 2's updates
    assert not np.allclose(  # personalised: two sites' shared arrays differ
        captured[2][2]["client-0"].encoder["backbone.blocks.0.attn.qkv.weight"],
        captured[2][2]["client-1"].encoder["backbone.blocks.0.attn.qkv.weight"],
    )
    server = records(run_dir_of(config), "server")
    assert set(server[0]["ca_weights"]) == {"client-0", "client-1", "client-2"}
    assert sum(server[0]["ca_weights"].values()) == pytest.approx(1.0, abs=1e-5)
    state = run_dir_of(config) / "client-state" / "partition-0" / "fedhca2"
    from safetensors.numpy import load_file

    saved = load_file(str(state / "round-2.safetensors"))
    assert saved and not any(k.startswith("backbone.") for k in saved)  # the site keeps its decoder, not the encoder


def test_local_decoders_stay_on_the_sites(tiny, monkeypatch):
    captured = capture(monkeypatch)
    run_inprocess(tiny(**{**MIXED, "run-name": "local", "num-rounds": 1, "fedhca2-decoders": "local"}), num_nodes=3)
    replies = captured[1][0]
    assert all(not any(k.startswith("decoder.") for k in r.arrays) for r in replies)


def test_resume_with_partial_participation_equals_an_uninterrupted_run(tiny, monkeypatch):
    class Stop(Exception):
        pass

    base = {**MIXED, "num-rounds": 3, "fraction-train": 0.67, "seed": 5}  # samples sites {1, 2}, {0, 2}, {1, 2}
    full = tiny(**base, **{"run-name": "full"})
    run_inprocess(full, num_nodes=3)
    trained = [{r["client"] for r in records(run_dir_of(full), "train") if r["round"] == rnd} for rnd in (1, 2, 3)]
    # client-1 skips round 2, so round 3 learns its α from the direction of round 1; client-0 joins in round 2
    assert trained == [{"client-1", "client-2"}, {"client-0", "client-2"}, {"client-1", "client-2"}]
    stopped = tiny(**base, **{"run-name": "stopped"})
    original = InProcessGrid.send_and_receive

    def dies_in_round_3(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and int(messages[0].metadata.group_id) == 3:
            raise Stop
        return original(self, messages, timeout=timeout)

    with monkeypatch.context() as patch:
        patch.setattr(InProcessGrid, "send_and_receive", dies_in_round_3)
        with pytest.raises(Stop):
            run_inprocess(stopped, num_nodes=3)
    run_inprocess({**stopped, "resume-from": str(run_dir_of(stopped))}, num_nodes=3)
    a, meta_a = Checkpointer(run_dir_of(full) / "checkpoint").load()
    b, meta_b = Checkpointer(run_dir_of(stopped) / "checkpoint").load()
    assert meta_a["completed_rounds"] == meta_b["completed_rounds"] == 3
    assert meta_a["strategy_meta"] == meta_b["strategy_meta"]
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert len(meta_a["strategy_meta"]["sites"]) == 3 and any(k.startswith("site0/encoder-direction/") for k in a)


def test_bad_config_is_named(tiny):
    def check(**overrides):
        return ExperimentConfig.from_run_config({**defaults(), **tiny(**{"strategy": "fedhca2", **overrides})})

    with pytest.raises(ConfigError, match="'fedhca2-ca-c' = -0.1 is invalid: must be >= 0"):
        check(**{"fedhca2-ca-c": -0.1})
    with pytest.raises(ConfigError, match="'fedhca2-hyper-lr' = 0.0 is invalid: must be > 0"):
        check(**{"fedhca2-hyper-lr": 0.0})
    with pytest.raises(ConfigError, match="valid choices are cross-attention, local"):
        check(**{"fedhca2-decoders": "fedavg"})
    with pytest.raises(ConfigError, match="fedhca2-decoders.*dataset to a segmentation source"):
        check(**{"dataset": "synthetic", "site-datasets": "synthetic,synthetic-seg"})
    check(**{"dataset": "synthetic", "site-datasets": "synthetic,synthetic-seg", "fedhca2-decoders": "local"})
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        check(**{"fedbkd-capacities": "0.5,2"})
    assert fedhca2.FedHCA2.adapter == "full"
