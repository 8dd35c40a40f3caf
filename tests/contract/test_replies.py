"""The one checking step every reply goes through (medflower/contract/replies.py), the capped aggregation shares,
the site registry, the guard that keeps a non-finite aggregate out of the model, and what a failing site sends.

tests/contract/test_fault_injection.py sends the same faults through the real ServerApp/ClientApp code for every
strategy.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from helpers import TINY, declaring_size, records, run_dir_of

from medflower.config import ConfigError, defaults
from medflower.contract.checkpoint import Checkpointer
from medflower.contract.replies import NPY_HEADER, RejectedReply, check_reply, count_check
from medflower.contract.server import FederatedStrategy
from medflower.contract.site_registry import SiteRegistry
from medflower.inprocess import run_inprocess
from medflower.records import (
    capped_shares,
    from_record,
    median_capped,
    record_bytes,
    scaled_update,
    to_record,
    update_norm_bounds,
)
from medflower.site_app import SiteError, handle
from medflower.strategies import STRATEGIES

SPEC = {"w": ((2, 3), "float32"), "b": ((3,), "float32")}
LIMIT = 1e6


def honest(**metrics) -> RecordDict:
    arrays = ArrayRecord()
    arrays["w"] = Array(np.ones((2, 3), np.float32))
    arrays["b"] = Array(np.zeros(3, np.float32))
    return RecordDict(
        {
            "arrays": arrays,
            "metrics": MetricRecord({"num-examples": 10.0, "loss": 0.5, "confusion": [1, 2, 3, 4], **metrics}),
            "info": ConfigRecord({"partition-id": 1, "client": "site-1"}),
        }
    )


def raw(dtype: str, shape: tuple, stype: str, data: bytes) -> Array:
    """An Array with the given metadata and payload (what a hostile site can send)."""
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


def rejected(content: RecordDict, expected=SPEC) -> str:
    with pytest.raises(RejectedReply) as err:
        check_reply(content, expected, LIMIT)
    return str(err.value)


def test_an_honest_reply_passes_and_is_decoded():
    arrays, metrics, info = check_reply(honest(), SPEC, LIMIT)
    assert list(arrays) == ["w", "b"] and arrays["w"].dtype == np.float32 and (arrays["w"] == 1).all()
    assert metrics["confusion"] == [1, 2, 3, 4] and info == {"partition-id": 1, "client": "site-1"}


def _set(content: RecordDict, record: str, key: str, value) -> RecordDict:
    content[record][key] = value
    return content


def _without(content: RecordDict, record: str) -> RecordDict:
    del content[record]
    return content


def _array(content: RecordDict, name: str, value) -> RecordDict:
    content["arrays"][name] = value if isinstance(value, Array) else Array(value)
    return content


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (lambda c: c.__setitem__("extra", ConfigRecord({"x": 1})) or c, "unexpected record 'extra'"),
        (lambda c: _without(c, "info"), "no 'info' record"),
        (lambda c: _set(c, "info", "node", 3), "info must hold exactly"),
        (lambda c: _set(c, "info", "partition-id", 1.5), "partition-id must be an integer"),
        (lambda c: _set(c, "info", "partition-id", True), "partition-id must be an integer"),
        (lambda c: _set(c, "info", "partition-id", -1), "partition-id must be an integer"),
        (lambda c: _set(c, "info", "partition-id", "0"), "partition-id must be an integer"),
        (lambda c: _set(c, "info", "client", "a\nb"), "info client must be a printable name"),
        (lambda c: _set(c, "info", "client", "x" * 500), "info client must be a printable name"),
        (lambda c: _set(c, "metrics", "loss", float("nan")), "metric loss is not a finite number"),
        (lambda c: _set(c, "metrics", "num-examples", float("inf")), "metric num-examples is not a finite"),
        (lambda c: _set(c, "metrics", "confusion", [1.0, float("nan")]), "metric confusion has a value"),
        (lambda c: _set(c, "metrics", "round", 3.0), "reserved for the record's own fields"),
        (lambda c: _set(c, "metrics", "client", 3.0), "reserved for the record's own fields"),
        (lambda c: _set(c, "metrics", "m" * 100, 3.0), "is not 1 to 64 characters"),
        (lambda c: _array(c, "extra", np.zeros(2, np.float32)), "unexpected ['extra']"),
        (lambda c: c["arrays"].__delitem__("b") or c, "missing ['b']"),
        (lambda c: _array(c, "w", np.ones((2, 3), np.float64)), "has dtype float64, expected float32"),
        (lambda c: _array(c, "w", np.ones((3, 2), np.float32)), "has shape (3, 2), expected (2, 3)"),
        (lambda c: _array(c, "w", np.full((2, 3), np.nan, np.float32)), "NaN/Inf"),
        (lambda c: _array(c, "w", np.full((2, 3), 1e20, np.float32)), "beyond ±1e+06"),
        (
            lambda c: _array(
                c,
                "w",
                raw(
                    "float32",
                    (
                        2,
                        3,
                    ),
                    "numpy.ndarray",
                    b"\x00" * 60,
                ),
            ),
            "not a valid npy",
        ),
        (
            lambda c: _array(
                c,
                "w",
                raw(
                    "float32",
                    (
                        2,
                        3,
                    ),
                    "numpy.ndarray",
                    b"\x00" * (24 + NPY_HEADER + 1),
                ),
            ),
            "bytes, at most",
        ),
        (
            lambda c: _array(
                c,
                "w",
                raw(
                    "float32",
                    (
                        2,
                        3,
                    ),
                    "torch.tensor",
                    b"\x00" * 24,
                ),
            ),
            "not numpy.ndarray",
        ),
    ],
)
def test_a_malformed_reply_is_rejected_with_its_reason(fault, reason):
    assert reason in rejected(fault(honest()))


def test_too_many_metrics_and_arrays_where_none_are_expected():
    assert "at most 256" in rejected(honest(**{f"m{i}": 1.0 for i in range(300)}))
    assert "2 arrays where none are expected" in rejected(honest(), expected=None)
    assert "2 arrays where none are expected" in rejected(honest(), expected={})
    content = _without(honest(), "arrays")
    assert check_reply(content, None, LIMIT)[0] == OrderedDict()


def test_nothing_is_decoded_before_names_shapes_dtypes_and_sizes_pass(monkeypatch):
    decoded = []
    original = Array.numpy
    monkeypatch.setattr(Array, "numpy", lambda self: decoded.append(1) or original(self))
    for fault in (
        lambda c: _array(c, "extra", np.zeros(10**6, np.float32)),
        lambda c: _array(c, "b", np.zeros(10**6, np.float32)),
        lambda c: _array(c, "b", raw("float32", (3,), "numpy.ndarray", b"\x00" * 10**6)),
    ):
        rejected(fault(honest()))
    assert decoded == []
    assert record_bytes(honest()) == 4 * 9 and decoded == []  # bytes are counted from the metadata too


def test_count_check():
    assert count_check({"n": 10.0}, "n", 10) is None and count_check({"n": 0}, "n") is None
    assert "non-negative integer" in count_check({"n": -1.0}, "n")
    assert "non-negative integer" in count_check({"n": 2.5}, "n")
    assert "non-negative integer" in count_check({"n": float("nan")}, "n")
    assert "exceeds the 10 training samples" in count_check({"n": 11.0}, "n", 10)


@pytest.mark.parametrize(
    ("weights", "cap", "expected"),
    [
        ([1, 1, 2], 1.0, [0.25, 0.25, 0.5]),
        ([1, 1, 8], 0.5, [0.25, 0.25, 0.5]),  # the excess of the capped site goes to the others in proportion
        ([1, 3, 96], 0.5, [0.125, 0.375, 0.5]),
        ([1, 2, 97, 100], 0.3, [0.4 / 3 * 1 / 1, 0.4 / 3 * 2, 0.3, 0.3]),  # two capped, the rest shared 1:2
        ([10, 0, 0], 0.5, [0.5, 0.25, 0.25]),  # zero-weight sites share the excess equally
        ([5, 5], 0.4, [0.5, 0.5]),  # a cap below 1/K cannot hold: equal shares
        ([0, 0], 1.0, [0.5, 0.5]),
    ],
)
def test_capped_shares(weights, cap, expected):
    shares = capped_shares(weights, cap)
    assert np.allclose(shares, expected) and math.isclose(shares.sum(), 1.0)
    if cap * len(weights) > 1:
        assert shares.max() <= cap + 1e-12


def test_capped_shares_never_exceed_the_cap_and_keep_the_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = rng.pareto(1.0, size=rng.integers(2, 9))
        cap = rng.uniform(1.0 / len(w) + 1e-3, 1.0)
        shares = capped_shares(w, cap)
        assert math.isclose(shares.sum(), 1.0) and shares.max() <= cap + 1e-9
        assert (np.diff(shares[np.argsort(w)]) >= -1e-12).all(), "a heavier site never gets a smaller share"


def test_a_weight_is_capped_at_a_multiple_of_the_median_with_three_sites_or_more():
    assert np.allclose(median_capped([10, 20, 1e9], 10.0), [10, 20, 200])
    assert np.allclose(median_capped([10, 1e9], 10.0), [10, 1e9]), "two sites: the median caps nothing"
    assert np.allclose(median_capped([10, 20, 1e9], 0.0), [10, 20, 1e9]), "0 = off"
    honest = [120, 80, 300, 95]  # no honest site above 10x the median: nothing changes
    assert np.allclose(median_capped(honest, 10.0), honest)
    # The bound on one site's share: factor / (factor + K - 1) of the others at the median.
    shares = capped_shares(median_capped([50, 50, 1e9], 10.0), 1.0)
    assert shares[2] == pytest.approx(10 / 12)


def test_a_site_declaring_a_billion_images_does_not_take_the_mean(tmp_path, monkeypatch):
    """Three sites of about 56 images; site-0 declares 10^9 at joining and in its replies. With the default
    max-weight-over-median = 10 its share of the FedAvg mean is about 10/12, not 1: the mean still moves with the
    others."""
    from medflower.contract.client import ClientHalf

    lying_query, lying_reply = declaring_size(1e9)
    monkeypatch.setattr(ClientHalf, "query", lying_query)
    monkeypatch.setattr(ClientHalf, "reply", lying_reply)
    seen = {}
    original = FederatedStrategy.shares

    def recording(self, weights):
        seen["weights"], seen["shares"] = list(weights), original(self, weights)
        return seen["shares"]

    monkeypatch.setattr(FederatedStrategy, "shares", recording)
    config = {**TINY, "num-rounds": 1, "output-dir": str(tmp_path), "run-name": "big"}
    run_inprocess(config, 3)
    weights = np.asarray(seen["weights"])
    honest = np.sort(weights)[:2]
    assert weights.max() == 1e9 and honest.max() < 100
    bound = 10 * honest.max()  # the median of three is the larger honest size
    assert max(seen["shares"]) == pytest.approx(bound / (bound + honest.sum())) and max(seen["shares"]) < 0.85
    run_inprocess({**config, "run-name": "uncapped", "max-weight-over-median": 0.0}, 3)
    assert max(seen["shares"]) > 1 - 1e-6


def test_site_registry(tmp_path):
    path = tmp_path / "sites.toml"
    path.write_text('[sites]\nhospital-a = 11\n"hospital b" = 12\n')
    registry = SiteRegistry.load(str(path))
    assert registry.check(11, "hospital-a") is None and registry.check(12, "hospital b") is None
    assert "registered to another node" in registry.check(12, "hospital-a")
    assert "not in the site registry" in registry.check(13, "hospital-c")
    for text, why in (
        ("[sites]\na = 1\nb = 1\n", "one node id is given to two sites"),
        ("[sites]\na = -1\n", "non-negative integer"),
        ("[sites]\na = '1'\n", "non-negative integer"),
        ("[other]\na = 1\n", "needs a [sites] table"),
        ("[sites\n", "cannot be read as TOML"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match="site-registry") as err:
            SiteRegistry.load(str(path))
        assert why in str(err.value)


def test_the_registry_binds_site_names_to_node_ids(tmp_path):
    """InProcessGrid: node i + 1 holds partition i. Node 3 claims hospital-a's name: refused, the others train."""
    registry = tmp_path / "sites.toml"
    registry.write_text("[sites]\nhospital-a = 1\nhospital-b = 2\nhospital-c = 3\n")
    names = ["hospital-a", "hospital-b", "hospital-a"]
    config = {**TINY, "num-rounds": 2, "output-dir": str(tmp_path), "run-name": "r", "site-registry": str(registry)}
    summary, _ = run_inprocess(config, 3, node_configs=[{"site-name": n} for n in names])
    server = records(run_dir_of(config), "server")
    assert summary["rounds"] == 2
    for record in server:  # asked again every round, refused every round
        assert len(record["rejected"]) == 1 and "registered to another node" in record["rejected"][0]
    assert {r["client"] for r in records(run_dir_of(config), "train")} == {"hospital-a", "hospital-b"}


def test_duplicate_site_names_are_refused_not_merged(tmp_path):
    config = {**TINY, "num-rounds": 1, "output-dir": str(tmp_path), "run-name": "r"}
    run_inprocess(config, 3, node_configs=[{"site-name": "same"}, {"site-name": "same"}, {"site-name": "other"}])
    (server,) = records(run_dir_of(config), "server")
    assert len(server["rejected"]) == 1 and "already held by node 1" in server["rejected"][0]
    train = records(run_dir_of(config), "train")
    assert sorted(r["client"] for r in train) == ["other", "same"]


def test_a_non_finite_aggregate_never_replaces_the_model_or_the_checkpoint(tmp_path, monkeypatch):
    fedavg = STRATEGIES["fedavg"]
    original = fedavg.aggregate_train

    def poisoned(self, rnd, replies):
        original(self, rnd, replies)
        if rnd == 2:
            self.global_arrays = OrderedDict((k, np.full_like(v, np.nan)) for k, v in self.global_arrays.items())

    config = {**TINY, "num-rounds": 2, "output-dir": str(tmp_path), "run-name": "r"}
    monkeypatch.setattr(fedavg, "aggregate_train", poisoned)
    run_inprocess({**config, "num-rounds": 1}, 3)
    after_round_1, _ = Checkpointer(run_dir_of(config) / "checkpoint").load()
    run_inprocess({**config, "resume-from": str(run_dir_of(config))}, 3)
    arrays, meta = Checkpointer(run_dir_of(config) / "checkpoint").load()
    assert meta["completed_rounds"] == 2
    for k, v in after_round_1.items():
        assert np.array_equal(arrays[k], v), f"{k}: the failed round's aggregate was kept"
    server = records(run_dir_of(config), "server")
    assert "round_failed" not in server[0] and "aggregate is not finite" in server[1]["round_failed"]


def test_the_error_reply_is_redacted():
    """A site whose data folder is missing: the path stays in its own log unless node-config share-error-detail."""

    secret = "/data/patient-0001/scan.dcm"
    message = Message(RecordDict({"config": ConfigRecord({"round": 1})}), dst_node_id=1, message_type="query")
    run_config = {**defaults(), **TINY, "dataset": "site", "num-classes": 2}
    for share, leaks in (("false", False), ("true", True)):
        context = Context(
            run_id=1,
            node_id=1,
            node_config={"data-path": secret, "share-error-detail": share},
            state=RecordDict(),
            run_config=run_config,
        )
        with pytest.raises(SiteError) as err:
            handle(message, context)
        assert (secret in str(err.value)) is leaks
        assert str(err.value).startswith("DataError")


def test_a_new_nodes_first_answer_may_take_node_wait_timeout(tmp_path, monkeypatch):
    """The joining query starts the site's worker and reads its data: it waits node-wait-timeout when that is longer
    than round-timeout; the rounds' phases keep round-timeout."""
    from medflower.inprocess import InProcessGrid

    waits: list[tuple[str, float]] = []
    original = InProcessGrid.send_and_receive

    def recording(self, messages, *, timeout=None):
        messages = list(messages)
        waits.append((messages[0].metadata.message_type, timeout))
        return original(self, messages, timeout=timeout)

    monkeypatch.setattr(InProcessGrid, "send_and_receive", recording)
    config = {**TINY, "num-rounds": 1, "output-dir": str(tmp_path), "run-name": "r"}
    run_inprocess({**config, "round-timeout": 30.0, "node-wait-timeout": 500.0}, 2)
    assert waits[0] == ("query", 500.0)
    assert {t for kind, t in waits[1:]} == {30.0} and {kind for kind, _ in waits[1:]} == {"train", "evaluate"}
    waits.clear()
    run_inprocess({**config, "run-name": "s", "round-timeout": 300.0, "node-wait-timeout": 20.0}, 2)
    assert waits[0] == ("query", 300.0)


def test_an_aggregate_that_makes_every_site_fail_is_rolled_back(tmp_path, monkeypatch):
    """One site's round-2 reply has entries of 9e5, inside reply-value-limit, and the update bound is off: averaged
    in, the model makes every site's training loss non-finite in round 3. The server rolls back to the model before
    round 2's aggregate, and round 4 trains on all three sites again."""
    half = STRATEGIES["fedavg"].client_half
    monkeypatch.setattr(half, "train", poisoning_round_2(half))
    config = {**TINY, "num-rounds": 4, "output-dir": str(tmp_path), "run-name": "poison", "keep-checkpoints": 4}
    run_inprocess({**config, "max-update-over-median": 0}, 3)  # the default bound would scale the reply down
    server = {r["round"]: r for r in records(run_dir_of(config), "server") if "evaluated_in" not in r}
    assert len(server[3]["failed"]) == 3 and "round 2's aggregate" in server[3]["rolled_back"]
    assert server[4]["failed"] == [] and "rolled_back" not in server[4]
    trained = {r["client"] for r in records(run_dir_of(config), "train") if r["round"] == 4}
    assert trained == {"site-0", "site-1", "site-2"}
    checkpoints = run_dir_of(config) / "checkpoint"
    one, three = (Checkpointer(checkpoints / f"round-00000{r}").load()[0] for r in (1, 3))
    assert all(np.array_equal(one[k], three[k]) for k in one)  # round 3 ends with the model before round 2's mean


def poisoning_round_2(half):
    """``half.train`` whose partition 0 replies with entries of 9e5 in round 2 (inside reply-value-limit)."""
    honest_train = half.train

    def poisoning(self, message):
        content = honest_train(self, message)
        if self.rt.partition_id == 0 and self.rt.round == 2:
            arrays = from_record(content["arrays"])
            content["arrays"] = to_record({k: np.full_like(v, 9e5) for k, v in arrays.items()})
        return content

    return poisoning


def test_one_sites_update_is_bounded_by_the_median_update(tmp_path, monkeypatch):
    """The same in-range poisoned reply with the default max-update-over-median (10): the reply is scaled to ten
    times the round's median update norm, so the round-2 mean moves by at most that bound, no site fails in the
    later rounds and nothing needs a rollback."""
    half = STRATEGIES["fedavg"].client_half
    monkeypatch.setattr(half, "train", poisoning_round_2(half))
    seen: dict[int, tuple[list[float], float]] = {}
    original = FederatedStrategy.bound_updates

    def spying(self, rnd, message_type, contents, replies):
        sent = [from_record(contents[r.node_id]["arrays"]) for r in replies]
        seen[rnd] = update_norm_bounds(sent, [r.arrays for r in replies], self.cfg.max_update_over_median)
        original(self, rnd, message_type, contents, replies)

    monkeypatch.setattr(FederatedStrategy, "bound_updates", spying)
    config = {**TINY, "num-rounds": 4, "output-dir": str(tmp_path), "run-name": "bounded", "keep-checkpoints": 4}
    run_inprocess(config, 3)
    server = {r["round"]: r for r in records(run_dir_of(config), "server") if "evaluated_in" not in r}
    norms, bound = seen[2]
    assert bound == pytest.approx(10 * float(np.median(norms))) and max(norms) > 1e3 * bound
    assert [b.split(":")[0] for b in server[2]["bounded"]] == ["site-0"]
    assert all(r["failed"] == [] and "rolled_back" not in r for r in server.values())
    assert all("bounded" not in server[r] for r in (1, 3, 4))  # honest rounds: nothing scaled
    checkpoints = run_dir_of(config) / "checkpoint"
    one, two = (Checkpointer(checkpoints / f"round-00000{r}").load()[0] for r in (1, 2))
    moved = math.sqrt(sum(float(np.sum((two[k].astype(np.float64) - one[k]) ** 2)) for k in one))
    assert moved <= bound * (1 + 1e-5)  # a convex combination of updates no longer than the bound


def test_update_bound_maths():
    """Norms over the arrays both hold under one name and shape; the bound is factor × median with 3+ replies (inf
    with 2, or a median of 0); scaling keeps the update's direction and leaves the other arrays as they are."""
    sent = {"a": np.zeros(2, np.float32), "b": np.ones(3, np.float32)}
    replies = [
        {"a": np.array([3.0, 4.0], np.float32), "b": np.ones(3, np.float32), "extra": np.full(4, 1e5, np.float32)},
        {"a": np.array([0.0, 1.0], np.float32), "b": np.full(3, 1.0, np.float32)},
        {"a": np.array([0.0, 0.0], np.float32), "b": np.array([1.0, 1.0, 3.0], np.float32)},
        {"a": np.array([600.0, 800.0], np.float32), "b": np.ones(3, np.float32)},
    ]
    norms, bound = update_norm_bounds([sent] * 4, replies, 10.0)
    assert norms == pytest.approx([5.0, 1.0, 2.0, 1000.0]) and bound == pytest.approx(35.0)
    scaled = scaled_update(sent, replies[3], bound / norms[3])
    assert scaled["a"] == pytest.approx([21.0, 28.0]) and np.array_equal(scaled["b"], sent["b"])
    assert update_norm_bounds([sent] * 4, replies, 10.0)[0][3] == pytest.approx(1000.0)  # the inputs are untouched
    kept = scaled_update(sent, replies[0], 0.5)
    assert np.array_equal(kept["extra"], replies[0]["extra"]) and kept["a"].dtype == np.float32
    assert update_norm_bounds([sent] * 2, replies[:2], 10.0)[1] == math.inf
    assert update_norm_bounds([sent] * 4, replies, 0.0)[1] == math.inf
    assert update_norm_bounds([sent] * 3, [sent, sent, replies[3]], 10.0)[1] == math.inf  # median 0
