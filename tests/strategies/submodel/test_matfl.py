"""MaT-FL (Cai et al., CVPRW 2023): the grouping and the within-group means against a hand computation, the sums over
held entries on sub-encoders against an entry-by-entry reference, one group = FedAvg (HeteroFL's merge with
capacities), the server state across a checkpoint, a multi-task run in process (what each site receives), a resume
of it, and bad config (faults, bytes and the generic resume of every strategy: tests/contract/test_contract.py)."""

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import MIXED_TASKS, TINY, TINY_MLP, records, run_dir_of

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import Checkpointer, spec_of
from medflower.contract.messaging import RoundStats
from medflower.inprocess import run_inprocess
from medflower.models.ffn_slices import kept_count
from medflower.strategies.submodel import matfl
from medflower.strategies.submodel.capacity_baselines import HeteroFL
from medflower.strategies.submodel.matfl import MaTFL, MaTFLClient
from medflower.strategies.submodel.protocol import SubModelClient

FFN = "backbone.blocks.0.mlp"
TOY = OrderedDict(  # a toy encoder: one FFN of 4 hidden neurons (width 2) and an array every sub-encoder holds whole
    [
        (f"{FFN}.fc1.weight", (4, 2)),
        (f"{FFN}.fc1.bias", (4,)),
        (f"{FFN}.fc2.weight", (2, 4)),
        (f"{FFN}.fc2.bias", (2,)),
        ("backbone.attn.w", (3,)),
    ]
)
SLICED = {f"{FFN}.fc1.weight": 0, f"{FFN}.fc1.bias": 0, f"{FFN}.fc2.weight": 1}  # name -> the axis a capacity cuts


def server(arrays, grouping="hard", groups=2, threshold=0.0, weights="uniform", strategy=MaTFL):
    """A server half without a run around it: only what aggregate_train and train_content read."""
    s = object.__new__(strategy)
    s.cfg = SimpleNamespace(
        matfl_grouping=grouping, matfl_groups=groups, matfl_threshold=threshold, matfl_weights=weights
    )
    s.cfg.max_client_share, s.cfg.max_weight_over_median = 1.0, 10.0
    s.stats = RoundStats()
    s.global_arrays = OrderedDict((k, np.array(v)) for k, v in arrays.items())
    s.spec = spec_of(s.global_arrays)
    s.setup(s.global_arrays)
    return s


def reply(client, full, neurons=None, n=1.0):
    """Site ``client``'s reply: its encoder ``full`` cut to its first ``neurons`` FFN neurons (all: None)."""
    width = 4 if FFN + ".fc1.weight" in full else 0
    neurons = width if neurons is None else neurons
    arrays = OrderedDict(
        (k, np.take(v, np.arange(neurons), axis=SLICED[k]) if k in SLICED else v) for k, v in full.items()
    )
    if width:
        arrays["kept/" + FFN] = np.arange(neurons, dtype=np.int64)
    return SimpleNamespace(client=client, arrays=arrays, num_examples=float(n))


def test_the_grouping_and_the_group_means_match_a_hand_computation():
    # θ̄ = (1, 1); d = (1, -1), (1, 0), (-2, 1): cos01 = 1/√2, cos02 = -3/√10, cos12 = -2/√5
    thetas = {"A": [2.0, 0.0], "B": [2.0, 1.0], "C": [-1.0, 2.0]}
    full = {c: OrderedDict(w=np.array(v)) for c, v in thetas.items()}
    s = server(OrderedDict(w=np.zeros(2)))
    s.aggregate_train(1, [reply(c, full[c]) for c in thetas])
    c01, c02, c12 = 1 / np.sqrt(2), -3 / np.sqrt(10), -2 / np.sqrt(5)
    cosine = s.stats.extra["matfl_cosine"]
    assert [cosine["A"]["B"], cosine["A"]["C"], cosine["B"]["C"]] == pytest.approx([c01, c02, c12], abs=1e-6)
    np.testing.assert_allclose(s.global_arrays["w"], [1.0, 1.0])  # the soup θ̄
    # 2 groups, average linkage on 1 − cos: {A, B} (distance 0.29) and {C}; uniform means within them
    assert s.stats.extra["matfl_groups"] == {"A": 0, "B": 0, "C": 1}
    for c, expected in (("A", [2.0, 0.5]), ("B", [2.0, 0.5]), ("C", [-1.0, 2.0])):
        np.testing.assert_allclose(s.personal[c]["w"], expected)
    # n_k within the group: (1·(2, 0) + 3·(2, 1)) / 4
    s = server(OrderedDict(w=np.zeros(2)), weights="examples")
    s.aggregate_train(1, [reply("A", full["A"], n=1), reply("B", full["B"], n=3), reply("C", full["C"], n=1)])
    np.testing.assert_allclose(s.personal["A"]["w"], [2.0, 0.75])
    np.testing.assert_allclose(s.personal["B"]["w"], [2.0, 0.75])
    # soft, τ = 0: a = max(cos, 0), so A takes B at 1/√2 and C at 0: θ_A = (θ_A + θ_B/√2) / (1 + 1/√2)
    s = server(OrderedDict(w=np.zeros(2)), grouping="soft")
    s.aggregate_train(1, [reply(c, full[c]) for c in thetas])
    np.testing.assert_allclose(s.personal["A"]["w"], [2.0, np.sqrt(2) - 1], rtol=1e-12)
    np.testing.assert_allclose(s.personal["B"]["w"], [2.0, 2 - np.sqrt(2)], rtol=1e-12)
    np.testing.assert_allclose(s.personal["C"]["w"], [-1.0, 2.0])
    assert "matfl_groups" not in s.stats.extra and set(s.stats.extra["matfl_shares"]["C"]) == {"C"}
    # soft, τ = 1: every weight cos + 1 (C gets A at 1 − 3/√10 > 0)
    s = server(OrderedDict(w=np.zeros(2)), grouping="soft", threshold=1.0)
    s.aggregate_train(1, [reply(c, full[c]) for c in thetas])
    a = np.array([1 + c02, 1 + c12, 2.0])  # C's row: A, B, C
    expected = sum(w * np.array(thetas[c]) for w, c in zip(a, "ABC")) / a.sum()
    np.testing.assert_allclose(s.personal["C"]["w"], expected, rtol=1e-12)


def reference(fulls, neurons, grouping, threshold):
    """MaT-FL entry by entry: the soup over each entry's holders, cosines over both sites' entries, the hard groups
    of 3 sites into 2 (the closest pair together), the group mean over the holders of each entry."""
    sites = list(fulls)

    def holds(site, name, index):
        return name not in SLICED or index[SLICED[name]] < neurons[site]

    entries = [(name, i) for name, shape in TOY.items() for i in np.ndindex(*shape)]
    soup = {e: np.mean([fulls[s][e[0]][e[1]] for s in sites if holds(s, *e)]) for e in entries}
    dev = {(s, e): fulls[s][e[0]][e[1]] - soup[e] for s in sites for e in entries if holds(s, *e)}
    cos = np.eye(len(sites))
    for a, sa in enumerate(sites):
        for b, sb in enumerate(sites):
            both = [e for e in entries if holds(sa, *e) and holds(sb, *e)]
            if a != b:
                inner = sum(dev[sa, e] * dev[sb, e] for e in both)
                cos[a, b] = inner / np.sqrt(sum(dev[sa, e] ** 2 for e in both) * sum(dev[sb, e] ** 2 for e in both))
    if grouping == "hard":
        pair = max(((a, b) for a in range(3) for b in range(a + 1, 3)), key=lambda p: cos[p])
        weight = np.array([[1.0 if {a, b} <= set(pair) or a == b else 0.0 for b in range(3)] for a in range(3)])
    else:
        weight = np.maximum(cos + threshold, 0.0)
    grouped = {}
    for a, sa in enumerate(sites):
        for e in entries:
            if holds(sa, *e):
                held = [(weight[a, b], fulls[sb][e[0]][e[1]]) for b, sb in enumerate(sites) if holds(sb, *e)]
                grouped[sa, e] = sum(w * v for w, v in held) / sum(w for w, _ in held)
    return soup, cos, grouped


@pytest.mark.parametrize(("grouping", "threshold"), [("hard", 0.0), ("soft", 0.0), ("soft", 0.5)])
def test_with_sub_encoders_every_sum_runs_over_the_entries_the_sites_hold(grouping, threshold):
    rng = np.random.default_rng(3)
    neurons = {"A": 4, "B": 2, "C": 1}
    fulls = {s: OrderedDict((k, rng.normal(size=shape)) for k, shape in TOY.items()) for s in neurons}
    start = OrderedDict((k, np.full(shape, 7.0)) for k, shape in TOY.items())
    s = server(start, grouping=grouping, threshold=threshold)
    s.aggregate_train(1, [reply(c, fulls[c], neurons[c]) for c in neurons])
    soup, cos, grouped = reference(fulls, neurons, grouping, threshold)
    got = np.array([[s.stats.extra["matfl_cosine"][a][b] for b in neurons] for a in neurons])
    np.testing.assert_allclose(got, cos, atol=1e-6)
    for (name, index), value in soup.items():
        assert s.global_arrays[name][index] == pytest.approx(value, rel=1e-12)
    for (site, (name, index)), value in grouped.items():
        assert s.personal[site][name][index] == pytest.approx(value, rel=1e-12), (site, name, index)
    for site, k in neurons.items():  # each site's grouped encoder has its own sub-encoder's shapes
        shapes = [s.personal[site][FFN + w].shape for w in (".fc1.weight", ".fc2.weight")]
        assert shapes == [(k, 2), (2, k)]
        np.testing.assert_array_equal(s.personal[site]["kept/" + FFN], np.arange(k))
    # what site C receives: its grouped prefix written into the soup (neurons it does not hold: the soup's)
    received = s.encoder_for(s.personal["C"])
    np.testing.assert_array_equal(received[FFN + ".fc1.bias"][:1], s.personal["C"][FFN + ".fc1.bias"])
    np.testing.assert_array_equal(received[FFN + ".fc1.bias"][1:], s.global_arrays[FFN + ".fc1.bias"][1:])
    assert s.encoder_for(None) is s.global_arrays  # a site that never replied: the soup


def test_a_single_group_is_fedavg_and_with_capacities_heterofls_merge():
    rng = np.random.default_rng(0)
    sizes = {"A": 10, "B": 30, "C": 60}
    fulls = {c: OrderedDict((k, rng.normal(size=shape).astype(np.float32)) for k, shape in TOY.items()) for c in sizes}
    start = OrderedDict((k, np.zeros(shape, np.float32)) for k, shape in TOY.items())
    s = server(start, groups=1, weights="examples")
    s.aggregate_train(1, [reply(c, fulls[c], n=n) for c, n in sizes.items()])
    total = sum(sizes.values())
    for name in TOY:  # FedAvg: Σ n_k θ_k / Σ n_k, the same for every site
        fedavg = sum(n / total * fulls[c][name].astype(np.float64) for c, n in sizes.items())
        for c in sizes:
            np.testing.assert_allclose(s.personal[c][name], fedavg, rtol=1e-6, atol=1e-7)
    # capacities: each site's encoder is HeteroFL's n_k-weighted covered merge, cut to its prefix
    neurons = {"A": 4, "B": 2, "C": 1}
    replies = [reply(c, fulls[c], neurons[c], n=sizes[c]) for c in sizes]
    s = server(start, groups=1, weights="examples")
    s.aggregate_train(1, replies)
    hetero = server(start, strategy=HeteroFL)
    hetero.aggregate_train(1, replies)
    for c, k in neurons.items():
        for name in TOY:
            expected = hetero.global_arrays[name]
            expected = np.take(expected, np.arange(k), axis=SLICED[name]) if name in SLICED else expected
            np.testing.assert_allclose(s.personal[c][name], expected, rtol=1e-6, atol=1e-7)
    # one group, uniform weights: the plain mean
    s = server(start, groups=1)
    s.aggregate_train(1, [reply(c, fulls[c], n=n) for c, n in sizes.items()])
    mean = np.mean([f["backbone.attn.w"] for f in fulls.values()], axis=0)
    np.testing.assert_allclose(s.personal["B"]["backbone.attn.w"], mean, rtol=1e-6)


def test_the_server_state_survives_a_checkpoint():
    rng = np.random.default_rng(1)
    neurons = {"A": 4, "B": 2, "C": 1}
    start = OrderedDict((k, np.zeros(shape, np.float32)) for k, shape in TOY.items())

    def replies():
        return [
            reply(c, OrderedDict((k, rng.normal(size=sh).astype(np.float32)) for k, sh in TOY.items()), neurons[c])
            for c in neurons
        ]

    s = server(start)
    s.aggregate_train(1, replies()[:2])  # C did not reply: no grouped encoder for it
    arrays, meta = s.state()
    resumed = server(OrderedDict((k, np.full(shape, 9.0, np.float32)) for k, shape in TOY.items()))
    resumed.load_state(arrays, meta)
    assert list(resumed.personal) == ["A", "B"] and meta == {"sites": ["A", "B"]}
    for site in ("A", "B", None):
        own = None if site is None else s.personal[site]
        a, b = s.encoder_for(own), resumed.encoder_for(None if site is None else resumed.personal[site])
        assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    second = replies()
    s.aggregate_train(2, second)
    resumed.aggregate_train(2, second)
    for site in neurons:
        assert all(np.array_equal(s.personal[site][k], resumed.personal[site][k]) for k in s.personal[site])
    with pytest.raises(ValueError, match="kept neurons of site 'A'"):
        server(start).load_state({k: v for k, v in arrays.items() if "kept/" not in k}, meta)


def test_a_reply_with_repeated_neurons_is_rejected_and_left_out_of_the_groups():
    rng = np.random.default_rng(2)
    fulls = {c: OrderedDict((k, rng.normal(size=shape)) for k, shape in TOY.items()) for c in "ABC"}
    replies = [reply(c, fulls[c], 2) for c in "ABC"]
    replies[1].arrays["kept/" + FFN] = np.array([0, 0], np.int64)
    s = server(OrderedDict((k, np.zeros(shape)) for k, shape in TOY.items()))
    s.aggregate_train(1, replies)
    assert len(s.stats.rejected) == 1 and s.stats.rejected[0].startswith("B: kept indices")
    assert set(s.personal) == {"A", "C"} and set(s.stats.extra["matfl_groups"]) == {"A", "C"}


MIXED = {
    **MIXED_TASKS,
    "num-rounds": 2,
    "strategy": "matfl",
}
VIT_FFN = "backbone.blocks.0.mlp"


def test_segmentation_and_classification_sites_each_receive_their_groups_encoder(tiny, monkeypatch):
    seen = {}
    original = MaTFL.aggregate_train

    def spy(self, rnd, replies):
        original(self, rnd, replies)
        seen[rnd] = (replies, {c: OrderedDict(a) for c, a in self.personal.items()}, dict(self.stats.extra))

    monkeypatch.setattr(MaTFL, "aggregate_train", spy)
    config = tiny(**{**MIXED, "run-name": "mixed"})
    summary, grid = run_inprocess(config, num_nodes=3)
    per_client = summary["per_client"]
    assert "dice" in per_client["client-0"] and "dice" in per_client["client-1"]
    assert "accuracy" in per_client["client-2"] and "dice" not in per_client["client-2"]
    replies, personal, extra = seen[1]
    for r in replies:  # HeteroFL's prefix of each site's capacity; no decoder or head leaves a site
        k = kept_count(TINY_MLP, {"client-0": 0.5, "client-1": 0.125, "client-2": 0.25}[r.client])
        np.testing.assert_array_equal(r.arrays["kept/" + VIT_FFN], np.arange(k))
        assert not any(name.startswith(("decoder.", "head.")) for name in r.arrays)
    groups = extra["matfl_groups"]
    assert sorted(groups) == ["client-0", "client-1", "client-2"] and len(set(groups.values())) == 2
    # round 2: each site receives its own grouped encoder (the prefix it holds), computed from round 1's replies
    sent = {
        grid.contexts[m.metadata.dst_node_id].node_config["partition-id"]: m.content["arrays"]
        for m in grid.sent
        if m.metadata.message_type == "train" and int(m.metadata.group_id) == 2
    }
    for partition, client in enumerate(("client-0", "client-1", "client-2")):
        k = len(personal[client]["kept/" + VIT_FFN])
        received = sent[partition][VIT_FFN + ".fc1.weight"].numpy()
        np.testing.assert_array_equal(received[:k], personal[client][VIT_FFN + ".fc1.weight"])
        qkv = "backbone.blocks.0.attn.qkv.weight"
        np.testing.assert_array_equal(sent[partition][qkv].numpy(), personal[client][qkv])
    mates = [c for c in groups if c != "client-2" and groups[c] == groups["client-2"]]
    if not mates:  # the classification site alone in its group: its encoder is its own, the others' differ from it
        qkv = "backbone.blocks.0.attn.qkv.weight"
        own = next(r for r in replies if r.client == "client-2").arrays[qkv]
        np.testing.assert_array_equal(personal["client-2"][qkv], own)
        assert not np.array_equal(personal["client-0"][qkv], own)
    server = records(run_dir_of(config), "server")
    assert [set(r["matfl_shares"]) for r in server] == [set(groups)] * 2
    assert all(abs(sum(row.values()) - 1) < 1e-5 for r in server for row in r["matfl_shares"].values())


def test_a_resumed_multi_task_run_equals_an_uninterrupted_one(tiny):
    whole = tiny(**{**MIXED, "run-name": "whole"})
    _, whole_grid = run_inprocess(whole, num_nodes=3)
    part = tiny(**{**MIXED, "run-name": "part", "num-rounds": 1})
    run_inprocess(part, num_nodes=3)
    _, grid = run_inprocess({**part, "num-rounds": 2, "resume-from": str(run_dir_of(part))}, num_nodes=3)

    def round_two(g):
        return [
            (m.metadata.dst_node_id, {k: v.numpy() for k, v in m.content["arrays"].items()})
            for m in g.sent
            if m.metadata.message_type == "train" and int(m.metadata.group_id) == 2
        ]

    for (node_a, a), (node_b, b) in zip(round_two(whole_grid), round_two(grid), strict=True):
        assert node_a == node_b and list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    final, meta = Checkpointer(run_dir_of(whole) / "checkpoint").load()
    resumed, resumed_meta = Checkpointer(run_dir_of(part) / "checkpoint").load()
    assert list(final) == list(resumed) and any(k.startswith(matfl.PERSONAL) for k in final)
    assert all(np.array_equal(final[k], resumed[k]) for k in final)
    assert meta["strategy_meta"] == resumed_meta["strategy_meta"]


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"matfl-groups": 0}, r"'matfl-groups' = 0 is invalid: must be > 0"),
        ({"matfl-grouping": "kmeans"}, r"'matfl-grouping' = 'kmeans' is invalid: valid choices are hard, soft"),
        ({"matfl-grouping": "soft", "matfl-threshold": -0.5}, r"'matfl-threshold' = -0.5 is invalid: must be >= 0"),
        ({"matfl-threshold": 0.5}, r"'matfl-threshold' = 0.5 is invalid: only matfl-grouping='soft' uses it"),
        ({"matfl-weights": "size"}, r"'matfl-weights' = 'size' is invalid: valid choices are uniform, examples"),
        ({"fedbkd-capacities": "0.5,2"}, r"must be in \(0, 1\]"),
        ({"adapter": "ia3"}, "trains adapter 'full'"),
    ],
)
def test_bad_config_is_refused_naming_the_key(overrides, why):
    with pytest.raises(ConfigError, match=why):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "matfl", **overrides})


def test_the_client_half_is_heterofls_site():
    assert MaTFL.client_half is MaTFLClient and issubclass(MaTFLClient, SubModelClient)
    assert MaTFLClient.selection == "prefix" and MaTFLClient.sends_update and not MaTFLClient.computes_spread
    assert not MaTFL.folds_evaluation and MaTFL.mixed_tasks and MaTFL.adapter == "full"
