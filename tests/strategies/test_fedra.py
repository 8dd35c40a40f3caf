"""FedRA (Su, Li, Xue, ECCV 2024): layers from adapter names, the seeded allocation draw, the per-layer mean over the
sites allocated each layer by hand, the skipped layers against the reference's shallower model, a site's training
message by message, the option checks, and short runs (layers nobody trained keep their values; the model learns)."""

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from helpers import TINY, VIT_TINY, records, run_dir_of, site_runtime
from torch import nn

from medflower.config import ExperimentConfig, defaults
from medflower.contract import from_record, to_record
from medflower.contract.checkpoint import Checkpointer
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies import STRATEGIES
from medflower.strategies.fedra import (
    ALLOCATION,
    FedRA,
    FedRAClient,
    adapter_layers,
    allocated_names,
    draw_allocation,
    layerwise_mean,
    site_layer_count,
    skipped_layers,
)

NAMES = [
    "backbone.blocks.0.adapter_attn.down.weight",
    "backbone.blocks.0.adapter_mlp.down.weight",
    "backbone.blocks.10.adapter_attn.down.weight",
    "backbone.blocks.2.adapter_attn.down.weight",
    "backbone.blocks.2.adapter_mlp.down.weight",
    "backbone.patch_embed.proj.lora_A.weight",
    "decoder.out.weight",
]


def test_a_layer_is_the_block_its_adapters_sit_in_in_depth_order():
    layers = adapter_layers(NAMES)
    assert list(layers) == ["backbone.blocks.0", "backbone.blocks.2", "backbone.blocks.10"]
    assert layers["backbone.blocks.2"] == NAMES[3:5]
    swin = ["backbone.layers.1.blocks.0.attn.qkv.lora_A.weight", "backbone.layers.0.blocks.1.attn.qkv.lora_A.weight"]
    assert list(adapter_layers(swin)) == ["backbone.layers.0.blocks.1", "backbone.layers.1.blocks.0"]
    # layer 1 (blocks.2) and everything outside the layers: the unnumbered adapter and the decoder
    assert allocated_names(NAMES, layers, [1]) == NAMES[3:]
    assert STRATEGIES["fedra"] is FedRA


def test_the_allocation_is_a_seeded_draw_of_c_distinct_layers_per_site_and_round():
    rows = [draw_allocation(0, rnd, 1, 4, 12) for rnd in range(1, 21)]
    assert all(len(r) == 4 == len(set(r)) and r == sorted(r) and r[0] >= 0 and r[-1] < 12 for r in rows)
    assert len({tuple(r) for r in rows}) > 10  # a fresh draw each round
    assert draw_allocation(0, 3, 1, 4, 12) == rows[2]  # the same on resume
    assert draw_allocation(0, 3, 2, 4, 12) != rows[2] or draw_allocation(0, 4, 2, 4, 12) != rows[3]
    assert draw_allocation(5, 1, 0, 12, 12) == list(range(12))
    counts = np.bincount(np.concatenate([draw_allocation(0, r, 0, 3, 6) for r in range(600)]), minlength=6)
    assert counts.min() > 250 and counts.max() < 350  # uniform: 300 each


def test_each_layer_is_the_weighted_mean_of_the_sites_allocated_it_by_hand():
    g = OrderedDict(l0=np.array([1.0, 1.0], np.float32), l1=np.array([5.0], np.float32), head=np.zeros(1, np.float32))
    a = {"l0": np.array([2.0, 4.0], np.float32), "head": np.array([1.0], np.float32)}  # layer 0 only
    b = {"l0": np.array([8.0, 0.0], np.float32), "head": np.array([4.0], np.float32)}  # layer 0 only
    c = {"head": np.array([10.0], np.float32)}  # no layer
    out, untouched = layerwise_mean(g, [a, b, c], [0.5, 0.25, 0.25])
    np.testing.assert_allclose(out["l0"], [(0.5 * 2 + 0.25 * 8) / 0.75, (0.5 * 4 + 0.25 * 0) / 0.75], rtol=1e-6)
    np.testing.assert_array_equal(out["l1"], g["l1"])  # nobody trained layer 1: it keeps its value
    np.testing.assert_allclose(out["head"], [0.5 * 1 + 0.25 * 4 + 0.25 * 10])
    assert untouched == ["l1"] and out["l0"].dtype == np.float32


# ----------------------------------------------------------------------------- a site
# The tests below count ViT-Tiny's 12 blocks (FedRA's default fedra-layers is all of them): they run on it.
@pytest.fixture
def tiny(tiny):
    return lambda **overrides: tiny(**{**VIT_TINY, **overrides})


def site(tmp_path, **run_config):
    return site_runtime(tmp_path, "fedra", **{**VIT_TINY, **run_config})


def message(rnd: int, arrays, allocation):
    config = ConfigRecord({"round": rnd, ALLOCATION: allocation})
    return SimpleNamespace(content=RecordDict({"arrays": to_record(arrays), "config": config}))


def train(rt, rnd, arrays, allocation):
    rt.config.update({"round": rnd, ALLOCATION: list(allocation)})
    return FedRAClient(rt).train(message(rnd, arrays, allocation))


def test_skipping_layers_is_the_shallower_model_of_the_allocated_blocks(tmp_path):
    model = site(tmp_path).model
    backbone = model.backbone
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    with torch.no_grad():
        whole = backbone.forward_features(x)
        blocks = backbone.blocks
        backbone.blocks = nn.Sequential(*(blocks[i] for i in (1, 4, 7)))  # the reference's depth-3 model
        try:
            shallow = backbone.forward_features(x)
        finally:
            backbone.blocks = blocks
        skipped = [f"backbone.blocks.{i}" for i in range(12) if i not in (1, 4, 7)]
        with skipped_layers(model, skipped):
            assert not any(p.requires_grad for p in blocks[0].parameters())
            torch.testing.assert_close(backbone.forward_features(x), shallow, rtol=0, atol=0)
        assert not torch.allclose(shallow, whole)
        torch.testing.assert_close(backbone.forward_features(x), whole, rtol=0, atol=0)  # restored
    assert any(p.requires_grad for p in blocks[0].parameters())
    not_a_block = ["backbone.blocks.0.attn"]
    with pytest.raises(ValueError, match="skips whole transformer blocks"), skipped_layers(model, not_a_block):
        pass


def test_a_site_trains_its_allocated_layers_only_and_sends_them_with_the_head(tmp_path):
    rt = site(tmp_path, **{"fedra-layers": "3,12"})  # partition 0: 3 layers
    initial = rt.initial_arrays
    layers = adapter_layers(initial)
    sent = allocated_names(initial, layers, [0, 5, 9])
    start = OrderedDict((k, (v + 0.01).astype(np.float32)) for k, v in initial.items())
    up = from_record(train(rt, 1, OrderedDict((k, start[k]) for k in sent), [0, 5, 9])["arrays"])
    assert list(up) == sent and "head.weight" in up
    assert all(not np.array_equal(up[k], start[k]) for k in sent)  # every allocated adapter and the head trained
    # evaluate-in-train sends the whole model: the same training, the other layers untouched
    whole = from_record(train(rt, 1, start, [0, 5, 9])["arrays"])
    for k in sent:
        np.testing.assert_array_equal(whole[k], up[k])
    after = rt.model.get_trainable()
    for k in initial:
        if k not in sent:
            np.testing.assert_array_equal(after[k], start[k])
    with pytest.raises(ValueError, match="at most 3"):
        train(rt, 2, start, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="distinct layer indices below 12"):
        train(rt, 2, start, [0, 12])
    with pytest.raises(ValueError, match="not this site's allocated sub-model"):
        train(rt, 2, OrderedDict((k, start[k]) for k in sent), [1, 5, 9])


def test_a_site_declares_its_layer_count(tmp_path):
    rt = site(tmp_path, **{"fedra-layers": "3,12"})
    assert site_layer_count(rt, 12) == 3
    rt.context.node_config["fedra-layers"] = "7"  # the site's own capacity wins
    assert site_layer_count(rt, 12) == 7
    rt.context.node_config["fedra-layers"] = "20"
    with pytest.raises(ValueError, match="gives this site 20 layers; the model has 12"):
        site_layer_count(rt, 12)
    rt.context.node_config["fedra-layers"] = "a few"
    with pytest.raises(ValueError, match="a layer count"):
        site_layer_count(rt, 12)
    del rt.context.node_config["fedra-layers"]
    rt.partition_id = 2
    with pytest.raises(ValueError, match="lists 2 layer counts but this site is partition 2"):
        site_layer_count(rt, 12)
    assert site_layer_count(site(tmp_path / "b", **{"fedra-layers": ""}), 12) == 12


# ----------------------------------------------------------------------------- config and server checks
@pytest.mark.parametrize("value", ["12,x", "0", "3,-1", "2.5"])
def test_bad_layer_counts_are_refused_with_the_key(value):
    with pytest.raises(ConfigError, match="'fedra-layers'.*layer count"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedra", "fedra-layers": value})


def test_more_layers_than_the_model_has_are_refused_before_round_1(tiny):
    with pytest.raises(ConfigError, match="'fedra-layers'.*the model has 12 layers, not 13"):
        run_inprocess(tiny(strategy="fedra", **{"fedra-layers": "13,2", "run-name": "deep"}), num_nodes=2)


def test_a_model_without_adapters_in_blocks_is_refused():
    strategy = object.__new__(FedRA)
    strategy.cfg = SimpleNamespace(adapter="lora", fedra_layers="")
    with pytest.raises(ConfigError, match="'adapter'.*none found"):
        strategy.setup(OrderedDict(head=np.zeros(2, np.float32)))


def test_a_query_must_declare_a_layer_count_the_model_has():
    strategy = object.__new__(FedRA)
    strategy.cfg = SimpleNamespace(adapter="lora", fedra_layers="", site_registry="")
    strategy.registry, strategy.nodes = None, {}
    strategy.setup(OrderedDict((k, np.zeros(1, np.float32)) for k in NAMES))
    query = {"partition-id": 0, "client": "a"}

    def check(metrics):
        return strategy.check_reply_values("query", SimpleNamespace(node_id=1, metrics=metrics, config=query))

    assert check({"num-train": 5.0, "fedra-layers": 3.0}) is None
    assert "must declare fedra-layers" in check({"num-train": 5.0})
    assert "integer in 1..3" in check({"num-train": 5.0, "fedra-layers": 4.0})
    assert "integer in 1..3" in check({"num-train": 5.0, "fedra-layers": 1.5})


# ----------------------------------------------------------------------------- short runs
def test_layers_nobody_was_allocated_keep_their_initial_adapters(tiny):
    config = tiny(strategy="fedra", **{"run-name": "few", "num-rounds": 2, "fedra-layers": "2,1,1"})
    run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    server = [r for r in records(run_dir, "server") if "fedra_allocation" in r]
    assert [sorted(len(a) for a in r["fedra_allocation"].values()) for r in server] == [[1, 1, 2]] * 2
    trained = set()
    for r in server:
        covered = {i for a in r["fedra_allocation"].values() for i in a}
        assert r["fedra_untrained_layers"] == [i for i in range(12) if i not in covered]
        trained |= covered
    final, _ = Checkpointer(run_dir / "checkpoint").load()
    initial = site(run_dir / "probe").initial_arrays
    layers = list(adapter_layers(initial).values())
    assert len(trained) < 12
    for i, names in enumerate(layers):
        changed = [not np.array_equal(final[k], initial[k]) for k in names]
        assert all(changed) if i in trained else not any(changed), i
    # bytes up: each site sends its allocated layers' adapters and the head
    per_layer = sum(initial[k].nbytes for k in layers[0])
    head = sum(v.nbytes for k, v in initial.items() if k.startswith("head."))
    assert [r["bytes_up"] for r in server] == [4 * per_layer + 3 * head] * 2


def test_fedra_learns_in_process(tiny):
    config = tiny(strategy="fedra", **{"run-name": "ra", "num-rounds": 4})
    summary, _ = run_inprocess(config, num_nodes=3)
    evals = records(run_dir_of(config), "eval")
    first = np.mean([r["auc"] for r in evals if r["round"] == 1])
    assert summary["final"]["auc"] > first + 0.05, (first, summary["final"])
