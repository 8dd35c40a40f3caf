"""FedSA-LoRA (Guo et al., ICLR 2025): which arrays travel, the server's n_k-weighted mean of the A matrices by hand,
the B matrices and head kept on each site (across rounds and a restart), the adapter check, and a short run."""

from collections import OrderedDict

import numpy as np
import pytest
from helpers import TINY, records, run_dir_of, send_to_site, site_runtime, training_starts

from medflower.config import ExperimentConfig, defaults
from medflower.contract import from_record
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies import STRATEGIES
from medflower.strategies.fedsa import FedSA, FedSAClient, shared_names

NAMES = [
    "backbone.blocks.0.attn.qkv.lora_A.weight",
    "backbone.blocks.0.attn.qkv.lora_B.weight",
    "backbone.blocks.1.attn.qkv.lora_A.weight",
    "backbone.blocks.1.attn.qkv.lora_B.weight",
    "head.weight",
    "head.bias",
]


def test_only_the_a_matrices_travel_and_the_head_by_choice():
    a = [NAMES[0], NAMES[2]]
    assert shared_names(NAMES, "head", share_head=False) == a
    assert shared_names(NAMES, "head", share_head=True) == [*a, "head.weight", "head.bias"]
    seg = [NAMES[0], NAMES[1], "decoder.conv.weight", "decoder.conv.bias"]
    assert shared_names(seg, "decoder", share_head=False) == [NAMES[0]]
    assert STRATEGIES["fedsa"] is FedSA


@pytest.mark.parametrize("adapter", ["ia3", "bottleneck"])
def test_an_adapter_other_than_lora_is_refused_with_the_key(adapter):
    with pytest.raises(ConfigError, match=f"'adapter' = '{adapter}'.*use 'lora'"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedsa", "adapter": adapter})


def test_a_bad_share_head_value_is_refused_with_the_key():
    with pytest.raises(ConfigError, match="'fedsa-share-head'.*true or false"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedsa", "fedsa-share-head": "yes"})


# ----------------------------------------------------------------------------- the server, on real replies
def capture(monkeypatch):
    captured = {}
    original = FedSA.aggregate_train

    def spy(self, rnd, replies):
        original(self, rnd, replies)
        captured[rnd] = (replies, OrderedDict((k, v.copy()) for k, v in self.global_arrays.items()))

    monkeypatch.setattr(FedSA, "aggregate_train", spy)
    return captured


@pytest.mark.parametrize("share_head", [False, True])
def test_the_server_averages_the_a_matrices_by_site_size(tiny, monkeypatch, share_head):
    captured = capture(monkeypatch)
    config = tiny(strategy="fedsa", partition="dirichlet", **{"run-name": "sa", "num-rounds": 1})
    config["fedsa-share-head"] = share_head
    run_inprocess(config, num_nodes=3)
    replies, after = captured[1]
    sent = list(replies[0].arrays)
    assert sent and all(".lora_A." in k or (share_head and k.startswith("head.")) for k in sent)
    assert any(k.startswith("head.") for k in sent) == share_head
    assert list(after) == sent
    sizes = np.array([r.num_examples for r in replies])
    assert len(set(sizes)) > 1  # Dirichlet: the sites differ in size, so n_k-weighting shows
    for k in sent:  # A ← Σ n_k A_k / Σ n_k
        by_hand = sum(n * r.arrays[k].astype(np.float64) for n, r in zip(sizes, replies)) / sizes.sum()
        np.testing.assert_allclose(after[k], by_hand, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- a site, message by message
def site(tmp_path, **run_config):
    return site_runtime(tmp_path, "fedsa", **run_config)


def send(rt, kind: str, rnd: int, arrays):
    return send_to_site(rt, FedSAClient, kind, rnd, arrays)


def test_a_site_trains_the_received_a_with_its_own_b_and_head_across_a_restart(tmp_path, monkeypatch):
    rt = site(tmp_path)
    seen = training_starts(monkeypatch)
    initial = rt.initial_arrays
    names = shared_names(initial, "head", False)
    a1 = OrderedDict((k, (initial[k] + 0.01).astype(np.float32)) for k in names)
    up = from_record(send(rt, "train", 1, a1)["arrays"])
    assert list(up) == names  # only A leaves the site
    for k in initial:  # round 1 starts from the received A and the seeded initial B and head
        np.testing.assert_array_equal(seen[0][k], a1[k] if k in a1 else initial[k])
    own = FedSAClient(rt).personal().load(before=2)
    assert list(own) == list(initial)
    local = [k for k in initial if k not in a1]
    assert any(".lora_B." in k for k in local) and "head.weight" in local
    assert any(not np.array_equal(own[k], initial[k]) for k in local)  # B and head trained

    a2 = OrderedDict((k, (initial[k] - 0.02).astype(np.float32)) for k in names)
    restarted = site(tmp_path)  # a fresh process: empty context.state, the same state folder
    evaluated = send(restarted, "evaluate", 1, a2)  # round 1's evaluation: the model round 2 trains from
    assert "auc" in evaluated["metrics"]
    model_evaluated = restarted.model.get_trainable()
    send(restarted, "train", 2, a2)
    for k in initial:  # round 2 starts from the new A and the site's own B and head of round 1
        np.testing.assert_array_equal(seen[1][k], a2[k] if k in a2 else own[k])
        np.testing.assert_array_equal(model_evaluated[k], seen[1][k])


def test_arrays_that_are_not_the_shared_set_are_refused(tmp_path):
    rt = site(tmp_path)
    with pytest.raises(ValueError, match="shared FedSA arrays"):
        send(rt, "train", 1, rt.initial_arrays)  # B and head too: not what the server sends


# ----------------------------------------------------------------------------- a short run
def test_fedsa_learns_in_process(tiny):
    config = tiny(strategy="fedsa", **{"run-name": "sa", "num-rounds": 4})
    summary, _ = run_inprocess(config, num_nodes=3)
    evals = records(run_dir_of(config), "eval")
    first = np.mean([r["auc"] for r in evals if r["round"] == 1])
    assert summary["final"]["auc"] > 0.7 and summary["final"]["auc"] > first, (first, summary["final"])
