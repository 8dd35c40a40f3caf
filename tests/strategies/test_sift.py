"""SiFT: every site trains once per round in the seeded cyclic order, the pair really passes along, a silent
site in the middle of the order is skipped and the next one gets the pair it was sent, sites report the pooled
balanced accuracy, the EMA is exact (BatchNorm statistics included), a run stopped mid-round resumes to the same
result, the head and projector get no gradient unless the variant says so, a local text encoder gives one row
per class, and bad configurations are named."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers import records, run_dir_of

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import Checkpointer, from_record
from medflower.inprocess import InProcessGrid, run_inprocess
from medflower.models import ModelError, build_model
from medflower.models.text_head import encode_class_texts
from medflower.strategies.sift import LONG, SHORT, ema_update, split_pair
from medflower.training.metrics import CONFUSION, pooled_metrics

NUM_NODES = 4


@pytest.fixture
def embeddings(tmp_path):
    path = tmp_path / "classes.npy"
    np.save(path, np.random.default_rng(0).normal(size=(8, 24)).astype(np.float32))
    return str(path)


@pytest.fixture
def sift(tiny, embeddings):
    def make(**overrides):
        return tiny(
            **{
                "strategy": "sift",
                "class-embeddings": embeddings,
                "num-rounds": 2,
                "sift-batch-size": 32,
                "sift-lr-first": 0.05,
                "sift-lr": 0.01,
                **overrides,
            }
        )

    return make


@pytest.fixture
def replies(monkeypatch):
    """Every (sent message, reply) pair of the in-process grid, in order."""
    log = []
    original = InProcessGrid.send_and_receive

    def spy(self, messages, *, timeout=None):
        messages = list(messages)
        out = list(original(self, messages, timeout=timeout))
        by_node = {m.metadata.src_node_id: m for m in out}
        log.extend((m, by_node.get(m.metadata.dst_node_id)) for m in messages)
        return out

    monkeypatch.setattr(InProcessGrid, "send_and_receive", spy)
    return log


def train_hops(log):
    return [(int(m.metadata.group_id), m, r) for m, r in log if m.metadata.message_type == "train"]


def test_each_site_trains_once_per_round_in_the_seeded_order_and_the_pair_passes_along(sift, replies):
    config = sift(**{"run-name": "relay"})
    run_inprocess(config, NUM_NODES)
    hops = train_hops(replies)
    order = Checkpointer(run_dir_of(config) / "checkpoint").load()[1]["strategy_meta"]["order"]
    assert sorted(order) == list(range(NUM_NODES))
    for rnd in (1, 2):  # node id = partition id + 1 in the in-process grid
        assert [m.metadata.dst_node_id - 1 for r, m, _ in hops if r == rnd] == order
    for (_, _, reply), (_, nxt, _) in zip(hops, hops[1:]):  # what a site sends is what the next one receives
        sent, received = from_record(reply.content["arrays"]), from_record(nxt.content["arrays"])
        assert list(sent) == list(received)
        for name in sent:
            np.testing.assert_array_equal(sent[name], received[name])
    lrs = [r["lr"] for r in records(run_dir_of(config), "train")]
    assert lrs == [0.05] * NUM_NODES + [0.01] * NUM_NODES
    # the order comes from the seed
    other = sift(**{"run-name": "relay-seed", "seed": 3, "num-rounds": 1})
    run_inprocess(other, NUM_NODES)
    meta = Checkpointer(run_dir_of(other) / "checkpoint").load()[1]
    assert meta["strategy_meta"]["order"] != order


def test_the_long_term_model_is_the_exact_ema_of_the_short_term_one_batchnorm_included(sift, replies):
    config = sift(**{"run-name": "ema", "num-rounds": 1, "backbone": "resnet18", "adapter": "full", "sift-beta": 0.75})
    run_inprocess(config, 2)
    (_, sent, reply), _ = train_hops(replies)
    short_in, long_in = split_pair(from_record(sent.content["arrays"]))
    short_out, long_out = split_pair(from_record(reply.content["arrays"]))
    stats = [k for k in short_out if k.endswith("running_mean")]
    assert stats and any(k.endswith("running_var") for k in short_out)
    assert not np.allclose(short_out[stats[0]], short_in[stats[0]])  # BatchNorm statistics trained and travel
    for name in short_out:
        np.testing.assert_allclose(long_out[name], 0.75 * long_in[name] + 0.25 * short_out[name], rtol=1e-6, atol=1e-7)
    a = OrderedDict(w=np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(
        ema_update(a, OrderedDict(w=np.array([3.0, 6.0], np.float32)), 0.9)["w"], np.array([1.2, 2.4], np.float32)
    )


def test_sites_evaluate_the_long_term_model_and_single_sends_the_short_term_model_alone(sift, replies):
    config = sift(**{"run-name": "pair", "num-rounds": 1})
    summary, _ = run_inprocess(config, 2)
    evaluations = [(m, r) for m, r in replies if m.metadata.message_type == "evaluate"]
    last_pair = from_record(train_hops(replies)[-1][2].content["arrays"])
    for m, _ in evaluations:
        sent = from_record(m.content["arrays"])
        assert list(sent) == [k[len(LONG) :] for k in last_pair if k.startswith(LONG)]
        for k, v in sent.items():
            np.testing.assert_array_equal(v, last_pair[LONG + k])
    # the paper's metric: balanced accuracy on the sites' test splits pooled, from the counts they sent
    counts = sum(np.reshape(r[CONFUSION], (8, 8)) for r in records(run_dir_of(config), "eval"))
    assert summary["final"]["pooled_balanced_accuracy"] == pooled_metrics(counts)["pooled_balanced_accuracy"]
    replies.clear()
    run_inprocess(sift(**{"run-name": "single", "num-rounds": 1, "sift-variant": "single"}), 2)
    assert all(k.startswith(SHORT) for k in from_record(train_hops(replies)[-1][2].content["arrays"]))


def test_a_silent_site_in_the_middle_of_the_order_is_skipped_and_the_next_gets_the_pair_it_was_sent(sift, replies):
    config = sift(**{"run-name": "drop", "num-rounds": 1})
    trains = []

    def silent_second_site(node, message):  # the second site of the order: neither the first nor the last
        if message.metadata.message_type != "train":
            return False
        trains.append(node)
        return len(trains) == 2

    run_inprocess(config, NUM_NODES, drop=silent_second_site)
    hops = train_hops(replies)
    assert [m.metadata.dst_node_id for _, m, _ in hops] == trains and len(hops) == NUM_NODES
    (_, _, first_reply), (_, to_silent, silent_reply), (_, to_next, next_reply) = hops[:3]
    assert first_reply is not None and silent_reply is None and next_reply is not None
    sent, received = from_record(to_silent.content["arrays"]), from_record(to_next.content["arrays"])
    assert list(received) == list(sent)
    for name in sent:  # the pair goes on unchanged: exactly what the silent site was sent
        np.testing.assert_array_equal(received[name], sent[name])
    run_dir = run_dir_of(config)
    server = records(run_dir, "server")[0]
    assert server["num_failed"] == 1 and server["failed"][0].endswith(": no reply")
    assert [r["position"] for r in records(run_dir, "train")] == [0, 2, 3]


class Crash(RuntimeError):
    pass


def test_a_run_stopped_mid_round_resumes_to_the_uninterrupted_result(sift, monkeypatch):
    whole = sift(**{"run-name": "whole", "num-rounds": 2})
    run_inprocess(whole, NUM_NODES)
    stopped = sift(**{"run-name": "stopped", "num-rounds": 2})
    original = InProcessGrid.send_and_receive
    calls = {"train": 0}

    def crash_at_sixth_hop(self, messages, *, timeout=None):
        messages = list(messages)
        if messages[0].metadata.message_type == "train":
            calls["train"] += 1
            if calls["train"] == 6:  # round 2, third site
                raise Crash("server stopped")
        return original(self, messages, timeout=timeout)

    monkeypatch.setattr(InProcessGrid, "send_and_receive", crash_at_sixth_hop)
    with pytest.raises(Crash):
        run_inprocess(stopped, NUM_NODES)
    meta = Checkpointer(run_dir_of(stopped) / "checkpoint").load()[1]
    assert meta["completed_rounds"] == 1 and meta["strategy_meta"]["position"] == 1
    monkeypatch.setattr(InProcessGrid, "send_and_receive", original)
    run_inprocess({**stopped, "resume-from": str(run_dir_of(stopped))}, NUM_NODES)
    a, _ = Checkpointer(run_dir_of(whole) / "checkpoint").load()
    b, _ = Checkpointer(run_dir_of(stopped) / "checkpoint").load()
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    for kind in ("train", "eval"):
        whole_records = records(run_dir_of(whole), kind)
        resumed = records(run_dir_of(stopped), kind)
        assert [(r["round"], r["client"]) for r in resumed] == [(r["round"], r["client"]) for r in whole_records]
        assert [r["train_loss" if kind == "train" else "loss"] for r in resumed] == [
            r["train_loss" if kind == "train" else "loss"] for r in whole_records
        ]
    server_whole = records(run_dir_of(whole), "server")
    server_resumed = records(run_dir_of(stopped), "server")
    assert [r["bytes_up"] for r in server_resumed] == [r["bytes_up"] for r in server_whole]


def model_for(config: dict, class_names=None):
    cfg = ExperimentConfig.from_run_config({**defaults(), **config})
    return build_model(cfg.model_spec(class_names or [f"class {i}" for i in range(8)]), 8)


@pytest.mark.parametrize(
    "variant, trains",
    [
        ("full", set()),
        ("single", set()),
        ("random-head", set()),
        ("trainable-proj", {"head.projector"}),
        ("trainable-head", {"head.weight", "head.bias"}),
    ],
)
def test_head_and_projector_get_no_gradient_unless_the_variant_says_so(sift, embeddings, variant, trains):
    model = model_for(sift(**{"sift-variant": variant}))
    head_arrays = {k for k in model.trainable_names() if k.startswith("head.")}
    assert head_arrays == trains
    x = torch.randn(4, 3, 16, 16)
    model.train()
    torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3])).backward()
    for name, tensor in [*model.head.named_parameters(), *model.head.named_buffers()]:
        assert (tensor.grad is not None) == (f"head.{name}" in trains), name
    if variant in ("full", "single", "trainable-proj"):
        np.testing.assert_array_equal(model.head.weight.detach().numpy(), np.load(embeddings))
    if variant == "random-head":
        assert model.head.weight.shape == (8, 24) and not np.allclose(model.head.weight.numpy(), np.load(embeddings))
    if variant != "trainable-head":  # P is rebuilt from the seed alone
        torch.testing.assert_close(
            model.head.projector.detach(), model_for(sift(**{"sift-variant": variant})).head.projector.detach()
        )


def test_a_local_text_encoder_gives_the_head_one_row_per_class(sift, tiny_bert):
    texts = ["normal chest", "pneumonia", "lung opacity", "chest", "normal lung", "opacity", "pneumonia lung", "lung"]
    config = sift(**{"class-embeddings": "", "text-encoder": str(tiny_bert), "class-texts": "; ".join(texts)})
    model = model_for(config)
    np.testing.assert_allclose(
        model.head.weight.numpy(), encode_class_texts(str(tiny_bert), texts), rtol=1e-5, atol=1e-6
    )
    by_name = model_for({**config, "class-texts": ""}, class_names=texts[::-1])  # class names when no texts are given
    np.testing.assert_allclose(
        by_name.head.weight.numpy(), encode_class_texts(str(tiny_bert), texts[::-1]), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ModelError, match="3 class texts for 8 classes"):
        model_for({**config, "class-texts": "a; b; c"})


def test_bad_sift_and_full_model_configs_are_named(tiny, tmp_path, embeddings):
    def check(**overrides):
        ExperimentConfig.from_run_config({**defaults(), **tiny(**overrides)})

    with pytest.raises(ConfigError, match="'class-embeddings'.*or 'text-encoder'"):
        check(strategy="sift")
    check(strategy="sift", **{"sift-variant": "trainable-head"})  # a linear head needs no text
    with pytest.raises(ConfigError, match="does not exist"):
        check(strategy="sift", **{"class-embeddings": str(tmp_path / "missing.npy")})
    with pytest.raises(ConfigError, match="text-encoder"):
        check(strategy="sift", **{"text-encoder": str(tmp_path / "no-model")})
    with pytest.raises(ConfigError, match="whole backbone trains only with"):
        check(strategy="sgca", adapter="full")
    np.save(tmp_path / "five.npy", np.zeros((5, 24), np.float32))
    with pytest.raises(ModelError, match=r"\[8, dim\]"):
        model_for(tiny(strategy="sift", **{"class-embeddings": str(tmp_path / "five.npy")}))
