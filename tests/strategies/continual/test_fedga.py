"""FedGA in FedKEI's protocol: the weight update (normalised gap, the authors' 1/3, clip and renormalise) and the
decaying step by hand; a site's gap against its own module and a restart; the gap phase in process (the start of
task 2 is Σ a_i θ_i^1 with the logged a, the weights follow the logged gaps, the larger gap gets the larger weight,
bytes); resume; the option checks."""

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict
from helpers import TINY, records, run_dir_of, site_runtime
from safetensors.numpy import load_file

from medflower.config import ExperimentConfig, defaults
from medflower.contract import to_record
from medflower.data import DataError
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies.continual import fedga as ga
from medflower.strategies.continual.knowledge_pool import safe_name

TASKS = {"strategy": "fedga", "num-tasks": 2, "task-epochs": 1, "optimizer": "sgd", "lr": 0.01, "fedga-rounds": 3}
SITE = {**{k: v for k, v in TASKS.items() if k != "strategy"}, "task-epochs": 2, "lr": 0.1}


# ----------------------------------------------------------------------------- the update by hand
def test_the_step_decays_linearly_from_d_to_d_over_r():
    assert [ga.step_size(0.2, r, 4) for r in (1, 2, 3, 4)] == pytest.approx([0.2, 0.15, 0.1, 0.05])
    assert ga.step_size(0.3, 1, 1) == pytest.approx(0.3)


def test_the_weights_move_by_a_third_of_the_step_times_the_gap_over_the_largest_gap():
    # a = (0.5, 0.3, 0.2), G = (0.3, -0.6, 0), d = 0.2: a + (0.2/3)·(0.5, -1, 0) = (0.5333, 0.2333, 0.2), / 0.9667
    got = ga.ga_update(np.array([0.5, 0.3, 0.2]), {0: 0.3, 1: -0.6, 2: 0.0}, 0.2)
    raw = np.array([0.5 + 0.2 / 3 * 0.5, 0.3 - 0.2 / 3, 0.2])
    np.testing.assert_allclose(got, raw / raw.sum(), rtol=1e-12)
    assert got.sum() == pytest.approx(1.0) and got[0] > 0.5 and got[1] < 0.3


def test_the_weights_are_clipped_to_the_unit_interval_then_renormalised():
    # a = (0.95, 0.05), G = (1, 0.5), d = 0.6: (0.95 + 0.2, 0.05 + 0.1) = (1.15, 0.15) -> clip (1, 0.15) -> / 1.15
    np.testing.assert_allclose(ga.ga_update(np.array([0.95, 0.05]), {0: 1.0, 1: 0.5}, 0.6), [1 / 1.15, 0.15 / 1.15])
    # a = (0.9, 0.05, 0.05), G = (1, -2, -2), d = 0.6: (1.0, -0.15, -0.15) -> clip (1, 0, 0)
    np.testing.assert_allclose(ga.ga_update(np.array([0.9, 0.05, 0.05]), {0: 1.0, 1: -2.0, 2: -2.0}, 0.6), [1, 0, 0])


def test_a_site_without_a_gap_keeps_its_weight_before_the_renormalisation():
    # only site 0 answered: a_0 += 0.3/3 · 1 (its gap is the largest), a_1 and a_2 unchanged, then / 1.1
    got = ga.ga_update(np.array([0.4, 0.4, 0.2]), {0: 0.2}, 0.3)
    np.testing.assert_allclose(got, np.array([0.5, 0.4, 0.2]) / 1.1)
    weights = np.array([0.6, 0.4])
    for gaps in ({}, {0: 0.0, 1: 0.0}):  # nothing to normalise by: unchanged
        np.testing.assert_array_equal(ga.ga_update(weights, gaps, 0.2), weights)


def test_the_update_is_not_centred():
    """Equal positive gaps move every weight up by the same d/3 (centring them would move nothing)."""
    got = ga.ga_update(np.array([0.7, 0.3]), {0: 0.1, 1: 0.1}, 0.3)
    np.testing.assert_allclose(got, np.array([0.8, 0.4]) / 1.2)
    assert not np.allclose(got, [0.7, 0.3])


# ----------------------------------------------------------------------------- a site's gap
def message(task: int, arrays=None, source: int | None = None):
    config = {"round": task} if source is None else {"round": task, ga.SOURCE: source}
    content = RecordDict({"config": ConfigRecord(config)})
    if arrays is not None:
        content["arrays"] = to_record(arrays)
    return SimpleNamespace(content=content)


def test_a_site_answers_the_aggregates_validation_loss_minus_its_own_modules(tmp_path):
    rt = site_runtime(tmp_path, "fedga", **SITE)
    rt.config.update({"round": 1, "model-classes": 2})
    site = ga.FedGAClient(rt)
    site.train(message(1))
    own = rt.model.get_trainable()  # θ_i^1, what it uploaded
    rt.config["round"] = 2
    assert site.fedga_gap(message(2, own, source=1))["metrics"][ga.GAP] == 0.0  # its own module: no gap
    fresh = rt.initial_arrays
    gap = site.fedga_gap(message(2, fresh, source=1))["metrics"][ga.GAP]
    rt.model.set_trainable(fresh)
    fresh_loss = site.validation_loss(1)
    rt.model.set_trainable(own)
    assert gap == pytest.approx(fresh_loss - site.validation_loss(1), abs=1e-6) and gap != 0.0
    # the kept loss survives a restart of the site (its state folder); another task's is refused
    again = ga.FedGAClient(site_runtime(tmp_path, "fedga", **SITE))
    again.rt.config.update({"round": 2, "model-classes": 2})
    assert again.fedga_gap(message(2, own, source=1))["metrics"][ga.GAP] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(DataError, match="no validation loss of its own module of task 2"):
        again.fedga_gap(message(3, own, source=2))


# ----------------------------------------------------------------------------- the gap phase, in process
def pooled(run_dir, task: int, client: str) -> dict[str, np.ndarray]:
    return load_file(str(run_dir / "checkpoint" / "pool" / f"task-{task:03d}" / f"{safe_name(client)}.safetensors"))


def test_task_2_starts_from_the_gap_weighted_mean_of_task_1s_modules(tiny, monkeypatch):
    starts = {}
    original = ga.FedGAClient.finetune

    def spy(self, train, epochs, after_epoch, extra_loss, device):
        starts[(self.rt.client, self.task)] = self.rt.model.get_trainable()
        return original(self, train, epochs, after_epoch, extra_loss, device)

    monkeypatch.setattr(ga.FedGAClient, "finetune", spy)
    config = tiny(**{**TASKS, "run-name": "ga", "partition": "dirichlet", "dirichlet-alpha": 5.0})
    summary, grid = run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    server = records(run_dir, "server")
    assert "fedga" not in server[0]  # task 1: fresh, no gap phase
    log = server[1]["fedga"]
    assert log["task"] == 1 and len(log["gaps"]) == 3 and len(log["weights"]) == 4
    clients = log["clients"]
    sizes = {r["client"]: r["num-examples"] for r in records(run_dir, "eval") if r["task"] == 1}
    n = np.array([sizes[c] for c in clients], dtype=float)
    assert len(set(n)) > 1
    np.testing.assert_allclose(log["weights"][0], n / n.sum())  # a^1: the n_i shares
    for r, gaps in enumerate(log["gaps"], start=1):  # every a^{r+1} is the update of a^r by the logged gaps
        assert set(gaps) == set(clients)
        expected = ga.ga_update(
            np.array(log["weights"][r - 1]), {clients.index(c): g for c, g in gaps.items()}, ga.step_size(0.2, r, 3)
        )
        np.testing.assert_allclose(log["weights"][r], expected, rtol=1e-12)
    a = np.array(log["weights"][-1])
    assert not np.allclose(a, n / n.sum())
    modules = [pooled(run_dir, 1, c) for c in clients]
    for client in clients:
        start = starts[(client, 2)]
        for name, value in start.items():
            np.testing.assert_allclose(value, sum(w * m[name] for w, m in zip(a, modules)), rtol=1e-5, atol=1e-6)
    # the gap messages: θ̄(a^r) to every site, the scalar back; bytes (R + 2)·|θ| per site in task 2
    gap_messages = [m for m in grid.sent if m.metadata.message_type == ga.ACTION]
    assert len(gap_messages) == 9 and {m.metadata.group_id for m in gap_messages} == {"2"}
    width = sum(v.size for v in modules[0].values())
    assert server[1]["bytes_down"] + server[1]["bytes_up"] == 3 * (3 + 2) * 4 * width
    assert server[1]["bytes"]["fedga_gap"] == {"down": 9 * 4 * width, "up": 0, "nodes": 3, "rounds": 3}
    assert set(summary["tasks"]) == {"1", "2"} and "variant" not in summary


def test_the_site_with_the_larger_gap_gets_the_larger_weight(tiny):
    """Two sites at equal a^1 (max-client-share 0.5 caps both n_i shares at 1/2): after round 1 the weights are
    ordered as the gaps, the site whose loss under θ̄ rose more above its own module's gains weight."""
    config = tiny(**{**TASKS, "run-name": "sign", "fedga-rounds": 1, "max-client-share": 0.5})
    run_inprocess(config, num_nodes=2)
    log = records(run_dir_of(config), "server")[1]["fedga"]
    before, after = np.array(log["weights"][0]), np.array(log["weights"][1])
    gaps = np.array([log["gaps"][0][c] for c in log["clients"]])
    assert before == pytest.approx([0.5, 0.5]) and gaps[0] != gaps[1]
    high, low = int(np.argmax(gaps)), int(np.argmin(gaps))
    assert after[high] > 0.5 > after[low]


def test_a_gap_reply_without_a_gap_is_rejected_and_its_site_keeps_its_weight(tiny, monkeypatch):
    original = ga.FedGAClient.fedga_gap

    def broken(self, message):
        if self.rt.partition_id == 0:
            return self.reply(metrics={"fedga_gp": 0.5})  # a misspelt gap
        return original(self, message)

    monkeypatch.setattr(ga.FedGAClient, "fedga_gap", broken)
    config = tiny(**{**TASKS, "run-name": "bad", "fedga-rounds": 2})
    summary, _ = run_inprocess(config, num_nodes=3)
    server = records(run_dir_of(config), "server")[1]
    log = server["fedga"]
    site = log["clients"][0]
    assert sum(f"a gap reply must carry a finite {ga.GAP}" in r and r.startswith(site) for r in server["rejected"]) == 2
    for r, gaps in enumerate(log["gaps"], start=1):
        assert set(gaps) == set(log["clients"][1:])
        expected = ga.ga_update(
            np.array(log["weights"][r - 1]),
            {log["clients"].index(c): g for c, g in gaps.items()},
            ga.step_size(0.2, r, 2),
        )
        np.testing.assert_allclose(log["weights"][r], expected, rtol=1e-12)
    assert set(summary["tasks"]) == {"1", "2"}


def test_a_finished_run_extended_by_a_task_equals_an_uninterrupted_one(tiny):
    full = tiny(**{**TASKS, "run-name": "full", "num-tasks": 3, "fedga-rounds": 2})
    run_inprocess(full, num_nodes=2)
    part = tiny(**{**TASKS, "run-name": "part", "num-tasks": 2, "fedga-rounds": 2})
    run_inprocess(part, num_nodes=2)
    run_inprocess(tiny(**{**TASKS, "num-tasks": 3, "fedga-rounds": 2, "resume-from": str(run_dir_of(part))}), 2)
    key = lambda d: [(r["task"], r["client"], r["auc_curve"]) for r in records(d, "eval")]  # noqa: E731
    assert key(run_dir_of(full)) == key(run_dir_of(part))
    logs = lambda d: [r.get("fedga") for r in records(d, "server")]  # noqa: E731
    assert logs(run_dir_of(full)) == logs(run_dir_of(part))


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("fedga-rounds", 0, "must be > 0"),
        ("fedga-step", 0.0, "must be > 0"),
        ("fedga-step", -0.2, "must be > 0"),
        ("fedkei-variant", "B", "has its own"),
        ("val-fraction", 0.0, "validation split"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "fedga", key: value})
