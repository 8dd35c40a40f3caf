"""SGCA (FedSCA) and LAT: the aggregation QP, LAT name selection, the client's cosine pull, the protocol."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers import TINY_BLOCKS, VIT_TINY, records, run_dir_of
from scipy.spatial.distance import cdist

from medflower.config import ConfigError, ExperimentConfig
from medflower.contract import Checkpointer
from medflower.inprocess import run_inprocess
from medflower.models import lowest_adapter_names
from medflower.strategies import sgca as sgca_module
from medflower.strategies.sgca import (
    adapter_distances,
    cosine_pull,
    project_rows_onto_simplex,
    sgca_weights,
    sgca_weights_closed_form,
    sgca_weights_cvxpy,
)


def assert_on_simplex(w):
    assert (w >= 0).all()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-9)


# ----------------------------------------------------------------------------- the QP
def instances():
    rng = np.random.default_rng(0)
    for n in (1, 2, 10, 100):
        yield f"random-{n}", rng.dirichlet(np.ones(n)), adapter_distances(rng.normal(size=(n, 40))), 0.8
    base = rng.normal(size=(1, 30))
    yield (
        "ties",
        np.full(6, 1 / 6),
        adapter_distances(np.repeat(base, 6, axis=0) + np.repeat(rng.normal(size=(3, 30)), 2, axis=0)),
        0.8,
    )
    yield "zero-distances", np.full(5, 0.2), adapter_distances(np.repeat(base, 5, axis=0)), 0.8
    skew = np.array([0.96, 0.01, 0.01, 0.01, 0.01])
    yield "skewed-sizes", skew, adapter_distances(rng.normal(size=(5, 20))), 0.8
    yield "large-alpha", rng.dirichlet(np.ones(12)), adapter_distances(rng.normal(size=(12, 8)), "l1"), 5.0
    yield "similarity", rng.dirichlet(np.ones(8)), adapter_distances(rng.normal(size=(8, 8)), "cosine"), 0.8


@pytest.mark.parametrize("name, m, d, alpha", list(instances()), ids=[i[0] for i in instances()])
def test_cvxpy_and_closed_form_agree_and_lie_on_the_simplex(name, m, d, alpha):
    closed = sgca_weights(m, d, alpha, "closed-form")
    solved = sgca_weights(m, d, alpha, "cvxpy")
    np.testing.assert_allclose(closed, solved, atol=1e-6)
    assert_on_simplex(closed)
    assert_on_simplex(solved)


def test_closed_form_is_the_qp_minimiser():
    """No feasible perturbation of a row lowers the QP objective."""
    rng = np.random.default_rng(1)
    m = rng.dirichlet(np.ones(7))
    d = adapter_distances(rng.normal(size=(7, 9)))
    w = sgca_weights_closed_form(m, d, 0.8)
    objective = lambda row, i: np.sum((row - m) ** 2) + 0.8 * row @ d[i]
    for i in range(7):
        for _ in range(200):
            other = project_rows_onto_simplex(w[i] + rng.normal(scale=0.05, size=7))[0]
            assert objective(other, i) >= objective(w[i], i) - 1e-12


def test_single_participant_gets_weight_one():
    assert sgca_weights(np.ones(1), np.zeros((1, 1)), 0.8, "cvxpy").tolist() == [[1.0]]
    assert sgca_weights(np.ones(1), np.zeros((1, 1)), 0.8, "closed-form").tolist() == [[1.0]]


def test_zero_alpha_gives_fedavg_weights():
    m = np.array([0.5, 0.3, 0.2])
    w = sgca_weights_cvxpy(m, adapter_distances(np.eye(3)), 0.0)
    np.testing.assert_allclose(w, np.tile(m, (3, 1)), atol=1e-7)


def test_projection_of_points_already_on_the_simplex_is_identity():
    p = np.random.default_rng(2).dirichlet(np.ones(9), size=4)
    np.testing.assert_allclose(project_rows_onto_simplex(p), p, atol=1e-12)


@pytest.mark.parametrize("metric, scipy_metric", [("l2", "euclidean"), ("l1", "cityblock")])
def test_distances_match_scipy_row_scaled(metric, scipy_metric):
    x = np.random.default_rng(3).normal(size=(6, 50)).astype(np.float32) + 10.0  # far from the origin
    ref = cdist(x.astype(np.float64), x.astype(np.float64), scipy_metric)
    ref /= ref.max(axis=1, keepdims=True)
    np.testing.assert_allclose(adapter_distances(x, metric), ref, atol=1e-5)


def test_similarities_enter_negated():
    x = np.random.default_rng(4).normal(size=(4, 10))
    cos = 1 - cdist(x, x, "cosine")
    d = adapter_distances(x, "cosine")
    np.testing.assert_allclose(d, -cos / np.abs(cos).max(axis=1, keepdims=True), atol=1e-6)
    inner = x @ x.T
    np.testing.assert_allclose(
        adapter_distances(x, "inner"), -inner / np.abs(inner).max(axis=1, keepdims=True), atol=1e-5
    )
    with pytest.raises(ValueError, match="sgca-metric"):
        adapter_distances(x, "manhattan")


@pytest.mark.parametrize("metric, scipy_metric", [("l2", "euclidean"), ("l1", "cityblock")])
def test_median_scale_divides_by_one_global_constant(metric, scipy_metric):
    x = np.random.default_rng(6).normal(size=(5, 30))
    ref = cdist(x, x, scipy_metric)
    ref /= np.median(ref[~np.eye(5, dtype=bool)])
    np.testing.assert_allclose(adapter_distances(x, metric, "median"), ref, atol=1e-5)
    assert adapter_distances(x[:1], metric, "median").tolist() == [[0.0]]  # no pair: nothing to scale
    with pytest.raises(ValueError, match="sgca-distance-scale"):
        adapter_distances(x, metric, "row-mean")


def test_a_site_far_from_everyone_keeps_more_of_itself_with_the_median_scale():
    """Row-max scaling gives the outlier's row the same 0..1 range as everyone else's, so it still mixes in its
    far neighbours; one global constant keeps its large distances large."""
    rng = np.random.default_rng(7)
    centre = rng.normal(size=40)
    thetas = np.stack([centre + 0.1 * rng.normal(size=40) for _ in range(4)] + [centre + 5.0 * rng.normal(size=40)])
    m = np.full(5, 0.2)
    by_row = sgca_weights(m, adapter_distances(thetas, "l2", "row-max"), 0.8, "closed-form")
    by_median = sgca_weights(m, adapter_distances(thetas, "l2", "median"), 0.8, "closed-form")
    assert by_median[4, 4] == pytest.approx(1.0)  # the outlier keeps its own adapter
    assert by_row[4, 4] < 0.6  # row-max: its nearest "neighbours" are at distance < 1, so it mixes in half


@pytest.mark.parametrize("metric", ["l2", "l1", "cosine", "inner"])
def test_alike_site_gets_more_weight_than_the_different_one(metric):
    rng = np.random.default_rng(5)
    shared, other = rng.normal(size=64), rng.normal(size=64)
    thetas = np.stack(
        [shared + 0.05 * rng.normal(size=64), shared + 0.05 * rng.normal(size=64), other + 0.05 * rng.normal(size=64)]
    )
    w = sgca_weights(np.full(3, 1 / 3), adapter_distances(thetas, metric), 0.8, "closed-form")
    assert w[0, 1] > w[0, 2] and w[1, 0] > w[1, 2]
    assert w[2, 2] > w[2, 0] and w[2, 2] > w[2, 1]


# ----------------------------------------------------------------------------- LAT and the cosine pull
def test_lat_picks_the_lowest_adapter_modules():
    names = [
        "backbone.blocks.1.adapter_attn.down.weight",
        "backbone.blocks.0.adapter_mlp.up.weight",
        "backbone.blocks.0.adapter_attn.down.weight",
        "backbone.blocks.0.adapter_attn.up.bias",
        "backbone.blocks.10.adapter_attn.down.weight",
        "decoder.out.weight",
    ]
    assert lowest_adapter_names(names, 1) == [
        "backbone.blocks.0.adapter_attn.down.weight",
        "backbone.blocks.0.adapter_attn.up.bias",
    ]
    assert lowest_adapter_names(names, 2) == names[1:4]
    assert lowest_adapter_names(names, "all") == names[:5]
    lora = [
        "backbone.blocks.0.attn.qkv.lora_A.weight",
        "backbone.blocks.0.attn.qkv.lora_B.weight",
        "backbone.blocks.1.attn.qkv.lora_A.weight",
        "head.weight",
    ]
    assert lowest_adapter_names(lora, 1) == lora[:2]
    with pytest.raises(ValueError, match="no adapter parameters"):
        lowest_adapter_names(["head.weight", "head.bias"], 1)


@pytest.mark.parametrize("value, parsed", [(1, 1), (3, 3), ("2", 2), ("all", "all")])
def test_lat_layers_config(value, parsed):
    assert ExperimentConfig.from_run_config({"lat-layers": value}).lat_layers == parsed


@pytest.mark.parametrize("value", [0, -1, "some", 1.5, True])
def test_lat_layers_config_refuses_bad_values(value):
    with pytest.raises(ConfigError, match="'lat-layers'.*integer >= 1 or 'all'"):
        ExperimentConfig.from_run_config({"lat-layers": value})


def test_cosine_pull_moves_adapters_toward_the_aggregate():
    torch.manual_seed(0)
    params = OrderedDict(a=torch.nn.Parameter(torch.randn(5, 3)), b=torch.nn.Parameter(torch.randn(4)))
    aggregate = {"a": torch.randn(5, 3), "b": torch.randn(4)}
    flat = lambda d: torch.cat([d["a"].reshape(-1), d["b"].reshape(-1)])
    term = cosine_pull(params, aggregate, beta=0.5)
    before = torch.nn.functional.cosine_similarity(flat(params).detach(), flat(aggregate), dim=0)
    loss = term(None, None, None)
    np.testing.assert_allclose(loss.item(), -0.5 * before.item(), rtol=1e-6)
    opt = torch.optim.SGD(params.values(), lr=0.5)
    for _ in range(20):
        opt.zero_grad()
        term(None, None, None).backward()
        opt.step()
    after = torch.nn.functional.cosine_similarity(flat(params).detach(), flat(aggregate), dim=0)
    assert after > before + 0.2


# ----------------------------------------------------------------------------- the protocol, in process
@pytest.mark.parametrize("scale", ["row-max", "median"])
def test_sgca_sends_each_node_its_own_aggregate_and_logs_w(tiny, monkeypatch, scale):
    sent_up, sizes = {}, {}
    original = sgca_module.SGCAClient.train

    def spy(self, message):
        content = original(self, message)
        sent_up[(self.rt.round, self.rt.client)] = np.concatenate(
            [a.numpy().ravel() for a in content["arrays"].values()]
        )
        sizes[(self.rt.round, self.rt.client)] = content["metrics"]["num-examples"]
        return content

    monkeypatch.setattr(sgca_module.SGCAClient, "train", spy)
    config = tiny(
        strategy="sgca", adapter="bottleneck", **{"run-name": "sg", "num-rounds": 2, "sgca-distance-scale": scale}
    )
    summary, grid = run_inprocess(config, num_nodes=3)
    server = records(run_dir_of(config), "server")
    for rnd, r in enumerate(server, 1):
        w = np.array(r["sgca_W"])
        assert w.shape == (3, 3) and r["sgca_clients"] == ["site-0", "site-1", "site-2"]
        # The logged W is the QP's solution (Eq. 7) for exactly the adapters the sites uploaded that round.
        uploaded = np.stack([sent_up[(rnd, c)] for c in r["sgca_clients"]])
        n = np.array([sizes[(rnd, c)] for c in r["sgca_clients"]], dtype=np.float64)
        d = adapter_distances(uploaded, "l2", scale)
        expected = sgca_weights(n / n.sum(), d, 0.8, "cvxpy")
        np.testing.assert_allclose(w, expected, atol=2e-8)
        # beside W, the two things it weighs: the scaled distances D and the size shares m
        np.testing.assert_allclose(r["sgca_D"], d, atol=1e-7)
        np.testing.assert_allclose(r["sgca_m"], n / n.sum(), atol=1e-8)
        assert not np.allclose(w, np.tile(n / n.sum(), (3, 1)), atol=1e-3)  # not FedAvg's weights
    round2 = [m for m in grid.sent if m.metadata.message_type == "train" and m.metadata.group_id == "2"]
    names = list(round2[0].content["arrays"].keys())
    assert names == lowest_adapter_names(names + ["decoder.x"], 1) and len(names) == 4  # blocks.0.adapter_attn
    # What node i gets in round 2 is Σ_j W_ij Θ_j over the adapters the sites sent in round 1.
    clients, w = server[0]["sgca_clients"], np.array(server[0]["sgca_W"])
    thetas = np.stack([sent_up[(1, c)] for c in clients])
    by_client = {site_of(grid, m.metadata.dst_node_id): m for m in round2}
    for i, client in enumerate(clients):
        got = np.concatenate([a.numpy().ravel() for a in by_client[client].content["arrays"].values()])
        np.testing.assert_allclose(got, w[i] @ thetas, rtol=1e-5, atol=1e-6)
    assert not np.allclose(w[0] @ thetas, w[1] @ thetas)


def site_of(grid, node_id: int) -> str:
    """Site name of an in-process node (partition i is site-i)."""
    return f"site-{grid.contexts[node_id].node_config['partition-id']}"


def test_lat_layers_all_sends_every_adapter_and_lat_uses_fedavg_weights(tiny):
    one = tiny(strategy="lat", **{"run-name": "lat1", "num-rounds": 1})
    allc = tiny(
        strategy="sgca", **{"run-name": "all", "num-rounds": 1, "lat-layers": "all", "sgca-solver": "closed-form"}
    )
    s1, g1 = run_inprocess(one, num_nodes=2)
    s2, g2 = run_inprocess(allc, num_nodes=2)
    up1, up2 = s1["communication"]["bytes_up"], s2["communication"]["bytes_up"]
    assert up2 == TINY_BLOCKS * up1  # LoRA on each block's qkv: all = blocks x the lowest
    w = np.array(records(run_dir_of(one), "server")[0]["sgca_W"])
    np.testing.assert_allclose(w[0], w[1])
    sizes = [r["num-examples"] for r in records(run_dir_of(one), "train")]
    np.testing.assert_allclose(w[0], np.array(sizes) / sum(sizes), atol=1e-7)
    sent = [m.content["arrays"] for m in g2.sent if m.metadata.message_type == "train"]
    assert not any(k.startswith("head.") for k in sent[0])


def test_bad_adapters_are_left_out_of_w(tiny, monkeypatch):
    original = sgca_module.SGCAClient.train

    def poisoned(self, message):
        content = original(self, message)
        if self.rt.partition_id == 1:
            name = next(iter(content["arrays"].keys()))
            from flwr.app import Array

            bad = content["arrays"][name].numpy().copy()
            bad[0] = np.inf if self.rt.round == 1 else bad[0]
            content["arrays"][name] = Array(bad if self.rt.round == 1 else bad[:1])  # round 2: wrong shape
        return content

    monkeypatch.setattr(sgca_module.SGCAClient, "train", poisoned)
    config = tiny(strategy="sgca", **{"run-name": "bad", "num-rounds": 2})
    # that they are rejected, logged and not aggregated: tests/contract/test_contract.py
    run_inprocess(config, num_nodes=3)
    for r in records(run_dir_of(config), "server"):
        assert r["sgca_clients"] == ["site-0", "site-2"] and np.array(r["sgca_W"]).shape == (2, 2)
    _, meta = Checkpointer(run_dir_of(config) / "checkpoint").load()
    assert meta["strategy_meta"]["clients"] == ["site-0", "site-2"]  # site-1 keeps the initial adapters


def test_a_single_participant_gets_w_one(tiny):
    config = tiny(strategy="sgca", **{"run-name": "one", "num-rounds": 2, "fraction-train": 0.3})
    run_inprocess(config, num_nodes=3)
    for r in records(run_dir_of(config), "server"):
        assert r["sgca_W"] == [[1.0]] and len(r["sgca_clients"]) == 1


def test_beta_pulls_the_trained_adapters_toward_the_aggregate(tiny, monkeypatch):
    """Same data and seeds; with a large beta the adapters a site sends are closer (cosine) to what it got."""
    cosines = {}
    original = sgca_module.SGCAClient.train

    def spy(self, message):
        content = original(self, message)
        got = np.concatenate([a.numpy().ravel() for a in message.content["arrays"].values()])
        sent = np.concatenate([a.numpy().ravel() for a in content["arrays"].values()])
        cosines.setdefault(self.rt.cfg.sgca_beta, []).append(
            float(got @ sent / np.linalg.norm(got) / np.linalg.norm(sent))
        )
        return content

    monkeypatch.setattr(sgca_module.SGCAClient, "train", spy)
    for beta in (0.0, 5.0):
        run_inprocess(
            tiny(strategy="sgca", **{"run-name": f"b{beta}", "num-rounds": 2, "sgca-beta": beta, "lr": 0.05}),
            num_nodes=2,
        )
    assert np.mean(cosines[5.0]) > np.mean(cosines[0.0])


# ----------------------------------------------------------------------------- segmentation federations
SEG = {"partition": "natural", "adapter": "bottleneck", "img-size": 32, "sgca-solver": "closed-form"}


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_trained_alike_sites_weigh_each_other_more_than_the_different_one(tiny, tmp_path, metric):
    """Three segfolder sites: a and b rendered in the same style, c in another; real local training. On ViT-Tiny:
    after 2 rounds the 64-wide test ViT's adapters are too alike for the cosine metric to order the sites."""
    from medflower.data.synthetic_seg import write_segfolder

    root = write_segfolder(tmp_path / "data", {"a-hosp": 0, "b-hosp": 0, "c-hosp": 1}, per_site=60, size=32, seed=0)
    config = tiny(
        **VIT_TINY,
        strategy="sgca",
        dataset=f"segfolder:{root}",
        **SEG,
        **{"run-name": metric, "num-rounds": 2, "sgca-metric": metric},
    )
    run_inprocess(config, num_nodes=3)
    for r in records(run_dir_of(config), "server"):
        assert r["sgca_clients"] == ["a-hosp", "b-hosp", "c-hosp"]
        w = np.array(r["sgca_W"])
        assert w[0, 1] > w[0, 2] and w[1, 0] > w[1, 2], w
        assert w[2, 2] > max(w[2, 0], w[2, 1]), w


@pytest.mark.parametrize(
    "strategy, extra",
    [("sgca", {}), ("sgca", {"lat-layers": "all"}), ("lat", {}), ("fedavg", {}), ("fedprox", {}), ("local", {})],
)
def test_every_baseline_segments_synthetic_seg(tiny, strategy, extra):
    config = tiny(
        strategy=strategy,
        dataset="synthetic-seg",
        **SEG,
        **extra,
        **{"run-name": strategy, "num-rounds": 3, "synthetic-size": 480, "lr": 3e-3},
    )
    summary, _ = run_inprocess(config, num_nodes=3)
    assert set(summary["per_client"]) == {"site-0", "site-1", "site-2"}
    for values in summary["per_client"].values():
        for key in ("dice", "iou", "dice_ellipse", "iou_rectangle", "val_dice"):
            assert 0.0 <= values[key] <= 1.0, key
    evals = records(run_dir_of(config), "eval")
    first = np.mean([r["loss"] for r in evals if r["round"] == 1])
    assert summary["final"]["loss"] < first, "the BCE + Dice test loss falls from round 1 to round 3"
