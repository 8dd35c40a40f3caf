"""Secure aggregation (docs/privacy.md#secure-aggregation): Flower's SecAgg+ gives the same aggregate as the plain
FedAvg round, the server receives no single update, a site dropping out in the middle of the protocol is unmasked
from its neighbours' shares, and bad settings are refused with the key and what would work."""

import numpy as np
import pytest
from helpers import declaring_size, records, run_dir_of
from safetensors.numpy import load_file

from medflower.config import ConfigError, ExperimentConfig
from medflower.inprocess import InProcessGrid, run_inprocess
from medflower.privacy.client_dp import PRIVATE_TRAIN_METRICS

STAGE = "stage"


def _stage(message) -> str | None:
    configs = message.content.config_records.get("secaggplus_configs")
    return None if configs is None else configs.get(STAGE)


def _arrays(config, rnd=1):
    return load_file(str(run_dir_of(config) / "checkpoint" / f"round-{rnd:06d}" / "arrays.safetensors"))


def test_secure_round_equals_the_plain_fedavg_round(tiny):
    plain = tiny(**{"run-name": "plain", "num-rounds": 1})
    secure = tiny(**{"run-name": "secure", "num-rounds": 1, "secagg": True})
    run_inprocess(plain, num_nodes=3)
    summary, _ = run_inprocess(secure, num_nodes=3)
    a, b = _arrays(plain), _arrays(secure)
    assert set(a) == set(b)
    for k in a:  # the same n_k-weighted mean, up to SecAgg+'s quantisation (2^22 levels over ±8)
        assert np.allclose(a[k], b[k], atol=2e-5), k
    assert summary["communication"]["bytes_up"] > 0
    assert [r["secagg_sites"] for r in records(run_dir_of(secure), "server")] == [3]
    assert len(records(run_dir_of(secure), "train")) == 3  # each site's training metrics, numbers only
    # Beside the secure sum only what does not depend on the images travels in the clear (n_k, steps); without
    # secagg the loss comes too.
    assert all("train_loss" in r for r in records(run_dir_of(plain), "train"))
    for record in records(run_dir_of(secure), "train"):
        assert set(record) - {"kind", "round", "client"} <= PRIVATE_TRAIN_METRICS, record


def test_a_sites_bad_training_metrics_are_dropped_and_its_masked_update_still_counts(tiny, monkeypatch):
    """The metrics that come with SecAgg+'s FitRes are untrusted like any reply's: a name that would overwrite the
    record's own fields is refused and logged as rejected; the round's sum is still applied."""
    import flwr.compat.common.recorddict_compat as compat

    original = compat.fitres_to_recorddict

    def tampered(fitres, keep_input):
        fitres.metrics["client"] = 7.0
        return original(fitres, keep_input)

    monkeypatch.setattr(compat, "fitres_to_recorddict", tampered)
    plain = tiny(**{"run-name": "bad-metrics-plain", "num-rounds": 1})
    secure = tiny(**{"run-name": "bad-metrics", "num-rounds": 1, "secagg": True})
    run_inprocess(plain, num_nodes=3)
    run_inprocess(secure, num_nodes=3)
    assert records(run_dir_of(secure), "train") == []
    server = records(run_dir_of(secure), "server")[0]
    assert server["num_rejected"] == 3 and all("reserved" in r for r in server["rejected"])
    a, b = _arrays(plain), _arrays(secure)
    assert all(np.allclose(a[k], b[k], atol=2e-5) for k in a)


def test_the_server_receives_masked_vectors_only(tiny, monkeypatch):
    seen = []
    original = InProcessGrid.send_and_receive

    def spy(self, messages, *, timeout=None):
        replies = list(original(self, messages, timeout=timeout))
        seen.extend(replies)
        return replies

    monkeypatch.setattr(InProcessGrid, "send_and_receive", spy)
    run_inprocess(tiny(**{"run-name": "spy", "num-rounds": 1, "secagg": True}), num_nodes=3)
    train = [m for m in seen if m.metadata.message_type == "train"]
    assert len(train) == 12  # four stages, three sites
    assert all(len(record) == 0 for m in train for record in m.content.array_records.values())


def test_a_site_dropping_out_after_the_keys_are_shared_is_unmasked_by_the_others(tiny):
    """Site 3 answers the setup and share-keys stages, then never sends its masked update: the sum of sites 1 and 2
    is recovered and equals a plain round in which site 3 does not answer."""
    secure = tiny(**{"run-name": "drop-secure", "num-rounds": 1, "secagg": True})
    run_inprocess(secure, num_nodes=3, drop=lambda node, m: node == 3 and _stage(m) == "collect_masked_vectors")
    plain = tiny(**{"run-name": "drop-plain", "num-rounds": 1})
    run_inprocess(plain, num_nodes=3, drop=lambda node, m: node == 3 and m.metadata.message_type == "train")
    a, b = _arrays(plain), _arrays(secure)
    for k in a:
        assert np.allclose(a[k], b[k], atol=2e-5), k
    assert records(run_dir_of(secure), "server")[0]["secagg_sites"] == 2


def test_too_many_dropouts_leave_the_model_unchanged_and_the_run_going(tiny):
    config = tiny(**{"run-name": "drop-two", "num-rounds": 2, "secagg": True})
    summary, _ = run_inprocess(
        config, num_nodes=3, drop=lambda node, m: node in (2, 3) and _stage(m) == "collect_masked_vectors"
    )
    server = records(run_dir_of(config), "server")
    assert summary["rounds"] == 2
    assert all("secagg: the protocol halted" in r["failed"][0] for r in server)
    first, second = _arrays(config, 1), _arrays(config, 2)
    assert all(np.array_equal(first[k], second[k]) for k in first)


def test_a_round_left_with_two_sites_is_skipped_and_the_run_goes_on(tiny, monkeypatch):
    """Three sites, then one leaves the federation: a 2-site round cannot be secured (each site would read the
    other's update from the new model, and Flower's workflow refuses 2 shares). The round is skipped with its
    reason, the model kept, and the run ends; before, the workflow's error stopped the whole run."""
    from medflower.contract.server import FederatedStrategy

    original = FederatedStrategy.run_round
    left: list[bool] = []

    def run_round(self, grid, rnd):
        original(self, grid, rnd)
        left.append(True)  # after round 1, node 3 is gone

    monkeypatch.setattr(FederatedStrategy, "run_round", run_round)
    monkeypatch.setattr(InProcessGrid, "get_node_ids", lambda self: [1, 2] if left else list(self.contexts))
    config = tiny(**{"run-name": "two-left", "num-rounds": 2, "secagg": True})
    summary, _ = run_inprocess(config, num_nodes=3)
    server = records(run_dir_of(config), "server")
    assert summary["rounds"] == 2 and [r["secagg_sites"] for r in server] == [3, 0]
    assert "secagg: round skipped: SecAgg+ needs at least 3 sites" in server[1]["failed"][0]
    first, second = _arrays(config, 1), _arrays(config, 2)
    assert all(np.array_equal(first[k], second[k]) for k in first)


def test_a_site_declaring_a_billion_images_does_not_zero_the_honest_weights(tiny, monkeypatch):
    """SecAgg+'s max_weight was the largest declared size: a site declaring 10^9 made every honest weight n/10^9
    quantise to 0, and the secure mean was that site's update alone. With max_weight capped at
    max-weight-over-median x the median, the secure mean equals the plain mean with the same cap."""
    from medflower.contract.client import ClientHalf

    lying_query, lying_reply = declaring_size(1e9)
    monkeypatch.setattr(ClientHalf, "query", lying_query)
    monkeypatch.setattr(ClientHalf, "reply", lying_reply)
    plain = tiny(**{"run-name": "liar-plain", "num-rounds": 1})
    secure = tiny(**{"run-name": "liar-secure", "num-rounds": 1, "secagg": True})
    run_inprocess(plain, num_nodes=3)
    run_inprocess(secure, num_nodes=3)
    a, b = _arrays(plain), _arrays(secure)
    for k in a:
        assert np.allclose(a[k], b[k], atol=2e-5), k


def _first_only(condition):
    """A drop rule true for the first message that meets ``condition`` only."""
    seen = []

    def rule(node, message):
        if condition(node, message) and not seen:
            seen.append(node)
            return True
        return False

    return rule


def test_lat_secure_rounds_equal_plain_lat_rounds_also_after_a_site_skipped_one(tiny):
    """lat's Σ_j m_j Θ_j from SecAgg+'s sum: site 3 misses round 1, so in round 2 the sites hold different
    aggregates Θ̂_j; the server adds Σ_j m_j Θ̂_j to the secure mean update and gets the plain round's result."""
    common = {"num-rounds": 2, "strategy": "lat", "lat-layers": 1, "optimizer": "sgd"}  # Adam would amplify round
    # 1's quantisation error (2e-5) through its normalised steps
    secure = tiny(**{"run-name": "lat-secure", "secagg": True, **common})
    plain = tiny(**{"run-name": "lat-plain", **common})
    run_inprocess(secure, num_nodes=3, drop=_first_only(lambda n, m: n == 3 and _stage(m) == "collect_masked_vectors"))
    run_inprocess(plain, num_nodes=3, drop=_first_only(lambda n, m: n == 3 and m.metadata.message_type == "train"))
    assert [r["secagg_sites"] for r in records(run_dir_of(secure), "server")] == [2, 3]
    for rnd in (1, 2):
        a, b = _arrays(plain, rnd), _arrays(secure, rnd)
        assert set(a) == set(b) and len(a) > 0
        for k in a:
            assert np.allclose(a[k], b[k], atol=5e-5), (rnd, k, np.abs(a[k] - b[k]).max(), np.abs(a[k]).max())
    # the round-2 aggregate is not the same array on every site in round 1: site 3 kept the initial adapters
    first = _arrays(secure, 1)
    site3 = [k for k in first if k.startswith("client-2/")]
    assert not site3 or not all(np.allclose(first[k], first[k.replace("client-2/", "client-0/")]) for k in site3)


def test_site_noise_and_secure_aggregation_together(tiny):
    config = tiny(**{"run-name": "dp-secagg", "num-rounds": 2, "secagg": True, "dp": "site"})
    summary, _ = run_inprocess(config, num_nodes=3)
    assert summary["privacy"]["client_level"]["rounds"] == 2
    assert [r["secagg_sites"] for r in records(run_dir_of(config), "server")] == [3, 3]
    for record in records(run_dir_of(config), "train"):
        assert set(record) - {"kind", "round", "client"} <= PRIVATE_TRAIN_METRICS, record


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            {"secagg": True, "strategy": "sgca"},
            r"'secagg' = True is invalid: strategy 'sgca' needs each site's "
            r"update.*secagg works with fedavg, fedprox, lat",
        ),
        ({"secagg": True, "dp": "server"}, r"'secagg' = True is invalid: dp='server' clips every site's update on the"),
        (
            {"secagg": True, "secagg-num-shares": 3, "secagg-reconstruction-threshold": 4},
            r"'secagg-reconstruction-threshold' = 4 is invalid: is not less than secagg-num-shares = 3",
        ),
        ({"secagg": True, "secagg-reconstruction-threshold": 1}, r"'secagg-reconstruction-threshold' = 1 .*>= 2"),
        ({"secagg": True, "max-client-share": 0.5}, r"'secagg' = True is invalid: max-client-share = 0.5 caps"),
        ({"secagg": True, "secagg-clipping-range": 0.0}, r"'secagg-clipping-range' = 0.0 is invalid: must be > 0"),
    ],
)
def test_bad_secagg_config_is_refused_before_round_1(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ExperimentConfig.from_run_config(overrides, check_paths=False)


def test_a_federation_too_small_for_secagg_is_refused_at_round_1(tiny):
    config = tiny(**{"run-name": "few", "secagg": True, "secagg-reconstruction-threshold": 3})
    with pytest.raises(
        ConfigError,
        match=r"'secagg' = True cannot run: SecAgg\+ needs at least 3 sites in a round and this round has 2.*set "
        r"min-nodes",
    ):
        run_inprocess(config, num_nodes=2)
